# Helpers of the figures and tables (workflow/rules/figures.smk; docs/analysis.md, "Figures and
# tables"): per-study settings and the files of the default target.
import hashlib
import json

from kvdiverge.config import action_labels, baseline_pairs, budget_sweeps

_CONFIG_JSON = json.dumps(config, sort_keys=True, default=str)
CONFIG_SHA256 = hashlib.sha256(_CONFIG_JSON.encode()).hexdigest()
"""SHA-256 of the effective config (sorted-key JSON): a study's metrics.json records it."""


def flag_stale_report():
    """At parse time, one warning when `<output_dir>/report.html` does not show the current
    results (kvdiverge.pipeline.report.stale_report): a run with nothing to be done builds no
    report, so this line is what says it is stale. Not in cluster jobs."""
    from snakemake.logging import logger
    from kvdiverge.pipeline.report import stale_report

    if not workflow.is_main_process or workflow.remote_exec:
        return
    line = stale_report(results("report.html"), final_outputs())
    if line:
        logger.warning(line)


def study_metrics_inputs(wildcards):
    """A study's estimands, accuracy and lock, and its contrasts when it has a baseline."""
    study = wildcards.study
    inputs = {
        "estimands": results(f"{study}/tables/estimands.csv"),
        "accuracy": results(f"{study}/tables/accuracy.csv"),
        "lock": results(f"{study}/lock.json"),
        "fig5": results(f"{study}/figures/fig5_divergence_cdf.png"),  # on the landing page
    }
    if study in baseline_studies():
        inputs["contrasts"] = results(f"{study}/tables/contrasts.csv")
    return inputs


def study_labels(wildcards):
    """The study's actions' display labels by name (`actions.<name>.label`, else the name;
    kvdiverge.config.actions): what its figures and tables show."""
    return action_labels(config, config["studies"][wildcards.study]["actions"])


def sweep_studies():
    """Studies with a method at two budgets or more among their compared actions (a budget
    sweep, or actions written one by one): they get the budget-sweep figure."""
    return [s for s in config["studies"] if budget_sweeps(config, s)]


def study_budget_sweep(wildcards):
    """The study's swept actions: name -> (method as the figure names it, budget)."""
    return budget_sweeps(config, wildcards.study)


def study_main_contrast(wildcards):
    """Tables 3-4's contrast 'b - a': figures.main_contrast, else the prediction pair, else None
    (the first contrast of the estimands table)."""
    pair = config["figures"]["main_contrast"].get(wildcards.study)
    predicted = config["analysis"]["prediction"]["pairs"].get(wildcards.study)
    if not pair and predicted and list(predicted) in study_contrasts(wildcards.study):
        pair = predicted
    return f"{pair[0]} - {pair[1]}" if pair else None


def study_tables_inputs(wildcards):
    """estimands.csv and the study's lock, plus prediction.csv when the study has a prediction
    pair."""
    inputs = {
        "estimands": results(f"{wildcards.study}/tables/estimands.csv"),
        "lock": results(f"{wildcards.study}/lock.json"),  # the registration the tables name
    }
    if config["analysis"]["prediction"]["pairs"].get(wildcards.study):
        inputs["prediction"] = results(f"{wildcards.study}/tables/prediction.csv")
    return inputs


def family_studies():
    """Studies with a prespecified endpoint family (family_endpoints > 1): they get figure 7."""
    return [s for s, spec in config["studies"].items() if spec.get("family_endpoints", 1) > 1]


def figures_and_tables_outputs():
    """Figure 1, every study's figures 5 (pooled, and per stratum in the appendix), 6 and the
    decomposition (and figure 7 for a family study, the budget-sweep figure for a study with
    a method at two budgets or more), Tables 1-4 in CSV, Markdown, LaTeX and
    HTML, and the estimands' typed Parquet copy and one-page summary; for a study with a
    baseline, its contrasts against it and their summary sentences (rule study_contrasts);
    each action's cache bytes beside its budget (rule study_cache_bytes)."""
    out = [results(f"theory/figures/fig1_introductory_example.{e}") for e in ("png", "pdf")]
    for study in config["studies"]:
        names = [
            "fig5_divergence_cdf",
            "fig5_divergence_cdf_strata",
            "fig6_tv_profiles",
            "decomposition",
        ]
        names += ["fig7_branch_contrasts"] if study in family_studies() else []
        names += ["budget_sweep"] if study in sweep_studies() else []  # rule study_sweep_figure
        out += [results(f"{study}/figures/{n}.{e}") for n in names for e in ("png", "pdf")]
        out += [
            results(f"{study}/tables/table{i}.{e}")
            for i in range(1, 5)
            for e in ("csv", "md", "tex", "html")
        ]
        out += [
            results(f"{study}/tables/estimands.parquet"),
            results(f"{study}/tables/estimands_summary.md"),
            results(f"{study}/tables/estimands_summary.html"),
        ]
        if study in baseline_studies():  # rule study_contrasts
            out += [results(f"{study}/tables/{n}") for n in STUDY_CONTRAST_FILES]
        out.append(results(f"{study}/metrics.json"))  # rule study_metrics
        out += [results(f"{study}/tables/cache_bytes.{e}") for e in ("csv", "md")]
        out.append(results(f"{study}/tables/landing.rst"))
    return out


STUDY_CONTRAST_FILES = (
    "contrasts.csv",
    "contrasts.md",
    "summary.md",
    "summary.html",
    "summary.rst",
)


def baseline_studies():
    """Studies with a baseline (studies.<study>.baseline): rule study_contrasts sets every
    compared action against it."""
    return [s for s, spec in config["studies"].items() if spec.get("baseline")]
