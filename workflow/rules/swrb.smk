# SWRB analysis under rollout.coupling: swrb (docs/method.md, "Survival-weighted residual
# branching"; docs/swrb.md, "Switching it on"): rollout_<study> writes one SWRB record
# file per (model, action, stratum) in <study>/<model>/swrb/; swrb_estimands turns a study's
# files into its estimands table (the layout of estimands.csv, with the stratified document
# bootstrap paired across actions) and swrb_figures draws its smooth divergence CDF.


include: "helpers/swrb.smk"


rule swrb_estimands:
    input:
        records=swrb_record_list,
        lock=results("{study}/lock.json"),
    output:
        csv=report(
            results("{study}/tables/swrb_estimands.csv"),
            caption="../report/swrb_estimands.rst",
            category="Language-model study",
            subcategory="Data",
            labels={"study": "{study}", "table": "SWRB estimands (CSV)"},
        ),
        md=results("{study}/tables/swrb_estimands.md"),
    log:
        logs("analysis/swrb_estimands/{study}.log"),
    benchmark:
        results("benchmarks/swrb_estimands/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        files=lambda w: swrb_record_files(w.study),
        contrasts=lambda w: study_contrasts(w.study),
        window=swrb_window(),
        draws=lambda w: config["studies"][w.study]["bootstrap_draws"],
        level=config["analysis"]["level"],
        seed=config["seed"],
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        prespecified=prespecified_study,
        code=script_code("swrb_estimands.py"),
    script:
        "../scripts/swrb_estimands.py"


rule swrb_figures:
    input:
        estimands=results("{study}/tables/swrb_estimands.csv"),
    output:
        fig5_divergence_cdf=report(
            results("{study}/figures/swrb_divergence_cdf.png"),
            caption="../report/swrb_divergence_cdf.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "5 (SWRB): smooth divergence CDF, pooled"},
        ),
        fig5_divergence_cdf_pdf=results("{study}/figures/swrb_divergence_cdf.pdf"),
        fig5_divergence_cdf_strata=report(
            results("{study}/figures/swrb_divergence_cdf_strata.png"),
            caption="../report/swrb_divergence_cdf_strata.rst",
            category="Language-model study",
            subcategory="Appendix figures",
            labels={"study": "{study}", "figure": "5 (SWRB, appendix): per stratum"},
        ),
        fig5_divergence_cdf_strata_pdf=results("{study}/figures/swrb_divergence_cdf_strata.pdf"),
    log:
        logs("figures/swrb_figures/{study}.log"),
    benchmark:
        results("benchmarks/swrb_figures/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    localrule: True
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=study_compared_actions,
        control=study_control,
        labels=lambda w: study_labels(w),  # workflow/rules/helpers/figures.smk
        code=script_code("study_figures.py"),
    script:
        "../scripts/study_figures.py"
