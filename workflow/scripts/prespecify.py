"""Rules prespecify and prespecify_group: the locks written before evaluation rollouts
(docs/prespecification.md, "Fixed by the lock"). For prespecify (params.lock `study`), the
study's lock from the config and its plan, registered in the study's lock history; for
prespecify_group (`amendment`), a later rollout group's amendment lock from the config and the
study's lock (docs/compare.md, "Rollout groups")."""

import json

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)  # first: import errors and warnings go to the log too

import os  # noqa: E402

from kvdiverge.analysis.prespecification import (  # noqa: E402
    check_history,
    endpoint_fingerprint,
    make_amendment,
    make_lock,
    read_lock,
    register,
    registration_line,
    rollout_models,
    write_lock,
)
from kvdiverge.io.locks import evaluation_documents_digest  # noqa: E402
from kvdiverge.io.model_digest import model_digests  # noqa: E402
from kvdiverge.io.trajectories import read_trajectory_metadata  # noqa: E402

spec = snakemake.params.prespecified
out = snakemake.output[0]
if snakemake.params.lock == "study":
    with open(snakemake.input.plan, encoding="utf-8") as handle:
        plan = json.load(handle)
    # what binds the evaluation: its documents, and the code that computes the endpoints
    cohort = spec["design"]["cohort"]
    documents = evaluation_documents_digest(list(snakemake.input.documents), cohort)
    script = os.path.join(snakemake.scriptdir, snakemake.params.endpoint_script)
    # and the rollouts: each model's digests, and the numerics its development rollouts ran
    development = {}
    for path in snakemake.input.development:
        meta = read_trajectory_metadata(path)
        development.setdefault(meta["model"]["name"], {})[path] = meta
    digests = {name: model_digests(path) for name, path in snakemake.params.model_paths.items()}
    models = rollout_models(development, digests)
    content = make_lock(spec, plan, documents, endpoint_fingerprint(script), models)
    lock = register(content, out, evaluation_files=snakemake.params.evaluation_files)
    what = (
        f"lock {lock['hash']}: K = {lock['design']['K']} ({lock['design']['K_setting']}), "
        f"rollout code {lock['rollout']['code']}"
    )
else:
    study_lock = read_lock(snakemake.input.lock)
    check_history(study_lock, snakemake.input.lock)
    lock = make_amendment(spec, study_lock)
    what = (
        f"amendment {lock['hash']} of group {lock['group']} under lock {study_lock['hash']}: "
        f"K = {lock['design']['K']}, actions {', '.join(lock['design']['actions'])}"
    )
    write_lock(lock, out)
endpoints = lock["endpoints"]
family = f"{len(endpoints['family'])} endpoints" if endpoints else "no endpoint family"
log.info("%s, %s -> %s", what, family, out)
if snakemake.params.lock == "study":
    log.info("%s History: %s", registration_line(lock), lock["registration"]["history"])
    for name, entry in lock["rollout"]["models"].items():
        log.info("model %s: %s", name, json.dumps(entry, sort_keys=True))
