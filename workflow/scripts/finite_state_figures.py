"""Rule finite_state_figures: the estimator and identified-interval figures."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.plots.finite_state import write_figures  # noqa: E402

out = snakemake.output
write_figures(
    snakemake.input.systems,
    snakemake.input.windows,
    list(snakemake.params.interval_systems),
    (out.estimators, out.estimators_pdf),
    (out.interval, out.interval_pdf),
)
log.info("wrote %s and %s", out.estimators, out.interval)
