"""Rule build_demo_model's job (kept apart from :mod:`kvdiverge.models.training`, whose source is
part
of the committed weights' training fingerprint: editing this wrapper must not make them stale)."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvdiverge.models.training import TrainSettings, train_demo_model

__all__ = ["train_demo_model_job"]


def train_demo_model_job(
    out_dir: str | os.PathLike, params: Any, log_path: str | os.PathLike, threads: int
) -> Path:
    """Train ``params.kind`` into ``out_dir`` with ``params.train`` and ``params.seed``, logging
    progress to ``log_path`` (docs/models.md, "Training").

    The rule's script (``workflow/scripts/build_demo_model.py``) calls it. Snakemake reruns a
    script job whose outputs are older than the script file, and in a fresh clone git writes
    ``data/models/`` before ``workflow/``; the committed weights' provenance is the training
    fingerprint instead (params and the parse-time check), and the workflow sets the script's
    modification time back before current committed weights (``keep_build_script_older`` in
    ``workflow/rules/helpers/models.smk``), so they are not retrained.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(int(threads))
    with open(log_path, "w") as log:
        handler = logging.StreamHandler(log)
        logging.getLogger().addHandler(handler)
        try:
            settings = TrainSettings.from_config(params.train, where=params.where)
            path = train_demo_model(
                params.kind, out_dir, settings, seed=params.seed, progress_file=log
            )
            logging.getLogger(__name__).info("trained %s demo model into %s", params.kind, path)
        finally:
            logging.getLogger().removeHandler(handler)
    return Path(path)
