"""Rule study_metrics: a study's metrics.json, the machine-readable results file that
`kvdiverge merge` reads (kvdiverge.tables.metrics): every estimand and contrast with its
interval, level and documents, the models, the actions' parameters, the design's settings from
the lock, the lock's hash and the effective config's digest; and tables/landing.rst, the
study's part of the report's landing page (kvdiverge.tables.landing: the headline table, the
contrasts, Figure 5, the sentences and what the documents allow)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import polars as pl  # noqa: E402

from kvdiverge import __version__  # noqa: E402
from kvdiverge.analysis.prespecification import registration_line  # noqa: E402
from kvdiverge.io import atomic_write_text  # noqa: E402
from kvdiverge.io.locks import read_lock  # noqa: E402
from kvdiverge.tables.headline import headline_table  # noqa: E402
from kvdiverge.tables.inputs import read_estimands  # noqa: E402
from kvdiverge.tables.landing import landing_documents, render_landing_rst  # noqa: E402
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
    baseline=dict(p.baseline) or None,
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

compared = [a for a in design["actions"] if a != design.get("control")]
compared = sorted(compared, key=lambda a: a != p.baseline_name)  # the baseline's row first
strata = [s for s in estimands["stratum"].unique(maintain_order=True).to_list() if s != "pooled"]
landing = render_landing_rst(
    snakemake.wildcards.study,
    headline_table(estimands, accuracy, compared),
    contrasts,
    H=design["H"],
    temperature=design.get("temperature", 1),
    documents=landing_documents(estimands.filter(estimands["action"].is_in(compared)), strata),
    labels=dict(p.labels),
    figure=snakemake.input.fig5,
    registration=registration_line(lock),
)
atomic_write_text(snakemake.output.landing, landing)
log.info("wrote %s", snakemake.output.landing)
