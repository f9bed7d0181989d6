# Documents of the language-model study (docs/architecture.md, "File contracts";
# docs/datasets.md, "Datasets").


include: "helpers/datasets.smk"


rule materialize_documents:
    input:
        unpack(documents_inputs),
    output:
        results("documents/{stratum}.parquet"),
    log:
        logs("datasets/materialize_documents/{stratum}.log"),
    benchmark:
        results("benchmarks/materialize_documents/{stratum}.tsv")
    wildcard_constraints:
        stratum=wildcard_alternation((s.name for s in DATASETS.strata), "no-stratum"),
    conda:
        "../../envs/kvdiverge.yaml"
    params:
        datasets=config["datasets"],
        models=lambda wildcards: documents_models(),
        code=script_code("materialize_documents.py"),
    script:
        "../scripts/materialize_documents.py"
