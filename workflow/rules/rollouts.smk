# Coupled rollouts (docs/architecture.md, "Coupled decoding" and "Rollout jobs"): one rule per
# study, rollout_<study>, and one job per (model, stratum) that loads the model once, prefills
# each document once and writes the trajectory file of every action of the study.


for study in config["studies"]:

    rule:
        name:
            f"rollout_{study}"
        input:
            documents="data/documents/{stratum}.parquet",
            model=rollout_model_input,
        output:
            **rollout_trajectories(study),
        log:
            f"logs/rollout/{study}/{{model}}/{{stratum}}.log",
        benchmark:
            f"results/benchmarks/rollout/{study}/{{model}}/{{stratum}}.tsv"
        wildcard_constraints:
            model="|".join(config["models"]) or "no-model",
        conda:
            "../../envs/rollout.yaml"
        threads: 1
        resources:
            gpu=rollout_gpus(),
            mem_mb=16000,
            runtime=240,
        params:
            model=rollout_model,
            actions=rollout_actions(study),
            cohorts=rollout_cohorts(study),
            H=config["rollout"]["H"],
            seed=config["seed"],
            coupling=config["rollout"]["coupling"],
            max_batch_rows=config["rollout"]["max_batch_rows"],
            device=config["rollout"]["device"],
            code=script_code("rollout.py"),
        script:
            "../scripts/rollout.py"
