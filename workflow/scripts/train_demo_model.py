"""Rule build_demo_model: train a tiny demo model on RULER-style text (README "Demo models")."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 (the job's log for its lifetime)
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()

from kvdiverge.training import TrainSettings, train_demo_model  # noqa: E402

torch.set_num_threads(snakemake.threads)
settings = TrainSettings.from_config(snakemake.params.train, where=snakemake.params.where)
path = train_demo_model(
    snakemake.params.kind,
    snakemake.output[0],
    settings,
    seed=snakemake.params.seed,
    progress_file=sys.stderr,
)
logging.info("trained %s demo model into %s", snakemake.params.kind, path)
