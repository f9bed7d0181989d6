# Figures and tables of the language-model studies (SPEC §5, paper §5) and figure 1 (SPEC §2):
# drawn from the analysis tables only (estimands.csv, prediction.csv).


rule introductory_figure:
    output:
        png=report(
            "results/theory/figures/fig1_introductory_example.png",
            caption="../report/introductory_example.rst",
            category="Theory",
            labels={"figure": "1: occurrence versus occupation", "format": "PNG"},
        ),
        pdf=report(
            "results/theory/figures/fig1_introductory_example.pdf",
            caption="../report/introductory_example.rst",
            category="Theory",
            labels={"figure": "1: occurrence versus occupation", "format": "PDF"},
        ),
    log:
        "logs/figures/introductory_figure.log",
    benchmark:
        "results/benchmarks/introductory_figure/introductory_figure.tsv"
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        eps=config["figures"]["introductory"]["eps"],
        horizon=config["figures"]["introductory"]["horizon"],
        code=fingerprint(
            "kvdiverge.plots.theory",
            "kvdiverge.plots.base",
            "kvdiverge.risk",
            "kvdiverge.coupling",
            "kvdiverge.io",
        ),
    script:
        "../scripts/introductory_figure.py"


rule study_figures:
    input:
        estimands="results/{study}/tables/estimands.csv",
    output:
        fig5_divergence_cdf=report(
            "results/{study}/figures/fig5_divergence_cdf.png",
            caption="../report/study_divergence_cdf.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "5: divergence CDF", "format": "PNG"},
        ),
        fig5_divergence_cdf_pdf=report(
            "results/{study}/figures/fig5_divergence_cdf.pdf",
            caption="../report/study_divergence_cdf.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "5: divergence CDF", "format": "PDF"},
        ),
        fig6_tv_profiles=report(
            "results/{study}/figures/fig6_tv_profiles.png",
            caption="../report/study_tv_profiles.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "6: TV profiles", "format": "PNG"},
        ),
        fig6_tv_profiles_pdf=report(
            "results/{study}/figures/fig6_tv_profiles.pdf",
            caption="../report/study_tv_profiles.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "6: TV profiles", "format": "PDF"},
        ),
        decomposition=report(
            "results/{study}/figures/decomposition.png",
            caption="../report/study_decomposition.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "D: gap decomposition", "format": "PNG"},
        ),
        decomposition_pdf=report(
            "results/{study}/figures/decomposition.pdf",
            caption="../report/study_decomposition.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "D: gap decomposition", "format": "PDF"},
        ),
    log:
        "logs/figures/study_figures/{study}.log",
    benchmark:
        "results/benchmarks/study_figures/{study}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        actions=study_compared_actions,
        control=study_control,
        palette_actions=list(config["actions"]),
        code=fingerprint(
            "kvdiverge.plots.study",
            "kvdiverge.plots.base",
            "kvdiverge.tables",
            "kvdiverge.io",
        ),
    script:
        "../scripts/study_figures.py"


rule study_branch_figure:
    input:
        estimands="results/{study}/tables/estimands.csv",
    output:
        fig7_branch_contrasts=report(
            "results/{study}/figures/fig7_branch_contrasts.png",
            caption="../report/study_branch_contrasts.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={
                "study": "{study}",
                "figure": "7: branch contrasts and saturation",
                "format": "PNG",
            },
        ),
        fig7_branch_contrasts_pdf=report(
            "results/{study}/figures/fig7_branch_contrasts.pdf",
            caption="../report/study_branch_contrasts.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={
                "study": "{study}",
                "figure": "7: branch contrasts and saturation",
                "format": "PDF",
            },
        ),
    log:
        "logs/figures/study_branch_figure/{study}.log",
    benchmark:
        "results/benchmarks/study_branch_figure/{study}.tsv"
    wildcard_constraints:
        study="|".join(family_studies()) or "no-family-study",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        actions=study_compared_actions,
        control=study_control,
        palette_actions=list(config["actions"]),
        code=fingerprint(
            "kvdiverge.plots.study",
            "kvdiverge.plots.base",
            "kvdiverge.tables",
            "kvdiverge.io",
        ),
    script:
        "../scripts/study_figures.py"


rule study_tables:
    input:
        unpack(study_tables_inputs),
    output:
        table1_csv=report(
            "results/{study}/tables/table1.csv",
            caption="../report/study_table1.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "1: timing and occupation", "format": "CSV"},
        ),
        table1_md=report(
            "results/{study}/tables/table1.md",
            caption="../report/study_table1.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "1: timing and occupation", "format": "Markdown"},
        ),
        table1_tex=report(
            "results/{study}/tables/table1.tex",
            caption="../report/study_table1.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "1: timing and occupation", "format": "TEX"},
        ),
        table2_csv=report(
            "results/{study}/tables/table2.csv",
            caption="../report/study_table2.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "2: gap decomposition", "format": "CSV"},
        ),
        table2_md=report(
            "results/{study}/tables/table2.md",
            caption="../report/study_table2.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "2: gap decomposition", "format": "Markdown"},
        ),
        table2_tex=report(
            "results/{study}/tables/table2.tex",
            caption="../report/study_table2.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "2: gap decomposition", "format": "TEX"},
        ),
        table3_csv=report(
            "results/{study}/tables/table3.csv",
            caption="../report/study_table3.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "3: main contrast by stratum", "format": "CSV"},
        ),
        table3_md=report(
            "results/{study}/tables/table3.md",
            caption="../report/study_table3.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={
                "study": "{study}",
                "table": "3: main contrast by stratum",
                "format": "Markdown",
            },
        ),
        table3_tex=report(
            "results/{study}/tables/table3.tex",
            caption="../report/study_table3.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "3: main contrast by stratum", "format": "TEX"},
        ),
        table4_csv=report(
            "results/{study}/tables/table4.csv",
            caption="../report/study_table4.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={
                "study": "{study}",
                "table": "4: uncalibrated contrasts and prediction",
                "format": "CSV",
            },
        ),
        table4_md=report(
            "results/{study}/tables/table4.md",
            caption="../report/study_table4.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={
                "study": "{study}",
                "table": "4: uncalibrated contrasts and prediction",
                "format": "Markdown",
            },
        ),
        table4_tex=report(
            "results/{study}/tables/table4.tex",
            caption="../report/study_table4.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={
                "study": "{study}",
                "table": "4: uncalibrated contrasts and prediction",
                "format": "TEX",
            },
        ),
    log:
        "logs/figures/study_tables/{study}.log",
    benchmark:
        "results/benchmarks/study_tables/{study}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
    localrule: True
    conda:
        "../../envs/analysis.yaml"
    params:
        actions=study_compared_actions,
        main_contrast=study_main_contrast,
        code=fingerprint("kvdiverge.tables", "kvdiverge.analysis.estimands", "kvdiverge.io"),
    script:
        "../scripts/study_tables.py"
