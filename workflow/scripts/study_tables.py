"""Rule study_tables: Tables 1-4 of one study as CSV, Markdown, LaTeX and HTML, and the
estimands' tidy Parquet copy with its summary (Markdown, HTML)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.estimands import draws_line  # noqa: E402
from kvdiverge.analysis.prespecification import read_lock, registration_line  # noqa: E402
from kvdiverge.tables import write_estimands_summary, write_study_tables  # noqa: E402

# the lock's registration, and the draws every interval of the tables comes from
draws = draws_line(snakemake.input.estimands)
registration = " ".join(filter(None, [registration_line(read_lock(snakemake.input.lock)), draws]))
out = snakemake.output
outputs = {
    f"table{i}": tuple(out[f"table{i}_{ext}"] for ext in ("csv", "md", "tex", "html"))
    for i in range(1, 5)
}
built = write_study_tables(
    snakemake.input.estimands,
    snakemake.input.get("prediction"),
    outputs,
    actions=list(snakemake.params.actions),
    main_contrast=snakemake.params.main_contrast,
    registration=registration,
    labels=dict(snakemake.params.labels),  # the rendered rows show the actions' labels
)
for name, table in built.items():
    log.info("%s: %d rows", name, table.data.height)
summary = write_estimands_summary(
    snakemake.input.estimands,
    out.estimands_parquet,
    out.estimands_summary_md,
    out.estimands_summary_html,
    study=snakemake.wildcards.study,
    registration=registration,
    temperature=snakemake.params.temperature,
)
log.info("estimands summary: %s", " ".join(summary.facts[:1]))
