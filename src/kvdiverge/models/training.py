"""Training the tiny demo models on RULER-style text (docs/models.md, "Demo models").

A randomly initialised model attends to nothing in particular, so every eviction selector looks
alike on it. The demo models are trained here, on CPU and deterministically from a seed, on
prompts made by this project's own RULER generators (:mod:`kvdiverge.datasets.ruler`: needle
retrieval, variable tracking, common/frequent word extraction) wrapped by the model's chat
template and followed by the gold answer and EOS, plus plain continuation text. The loss is the
mean cross-entropy on the answer tokens plus ``context_weight`` times the mean cross-entropy on
the other tokens. A curriculum of stages raises the sequence length up to the default strata's.

Provenance: :func:`training_fingerprint` hashes the training code and data generators, the
demo architecture, the settings and the seed; it is stored in ``training.json`` beside the
weights, and :func:`check_trained_model` refuses weights whose fingerprint differs, with the
command that retrains them (committed weights are never overwritten silently).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvdiverge.datasets import ruler as R
from kvdiverge.datasets.fitting import derive_seed
from kvdiverge.models.curriculum import (
    TRAINING_TASKS,
    Stage,
    TrainingSample,
    TrainSettings,
    _Generator,
    batch_loss,
    make_batch,
    sample_task_prompt,
)
from kvdiverge.pipeline.provenance import module_fingerprint

__all__ = [
    "TRAINING_FILE",
    "TRAINING_TASKS",
    "Stage",
    "StaleModelError",
    "TrainSettings",
    "TrainingSample",
    "check_demo_model_folder",
    "check_trained_model",
    "demo_model_fingerprint",
    "evaluate_answers",
    "heldout_samples",
    "make_batch",
    "sample_task_prompt",
    "train_demo_model",
    "train_model",
    "training_fingerprint",
]

log = logging.getLogger(__name__)

TRAINING_FILE = "training.json"

# Modules whose source determines the training data and procedure (the fingerprint's code part).
_CODE_MODULES = (
    "kvdiverge.models.training",
    "kvdiverge.models.curriculum",
    "kvdiverge.datasets.ruler",
    "kvdiverge.datasets.text",
)
_DRILL_TYPES = (("words", "numbers"), ("words", "numbers"), ("words", "uuids"), ("uuids", "uuids"))
_ANSWER_RESERVE = 72  # tokens kept free after the prompt for the answer and EOS


class StaleModelError(ValueError):
    """A demo model folder lacks ``training.json`` or was trained by other code or settings."""


def training_fingerprint(kind: str, settings: TrainSettings, seed: int) -> str:
    """Fingerprint of a trained demo model (docs/models.md, "Committed weights"):
    SHA-256 (16 hex digits) of the training code and data generators' source, the demo
    architecture and tokenizer spec, the settings and the seed. Thread count, machine and
    library versions are not part of it (they are recorded in ``training.json``)."""
    from kvdiverge.models import demo_spec_digest

    payload = {
        "code": module_fingerprint(*_CODE_MODULES),
        "architecture": demo_spec_digest(kind),
        "kind": kind,
        "settings": settings.as_dict(),
        "seed": int(seed),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def check_trained_model(
    path: str | os.PathLike, kind: str, settings: TrainSettings, seed: int
) -> dict[str, Any]:
    """The ``training.json`` of a trained demo model folder, after checking its fingerprint.

    Raises :class:`StaleModelError` (one line, with the retraining command) when the file is
    missing or unreadable or its fingerprint differs from :func:`training_fingerprint`.
    """
    folder = Path(path)
    retrain = f"retrain with: rm -r {folder} && snakemake --cores 2 {folder}"
    record_path = folder / TRAINING_FILE
    try:
        record = json.loads(record_path.read_text())
        found = record["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StaleModelError(
            f"{record_path}: no readable training fingerprint ({type(exc).__name__}); {retrain}"
        ) from exc
    expected = training_fingerprint(kind, settings, seed)
    if found != expected:
        raise StaleModelError(
            f"{folder}: trained with fingerprint {found}, but the training code/config give "
            f"{expected}; {retrain}"
        )
    return record


# ---- training ------------------------------------------------------------------------------


def _learning_rate(step: int, stage_step: int, settings: TrainSettings) -> float:
    """Cosine decay from ``lr`` to ``lr / 10`` over all steps, times a linear warm-up over the
    first ``warmup_steps`` of every stage (a new stage's longer or new-format sequences
    otherwise start at full step size and undo what the previous stage learnt)."""
    progress = step / max(1, settings.total_steps - 1)
    cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return settings.lr * cosine * min(1.0, (stage_step + 1) / settings.warmup_steps)


def _generator(tokenizer: Any, seed: int) -> tuple[_Generator, tuple[str, ...]]:
    essays = R.synthetic_essays(derive_seed(seed, "train-haystack"))
    plain = R.synthetic_essays(derive_seed(seed, "train-plain")).words
    return _Generator(tokenizer, essays, derive_seed(seed, "train-cwe-vocabulary")), plain


def train_model(
    model: torch.nn.Module,
    tokenizer: Any,
    settings: TrainSettings,
    seed: int,
    progress_file: Any = None,
) -> list[dict[str, float]]:
    """Train ``model`` in place through the curriculum (docs/models.md, "Training");
    deterministic in ``seed`` for a given thread count. Returns the loss history (mean per 25
    steps)."""
    from tqdm import tqdm

    torch.manual_seed(derive_seed(seed, "train-torch") % 2**31)
    gen, plain = _generator(tokenizer, seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": other}],
        lr=settings.lr,
        weight_decay=0.0,
        betas=(0.9, 0.98),
    )
    model.train()
    history: list[dict[str, float]] = []
    window: list[tuple[float, float, float]] = []
    step = 0
    with tqdm(total=settings.total_steps, file=progress_file, unit="step", mininterval=5) as bar:
        for stage in settings.stages:
            for stage_step in range(stage.steps):
                rng = random.Random(derive_seed(seed, "train-batch", step))
                batch = make_batch(gen, settings, stage, plain, rng)
                for group in optimizer.param_groups:
                    group["lr"] = _learning_rate(step, stage_step, settings)
                loss, ans, ctx = batch_loss(model, batch, settings.context_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                window.append((loss.item(), ans.item(), ctx.item()))
                step += 1
                bar.update(1)
                if len(window) == 25 or step == settings.total_steps:
                    mean = np.mean(window, axis=0)
                    history.append(
                        {
                            "step": step,
                            "max_tokens": stage.max_tokens,
                            "loss": float(mean[0]),
                            "answer_loss": float(mean[1]),
                            "context_loss": float(mean[2]),
                        }
                    )
                    bar.set_postfix(loss=f"{mean[0]:.3f}", answer=f"{mean[1]:.3f}")
                    window = []
    model.eval()
    return history


def heldout_samples(
    tokenizer: Any,
    seed: int,
    tasks: Sequence[str],
    lengths: Sequence[int],
    per_task: int,
) -> list[tuple[int, TrainingSample]]:
    """Held-out prompts ``(length, sample)``: ``per_task`` per task and length, from random
    streams disjoint from training's (another haystack seed and another batch key)."""
    gen = _Generator(
        tokenizer,
        R.synthetic_essays(derive_seed(seed, "heldout-haystack")),
        derive_seed(seed, "heldout-cwe-vocabulary"),
    )
    out = []
    for length in lengths:
        for task in tasks:
            for i in range(per_task):
                rng = random.Random(derive_seed(seed, "heldout", task, length, i))
                sample = sample_task_prompt(gen, task, length, rng)
                if sample is not None:
                    out.append((int(length), sample))
    return out


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


@torch.no_grad()
def evaluate_answers(
    model: torch.nn.Module,
    tokenizer: Any,
    samples: Sequence[TrainingSample],
    max_new_tokens: int = 48,
) -> list[dict[str, Any]]:
    """Greedy answers with the full cache; per sample: task, n_prompt, the reply, and
    ``correct`` = every gold answer occurs in the reply (RULER's string_match_all)."""
    from kvdiverge.models import chat_prompt_ids

    model.eval()
    device = next(model.parameters()).device
    out = []
    for sample in samples:
        ids = torch.tensor([chat_prompt_ids(tokenizer, sample.prompt)], device=device)
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        reply = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
        hits = [_normalize(a) in _normalize(reply) for a in sample.answers]
        out.append(
            {
                "task": sample.task,
                "n_prompt": int(ids.shape[1]),
                "reply": reply,
                "correct": bool(all(hits)),
                "answer_recall": float(np.mean(hits)),
            }
        )
    return out


def train_demo_model(
    kind: str,
    out_dir: str | os.PathLike,
    settings: TrainSettings,
    seed: int,
    progress_file: Any = None,
) -> Path:
    """Train demo architecture ``kind`` and write it to ``out_dir`` (docs/models.md, "Training").

    The folder loads with :func:`kvdiverge.models.load_model` / ``load_tokenizer`` like any
    model and holds ``training.json``: the fingerprint, settings, seed, loss history, held-out
    greedy accuracy per task (full cache), thread count, library versions and wall time.
    """
    import transformers
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    from kvdiverge.models import demo_tokenizer_and_config, save_model_dir

    fingerprint = training_fingerprint(kind, settings, seed)
    tokenizer, config = demo_tokenizer_and_config(kind)
    torch.manual_seed(derive_seed(seed, "init", kind) % 2**31)
    model = (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config)
    start = time.perf_counter()
    history = train_model(model, tokenizer, settings, seed, progress_file)
    train_seconds = time.perf_counter() - start
    samples = heldout_samples(
        tokenizer,
        seed,
        [t for t in sorted(settings.tasks) if settings.tasks[t] > 0],
        settings.eval_lengths,
        settings.eval_per_task,
    )
    results = evaluate_answers(model, tokenizer, [s for _, s in samples])
    accuracy: dict[str, float] = {}
    for task in sorted({r["task"] for r in results}):
        accuracy[task] = float(np.mean([r["correct"] for r in results if r["task"] == task]))
    record = {
        "fingerprint": fingerprint,
        "kind": kind,
        "seed": int(seed),
        "settings": settings.as_dict(),
        "train_seconds": round(train_seconds, 1),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "heldout_accuracy": accuracy,
        "heldout_documents": len(results),
        "loss_history": history,
    }
    log.info("trained %s in %.0f s; held-out accuracy %s", kind, train_seconds, accuracy)
    return save_model_dir(
        model, tokenizer, out_dir, {TRAINING_FILE: json.dumps(record, indent=1) + "\n"}
    )


def check_demo_model_folder(
    path: str | os.PathLike, model_config: Mapping[str, Any], seed: int, where: str = "model"
) -> dict[str, Any] | None:
    """Parse-time check of a demo model (docs/models.md, "Committed weights"): its ``train``
    settings are valid, and when ``path`` exists its ``training.json`` matches their
    fingerprint (else :class:`StaleModelError` with the retrain command). Returns the record,
    None when absent."""
    if "train" not in model_config:
        raise ValueError(f"{where}.train: expected the training settings of a demo model")
    settings = TrainSettings.from_config(model_config["train"], where=f"{where}.train")
    if not Path(path).exists():
        return None
    return check_trained_model(path, model_config["demo"], settings, seed)


def demo_model_fingerprint(model_config: Mapping[str, Any], seed: int) -> str:
    """:func:`training_fingerprint` of a demo model's config entry ``{demo, train}``."""
    settings = TrainSettings.from_config(model_config["train"])
    return training_fingerprint(model_config["demo"], settings, seed)
