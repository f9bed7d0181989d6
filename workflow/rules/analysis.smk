# Section 5 analysis (docs/method.md, "Estimands" to "Sample-size planning"; docs/analysis.md,
# "Analysis"; docs/prespecification.md, "Prespecification"): the sample-size plan and the lock from
# the development rollouts (before any evaluation rollout), each later rollout group's amendment
# lock (docs/compare.md, "Rollout groups"), per-document statistics, paired stratified bootstrap
# estimands and aggregate prediction.


include: "helpers/analysis.smk"


rule document_stats:
    input:
        unpack(lambda w: keyed("trajectories", action_trajectory_files(w.study, w.model))),
        documents=expand(results("documents/{stratum}.parquet"), stratum=study_strata()),
    output:
        results("{study}/{model}/document_stats.parquet"),
    log:
        logs("analysis/document_stats/{study}/{model}.log"),
    benchmark:
        results("benchmarks/document_stats/{study}/{model}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
        model=wildcard_alternation(config["models"], "no-model"),
    conda:
        "../../envs/kvdiverge.yaml"
    resources:
        mem_mb=32000,  # at the scale of configs/paper.yaml, as for estimands below
        runtime=60,
    params:
        development=lambda w: rollout_groups(w.study)[first_group(w.study)],
        cohorts=lambda w: trajectory_cohorts(w.study, w.model),
        control=lambda w: config["studies"][w.study]["control"],
        clock=config["analysis"]["clock"],
        code=script_code("document_stats.py"),
    script:
        "../scripts/document_stats.py"


rule estimands:
    input:
        unpack(lambda w: keyed("stats", document_stats_files(w.study))),
        unpack(
            lambda w: keyed(
                "amendment", {g: group_lock(w.study, g) for g in later_groups(w.study)}
            )
        ),
        lock=results("{study}/lock.json"),
        trajectories=lambda w: [
            f
            for files in study_trajectory_files(w.study, config["models"], "evaluation").values()
            for f in files
        ],
    output:
        csv=report(
            results("{study}/tables/estimands.csv"),
            caption="../report/estimands.rst",
            category="Language-model study",
            subcategory="Data",
            labels={"study": "{study}", "table": "estimands (CSV)"},
        ),
        md=results("{study}/tables/estimands.md"),
        plan_check=results("{study}/tables/plan_check.csv"),
        plan_check_md=results("{study}/tables/plan_check.md"),
    log:
        logs("analysis/estimands/{study}.log"),
    benchmark:
        results("benchmarks/estimands/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    resources:
        mem_mb=16000,
        runtime=120,
    params:
        study=lambda w: config["studies"][w.study],
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        strata=study_strata(),
        contrasts=estimand_contrasts,
        level=config["analysis"]["level"],
        alpha=config["analysis"]["alpha"],
        family_estimands=config["analysis"]["family_estimands"],
        seed=config["seed"],
        prespecified=prespecified_study,
        amendments=prespecified_amendments,
        code=script_code("estimands.py"),
    script:
        "../scripts/estimands.py"


rule prediction:
    input:
        unpack(lambda w: keyed("stats", document_stats_files(w.study))),
    output:
        report(
            results("{study}/tables/prediction.csv"),
            caption="../report/prediction.rst",
            category="Language-model study",
            subcategory="Data",
            labels={"study": "{study}", "table": "prediction (CSV)"},
        ),
    log:
        logs("analysis/prediction/{study}.log"),
    benchmark:
        results("benchmarks/prediction/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        pair=lambda w: config["analysis"]["prediction"]["pairs"].get(w.study),
        eval_cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        settings=prediction_settings(),
        alpha=config["analysis"]["alpha"],
        level=config["analysis"]["level"],
        seed=config["seed"],
        code=script_code("prediction.py"),
    script:
        "../scripts/prediction.py"


rule plan_sample_sizes:
    input:
        unpack(lambda w: keyed("development", development_files(w.study))),
    output:
        results("{study}/plan.json"),
    log:
        logs("analysis/plan_sample_sizes/{study}.log"),
    benchmark:
        results("benchmarks/plan_sample_sizes/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        actions=lambda w: rollout_groups(w.study)[first_group(w.study)],
        control=lambda w: config["studies"][w.study]["control"],
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        documents_per_stratum=lambda w: config["datasets"]["cohorts"][
            config["studies"][w.study].get("cohort", w.study)
        ],
        pinned_K=pinned_K,
        prespecified=prespecified_study,
        planning=config["analysis"]["planning"],
        code=script_code("plan_sample_sizes.py"),
    script:
        "../scripts/plan_sample_sizes.py"


rule prespecify:
    input:
        plan=results("{study}/plan.json"),
        documents=expand(results("documents/{stratum}.parquet"), stratum=study_strata()),
        development=lambda w: list(development_files(w.study).values()),
    output:
        results("{study}/lock.json"),
    log:
        logs("analysis/prespecify/{study}.log"),
    benchmark:
        results("benchmarks/prespecify/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        lock="study",
        prespecified=prespecified_study,
        # the lock registers each model folder's digests; a first registration beside
        # existing evaluation trajectories of the first group (an erased history) is refused
        model_paths={name: model_path(name) for name in config["models"]},
        evaluation_files=lambda w: locked_evaluation_files(w.study),
        endpoint_script=(
            "swrb_estimands.py" if config["rollout"]["coupling"] == "swrb" else "estimands.py"
        ),
        code=script_code("prespecify.py"),
    script:
        "../scripts/prespecify.py"


rule prespecify_group:
    input:
        lock=results("{study}/lock.json"),
    output:
        results("{study}/locks/{group}.json"),
    log:
        logs("analysis/prespecify_group/{study}/{group}.log"),
    benchmark:
        results("benchmarks/prespecify_group/{study}/{group}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
        group=amendment_groups(),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        lock="amendment",
        prespecified=prespecified_amendment,
        code=script_code("prespecify.py"),
    script:
        "../scripts/prespecify.py"
