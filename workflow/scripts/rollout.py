"""Rule rollout_<study>: coupled rollouts of a stratum's documents under every action of the
study, one trajectory file per action (DESIGN §3.2, §4)."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 (the job's log for its lifetime)
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # weight-loading bars; tqdm per document stays

import torch  # noqa: E402

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job  # noqa: E402

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
)
