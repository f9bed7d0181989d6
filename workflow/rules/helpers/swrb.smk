# Helpers of the SWRB analysis (rollout.coupling: swrb; workflow/rules/swrb.smk; docs/swrb.md,
# "SWRB for language-model rollouts").


def swrb_record_files(study):
    """The study's evaluation SWRB record files: model → action → stratum → path."""
    return {
        model: {
            action: {
                stratum: results(f"{study}/{model}/swrb/{action}/{stratum}.parquet")
                for stratum in study_strata()
            }
            for action in config["studies"][study]["actions"]
        }
        for model in config["models"]
    }


def swrb_record_list(wildcards):
    """Every SWRB record file of the study, as a flat list (the rule's input)."""
    return [
        path
        for by_action in swrb_record_files(wildcards.study).values()
        for by_stratum in by_action.values()
        for path in by_stratum.values()
    ]


def swrb_window():
    """The window L of Z_L and W_L in steps: the analysis clock's `window` at H."""
    from kvdiverge.analysis.document_stats import Clock

    return Clock.for_horizon(config["rollout"]["H"], **config["analysis"]["clock"]).window


def swrb_outputs():
    """The default target under `rollout.coupling: swrb` (final_outputs): figure 1, and per
    study its plan and lock, the SWRB estimands table (CSV, Markdown) and divergence CDF
    figures."""
    out = [results(f"theory/figures/fig1_introductory_example.{e}") for e in ("png", "pdf")]
    for study in config["studies"]:
        out += [
            results(f"{study}/plan.json"),
            results(f"{study}/lock.json"),
            results(f"{study}/tables/swrb_estimands.csv"),
            results(f"{study}/tables/swrb_estimands.md"),
        ]
        out += [
            results(f"{study}/figures/{name}.{e}")
            for name in ("swrb_divergence_cdf", "swrb_divergence_cdf_strata")
            for e in ("png", "pdf")
        ]
    return out
