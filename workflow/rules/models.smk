# Tiny demo models (DESIGN §2, §6): built locally and deterministically from the seed.


rule build_demo_model:
    output:
        directory("data/models/{model}"),
    log:
        "logs/models/build_demo_model/{model}.log",
    benchmark:
        "results/benchmarks/build_demo_model/{model}.tsv"
    wildcard_constraints:
        model="|".join(demo_models()) or "no-demo-model",
    conda:
        "../../envs/rollout.yaml"
    params:
        kind=lambda wildcards: config["models"][wildcards.model]["demo"],
        seed=config["seed"],
        code=fingerprint("kvdiverge.models"),
    script:
        "../scripts/build_demo_model.py"
