"""Rule rollout_<study>: the evaluation cohort's coupled rollouts of a stratum under every action
of the study, one trajectory file per action (docs/architecture.md, "Rollout jobs"). The
replicates come from the study's lock, written before any evaluation rollout, and every file
carries the lock's hash (docs/prespecification.md, "Fixed by the lock")."""

import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)

import torch  # noqa: E402
import transformers  # noqa: E402

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job  # noqa: E402
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
transformers.utils.logging.disable_progress_bar()  # weight-loading bars; tqdm per document stays
torch.set_num_threads(snakemake.threads)
params = snakemake.params
run_stratum_rollout_job(
    documents_path=snakemake.input.documents,
    out_paths=dict(snakemake.output.items()),
    model=params.model,
    actions=params.actions,
    cohorts=cohorts,
    settings=RolloutSettings(
        H=params.H,
        seed=seed,
        coupling=params.coupling,
        max_batch_rows=params.max_batch_rows,
    ),
    device=params.device,
    log_file=sys.stderr,
    resume_key=params.code,
    metadata={"lock": lock["hash"]},
)
