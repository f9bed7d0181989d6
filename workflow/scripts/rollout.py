"""Rules dev_rollout_<study> and rollout_<study>[_<group>]: the coupled rollouts of a stratum
under every action of the study (of its rollout group), one trajectory file per action
(docs/architecture.md, "Rollout jobs"). A development job (params.stage `dev`) runs the
development cohort with the config's replicates, before the study's plan and lock
(docs/prespecification.md, "Order of the stages"); an evaluation job runs the evaluation cohort
with the replicates and the seed of the study's lock, written before any evaluation rollout,
and every file carries the lock's hash (docs/prespecification.md, "Fixed by the lock")."""

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

params = snakemake.params
if params.stage == "dev":
    cohorts, seed, metadata = params.cohorts, params.seed, None
else:
    lock = read_lock(snakemake.input.lock)
    check_evaluation_documents(lock, snakemake.input.lock, snakemake.input.documents)
    cohorts = evaluation_cohorts(lock)
    # the evaluation's seed comes from the registration: a new registration, new trajectories
    seed = evaluation_seed(lock)
    metadata = {"lock": lock["hash"]}
    log.info(
        "lock %s: K = %d (%s), evaluation seed %d",
        lock["hash"],
        lock["design"]["K"],
        lock["design"]["K_setting"],
        seed,
    )
transformers.utils.logging.disable_progress_bar()  # weight-loading bars; tqdm per document stays
torch.set_num_threads(snakemake.threads)
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
        temperature=params.temperature,
    ),
    device=params.device,
    log_file=sys.stderr,
    resume_key=params.code,
    metadata=metadata,
)
