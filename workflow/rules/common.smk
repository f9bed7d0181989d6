# Configuration checks, path building and provenance fingerprints.
import os

from kvdiverge.config import check_config
from kvdiverge.pipeline.names import wildcard_alternation
from kvdiverge.pipeline.provenance import script_fingerprint
from kvdiverge.config import study_contrasts as configured_contrasts
from kvdiverge.config import study_groups
from kvdiverge.engine.preflight import check_configured_models
from kvdiverge.pipeline.folders import check_writable_folder

# Once, before any job: the config files read strictly, every value's kind and range, every
# cross-reference and every combination that would fail later (kvdiverge.config), and each
# model loaded from a local folder (kvdiverge.engine.preflight); one line naming the field otherwise.
# Before the first job of a run, the output folder is writable (kvdiverge.pipeline.folders).
check_config(
    config,
    os.path.join(workflow.basedir, "workflow", "schemas", "config.schema.yaml"),
    files=workflow.configfiles,
)
check_configured_models(config)


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
    """The `onsuccess` handler (Snakefile): after a real run of the default target, build
    `<output_dir>/report.html` with the run's effective config (kvdiverge.pipeline.report; its
    output in <output_dir>/logs/report.log). Dry runs, `--touch`, cluster jobs, and runs of
    other targets build none; `snakemake --report` runs no handler."""
    from snakemake.logging import logger
    from kvdiverge.pipeline.report import build_report, wants_report

    settings = workflow.dag_settings
    if wants_report(
        dryrun=workflow.dryrun,
        touch=workflow.touch,
        remote=workflow.remote_exec,
        targets=set(settings.targets),
        target_jobs=settings.target_jobs,
    ):
        path = results("report.html")
        logger.info(f"Building the report {path} (log: {logs('report.log')})")
        build_report(path, workflow.main_snakefile, config, logs("report.log"))
        logger.info(f"Report: {path}")


def script_code(script):
    """Params entry `code`: a fingerprint of every package module the rule's script reaches by
    import, found from the code (kvdiverge.pipeline.provenance; docs/architecture.md, "Reruns")."""
    return script_fingerprint(os.path.join(workflow.basedir, "workflow", "scripts", script))


def finite_state_study_settings():
    """config.finite_state less the figure-only key, so that editing it reruns only figures."""
    return {k: v for k, v in config["finite_state"].items() if k != "interval_figure_systems"}


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
    return out + figures_and_tables_outputs()


# ---- Datasets (docs/datasets.md, "Datasets"): the documents plan is checked at parse time ----
from kvdiverge.datasets import DatasetsConfig, stratum_source_paths

DATASETS = DatasetsConfig.from_config(config["datasets"])


def length_tokenizer_model():
    """Name and config entry of `datasets.length_tokenizer` (one-line error otherwise)."""
    name = DATASETS.length_tokenizer
    models = config.get("models", {})
    if name not in models:
        raise ValueError(
            f"config.datasets.length_tokenizer: expected the name of a configured model "
            f"({', '.join(models) or 'none configured'}), got {name!r}"
        )
    return name, models[name]


def length_tokenizer_path(wildcards=None):
    """Local folder of a demo or sourced model (built by build_demo_model or
    materialize_model), else the model's path or id."""
    name, spec = length_tokenizer_model()
    return model_path(name)


def documents_inputs(wildcards):
    """The stratum's data files that exist (missing ones get the script's one-line error), and
    the length tokenizer's folder when a rule of this workflow builds it."""
    name, spec = length_tokenizer_model()
    paths = [str(p) for p in stratum_source_paths(DATASETS, wildcards.stratum) if p.exists()]
    built = name in demo_models() or name in sourced_models()
    return {"tokenizer": [length_tokenizer_path()] if built else [], "data": paths}


# ---- Models and rollouts (docs/configuration.md, "Models", "Actions" and "Studies"): checked
# at parse time ----------------------------------------------------------------------------
from kvdiverge.eviction import parse_action

ROLLOUT_ACTIONS = {name: parse_action(spec, name=name) for name, spec in config["actions"].items()}


def rollout_gpus():
    """`gpu` resource of a rollout job: 1 when it will run on a GPU, else 0 (CPU jobs then run
    side by side under the local profile's GPU limit; the SLURM profile sets its own)."""
    from kvdiverge.pipeline.hardware import gpu_expected

    return int(gpu_expected(config["rollout"]["device"]))


def demo_models():
    """Names of the models built locally by rule build_demo_model."""
    return [name for name, spec in config["models"].items() if spec.get("demo")]


def sourced_models():
    """Names of the models with a `source` (GGUF file or package), written by rule
    materialize_model (kvdiverge.models.sources)."""
    return [name for name, spec in config["models"].items() if spec.get("source")]


def model_path(name):
    """A demo or sourced model's folder data/models/<name>, else the configured path or hub
    id (one-line errors)."""
    spec = config["models"].get(name)
    if spec is None:
        raise ValueError(f"config.models: no model named {name!r} ({', '.join(config['models'])})")
    if spec.get("demo") and spec.get("source"):
        raise ValueError(f"config.models.{name}: expected `demo` or `source`, not both")
    if spec.get("demo") or spec.get("source"):
        path = f"data/models/{name}"
        if spec.get("path", path) != path:
            kind = "a demo model is built" if spec.get("demo") else "a sourced model is written"
            raise ValueError(f"config.models.{name}.path: {kind} into {path}")
        return path
    if "path" not in spec:
        raise ValueError(
            f"config.models.{name}: expected `path` (directory or hub id), `demo` or `source`"
        )
    return spec["path"]


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


# ---- Plan, lock and analysis (docs/prespecification.md, "Prespecification";
# docs/analysis.md, "Analysis") ---------------------------------------------------------------
from kvdiverge.analysis.prespecification import prespecified, prespecified_group


def study_strata():
    """Every stratum's name, in the config's order."""
    return [s.name for s in DATASETS.strata]


def study_trajectory_files(study, models, stage):
    """The trajectory files of a study's models by action, every stratum: the development
    stage's (dev_rollout_<study>: the first rollout group's actions) or the evaluation's (the
    evaluation rules of every group: every action)."""
    folder = "dev/trajectories" if stage == "dev" else "trajectories"
    actions = rollout_groups(study)[first_group(study)] if stage == "dev" else None
    return {
        action: [
            results(f"{study}/{model}/{folder}/{action}/{stratum}.parquet")
            for model in models
            for stratum in study_strata()
        ]
        for action in actions or config["studies"][study]["actions"]
    }


def keyed(prefix, paths):
    """Named inputs `<prefix>/<key>`, one per entry of the mapping key -> path(s): a script
    reads them back by key (kvdiverge.pipeline.rule_inputs.keyed_inputs), never by position."""
    return {f"{prefix}/{key}": path for key, path in paths.items()}


def document_stats_files(study):
    """The study's document-statistics file of each model, by model."""
    return {model: results(f"{study}/{model}/document_stats.parquet") for model in config["models"]}


def action_trajectory_files(study, model):
    """One model's trajectory files of the study by action: development then evaluation
    files (an action of a later rollout group has evaluation files only)."""
    dev = study_trajectory_files(study, [model], "dev")
    return {
        action: dev.get(action, []) + evaluation
        for action, evaluation in study_trajectory_files(study, [model], "evaluation").items()
    }


def development_files(study):
    """The study's development trajectory files by `<model>/<action>/<stratum>`, the keys
    kvdiverge.pipeline.rule_inputs.keyed_inputs splits back into (model, action, stratum)."""
    actions = rollout_groups(study)[first_group(study)]
    return {
        f"{model}/{action}/{stratum}": results(
            f"{study}/{model}/dev/trajectories/{action}/{stratum}.parquet"
        )
        for model in config["models"]
        for action in actions
        for stratum in study_strata()
    }


def prediction_settings():
    """config.analysis.prediction less the per-study pairs (each job gets its own pair), so
    that editing one study's pair reruns only that study's prediction."""
    return {k: v for k, v in config["analysis"]["prediction"].items() if k != "pairs"}


def prespecified_study(wildcards):
    """What the config fixes for the study before its evaluation rollouts, plan aside
    (kvdiverge.analysis.prespecification.prespecified): the lock's content."""
    study = wildcards.study
    return prespecified(config, study, study_strata(), rollout_actions(study))


def prespecified_amendment(wildcards):
    """What the config fixes for a later rollout group before its evaluation rollouts, the
    study lock aside (kvdiverge.analysis.prespecification.prespecified_group)."""
    return prespecified_group(
        config, wildcards.study, wildcards.group, rollout_actions(wildcards.study)
    )


def prespecified_amendments(wildcards):
    """prespecified_amendment of every later rollout group of the study, by group."""
    actions = rollout_actions(wildcards.study)
    return {
        group: prespecified_group(config, wildcards.study, group, actions)
        for group in later_groups(wildcards.study)
    }


def amendment_groups():
    """A regex of every later rollout group's name (rule prespecify_group's `group`)."""
    names = sorted({g for study in config["studies"] for g in later_groups(study)})
    return wildcard_alternation(names, "no-group")


def pinned_K(wildcards):
    """The study's K when the config pins one, else None (K: plan)."""
    K = config["studies"][wildcards.study]["K"]
    return None if K == "plan" else K


# ---- Figures and tables (docs/analysis.md, "Figures and tables"): per-study settings ------
def study_contrasts(study):
    """The study's contrasts [b, a] in the estimands table (analysis.contrasts, else every pair
    of non-control actions, earlier minus later)."""
    return configured_contrasts(config, study)


def study_compared_actions(wildcards):
    """The study's actions without the full-retention control (plotted and tabulated)."""
    study = config["studies"][wildcards.study]
    return [a for a in study["actions"] if a != study["control"]]


def study_control(wildcards):
    """The study's full-retention control action."""
    return config["studies"][wildcards.study]["control"]


def study_main_contrast(wildcards):
    """Tables 3-4's contrast 'b - a': figures.main_contrast, else the prediction pair, else None
    (the first contrast of the estimands table)."""
    pair = config["figures"]["main_contrast"].get(wildcards.study)
    predicted = config["analysis"]["prediction"]["pairs"].get(wildcards.study)
    if not pair and predicted and list(predicted) in study_contrasts(wildcards.study):
        pair = predicted
    return f"{pair[0]} - {pair[1]}" if pair else None


def study_tables_inputs(wildcards):
    """estimands.csv and the study's lock, plus prediction.csv when the study has a prediction
    pair."""
    inputs = {
        "estimands": results(f"{wildcards.study}/tables/estimands.csv"),
        "lock": results(f"{wildcards.study}/lock.json"),  # the registration the tables name
    }
    if config["analysis"]["prediction"]["pairs"].get(wildcards.study):
        inputs["prediction"] = results(f"{wildcards.study}/tables/prediction.csv")
    return inputs


def family_studies():
    """Studies with a prespecified endpoint family (family_endpoints > 1): they get figure 7."""
    return [s for s, spec in config["studies"].items() if spec.get("family_endpoints", 1) > 1]


def figures_and_tables_outputs():
    """Figure 1, every study's figures 5 (pooled, and per stratum in the appendix), 6 and the
    decomposition (and figure 7 for a family study), Tables 1-4 in CSV, Markdown, LaTeX and
    HTML, and the estimands' typed Parquet copy and one-page summary."""
    out = [results(f"theory/figures/fig1_introductory_example.{e}") for e in ("png", "pdf")]
    for study in config["studies"]:
        names = [
            "fig5_divergence_cdf",
            "fig5_divergence_cdf_strata",
            "fig6_tv_profiles",
            "decomposition",
        ]
        names += ["fig7_branch_contrasts"] if study in family_studies() else []
        out += [results(f"{study}/figures/{n}.{e}") for n in names for e in ("png", "pdf")]
        out += [
            results(f"{study}/tables/table{i}.{e}")
            for i in range(1, 5)
            for e in ("csv", "md", "tex", "html")
        ]
        out += [
            results(f"{study}/tables/estimands.parquet"),
            results(f"{study}/tables/estimands_summary.md"),
            results(f"{study}/tables/estimands_summary.html"),
        ]
    return out


# ---- SWRB (rollout.coupling: swrb; docs/swrb.md, "SWRB for language-model rollouts") -----
def swrb_record_files(study):
    """The study's evaluation SWRB record files: model → action → stratum → path."""
    return {
        model: {
            action: {
                stratum: results(f"{study}/{model}/swrb/{action}/{stratum}.parquet")
                for stratum in study_strata()
            }
            for action in config["studies"][study]["actions"]
        }
        for model in config["models"]
    }


def swrb_record_list(wildcards):
    """Every SWRB record file of the study, as a flat list (the rule's input)."""
    return [
        path
        for by_action in swrb_record_files(wildcards.study).values()
        for by_stratum in by_action.values()
        for path in by_stratum.values()
    ]


def swrb_window():
    """The window L of Z_L and W_L in steps: the analysis clock's `window` at H."""
    from kvdiverge.analysis.document_stats import Clock

    return Clock.for_horizon(config["rollout"]["H"], **config["analysis"]["clock"]).window


def swrb_outputs():
    """The default target under `rollout.coupling: swrb` (final_outputs): figure 1, and per
    study its plan and lock, the SWRB estimands table (CSV, Markdown) and divergence CDF
    figures."""
    out = [results(f"theory/figures/fig1_introductory_example.{e}") for e in ("png", "pdf")]
    for study in config["studies"]:
        out += [
            results(f"{study}/plan.json"),
            results(f"{study}/lock.json"),
            results(f"{study}/tables/swrb_estimands.csv"),
            results(f"{study}/tables/swrb_estimands.md"),
        ]
        out += [
            results(f"{study}/figures/{name}.{e}")
            for name in ("swrb_divergence_cdf", "swrb_divergence_cdf_strata")
            for e in ("png", "pdf")
        ]
    return out
