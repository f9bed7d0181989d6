# Helpers of the rollout rules (workflow/rules/rollouts.smk; docs/architecture.md, "Rollout
# jobs"): their outputs, params, code fingerprints and resources.
from kvdiverge.pipeline.provenance import script_fingerprint


def rollout_on_gpu():
    """Whether a rollout job runs on a GPU: `rollout.device: cuda`, or `auto` where this machine
    has one (kvdiverge.pipeline.hardware) or the jobs go to a cluster: a non-local executor
    (`--executor slurm`), or a dry run of one (Snakemake runs a dry run with its own executor
    but forces threads for a remote one). Known only once the jobs are planned, not at parse
    time: the resources below ask it then."""
    from kvdiverge.pipeline.hardware import gpu_expected

    device = config["rollout"]["device"]
    if device != "auto":
        return device == "cuda"
    cluster = workflow.non_local_exec or (workflow.dryrun and workflow.use_threads)
    return cluster or gpu_expected(device)


def rollout_resources():
    """The resources of a rollout job from `rollout.resources` (docs/running.md, "Running on a
    SLURM cluster"): its memory and runtime, and on a GPU its GPUs (`gpu`, which the local
    profile limits), GPU model, CPUs per GPU and partition. A job on CPU asks for no GPU (CPU
    jobs then run side by side locally) and runs in the profile's default partition."""
    spec = config["rollout"]["resources"]
    resources = {"mem_mb": spec["mem_mb"], "runtime": spec["runtime"]}
    if config["rollout"]["device"] == "cpu":
        return {"gpu": 0, **resources}

    def on_gpu(value, otherwise=None):
        return lambda wildcards: value if rollout_on_gpu() else otherwise

    on_a_gpu = {
        "gpu_model": spec["gpu_model"],
        "cpus_per_gpu": spec["cpus_per_gpu"],
        "slurm_partition": spec["partition"],
    }
    resources["gpu"] = on_gpu(spec["gpus"], 0)
    for key, value in on_a_gpu.items():
        if value is not None:
            resources[key] = on_gpu(value)
    return resources


def rollout_params(study, group, stage):
    """Every param of a rollout job, spelled once for both stages (workflow/scripts/rollout.py;
    swrb_rollout.py for an evaluation under `rollout.coupling: swrb`): the stage (`dev`, or
    `evaluation` under the group's lock, which fixes the replicates and the seed), the study, the
    model,
    the group's actions, H, the seed, the coupling, the decoding temperature (rollout.temperature;
    swrb runs at any T > 0, not greedy), rows per model call, the device, the code
    fingerprint; and the development replicates for `dev`."""
    params = {
        "stage": stage,
        "study": study,  # recorded in every file: a file copied to another study stops on read
        "model": rollout_model,
        "actions": rollout_actions(study, group),
        "H": config["rollout"]["H"],
        "seed": config["seed"],
        "coupling": dev_rollout_coupling() if stage == "dev" else config["rollout"]["coupling"],
        "temperature": config["rollout"]["temperature"],
        "max_batch_rows": config["rollout"]["max_batch_rows"],
        "device": config["rollout"]["device"],
        "code": rollout_code(study, rollout_script(stage), group),
    }
    if stage == "dev":
        params["cohorts"] = dev_rollout_cohorts(study)
    return params


def rollout_model(wildcards):
    """Loading parameters of the rollout job's model (path, revision, remote code, dtype)."""
    spec = config["models"][wildcards.model]
    return {
        "name": wildcards.model,
        "path": model_path(wildcards.model),
        "revision": spec.get("revision"),
        "trust_remote_code": bool(spec.get("trust_remote_code", False)),
        "dtype": spec.get("dtype", "auto"),
    }


def rollout_model_input(wildcards):
    """The model folder when a rule of this workflow builds it (build_demo_model or
    materialize_model)."""
    built = wildcards.model in demo_models() or wildcards.model in sourced_models()
    return [model_path(wildcards.model)] if built else []


def rollout_rule_name(study, group):
    """The name of a rollout group's evaluation rule, rollout_<study> for the first group (as
    without groups), rollout_<study>_<group> for a later one."""
    return f"rollout_{study}" if group == first_group(study) else f"rollout_{study}_{group}"


def rollout_trajectories(study):
    """The study's trajectory files by action, with {model} and {stratum} left as
    wildcards: the outputs of rollout_<study>, one job per model and stratum. Under
    `rollout.coupling: swrb` its SWRB record files instead, in `swrb/` beside `trajectories/`
    (docs/swrb.md, "Switching it on")."""
    folder = "swrb" if config["rollout"]["coupling"] == "swrb" else "trajectories"
    return {
        action: results(f"{study}/{{model}}/{folder}/{action}/{{stratum}}.parquet")
        for action in config["studies"][study]["actions"]
    }


def group_trajectories(study, group):
    """The trajectory files of a rollout group's actions (rollout_trajectories): the outputs of
    its evaluation rule, one job per model and stratum."""
    files = rollout_trajectories(study)
    return {action: files[action] for action in rollout_groups(study)[group]}


def group_folder(study, group):
    """The folder of a rollout group's evaluation logs and benchmark records: `<study>` for the
    first group (as without groups), `<study>/<group>` for a later one."""
    return study if group == first_group(study) else f"{study}/{group}"


def rollout_code(study, script, group=None):
    """Params entry `code` of a rollout rule: the fingerprint of the engine its script reaches
    with only the selectors of the job's actions, those of the rollout group `group` (default:
    the first, which the development rule runs) (kvdiverge.pipeline.provenance; adding or editing
    another method reruns no rollout of other actions, nor of another group)."""
    actions = rollout_groups(study)[group or first_group(study)]
    selectors = sorted(
        {
            f"{type(spec.method).__module__}:{type(spec.method).__qualname__}"
            for name, spec in ROLLOUT_ACTIONS.items()
            if name in actions
        }
    )
    return script_fingerprint(
        os.path.join(workflow.basedir, "workflow", "scripts", script), selectors=selectors
    )


def dev_rollout_trajectories(study):
    """The development trajectory files of the study's first rollout group by action, with
    {model} and {stratum} left as wildcards: the outputs of dev_rollout_<study>."""
    return {
        action: results(f"{study}/{{model}}/dev/trajectories/{action}/{{stratum}}.parquet")
        for action in rollout_groups(study)[first_group(study)]
    }


def rollout_script(stage):
    """A rollout job's script: rollout.py (kvdiverge.engine.rollout_job), for both stages, but
    swrb_rollout.py for an evaluation under `rollout.coupling: swrb` (kvdiverge.engine.swrb_job)."""
    swrb = stage == "evaluation" and config["rollout"]["coupling"] == "swrb"
    return "swrb_rollout.py" if swrb else "rollout.py"


def dev_rollout_coupling():
    """The development rollouts' coupling: `rollout.coupling`, except under `swrb`, whose
    development cohort runs the shared-reference coupled rollouts the sample-size plan reads
    (docs/swrb.md, "Switching it on")."""
    coupling = config["rollout"]["coupling"]
    return "shared-reference" if coupling == "swrb" else coupling


def dev_rollout_cohorts(study):
    """Replicates of the development cohort per action of the study's first rollout group:
    K_dev, the control K_control. (The evaluation's come from the group's lock, read by the
    job.)"""
    spec = config["studies"][study]
    return {
        name: {"dev": spec["K_control"] if name == spec["control"] else spec["K_dev"]}
        for name in rollout_groups(study)[first_group(study)]
    }
