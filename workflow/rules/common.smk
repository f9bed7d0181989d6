# What several stages share (each stage's own helpers are in helpers/<stage>.smk, which the
# stage's file of rules includes): the configuration checks, output paths, the report after a
# run, provenance fingerprints, the default target, and the names of the config (strata,
# models, actions, studies and their rollout groups).
import os
import sys

from kvdiverge.config import check_config, compared_actions, configured_actions
from kvdiverge.config import wildcard_alternation
from kvdiverge.config import model_path as configured_model_path
from kvdiverge.config import study_contrasts as configured_contrasts
from kvdiverge.config import study_groups
from kvdiverge.pipeline.provenance import script_fingerprint
from kvdiverge.engine.preflight import check_configured_models
from kvdiverge.pipeline.folders import check_writable_folder
from kvdiverge.datasets import DatasetsConfig
from kvdiverge.analysis.prespecification import prespecified

# Once, before any job: the config files read strictly, every value's kind and range, every
# cross-reference and every combination that would fail later (kvdiverge.config), and each
# model loaded from a local folder (kvdiverge.engine.preflight); one line naming the field otherwise.
# Before the first job of a run, the output folder is writable (kvdiverge.pipeline.folders).
# At rollout.temperature 0 every study runs K = 1, with one note line per study that asked for more.
for note in check_config(
    config,
    os.path.join(workflow.basedir, "workflow", "schemas", "config.schema.yaml"),
    files=workflow.configfiles,
):
    print(note, file=sys.stderr)
check_configured_models(config)
# A config whose rollout jobs ask for a GPU prints each job's memory plan on an 80 GB card once
# per run, dry runs included (kvdiverge.engine.memory_plan; docs/running.md, "Memory and time
# per job"); not again in each cluster job.
if not workflow.remote_exec and config.get("rollout", {}).get("resources", {}).get("gpus"):
    from kvdiverge.engine.memory_plan import format_plan, plan_config

    print(format_plan(plan_config(config, 80), 80), file=sys.stderr)


onstart:  # a real run with jobs to do, before the first (a dry run writes nothing)
    check_writable_folder(config["output_dir"], "config.output_dir")


def results(path):
    """``path`` under the config's output folder (`output_dir`, default `results`): every
    result, benchmark record, log, the documents and the report of this workflow.
    `{wildcards}` stay as they are."""
    return os.path.join(config["output_dir"], path)


def logs(path):
    """``path`` under the config's log folder, `<output_dir>/logs`: one log per job, so that
    two configs never write over each other's logs."""
    return results(os.path.join("logs", path))


def report_after_run():
    """The `onsuccess` handler (Snakefile): after a real run of the whole default target, build
    `<output_dir>/report.html` with the run's effective config (kvdiverge.pipeline.report; its
    output in <output_dir>/logs/report.log). A partial run (other targets, --until, --omit-from,
    --allowed-rules, --batch) builds none and says how to build it; dry runs, `--touch` and
    cluster jobs build none; `snakemake --report` runs no handler."""
    from snakemake.logging import logger
    from kvdiverge.pipeline.report import build_report, partial_run, skipped_report

    if workflow.dryrun or workflow.touch or workflow.remote_exec:
        return
    settings = workflow.dag_settings
    batch = settings.batch
    path = results("report.html")
    partial = partial_run(
        targets=settings.targets,
        target_jobs=settings.target_jobs,
        until=settings.until,
        omit_from=settings.omit_from,
        allowed_rules=settings.allowed_rules,
        batch=batch and f"{batch.rulename}={batch.idx}/{batch.batches}",
    )
    if partial is not None:
        files = workflow.overwrite_configfiles
        replace = workflow.config_settings.replace_workflow_config
        values = bool(workflow.config_settings.config)
        logger.info(skipped_report(path, partial, files, replace, values))
        return
    logger.info(f"Building the report {path} (log: {logs('report.log')})")
    build_report(path, workflow.main_snakefile, config, logs("report.log"))
    logger.info(f"Report: {path}")


def script_code(script):
    """Params entry `code`: a fingerprint of every package module the rule's script reaches by
    import, found from the code (kvdiverge.pipeline.provenance; docs/architecture.md, "Reruns")."""
    return script_fingerprint(os.path.join(workflow.basedir, "workflow", "scripts", script))


def final_outputs():
    """Every file `rule all` builds — the finite-state study, figure 1, and for every study its
    estimands, prediction, sample-size plan and locks, figures and tables (through every
    upstream job)."""
    out = [
        results("finite_state/systems.csv"),
        results("finite_state/figures/estimators.png"),
        results("finite_state/figures/identified_interval.png"),
    ]
    if config["rollout"]["coupling"] == "swrb":  # the SWRB tables replace the trajectory analysis
        return out + swrb_outputs()
    for study in config["studies"]:
        out += [
            results(f"{study}/tables/estimands.csv"),
            results(f"{study}/plan.json"),
            results(f"{study}/lock.json"),
        ]
        out += [group_lock(study, group) for group in later_groups(study)]
        if config["analysis"]["prediction"]["pairs"].get(study):
            out.append(results(f"{study}/tables/prediction.csv"))
        out += [  # rule accuracy (workflow/rules/accuracy.smk) writes them together
            results(f"{study}/tables/accuracy.csv"),
            results(f"{study}/tables/table_accuracy.html"),
            results(f"{study}/figures/accuracy.png"),
        ]
        out += [  # rule study_generations (workflow/rules/accuracy.smk)
            results(f"{study}/tables/generations.html"),
            results(f"{study}/tables/generations.parquet"),
        ]
    return out + figures_and_tables_outputs()


# ---- Datasets (docs/datasets.md, "Datasets"): the documents plan is checked at parse time ----
DATASETS = DatasetsConfig.from_config(config["datasets"])


def study_strata():
    """Every stratum's name, in the config's order."""
    return [s.name for s in DATASETS.strata]


# ---- Models, actions, studies and rollout groups (docs/configuration.md, "Models", "Actions"
# and "Studies"): checked at parse time ------------------------------------------------------
# (a `label` is for display, no selector parameter: kvdiverge.config.configured_actions)
ROLLOUT_ACTIONS = configured_actions(config)


def demo_models():
    """Names of the models built locally by rule build_demo_model."""
    return [name for name, spec in config["models"].items() if spec.get("demo")]


def sourced_models():
    """Names of the models with a `source` (GGUF file or package), written by rule
    materialize_model (kvdiverge.models.sources)."""
    return [name for name, spec in config["models"].items() if spec.get("source")]


def model_path(name):
    """A demo or sourced model's folder data/models/<name>, else the configured path or hub
    id (kvdiverge.config.model_path, the parse-time check's own reading; one-line errors)."""
    return configured_model_path(config, name)


def rollout_groups(study):
    """The study's rollout groups in config order, name -> actions (`studies.<s>.groups`, else
    one group `main` of every action; kvdiverge.config.study_groups)."""
    return study_groups(config, study)


def first_group(study):
    """The study's first rollout group: its development rollouts plan K, its lock is the
    study's lock, its evaluation rule is rollout_<study>."""
    return next(iter(rollout_groups(study)))


def later_groups(study):
    """The study's rollout groups after the first, in config order (each with an amendment lock
    and evaluation rule rollout_<study>_<group>)."""
    return list(rollout_groups(study))[1:]


def group_lock(study, group):
    """The lock a rollout group's evaluation runs under: the study's lock for the first group,
    the group's amendment (rule prespecify_group) for a later one."""
    if group == first_group(study):
        return results(f"{study}/lock.json")
    return results(f"{study}/locks/{group}.json")


def rollout_actions(study, group=None):
    """Every action spec of the study (of its rollout group `group`) with all its parameters,
    by name."""
    names = config["studies"][study]["actions"] if group is None else rollout_groups(study)[group]
    return {name: ROLLOUT_ACTIONS[name].as_dict() for name in names}


def prespecified_study(wildcards):
    """What the config fixes for the study before its evaluation rollouts, plan aside
    (kvdiverge.analysis.prespecification.prespecified): the lock's content."""
    study = wildcards.study
    code = rollout_code(study, rollout_script("evaluation"))  # the evaluation jobs' code
    return prespecified(config, study, study_strata(), rollout_actions(study), code)


def study_contrasts(study):
    """The study's contrasts [b, a] in the estimands table (analysis.contrasts, else every pair
    of non-control actions, earlier minus later)."""
    return configured_contrasts(config, study)


def study_compared_actions(wildcards):
    """The study's actions without the full-retention control (plotted and tabulated;
    kvdiverge.config.compared_actions)."""
    return compared_actions(config, wildcards.study)


def study_control(wildcards):
    """The study's full-retention control action."""
    return config["studies"][wildcards.study]["control"]
