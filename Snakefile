# kvdiverge: divergence timing under KV-cache eviction (docs/method.md; the rules are described
# in docs/architecture.md, "The rule graph").
# The pipeline is read from workflow/rules/: one file per stage.


# The default config, config.yaml, unless config files replace it (--configfile with
# --replace-workflow-config). A cluster job is given the config files but never
# --replace-workflow-config, and reads only those files; so config files that extend config.yaml
# reach the jobs after config.yaml itself (docs/running.md, "Running on a SLURM cluster").
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"

elif workflow.is_main_process and not workflow.config_settings.replace_workflow_config:

    configfile: "config.yaml"

    workflow.config_settings.configfiles.insert(0, Path("config.yaml").absolute())


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/datasets.smk"
include: "workflow/rules/finite_state.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/rollouts.smk"
include: "workflow/rules/analysis.smk"
include: "workflow/rules/swrb.smk"
include: "workflow/rules/accuracy.smk"
include: "workflow/rules/figures.smk"


# The target rule prints one line, not its inputs (with the profile's `quiet: [reason]`, no
# reason listing them either: docs/running.md, "What a run prints").
rule all:
    default_target: True
    input:
        final_outputs(),
    localrule: True
    message:
        f"rule all: the {len(final_outputs())} final outputs under {config['output_dir']}/"


onsuccess:
    report_after_run()


flag_stale_report()  # a report older than the results, or a build left interrupted: one line
