"""Rule plan_sample_sizes: the evaluation K from the development rollouts alone, sized for the
study's prespecified endpoints at the family level when it has them (docs/prespecification.md)."""

import json

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.planning import study_plan  # noqa: E402
from kvdiverge.io import atomic_write_text  # noqa: E402
from kvdiverge.pipeline.rule_inputs import keyed_inputs, split_keys  # noqa: E402

p = snakemake.params
plan = study_plan(
    split_keys(keyed_inputs(snakemake.input, "development"), 3),  # (model, action, stratum)
    actions=list(p.actions),
    control=p.control,
    documents_per_stratum=p.documents_per_stratum,
    cohort=p.cohort,
    half_width=p.planning["half_width"],
    level=p.planning["level"],
    max_K=p.planning["max_K"],
    min_docs_per_stratum=p.planning["min_docs_per_stratum"],
    pinned_K=p.pinned_K,
    endpoints=p.prespecified["endpoints"],
)
plan = {"study": snakemake.wildcards.study, **plan}
atomic_write_text(snakemake.output[0], json.dumps(plan, indent=2) + "\n")
log.info(
    "evaluation K = %d (%s; planned %d) for %d documents per stratum -> %s",
    plan["K"],
    plan["K_source"],
    plan["K_planned"],
    plan["documents_per_stratum"],
    snakemake.output[0],
)
binding = plan["binding"]
log.info(
    "binding: %s of %s/%s at level %.6g asks for K = %d and %d documents per stratum",
    binding["estimand"],
    binding["model"],
    binding["action"],
    plan["level"],
    binding["K"],
    binding["docs_per_stratum_needed"],
)
for note in plan["notes"]:
    log.warning("%s", note)
