"""Rule document_stats: trajectories → one row per (document, action)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.document_stats import document_stats, write_document_stats  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs  # noqa: E402

files = {
    action: list(paths) for action, paths in keyed_inputs(snakemake.input, "trajectories").items()
}
role = {"study": snakemake.wildcards.study, "model": snakemake.wildcards.model}
stats, clock = document_stats(
    files,
    list(snakemake.input.documents),
    dict(snakemake.params.clock),
    snakemake.params.control,
    development=list(snakemake.params.development),
    role=role,  # each file's metadata names its study, model and action
    cohorts=dict(snakemake.params.cohorts),  # development files dev, evaluation files the study's
)
write_document_stats(stats, snakemake.output[0], clock, role)
log.info("%d (document, action) rows, %s -> %s", stats.height, clock, snakemake.output[0])
