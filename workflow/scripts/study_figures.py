"""Rules study_figures and study_branch_figure: figure 5 (pooled and per stratum), figures 6-7
and the decomposition bars of one study, drawn from its estimands table."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.plots.study import FIGURES, write_study_figures  # noqa: E402

out = snakemake.output
outputs = {name: (out[name], out[f"{name}_pdf"]) for name in FIGURES if name in out.keys()}
write_study_figures(
    snakemake.input.estimands,
    outputs,
    actions=list(snakemake.params.actions),
    control=snakemake.params.control,
    labels=dict(snakemake.params.labels),  # legends and ticks show the actions' labels
)
log.info("wrote %s", ", ".join(outputs))
