# Task accuracy beside divergence (src/kvdiverge/analysis/accuracy.py; docs/analysis.md,
# "Task accuracy"):
# every replicate's X and Y generations of the study's evaluation documents scored with their
# source's metric, per action, by divergence timing, with paired document-bootstrap intervals.


rule accuracy:
    input:
        trajectories=lambda w: expand(
            results("{study}/{model}/trajectories/{action}/{stratum}.parquet"),
            study=w.study,
            model=config["models"],
            action=study_compared_actions(w),
            stratum=[s.name for s in DATASETS.strata],
        ),
        documents=expand(
            results("documents/{stratum}.parquet"), stratum=[s.name for s in DATASETS.strata]
        ),
        models=lambda w: [
            model_path(m) for m in config["models"] if m in demo_models() + sourced_models()
        ],
        lock=results("{study}/lock.json"),
    output:
        csv=results("{study}/tables/accuracy.csv"),
        documents=results("{study}/tables/accuracy_documents.parquet"),
        table_csv=results("{study}/tables/table_accuracy.csv"),
        table_md=results("{study}/tables/table_accuracy.md"),
        table_tex=results("{study}/tables/table_accuracy.tex"),
        table_html=report(
            results("{study}/tables/table_accuracy.html"),
            caption="../report/study_table_accuracy.rst",
            category="Language-model study",
            subcategory="Tables",
            labels={"study": "{study}", "table": "A: task accuracy by divergence timing"},
        ),
        png=report(
            results("{study}/figures/accuracy.png"),
            caption="../report/study_accuracy.rst",
            category="Language-model study",
            subcategory="Figures",
            labels={"study": "{study}", "figure": "A: task accuracy by divergence timing"},
        ),
        pdf=results("{study}/figures/accuracy.pdf"),
    log:
        logs("analysis/accuracy/{study}.log"),
    benchmark:
        results("benchmarks/accuracy/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        tokenizers=lambda w: {  # the tokenizer of every model decodes its generations
            name: {
                "path": model_path(name),
                "revision": spec.get("revision"),
                "trust_remote_code": bool(spec.get("trust_remote_code", False)),
            }
            for name, spec in config["models"].items()
        },
        files=lambda w: {
            model: {
                action: [
                    results(f"{w.study}/{model}/trajectories/{action}/{s.name}.parquet")
                    for s in DATASETS.strata
                ]
                for action in study_compared_actions(w)
            }
            for model in config["models"]
        },
        actions=study_compared_actions,
        control=study_control,
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        datasets=config["datasets"],
        clock=config["analysis"]["clock"],
        draws=lambda w: config["studies"][w.study]["bootstrap_draws"],
        level=config["analysis"]["level"],
        seed=config["seed"],
        labels=lambda w: study_labels(w),  # figure and table (helpers/figures.smk, later)
        code=script_code("accuracy.py"),
    script:
        "../scripts/accuracy.py"


# Generations side by side (src/kvdiverge/tables/generations.py; docs/analysis.md,
# "Generations side by side"): a sample of the evaluation documents per model, action and
# stratum, their full-cache and evicted continuations with the divergence token marked.
rule study_generations:
    input:
        trajectories=lambda w: expand(
            results("{study}/{model}/trajectories/{action}/{stratum}.parquet"),
            study=w.study,
            model=config["models"],
            action=study_compared_actions(w),
            stratum=[s.name for s in DATASETS.strata],
        ),
        documents=expand(
            results("documents/{stratum}.parquet"), stratum=[s.name for s in DATASETS.strata]
        ),
        models=lambda w: [
            model_path(m) for m in config["models"] if m in demo_models() + sourced_models()
        ],
    output:
        html=report(
            results("{study}/tables/generations.html"),
            caption="../report/study_generations.rst",
            category="Language-model study",
            subcategory="Generations",
            labels={"study": "{study}", "page": "generations side by side (a sample)"},
        ),
        parquet=results("{study}/tables/generations.parquet"),
    log:
        logs("analysis/study_generations/{study}.log"),
    benchmark:
        results("benchmarks/study_generations/{study}.tsv")
    wildcard_constraints:
        study=wildcard_alternation(config["studies"], "no-study"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        tokenizers=lambda w: {  # the tokenizer of every model decodes its generations
            name: {
                "path": model_path(name),
                "revision": spec.get("revision"),
                "trust_remote_code": bool(spec.get("trust_remote_code", False)),
            }
            for name, spec in config["models"].items()
        },
        files=lambda w: {
            model: {
                action: [
                    results(f"{w.study}/{model}/trajectories/{action}/{s.name}.parquet")
                    for s in DATASETS.strata
                ]
                for action in study_compared_actions(w)
            }
            for model in config["models"]
        },
        actions=study_compared_actions,
        labels=lambda w: study_labels(w),  # workflow/rules/helpers/figures.smk
        datasets=config["datasets"],
        clock=config["analysis"]["clock"],
        per_stratum=3,  # documents drawn per model, action and stratum
        seed=config["seed"],
        cohort=lambda w: config["studies"][w.study].get("cohort", w.study),
        code=script_code("study_generations.py"),
    script:
        "../scripts/study_generations.py"
