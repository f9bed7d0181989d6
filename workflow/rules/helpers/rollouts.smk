# Helpers of the rollout rules (workflow/rules/rollouts.smk; docs/architecture.md, "Rollout
# jobs"): their outputs, params, code fingerprints and resources.
from kvdiverge.pipeline.provenance import script_fingerprint


def rollout_gpus():
    """`gpu` resource of a rollout job: 1 when it will run on a GPU, else 0 (CPU jobs then run
    side by side under the local profile's GPU limit; the SLURM profile sets its own)."""
    from kvdiverge.pipeline.hardware import gpu_expected

    return int(gpu_expected(config["rollout"]["device"]))


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


def rollout_script():
    """The evaluation rollout job's script: swrb_rollout.py under `rollout.coupling: swrb`
    (kvdiverge.engine.swrb_job), else rollout.py (kvdiverge.engine.rollout_job)."""
    return "swrb_rollout.py" if config["rollout"]["coupling"] == "swrb" else "rollout.py"


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
