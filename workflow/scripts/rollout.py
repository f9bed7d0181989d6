"""Rules dev_rollout_<study> and rollout_<study>[_<group>]: the coupled rollouts of a stratum
under every action of the study (of its rollout group), one trajectory file per action
(docs/architecture.md, "Rollout jobs"). A development job (params.stage `dev`) runs the
development cohort with the config's replicates, before the study's plan and lock
(docs/prespecification.md, "Order of the stages"); an evaluation job runs the evaluation cohort
with the replicates and the seed of the study's lock, written before any evaluation rollout,
and every file carries the lock's hash (docs/prespecification.md, "Fixed by the lock")."""

import os
import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)

import torch  # noqa: E402
import transformers  # noqa: E402

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job  # noqa: E402
from kvdiverge.engine.rollout_job import job_code, would_run  # noqa: E402
from kvdiverge.io.locks import (  # noqa: E402
    check_evaluation_documents,
    check_history,
    check_rollout,
    evaluation_cohorts,
    evaluation_seed,
    read_lock,
)

params = snakemake.params
settings = {
    k: getattr(params, k) for k in ("H", "seed", "coupling", "temperature", "max_batch_rows")
}
# the code this job runs, found again here: it is recorded in every file, and an evaluation
# job refuses to run other code than its lock registered
code = job_code(os.path.join(snakemake.scriptdir, "rollout.py"), params.actions)
registered = None
if params.stage == "dev":
    cohorts, seed, metadata = params.cohorts, params.seed, {"study": params.study, "code": code}
else:
    lock_path = snakemake.input.lock
    lock = read_lock(lock_path)
    check_history(lock, lock_path)
    check_evaluation_documents(lock, lock_path, snakemake.input.documents)
    # before any compute: what this job would run is what the lock registered
    fields = would_run(code, params.model, params.actions, settings, params.device)
    check_rollout(lock, lock_path, params.model["name"], fields)
    registered = lock["rollout"]["models"][params.model["name"]]
    cohorts = evaluation_cohorts(lock)
    # the evaluation's seed comes from the registration: a new registration, new trajectories
    seed = evaluation_seed(lock)
    metadata = {"study": params.study, "lock": lock["hash"], "code": code}
    log.info(
        "lock %s: K = %d (%s), evaluation seed %d; rollout side as registered (code %s)",
        lock["hash"],
        lock["design"]["K"],
        lock["design"]["K_setting"],
        seed,
        code,
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
        temperature=params.temperature,
    ),
    max_batch_rows=params.max_batch_rows,  # an integer, or auto: sized to the device in the job
    device=params.device,
    log_file=sys.stderr,
    resume_key=params.code,
    metadata=metadata,
    registered=registered,
)
