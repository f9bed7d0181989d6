"""Rule study_cache_bytes: each action's cache bytes beside its budget, per model
(kvdiverge.analysis.cache_bytes over the evaluation trajectory files' cache_bytes metadata: the
mean over documents of the sum over layers at steps 1 and H, and its share of the study's
full-retention control on the same documents); tables/cache_bytes.csv (a model column first)
and tables/cache_bytes.md (one table per model), beside Table 1."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import polars as pl  # noqa: E402

from kvdiverge.analysis.cache_bytes import (  # noqa: E402
    cache_bytes_markdown,
    cache_bytes_table,
    read_cache_bytes,
)
from kvdiverge.io import atomic_write_text  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs, split_keys  # noqa: E402

files = split_keys(keyed_inputs(snakemake.input, "trajectories"), 2)
control = snakemake.params.control
frames, sections = [], []
for model in dict.fromkeys(m for m, _ in files):
    actions = {a: read_cache_bytes(list(paths)) for (m, a), paths in files.items() if m == model}
    table = cache_bytes_table(actions, control)
    frames.append(table.insert_column(0, pl.Series("model", [model] * table.height)))
    sections.append(f"Model {model}:\n\n{cache_bytes_markdown(table)}")
    log.info("%s: the cache bytes of %d actions", model, table.height)
atomic_write_text(snakemake.output.csv, pl.concat(frames).write_csv())
atomic_write_text(snakemake.output.md, "\n".join(sections))
log.info("wrote %s and %s", snakemake.output.csv, snakemake.output.md)
