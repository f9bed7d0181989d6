"""Rollout settings and the per-document result of the coupled decode loop, with the small
helpers (device, clock, common random numbers) every engine module shares."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvdiverge.engine.batch_plan import MASKED_MIN_FRACTION
from kvdiverge.theory.coupling import (
    Stream,
    crn_uniforms,
)

__all__ = [
    "COUPLING_MODES",
    "ActionPaths",
    "MASKED_MIN_FRACTION",
    "PROMPT_LAYOUTS",
    "RolloutSettings",
    "model_device",
]

log = logging.getLogger(__name__)


COUPLING_MODES = ("shared-reference", "independent")
PROMPT_LAYOUTS = ("auto", "gathered", "masked")


@dataclass(frozen=True)
class RolloutSettings:
    """The settings that travel together through every rollout entry point.

    ``H``: steps per rollout; ``seed``: master seed of the common random numbers; ``coupling``:
    ``shared-reference`` (one X per replicate set, shared by the actions) or ``independent``;
    ``max_batch_rows``: rows a model call may hold (a replicate costs X, and Y and at most Z
    per evicting action); ``keep_logits``: also return every row's logits (tests; keeps ended
    rows); ``identity_shortcut``: Q := P for an action that keeps everything, without rows of
    its own (benchmarks only: the control then cannot fail); ``drop_ended``: rows whose
    stream has ended leave the batch; ``fused_attention``: use a validated fused attention
    kernel where one exists; ``native_attention`` (with ``fused_attention``): the rows attend
    to the prompt through the native prompt kernel where it is built and validated
    (:mod:`kvdiverge.engine.kernels.native`), else through the library kernels; ``temperature``: the
    kernels are softmax(logits / T), T = 0 the point mass on the argmax (greedy; ties to the
    smallest id), T = 1 (default) the model's own;
    ``prompt_attention``: how the rows attend to the prompt — ``gathered`` (each action's rows
    against its own gathered kept entries), ``masked`` (all rows of a document in one product
    against its full prompt, each action's evicted entries masked out) or ``auto`` (masked for
    the actions keeping at least :data:`MASKED_MIN_FRACTION` of the prompt, gathered for the
    others); every layout gives the same laws to float rounding.
    """

    H: int
    seed: int
    coupling: str = "shared-reference"
    max_batch_rows: int = 192
    keep_logits: bool = False
    identity_shortcut: bool = False
    drop_ended: bool = True
    fused_attention: bool = True
    native_attention: bool = True
    temperature: float = 1.0
    prompt_attention: str = "auto"

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0 <= t < float("inf"):
            raise ValueError(f"temperature: expected a finite number >= 0 (0: greedy), got {t!r}")
        from kvdiverge.pipeline.extremes import temperature_problem

        if problem := temperature_problem(t, "temperature"):  # NaN kernels near 0
            raise ValueError(problem)
        if self.prompt_attention not in PROMPT_LAYOUTS:
            raise ValueError(
                f"prompt_attention: expected one of {', '.join(PROMPT_LAYOUTS)}, "
                f"got {self.prompt_attention!r}"
            )
        if self.coupling not in COUPLING_MODES:
            raise ValueError(
                f"coupling: expected one of {', '.join(COUPLING_MODES)}, got {self.coupling!r}"
            )
        if not isinstance(self.H, int | np.integer) or self.H < 1:
            raise ValueError(f"H: expected an integer >= 1, got {self.H}")
        if self.max_batch_rows < 1:
            raise ValueError(f"max_batch_rows: expected an integer >= 1, got {self.max_batch_rows}")


@dataclass
class ActionPaths:
    """One document's coupled rollouts, arrays of shape (K, H) (logits: (K, H, V))."""

    doc_id: str
    replicates: np.ndarray
    x_token: np.ndarray
    y_token: np.ndarray
    tv_rollout: np.ndarray
    tv_fixed: np.ndarray
    x_eos: np.ndarray
    y_eos: np.ndarray
    n_prompt: int
    n_kept: int
    batch_rows: int = 0  # the most rows a model call could hold (largest chunk ran)
    rows_per_replicate: int = 3  # X, and Y and Z per evicting action of the reference group
    logits: dict[str, np.ndarray] | None = None
    prefill_seconds: float = 0.0
    selection_seconds: float = 0.0
    decode_seconds: float = 0.0
    document_seconds: float = 0.0  # the document's prefill, selections and share of decoding
    # bytes the action's cache holds per layer: {start: prompt part, end: at step H}
    cache_bytes: dict[str, list[int]] | None = None


def _check_model(model: torch.nn.Module, n: int, H: int) -> None:
    for layer in model.model.layers:
        window = getattr(layer.self_attn, "sliding_window", None)
        if window is not None and window < n + H:
            raise ValueError(
                f"model: layer uses sliding-window attention ({window} < {n + H} positions); "
                "the engine needs full attention"
            )


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done (CUDA is asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    return next(iter(model.parameters()), torch.empty(0)).device


def _uniforms(
    seed: int, doc_key: int, replicates: np.ndarray, H: int, salt: int, device: torch.device
) -> torch.Tensor:
    """The coupling's uniforms for every replicate and step: (H, K, 3) on ``device``.

    Streams REFERENCE, ACCEPT, RESIDUAL, keyed by (seed, document, replicate, t).
    """
    steps = np.arange(1, H + 1)[:, None]
    u = np.stack(
        [
            crn_uniforms(seed, doc_key, replicates[None, :], steps, stream, salt)
            for stream in (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
        ],
        axis=-1,
    )
    return torch.from_numpy(u).to(device)


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
