"""Shared set-ups of the registration tests: a lock's rollout side and the metadata of a
trajectory file rolled out under it, both as the pipeline writes them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvdiverge.io.locks import evaluation_seed

ROLLOUT_MODEL = {
    "weights": "a" * 64,
    "tokenizer": "b" * 64,
    "device": "cpu",
    "dtype": "float32",
    "kernel": {"prompt_masked": "native-avx512", "rows_own": "library-flash-cpu"},
    "libraries": {"torch": "2.13.0", "transformers": "5.2.0", "kvpress": "0.5.5"},
}


def rollout_models(models: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """A lock's ``rollout.models`` for every model name of ``models``."""
    return {name: {**ROLLOUT_MODEL, "kernel": dict(ROLLOUT_MODEL["kernel"])} for name in models}


def file_meta(lock: Mapping[str, Any], action: str, model: str, **changed: Any) -> dict:
    """The metadata an evaluation trajectory file of ``action`` and ``model`` carries when it
    was rolled out under ``lock`` (a study lock or an amendment), with ``changed`` keys set."""
    design, rollout = lock["design"], lock["rollout"]
    registered = rollout["models"][model]
    K = design["K_control"] if action == design["control"] else design["K"]
    meta = {
        "lock": lock["hash"],
        "model": {"name": model, "path": f"data/models/{model}"},
        "revision": None,
        "action": dict(design["actions"][action]),
        **{k: v for k, v in rollout["settings"].items() if k != "seed"},
        "seed": evaluation_seed(lock),
        "K": {design["cohort"]: K},
        "code": rollout["code"],
        "model_digest": {k: registered[k] for k in ("weights", "tokenizer")},
        "device": "cpu",
        "dtype": registered["dtype"],
        "kernel": dict(registered["kernel"]),
        "libraries": dict(registered["libraries"]),
    }
    meta.update(changed)
    return meta
