"""Rule study_sweep_figure: a study's divergence measures against the budget (P(τ ≤ H), the mean
entry time and R_SMC, one line per method run at two budgets or more, with intervals), drawn
from its estimands table (kvdiverge.plots.sweep)."""

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.plots.sweep import write_sweep_figure  # noqa: E402

p = snakemake.params
sweep = {action: (method, budget) for action, (method, budget) in p.sweep.items()}
baseline = p.baseline
table = write_sweep_figure(
    snakemake.input.estimands,
    sweep,
    snakemake.output.png,
    snakemake.output.pdf,
    baseline=baseline,
    baseline_label=dict(p.labels).get(baseline, baseline) if baseline else None,
)
methods = table["method"].unique(maintain_order=True).to_list()
log.info("%d method(s) against the budget: %s", len(methods), ", ".join(methods))
