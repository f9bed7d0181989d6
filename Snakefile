# kvdiverge: divergence timing under KV-cache eviction (docs/method.md; the rules are described
# in docs/architecture.md, "The rule graph").
# The pipeline is read from workflow/rules/: one file per stage.


configfile: "config.yaml"


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


rule all:
    default_target: True
    input:
        final_outputs(),


onsuccess:
    report_after_run()
