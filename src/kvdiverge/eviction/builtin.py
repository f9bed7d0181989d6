"""The built-in selectors: ``full`` (the control), ``recent`` (StreamingLLM) and ``snapkv``."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import ClassVar

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.run import _all_positions
from kvdiverge.eviction.selectors import (
    ScoredSelector,
    Selector,
    _check_always_kept,
    _check_budget_field,
    register_selector,
)

if typing.TYPE_CHECKING:
    from kvdiverge.eviction.prefill import Prefill
    from kvdiverge.eviction.selectors import ActionSpec


@register_selector
@dataclass(frozen=True)
class FullSelector(Selector):
    """Full retention: the control action, keeps every prompt entry (δ ≡ 0)."""

    name: ClassVar[str] = "full"
    keeps_everything: ClassVar[bool] = True

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None and action.budget != 1.0:
            raise ActionError(f"{where}.budget: selector 'full' keeps everything; omit budget")

    def n_keep(self, action: ActionSpec, n: int) -> int:
        return n

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        return _all_positions(prefill, prefill.n)


@register_selector
@dataclass(frozen=True)
class RecentSelector(ScoredSelector):
    """StreamingLLM (kvpress's StreamingLLMPress): the ``sinks`` first positions plus the most
    recent ones."""

    name: ClassVar[str] = "recent"
    sinks: int = 4

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if self.sinks < 0:
            raise ActionError(f"{where}.sinks: expected an integer >= 0, got {self.sinks}")
        if isinstance(action.budget, int) and action.budget < self.sinks:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the {self.sinks} sink positions"
            )

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        _check_always_kept(action, n, n_keep, self.sinks, f"the {self.sinks} sink positions")

    def always_kept(self, n: int) -> range:
        return range(self.sinks)

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        import torch

        n_kv, n = prefill.keys[layer].shape[:2]
        position = torch.arange(n, dtype=torch.float64, device=prefill.keys[layer].device)
        return position.expand(n_kv, n)  # the most recent score highest


def snapkv_scores(
    window_queries: torch.Tensor, keys: torch.Tensor, window: int, kernel: int, groups: int
) -> torch.Tensor:
    """SnapKV prefix scores of one layer, as kvpress's ``SnapKVPress.score``: (H_kv, n − w).

    ``window_queries`` (H, ≥w, d) post-RoPE, ``keys`` (H_kv, n, d) post-RoPE, in the model's
    dtype. The arithmetic follows kvpress step by step and in its dtypes, so that the kept sets
    agree also in bfloat16 (``docs/method.md``, "SnapKV"): logits q·kᵀ/√d in the model's dtype,
    causal mask inside the window, softmax over all n keys in float32 cast back to the model's
    dtype, prefix columns kept without renormalising, then in the model's dtype the mean over
    the w queries, zero-padded average pooling (kernel k, stride 1) and the mean over the
    query heads of each KV group.
    """
    import torch
    import torch.nn.functional as F

    q = window_queries[:, -window:]
    n_heads, w, d = q.shape
    n = keys.shape[1]
    k = keys.to(q.dtype).repeat_interleave(groups, dim=0)  # (H, n, d), repeat_kv layout
    logits = torch.matmul(q, k.transpose(1, 2)) / math.sqrt(d)
    pos_q = torch.arange(n - w, n, device=q.device)[:, None]
    pos_k = torch.arange(n, device=q.device)[None, :]
    logits = logits.masked_fill(pos_k > pos_q, float("-inf"))
    probs = logits.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    prefix = probs[..., : n - w].mean(dim=1)  # (H, n − w)
    pooled = F.avg_pool1d(prefix[:, None, :], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.view(n_heads // groups, groups, -1).mean(dim=1)


@register_selector
@dataclass(frozen=True)
class SnapKVSelector(ScoredSelector):
    """SnapKV as kvpress's SnapKVPress (``docs/method.md``, "SnapKV"): the ``window`` last
    positions always kept, the top prefix scores fill the rest of the budget."""

    name: ClassVar[str] = "snapkv"
    window: int = 64
    kernel: int = 5

    def validate(self, action: ActionSpec, where: str) -> None:
        _check_budget_field(action, where)
        if self.window < 1:
            raise ActionError(f"{where}.window: expected an integer >= 1, got {self.window}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ActionError(f"{where}.kernel: expected an odd integer >= 1, got {self.kernel}")
        if isinstance(action.budget, int) and action.budget < self.window:
            raise ActionError(
                f"{where}.budget: {action.budget} is below the observation window "
                f"{self.window} (the window is always kept)"
            )

    def query_window(self, action: ActionSpec) -> int:
        return self.window

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        what = f"the {self.window}-token observation window"
        _check_always_kept(action, n, n_keep, self.window, what)

    def always_kept(self, n: int) -> range:
        return range(n - self.window, n)

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        import torch.nn.functional as F

        w = self.window
        if not prefill.window_queries or prefill.window_queries[0].shape[1] < w:
            raise ActionError(f"action {action.name!r}: prefill did not record {w} window queries")
        q, k = prefill.window_queries[layer], prefill.keys[layer]
        scores = snapkv_scores(q, k, w, self.kernel, prefill.num_key_value_groups)
        return F.pad(scores, (0, w))  # the window's own scores: replaced by the always-kept score
