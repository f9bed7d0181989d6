# Finite-state SWRB study (docs/method.md, "Survival-weighted residual branching"): exact DP, naive
# and SWRB estimators, figures.


include: "helpers/finite_state.smk"


rule finite_state_systems:
    output:
        systems=report(
            results("finite_state/systems.csv"),
            caption="../report/finite_state_systems.rst",
            category="Finite-state study",
            subcategory="Data",
            labels={"table": "systems (CSV)"},
        ),
        windows=results("finite_state/windows.csv"),
    log:
        logs("finite_state/systems.log"),
    benchmark:
        results("benchmarks/finite_state_systems/systems.tsv")
    priority: -1  # off the rollout chain: it waits for a core the rollouts leave idle
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        seed=config["seed"],
        finite_state=finite_state_study_settings(),
        code=script_code("finite_state_systems.py"),
    script:
        "../scripts/finite_state_systems.py"


rule finite_state_figures:
    input:
        systems=results("finite_state/systems.csv"),
        windows=results("finite_state/windows.csv"),
    output:
        estimators=report(
            results("finite_state/figures/estimators.png"),
            caption="../report/finite_state_estimators.rst",
            category="Finite-state study",
            subcategory="Figures",
            labels={"figure": "4: estimators"},
        ),
        estimators_pdf=results("finite_state/figures/estimators.pdf"),
        interval=report(
            results("finite_state/figures/identified_interval.png"),
            caption="../report/finite_state_identified_interval.rst",
            category="Finite-state study",
            subcategory="Figures",
            labels={"figure": "2: identified interval"},
        ),
        interval_pdf=results("finite_state/figures/identified_interval.pdf"),
    log:
        logs("finite_state/figures.log"),
    benchmark:
        results("benchmarks/finite_state_figures/figures.tsv")
    priority: -1  # off the rollout chain: it waits for a core the rollouts leave idle
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        interval_systems=config["finite_state"]["interval_figure_systems"],
        code=script_code("finite_state_figures.py"),
    script:
        "../scripts/finite_state_figures.py"
