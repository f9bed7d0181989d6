# Section 5 analysis (docs/method.md, "Estimands" to "Sample-size planning"; README "Analysis"):
# per-document statistics, paired stratified bootstrap estimands, aggregate prediction and
# sample-size planning.


rule document_stats:
    input:
        trajectories=lambda w: expand(
            "results/{study}/{model}/trajectories/{action}/{stratum}.parquet",
            study=w.study,
            model=w.model,
            action=config["studies"][w.study]["actions"],
            stratum=[s.name for s in DATASETS.strata],
        ),
        documents=expand(
            "data/documents/{stratum}.parquet", stratum=[s.name for s in DATASETS.strata]
        ),
    output:
        "results/{study}/{model}/document_stats.parquet",
    log:
        "logs/analysis/document_stats/{study}/{model}.log",
    benchmark:
        "results/benchmarks/document_stats/{study}/{model}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
        model="|".join(config["models"]) or "no-model",
    conda:
        "../../envs/analysis.yaml"
    params:
        files=lambda w: {
            action: [
                f"results/{w.study}/{w.model}/trajectories/{action}/{s.name}.parquet"
                for s in DATASETS.strata
            ]
            for action in config["studies"][w.study]["actions"]
        },
        control=lambda w: config["studies"][w.study]["control"],
        clock=config["analysis"]["clock"],
        code=script_code("document_stats.py"),
    script:
        "../scripts/document_stats.py"


rule estimands:
    input:
        stats=lambda w: expand(
            "results/{study}/{model}/document_stats.parquet", study=w.study, model=config["models"]
        ),
    output:
        csv=report(
            "results/{study}/tables/estimands.csv",
            caption="../report/estimands.rst",
            category="Language-model study",
            subcategory="Data",
            labels={"study": "{study}", "table": "estimands (CSV)"},
        ),
        md="results/{study}/tables/estimands.md",
    log:
        "logs/analysis/estimands/{study}.log",
    benchmark:
        "results/benchmarks/estimands/{study}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
    conda:
        "../../envs/analysis.yaml"
    params:
        models=list(config["models"]),
        study=lambda w: config["studies"][w.study],
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        strata=[s.name for s in DATASETS.strata],
        contrasts=lambda w: config["analysis"]["contrasts"].get(w.study),
        level=config["analysis"]["level"],
        alpha=config["analysis"]["alpha"],
        family_estimands=config["analysis"]["family_estimands"],
        seed=config["seed"],
        code=script_code("estimands.py"),
    script:
        "../scripts/estimands.py"


rule prediction:
    input:
        stats=lambda w: expand(
            "results/{study}/{model}/document_stats.parquet", study=w.study, model=config["models"]
        ),
    output:
        report(
            "results/{study}/tables/prediction.csv",
            caption="../report/prediction.rst",
            category="Language-model study",
            subcategory="Data",
            labels={"study": "{study}", "table": "prediction (CSV)"},
        ),
    log:
        "logs/analysis/prediction/{study}.log",
    benchmark:
        "results/benchmarks/prediction/{study}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
    conda:
        "../../envs/analysis.yaml"
    params:
        models=list(config["models"]),
        pair=lambda w: config["analysis"]["prediction"]["pairs"].get(w.study),
        eval_cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        settings=config["analysis"]["prediction"],
        alpha=config["analysis"]["alpha"],
        level=config["analysis"]["level"],
        seed=config["seed"],
        code=script_code("prediction.py"),
    script:
        "../scripts/prediction.py"


rule plan_sample_sizes:
    input:
        stats=lambda w: expand(
            "results/{study}/{model}/document_stats.parquet", study=w.study, model=config["models"]
        ),
        trajectories=lambda w: expand(
            "results/{study}/{model}/trajectories/{action}/{stratum}.parquet",
            study=w.study,
            model=config["models"],
            action=config["studies"][w.study]["actions"],
            stratum=[s.name for s in DATASETS.strata],
        ),
    output:
        "results/{study}/plan.json",
    log:
        "logs/analysis/plan_sample_sizes/{study}.log",
    benchmark:
        "results/benchmarks/plan_sample_sizes/{study}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
    conda:
        "../../envs/analysis.yaml"
    params:
        models=list(config["models"]),
        study=lambda w: config["studies"][w.study],
        strata=[s.name for s in DATASETS.strata],
        planning=config["analysis"]["planning"],
        code=script_code("plan_sample_sizes.py"),
    script:
        "../scripts/plan_sample_sizes.py"
