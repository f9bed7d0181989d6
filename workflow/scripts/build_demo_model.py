"""Rule build_demo_model: a tiny deterministic demo model and tokenizer (DESIGN §2, §6)."""

import logging
import sys

sys.stderr = open(snakemake.log[0], "w")  # noqa: SIM115 (the job's log for its lifetime)
logging.basicConfig(stream=sys.stderr, level=logging.INFO)

import transformers  # noqa: E402

transformers.utils.logging.disable_progress_bar()  # weight-loading bars; tqdm per document stays

from kvdiverge.models import build_demo_model  # noqa: E402

path = build_demo_model(snakemake.params.kind, snakemake.output[0], seed=snakemake.params.seed)
logging.info("built %s demo model into %s", snakemake.params.kind, path)
