"""Rule rollout_<study> under ``rollout.coupling: swrb``: the evaluation cohort's SWRB
replicates of a stratum under every action of the study, one SWRB record file per action
(kvdiverge.engine.swrb_job; docs/swrb.md, "Switching it on"). The replicates come from the
study's lock, written before any evaluation rollout, and every file carries the lock's hash
(docs/prespecification.md, "Fixed by the lock")."""

import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)

import torch  # noqa: E402
import transformers  # noqa: E402

from kvdiverge.engine.swrb_job import run_swrb_job  # noqa: E402
from kvdiverge.io.locks import (  # noqa: E402
    check_evaluation_documents,
    evaluation_cohorts,
    evaluation_seed,
    read_lock,
)

lock = read_lock(snakemake.input.lock)
check_evaluation_documents(lock, snakemake.input.lock, snakemake.input.documents)
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
params = snakemake.params
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
    metadata={"lock": lock["hash"]},
    max_batch_rows=params.max_batch_rows,
    log_file=sys.stderr,
    resume_key=params.code,
)
for name, frame in frames.items():
    log.info("%s: %d documents, %d replicates", name, frame["doc_id"].n_unique(), frame.height)
