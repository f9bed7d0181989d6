"""Rule rollout_<study> under ``rollout.coupling: swrb``: the evaluation cohort's SWRB
replicates of a stratum under every action of the study, one SWRB record file per action
(kvdiverge.engine.swrb_job; docs/swrb.md, "Switching it on"). The replicates come from the
study's lock, written before any evaluation rollout, and every file carries the lock's hash
(docs/prespecification.md, "Fixed by the lock")."""

import os
import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)

import torch  # noqa: E402
import transformers  # noqa: E402

from kvdiverge.engine.rollout_job import job_code, library_versions, would_run  # noqa: E402
from kvdiverge.engine.swrb_job import run_swrb_job  # noqa: E402
from kvdiverge.io.locks import (  # noqa: E402
    check_evaluation_documents,
    check_history,
    check_rollout,
    evaluation_cohorts,
    evaluation_seed,
    read_lock,
)

params = snakemake.params
lock = read_lock(snakemake.input.lock)
check_history(lock, snakemake.input.lock)
check_evaluation_documents(lock, snakemake.input.lock, snakemake.input.documents)
# before any compute: what this job would run is what the lock registered
code = job_code(os.path.join(snakemake.scriptdir, "swrb_rollout.py"), params.actions)
settings = {
    k: getattr(params, k) for k in ("H", "seed", "coupling", "temperature", "max_batch_rows")
}
fields = would_run(code, params.model, params.actions, settings, params.device)
check_rollout(lock, snakemake.input.lock, params.model["name"], fields)
name = params.model["name"]
provenance = {
    "code": code,
    "model_digest": {k: fields[f"rollout.models.{name}.{k}"] for k in ("weights", "tokenizer")},
    "libraries": library_versions(),
    "max_batch_rows": params.max_batch_rows,
}
cohorts = evaluation_cohorts(lock)
# the evaluation's seed comes from the registration: a new registration, new trajectories
seed = evaluation_seed(lock)
log.info(
    "lock %s: K = %d (%s), evaluation seed %d",
    lock["hash"],
    lock["design"]["K"],
    lock["design"]["K_setting"],
    seed,
)
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(snakemake.threads)
frames = run_swrb_job(
    documents_path=snakemake.input.documents,
    out_paths=dict(snakemake.output.items()),
    model=params.model,
    actions=params.actions,
    cohorts={name: cohorts[name] for name in params.actions},
    H=params.H,
    seed=seed,
    temperature=params.temperature,
    device=params.device,
    metadata={"study": params.study, "lock": lock["hash"], **provenance},
    max_batch_rows=params.max_batch_rows,
    log_file=sys.stderr,
    resume_key=params.code,
)
for name, frame in frames.items():
    log.info("%s: %d documents, %d replicates", name, frame["doc_id"].n_unique(), frame.height)
