"""Rule study_metrics: a study's metrics.json, the machine-readable results file that
`kvdiverge merge` reads (kvdiverge.tables.metrics): every estimand and contrast with its
interval, level and documents, the models, the actions' parameters, the design's settings from
the lock, the lock's hash and the effective config's digest."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import polars as pl  # noqa: E402

from kvdiverge import __version__  # noqa: E402
from kvdiverge.io.locks import read_lock  # noqa: E402
from kvdiverge.tables.inputs import read_estimands  # noqa: E402
from kvdiverge.tables.metrics import metrics_record, write_metrics  # noqa: E402

p = snakemake.params
lock = read_lock(snakemake.input.lock)
design = lock["design"]
estimands = read_estimands(snakemake.input.estimands)
accuracy = pl.read_csv(snakemake.input.accuracy, infer_schema_length=None)
contrasts = None
if "contrasts" in snakemake.input.keys():
    contrasts = pl.read_csv(snakemake.input.contrasts, infer_schema_length=None)
settings = {
    "H": design["H"],
    "temperature": design.get("temperature"),
    "K": design["K"],
    "coupling": design["coupling"],
    "level": p.level,
    "draws": p.draws,
    "metric": "each source's metric",
    "documents": design.get("documents"),
    "seed": design.get("seed"),
    "strata": design.get("strata"),
    "documents_per_stratum": design.get("documents_per_stratum"),
}
record = metrics_record(
    kind="study",
    name=snakemake.wildcards.study,
    models=list(design.get("models", [])),
    actions=design["actions"],
    baseline=p.baseline or None,
    settings=settings,
    estimands=estimands,
    contrasts=contrasts,
    accuracy=accuracy,
    lock=lock["hash"],
    config_sha256=p.config_sha256,
    package_version=__version__,
)
write_metrics(record, snakemake.output.metrics)
log.info(
    "wrote %s: %d estimand rows, %d contrast rows, lock %s",
    snakemake.output.metrics, len(record["estimands"]), len(record["contrasts"]), lock["hash"],
)  # fmt: skip
