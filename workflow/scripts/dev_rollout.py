"""Rule dev_rollout_<study>: the development cohort's coupled rollouts of a stratum under every
action of the study, one trajectory file per action (docs/architecture.md, "Rollout jobs"),
before the study's plan and lock (docs/prespecification.md, "Order of the stages")."""

import sys

from kvdiverge.pipeline.logs import job_log

log = job_log(snakemake)

import torch  # noqa: E402
import transformers  # noqa: E402

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # weight-loading bars; tqdm per document stays
torch.set_num_threads(snakemake.threads)
params = snakemake.params
run_stratum_rollout_job(
    documents_path=snakemake.input.documents,
    out_paths=dict(snakemake.output.items()),
    model=params.model,
    actions=params.actions,
    cohorts=params.cohorts,
    settings=RolloutSettings(
        H=params.H,
        seed=params.seed,
        coupling=params.coupling,
        max_batch_rows=params.max_batch_rows,
    ),
    device=params.device,
    log_file=sys.stderr,
    resume_key=params.code,
)
