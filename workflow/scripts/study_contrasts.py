"""Rule study_contrasts: a study's compared actions each minus its baseline
(studies.<study>.baseline), per model, with paired bootstrap intervals: contrasts.{csv,md} and
summary.md in plain sentences, summary.html for the report and summary.rst for its landing page
(workflow/report/workflow.rst; kvdiverge.tables.contrasts)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.document_stats import read_document_stats  # noqa: E402
from kvdiverge.analysis.estimands import study_seed  # noqa: E402
from kvdiverge.analysis.prespecification import read_lock, registration_line  # noqa: E402
from kvdiverge.io import atomic_write_text, read_verified_parquet  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs  # noqa: E402
from kvdiverge.tables.contrasts import (  # noqa: E402
    labelled,
    render_summary_rst,
    study_contrasts,
    write_study_contrasts,
)
from kvdiverge.tables.inputs import read_estimands  # noqa: E402

p, out, study = snakemake.params, snakemake.output, snakemake.wildcards.study
stats = {
    model: read_document_stats(path)[0]
    for model, path in keyed_inputs(snakemake.input, "stats").items()
}
accuracy, _ = read_verified_parquet(snakemake.input.accuracy, "accuracy per document")
table, summary = study_contrasts(
    read_estimands(snakemake.input.estimands),
    stats,
    {model: accuracy.filter(accuracy["model"] == model) for model in stats},
    list(p.actions),
    dict(p.pairs),  # each action's baseline: the baseline's method at its budget when swept
    cohort=p.cohort,
    H=p.H,
    draws=p.draws,
    seed=study_seed(p.seed, study),
    level=p.level,
    temperature=p.temperature,
    labels=dict(p.labels),  # the sentences name the actions by their labels
)
registration = registration_line(read_lock(snakemake.input.lock))
write_study_contrasts(
    table, summary, out.csv, out.md, out.summary_md, out.summary_html, registration, dict(p.labels)
)
# the report's landing page opens on the headline of each study's summary (workflow.rst)
shown = labelled(table, dict(p.labels))
atomic_write_text(out.summary_rst, render_summary_rst(shown, study, p.H, p.temperature))
for row in table.filter(table["estimand"] == "R_smc").iter_rows(named=True):
    log.info(
        "%s %s - %s: ΔR_SMC %.4f [%.4f, %.4f]",
        row["model"], row["action"], row["baseline"], row["value"], row["ci_low"], row["ci_high"],
    )  # fmt: skip
log.info("wrote %s, %s, %s", out.csv, out.summary_md, out.summary_html)
