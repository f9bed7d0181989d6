# Figures and tables of the language-model studies and figure 1, drawn from the analysis tables
# only (estimands.csv, prediction.csv). In the report every figure is its PNG (the PDF beside it
# is for papers) and every table its HTML rendering (CSV, Markdown and LaTeX beside it).


include: "helpers/figures.smk"


rule introductory_figure:
    output:
        png=report(
            results("theory/figures/fig1_introductory_example.png"),
            caption="../report/introductory_example.rst",
            category="Theory",
            subcategory="Figures",
            labels={"figure": "1: occurrence versus occupation"},
        ),
        pdf=results("theory/figures/fig1_introductory_example.pdf"),
    log:
        logs("figures/introductory_figure.log"),
    benchmark:
        results("benchmarks/introductory_figure/introductory_figure.tsv")
    priority: -1  # off the rollout chain: it waits for a core the rollouts leave idle
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        eps=config["figures"]["introductory"]["eps"],
        horizon=config["figures"]["introductory"]["horizon"],
        code=script_code("introductory_figure.py"),
    script:
        "../scripts/introductory_figure.py"


rule study_figures:
    input:
        estimands=results("{study}/tables/estimands.csv"),
    output:
        fig5_divergence_cdf=report(
            results("{study}/figures/fig5_divergence_cdf.png"),
            caption="../report/study_divergence_cdf.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "5: divergence CDF, pooled"},
        ),
        fig5_divergence_cdf_pdf=results("{study}/figures/fig5_divergence_cdf.pdf"),
        fig5_divergence_cdf_strata=report(
            results("{study}/figures/fig5_divergence_cdf_strata.png"),
            caption="../report/study_divergence_cdf_strata.rst",
            category="Language-model study",
            subcategory="Appendix figures",
            labels={"study": "{study}", "figure": "5 (appendix): divergence CDF per stratum"},
        ),
        fig5_divergence_cdf_strata_pdf=results("{study}/figures/fig5_divergence_cdf_strata.pdf"),
        fig6_tv_profiles=report(
            results("{study}/figures/fig6_tv_profiles.png"),
            caption="../report/study_tv_profiles.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "6: TV profiles"},
        ),
        fig6_tv_profiles_pdf=results("{study}/figures/fig6_tv_profiles.pdf"),
        decomposition=report(
            results("{study}/figures/decomposition.png"),
            caption="../report/study_decomposition.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "D: gap decomposition"},
        ),
        decomposition_pdf=results("{study}/figures/decomposition.pdf"),
    log:
        logs("figures/study_figures/{study}.log"),
    benchmark:
        results("benchmarks/study_figures/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=study_compared_actions,
        control=study_control,
        labels=study_labels,
        code=script_code("study_figures.py"),
    script:
        "../scripts/study_figures.py"


rule study_branch_figure:
    input:
        estimands=results("{study}/tables/estimands.csv"),
    output:
        fig7_branch_contrasts=report(
            results("{study}/figures/fig7_branch_contrasts.png"),
            caption="../report/study_branch_contrasts.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "7: branch contrasts and saturation"},
        ),
        fig7_branch_contrasts_pdf=results("{study}/figures/fig7_branch_contrasts.pdf"),
    log:
        logs("figures/study_branch_figure/{study}.log"),
    benchmark:
        results("benchmarks/study_branch_figure/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(family_studies(), "no-family-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=study_compared_actions,
        control=study_control,
        labels=study_labels,
        code=script_code("study_figures.py"),
    script:
        "../scripts/study_figures.py"


rule study_sweep_figure:  # a study with a method at two budgets or more
    input:
        estimands=results("{study}/tables/estimands.csv"),
    output:
        png=report(
            results("{study}/figures/budget_sweep.png"),
            caption="../report/study_budget_sweep.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "S: divergence against the budget"},
        ),
        pdf=results("{study}/figures/budget_sweep.pdf"),
    log:
        logs("figures/study_sweep_figure/{study}.log"),
    benchmark:
        results("benchmarks/study_sweep_figure/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(sweep_studies(), "no-sweep-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        sweep=study_budget_sweep,
        baseline=lambda w: config["studies"][w.study].get("baseline"),
        labels=study_labels,
        code=script_code("study_sweep_figure.py"),
    script:
        "../scripts/study_sweep_figure.py"


rule study_tables:
    input:
        unpack(study_tables_inputs),
    output:
        table1_csv=results("{study}/tables/table1.csv"),
        table1_md=results("{study}/tables/table1.md"),
        table1_tex=results("{study}/tables/table1.tex"),
        table1_html=report(
            results("{study}/tables/table1.html"),
            caption="../report/study_table1.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "1: timing and occupation"},
        ),
        table2_csv=results("{study}/tables/table2.csv"),
        table2_md=results("{study}/tables/table2.md"),
        table2_tex=results("{study}/tables/table2.tex"),
        table2_html=report(
            results("{study}/tables/table2.html"),
            caption="../report/study_table2.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "2: gap decomposition"},
        ),
        table3_csv=results("{study}/tables/table3.csv"),
        table3_md=results("{study}/tables/table3.md"),
        table3_tex=results("{study}/tables/table3.tex"),
        table3_html=report(
            results("{study}/tables/table3.html"),
            caption="../report/study_table3.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "3: main contrast by stratum"},
        ),
        table4_csv=results("{study}/tables/table4.csv"),
        table4_md=results("{study}/tables/table4.md"),
        table4_tex=results("{study}/tables/table4.tex"),
        table4_html=report(
            results("{study}/tables/table4.html"),
            caption="../report/study_table4.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "4: uncalibrated contrasts and prediction"},
        ),
        estimands_parquet=results("{study}/tables/estimands.parquet"),
        estimands_summary_md=results("{study}/tables/estimands_summary.md"),
        estimands_summary_html=report(
            results("{study}/tables/estimands_summary.html"),
            caption="../report/estimands_summary.rst",
            category="Language-model study",
            subcategory="Estimands",
            labels={"study": "{study}", "table": "estimands: summary"},
        ),
    log:
        logs("figures/study_tables/{study}.log"),
    benchmark:
        results("benchmarks/study_tables/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=study_compared_actions,
        main_contrast=study_main_contrast,
        labels=study_labels,
        temperature=config["rollout"]["temperature"],  # greedy: the summary's greedy note
        code=script_code("study_tables.py"),
    script:
        "../scripts/study_tables.py"


rule study_contrasts:  # a study with a baseline (studies.<study>.baseline)
    input:
        unpack(lambda w: keyed("stats", document_stats_files(w.study))),
        estimands=results("{study}/tables/estimands.csv"),
        accuracy=results("{study}/tables/accuracy_documents.parquet"),
        lock=results("{study}/lock.json"),  # the registration the tables name
    output:
        csv=results("{study}/tables/contrasts.csv"),
        md=results("{study}/tables/contrasts.md"),
        summary_md=results("{study}/tables/summary.md"),
        summary_rst=results("{study}/tables/summary.rst"),  # the report's landing page reads it
        summary_html=report(
            results("{study}/tables/summary.html"),
            caption="../report/study_summary.rst",
            category="Language-model study",
            subcategory="Against the baseline",
            labels={"study": "{study}", "table": "summary: each action against the baseline"},
        ),
    log:
        logs("figures/study_contrasts/{study}.log"),
    benchmark:
        results("benchmarks/study_contrasts/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(baseline_studies(), "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=study_compared_actions,
        baseline=lambda w: config["studies"][w.study]["baseline"],
        pairs=lambda w: baseline_pairs(config, w.study),  # a swept baseline: paired by budget
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        H=config["rollout"]["H"],
        temperature=config["rollout"]["temperature"],
        draws=lambda w: config["studies"][w.study]["bootstrap_draws"],
        level=config["analysis"]["level"],
        seed=config["seed"],
        labels=study_labels,
        code=script_code("study_contrasts.py"),
    script:
        "../scripts/study_contrasts.py"


rule study_cache_bytes:  # each action's cache bytes beside its budget (analysis.cache_bytes)
    input:
        unpack(
            lambda w: keyed(
                "trajectories",
                {
                    f"{model}/{action}": paths
                    for model in config["models"]
                    for action, paths in study_trajectory_files(
                        w.study, [model], "evaluation"
                    ).items()
                },
            )
        ),
    output:
        csv=results("{study}/tables/cache_bytes.csv"),
        md=results("{study}/tables/cache_bytes.md"),
    log:
        logs("figures/study_cache_bytes/{study}.log"),
    benchmark:
        results("benchmarks/study_cache_bytes/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        control=study_control,
        code=script_code("study_cache_bytes.py"),
    script:
        "../scripts/study_cache_bytes.py"


rule study_metrics:  # metrics.json: what `kvdiverge merge` reads (kvdiverge.tables.metrics)
    input:
        unpack(study_metrics_inputs),
    output:
        metrics=results("{study}/metrics.json"),
        landing=results("{study}/tables/landing.rst"),  # the report's landing page reads it
    log:
        logs("figures/study_metrics/{study}.log"),
    benchmark:
        results("benchmarks/study_metrics/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        baseline=lambda w: baseline_pairs(config, w.study),  # each action's baseline
        baseline_name=lambda w: config["studies"][w.study].get("baseline"),
        draws=lambda w: config["studies"][w.study]["bootstrap_draws"],
        level=config["analysis"]["level"],
        config_sha256=CONFIG_SHA256,
        labels=study_labels,
        code=script_code("study_metrics.py"),
    script:
        "../scripts/study_metrics.py"
