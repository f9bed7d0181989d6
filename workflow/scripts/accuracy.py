"""Rule accuracy: task accuracy per action and by divergence timing (long CSV, table, figure)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import logging  # noqa: E402

import polars as pl  # noqa: E402

from kvdiverge.analysis.accuracy import (  # noqa: E402
    accuracy_document_stats,
    accuracy_table,
    metric_documents,
    timing_depth,
    write_accuracy,
)
from kvdiverge.analysis.estimands import study_seed  # noqa: E402
from kvdiverge.analysis.prespecification import read_lock, registration_line  # noqa: E402
from kvdiverge.io import write_parquet_with_metadata  # noqa: E402
from kvdiverge.io.trajectories import read_trajectory_metadata  # noqa: E402
from kvdiverge.models.detokenize import load_decoder  # noqa: E402
from kvdiverge.plots.accuracy import write_accuracy_figure  # noqa: E402
from kvdiverge.tables import write_accuracy_table  # noqa: E402

logging.getLogger("fontTools").setLevel(logging.WARNING)  # no subsetting lines per PDF
p, out, study = snakemake.params, snakemake.output, snakemake.wildcards.study
actions = list(p.actions)
documents = metric_documents(list(snakemake.input.documents), p.datasets)
tables, per_document = [], []
for model, files in p.files.items():
    spec = p.tokenizers[model]
    tokenizer = load_decoder(spec["path"], spec["revision"], spec["trust_remote_code"])
    depth = timing_depth(int(read_trajectory_metadata(files[actions[0]][0])["H"]), p.clock)
    role = {"study": study, "model": model, "cohort": p.cohort}  # each file's, and its documents'
    stats = accuracy_document_stats(files, documents, tokenizer, depth, role)
    per_document.append(stats.select(pl.lit(model).alias("model"), pl.all()))
    table = accuracy_table(
        stats,
        model=model,
        actions=actions,
        cohort=p.cohort,
        draws=p.draws,
        seed=study_seed(p.seed, study),
        level=p.level,
    )
    drops = table.filter((pl.col("stratum") == "pooled") & (pl.col("estimand") == "accuracy_drop"))
    for row in drops.iter_rows(named=True):
        log.info("%s %s: accuracy drop %.3f", model, row["action"], row["value"])
    tables.append(table)
write_accuracy(pl.concat(tables), out.csv)
# each document's accuracy per model and action: rule study_contrasts pairs its Δ accuracy
write_parquet_with_metadata(pl.concat(per_document), out.documents, {"study": study})
tabled = (out.table_csv, out.table_md, out.table_tex, out.table_html)
registration = registration_line(read_lock(snakemake.input.lock))
labels = dict(p.labels)  # the actions' labels: the figure and the rendered table show them
write_accuracy_table(out.csv, tabled, actions, registration=registration, labels=labels)
write_accuracy_figure(out.csv, out.png, out.pdf, actions, control=p.control, labels=labels)
log.info("wrote %s, %s, %s", out.csv, out.table_html, out.png)
