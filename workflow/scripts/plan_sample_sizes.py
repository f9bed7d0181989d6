"""Rule plan_sample_sizes: evaluation K and documents from development data."""

import json
from itertools import product

from kvdiverge.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.document_stats import read_document_stats  # noqa: E402
from kvdiverge.analysis.planning import study_plan  # noqa: E402
from kvdiverge.io import atomic_write_text  # noqa: E402

p = snakemake.params
study = p.study
stats = {
    m: read_document_stats(path)[0] for m, path in zip(p.models, snakemake.input.stats, strict=True)
}
keys = list(product(p.models, study["actions"], p.strata))  # the order of the rule's expand
trajectories = dict(zip(keys, snakemake.input.trajectories, strict=True))
eval_docs = {
    m: int(f.filter(cohort=study.get("cohort", snakemake.wildcards.study))["doc_id"].n_unique())
    for m, f in stats.items()
}
plan = study_plan(
    stats,
    trajectories,
    actions=list(study["actions"]),
    control=study["control"],
    half_width=p.planning["half_width"],
    level=p.planning["level"],
    max_K=p.planning["max_K"],
    min_docs_per_stratum=p.planning["min_docs_per_stratum"],
    configured_K=study["K"],
    configured_docs=max(eval_docs.values()),
)
plan["study"] = snakemake.wildcards.study
atomic_write_text(snakemake.output[0], json.dumps(plan, indent=2) + "\n")
log.info("%d plans -> %s", len(plan["plans"]), snakemake.output[0])
