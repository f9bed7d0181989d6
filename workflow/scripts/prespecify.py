"""Rule prespecify: the study's lock from the config and its plan, before any evaluation
rollout (docs/prespecification.md, "Fixed by the lock")."""

import json

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import os  # noqa: E402

from kvdiverge.analysis.prespecification import (  # noqa: E402
    endpoint_fingerprint,
    make_lock,
    register,
    registration_line,
    write_lock,
)
from kvdiverge.io.locks import evaluation_documents_digest  # noqa: E402

with open(snakemake.input.plan, encoding="utf-8") as handle:
    plan = json.load(handle)
spec = snakemake.params.prespecified
# what binds the evaluation: its documents, and the code that computes the endpoints
documents = evaluation_documents_digest(list(snakemake.input.documents), spec["design"]["cohort"])
code = endpoint_fingerprint(os.path.join(snakemake.scriptdir, snakemake.params.endpoint_script))
lock = register(make_lock(spec, plan, documents, code), snakemake.output[0])
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
log.info("%s History: %s", registration_line(lock), lock["registration"]["history"])
