"""Rule study_tables: Tables 1-4 of one study as CSV, Markdown and LaTeX (SPEC §5)."""

from kvdiverge.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.tables import write_study_tables  # noqa: E402

out = snakemake.output
outputs = {
    f"table{i}": tuple(out[f"table{i}_{ext}"] for ext in ("csv", "md", "tex")) for i in range(1, 5)
}
built = write_study_tables(
    snakemake.input.estimands,
    snakemake.input.get("prediction"),
    outputs,
    actions=list(snakemake.params.actions),
    main_contrast=snakemake.params.main_contrast,
)
for name, table in built.items():
    log.info("%s: %d rows", name, table.data.height)
