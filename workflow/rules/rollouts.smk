# Coupled rollouts (SPEC §1, §5, §6; DESIGN §3.2, §4): one job per (study, model, action, stratum).


rule rollout:
    input:
        documents="data/documents/{stratum}.parquet",
        model=rollout_model_input,
    output:
        "results/{study}/{model}/trajectories/{action}/{stratum}.parquet",
    log:
        "logs/rollout/{study}/{model}/{action}/{stratum}.log",
    benchmark:
        "results/benchmarks/rollout/{study}/{model}/{action}/{stratum}.tsv"
    wildcard_constraints:
        study="|".join(config["studies"]) or "no-study",
        model="|".join(config["models"]) or "no-model",
        action="|".join(config["actions"]) or "no-action",
    conda:
        "../../envs/rollout.yaml"
    threads: 1
    resources:
        gpu=rollout_gpus(),
        mem_mb=16000,
        runtime=240,
    params:
        model=rollout_model,
        action=rollout_action,
        cohorts=rollout_cohorts,
        H=config["rollout"]["H"],
        seed=config["seed"],
        coupling=config["rollout"]["coupling"],
        max_batch_rows=config["rollout"]["max_batch_rows"],
        device=config["rollout"]["device"],
        code=fingerprint(
            "kvdiverge.engine",
            "kvdiverge.eviction",
            "kvdiverge.models",
            "kvdiverge.coupling",
            "kvdiverge.trajectories",
            "kvdiverge.io",
        ),
    script:
        "../scripts/rollout.py"
