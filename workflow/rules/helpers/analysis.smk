# Helpers of the plan, the locks and the analysis (workflow/rules/analysis.smk;
# docs/prespecification.md, "Prespecification"; docs/analysis.md, "Analysis").
from kvdiverge.analysis.prespecification import prespecified_group
from kvdiverge.config import baseline_contrasts


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


def locked_evaluation_files(study):
    """The evaluation trajectory files the study's lock binds: those of its first rollout
    group's actions, every model and stratum (rule prespecify refuses a first registration
    beside any of them). A later group's files, bound by its amendment, are left out: appending
    an action in a new group changes no param of rule prespecify (docs/compare.md, "Rollout
    groups")."""
    files = study_trajectory_files(study, config["models"], "evaluation")
    return [f for action in rollout_groups(study)[first_group(study)] for f in files[action]]


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


def trajectory_cohorts(study, model):
    """The cohort each of one model's trajectory files of the study holds: `dev` for the
    development files, the study's evaluation cohort (studies.<s>.cohort, else the study's
    name) for the others (rule document_stats refuses a file holding another)."""
    cohort = config["studies"][study].get("cohort", study)
    stages = (("dev", "dev"), ("evaluation", cohort))
    return {
        path: name
        for stage, name in stages
        for paths in study_trajectory_files(study, [model], stage).values()
        for path in paths
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


def prespecified_amendment(wildcards):
    """What the config fixes for a later rollout group before its evaluation rollouts, the
    study lock aside (kvdiverge.analysis.prespecification.prespecified_group)."""
    study, group = wildcards.study, wildcards.group
    code = rollout_code(study, rollout_script("evaluation"), group)
    return prespecified_group(config, study, group, rollout_actions(study), code)


def prespecified_amendments(wildcards):
    """prespecified_amendment of every later rollout group of the study, by group."""
    study, actions = wildcards.study, rollout_actions(wildcards.study)
    script = rollout_script("evaluation")
    return {
        group: prespecified_group(config, study, group, actions, rollout_code(study, script, group))
        for group in later_groups(study)
    }


def amendment_groups():
    """A regex of every later rollout group's name (rule prespecify_group's `group`)."""
    names = sorted({g for study in config["studies"] for g in later_groups(study)})
    return wildcard_alternation(names, "no-group")


def estimand_contrasts(wildcards):
    """The estimands table's contrasts [b, a] (rows `b - a`): analysis.contrasts (None: every
    pair of compared actions), and with a study baseline (studies.<study>.baseline) every
    compared action minus the baseline too (rule study_contrasts reads them)."""
    given = config["analysis"]["contrasts"].get(wildcards.study)
    extra = baseline_contrasts(config, wildcards.study)
    if not extra:
        return given
    pairs = study_contrasts(wildcards.study)
    return pairs + [pair for pair in extra if pair not in pairs]


def pinned_K(wildcards):
    """The study's K when the config pins one, else None (K: plan)."""
    K = config["studies"][wildcards.study]["K"]
    return None if K == "plan" else K
