"""Rule prespecify: the study's lock from the config and its plan, before any evaluation
rollout (docs/prespecification.md, "Fixed by the lock")."""

import json

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

from kvdiverge.analysis.prespecification import make_lock, write_lock  # noqa: E402

with open(snakemake.input.plan, encoding="utf-8") as handle:
    plan = json.load(handle)
lock = make_lock(snakemake.params.prespecified, plan)
write_lock(lock, snakemake.output[0])
endpoints = lock["endpoints"]
log.info(
    "lock %s: K = %d (%s), %s -> %s",
    lock["hash"],
    lock["design"]["K"],
    lock["design"]["K_setting"],
    f"{len(endpoints['family'])} endpoints" if endpoints else "no endpoint family",
    snakemake.output[0],
)
