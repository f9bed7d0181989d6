# Helpers of the finite-state study (workflow/rules/finite_state.smk).


def finite_state_study_settings():
    """config.finite_state less the figure-only key, so that editing it reruns only figures."""
    return {k: v for k, v in config["finite_state"].items() if k != "interval_figure_systems"}
