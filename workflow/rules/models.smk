# Tiny demo models (DESIGN §2, §6; README "Demo models"): trained on CPU from the seed. The
# trained weights are committed under data/models/; weights whose training fingerprint differs
# from the current training code and config stop the workflow here, with the retrain command.
from kvdiverge.training import check_demo_model_folder, demo_model_fingerprint
from kvdiverge.training_job import train_demo_model_job

for _name in demo_models():
    check_demo_model_folder(
        model_path(_name),
        config["models"][_name],
        config["models"][_name]["seed"],
        where=f"config.models.{_name}",
    )


demo_training_fingerprint = lambda name: demo_model_fingerprint(
    config["models"][name], config["models"][name]["seed"]
)


rule build_demo_model:
    output:
        directory("data/models/{model}"),
    log:
        "logs/models/build_demo_model/{model}.log",
    benchmark:
        "results/benchmarks/build_demo_model/{model}.tsv"
    wildcard_constraints:
        model="|".join(demo_models()) or "no-demo-model",
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
    run:
        train_demo_model_job(output[0], params, log[0], threads)
