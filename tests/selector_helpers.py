"""User selectors that break the selector output contract, one way each, for the bad-selector
catalogue (tests/eviction/test_bad_selectors.py). Named in an action as ``selector_helpers:<Class>``
(tests/ is on the import path of the tests and of the job subprocesses they start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiverge.eviction import ScoredSelector, Selector


def _first(prefill, n_keep: int) -> torch.Tensor:
    """The first n_keep positions of every layer and KV head: a valid kept set."""
    n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
    return torch.arange(n_keep).expand(n_layers, n_kv, n_keep).clone()


@dataclass(frozen=True)
class Valid(Selector):
    """The first n_keep positions, written in descending order (the order is not contract)."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep).flip(-1).to(torch.int32)


@dataclass(frozen=True)
class Duplicates(Selector):
    """n_keep entries, position 3 twice."""

    def positions(self, prefill, action, n_keep):
        kept = _first(prefill, n_keep)
        kept[..., 4] = 3
        return kept


@dataclass(frozen=True)
class Everything(Selector):
    """Every prompt position at any budget."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, prefill.n)


@dataclass(frozen=True)
class Single(Selector):
    """One position per head."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, 1)


@dataclass(frozen=True)
class Negative(Selector):
    """A negative position other than the -1 padding."""

    def positions(self, prefill, action, n_keep):
        kept = _first(prefill, n_keep)
        kept[1, 0, 2] = -5
        return kept


@dataclass(frozen=True)
class Padded(Selector):
    """-1 padding from a selector that declares no ragged counts."""

    def positions(self, prefill, action, n_keep):
        kept = _first(prefill, n_keep)
        kept[0, 1, -1] = -1
        return kept


@dataclass(frozen=True)
class OutOfRange(Selector):
    """Position n."""

    def positions(self, prefill, action, n_keep):
        kept = _first(prefill, n_keep)
        kept[0, 0, -1] = prefill.n
        return kept


@dataclass(frozen=True)
class FloatPositions(Selector):
    """Positions as a float tensor."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep).float()


@dataclass(frozen=True)
class WrongShape(Selector):
    """(layers, n_keep): no KV-head axis."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)[:, 0]


@dataclass(frozen=True)
class NotATensor(Selector):
    """A nested list."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep).tolist()


@dataclass(frozen=True)
class Raises(Selector):
    """A bug in the user's code."""

    def positions(self, prefill, action, n_keep):
        return 1 // 0


@dataclass(frozen=True)
class ScalesValues(Selector):
    """Changes the shared prefill in place, then returns a valid kept set."""

    def positions(self, prefill, action, n_keep):
        prefill.values[0].mul_(0.5)
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class ObserveScalesKeys(Selector):
    """An observing selector that changes a layer's cache during the prefill."""

    observes: ClassVar[bool] = True

    def observe(self, action, layer, n_keep):
        layer.keys.mul_(0.5)

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class NaNScores(ScoredSelector):
    """NaN at one position of every layer."""

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        scores = torch.arange(n, dtype=torch.float32).expand(n_kv, n).clone()
        scores[0, 3] = float("nan")
        return scores


@dataclass(frozen=True)
class InfScores(ScoredSelector):
    """+inf at one position (topk would keep it whatever the others score)."""

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        scores = torch.zeros(n_kv, n)
        scores[1, 5] = float("inf")
        return scores


@dataclass(frozen=True)
class ScoreRaises(ScoredSelector):
    """A bug in the user's score."""

    def score(self, prefill, action, layer):
        raise KeyError("window")


@dataclass(frozen=True)
class RaggedValid(Selector):
    """Ragged: KV head 0 keeps n_keep + 1, KV head 1 keeps n_keep - 1, the rest n_keep; each
    layer keeps H_kv · n_keep in all, as declared."""

    def kept_per_layer(self, prefill, action, n_keep):
        return [prefill.keys[0].shape[0] * n_keep] * len(prefill.keys)

    def positions(self, prefill, action, n_keep):
        kept = torch.full((len(prefill.keys), prefill.keys[0].shape[0], n_keep + 1), -1)
        kept[:, :, :n_keep] = torch.arange(n_keep)
        kept[:, 0, n_keep] = n_keep
        kept[:, 1, n_keep - 1] = -1
        return kept


@dataclass(frozen=True)
class RaggedShort(RaggedValid):
    """Ragged, but layer 1 keeps one entry fewer than declared."""

    def positions(self, prefill, action, n_keep):
        kept = super().positions(prefill, action, n_keep)
        kept[1, 0, n_keep] = -1
        return kept


@dataclass(frozen=True)
class RaggedGap(RaggedValid):
    """Ragged, with -1 before a position."""

    def positions(self, prefill, action, n_keep):
        kept = super().positions(prefill, action, n_keep)
        kept[0, 0, 1] = -1
        return kept


@dataclass(frozen=True)
class BadAlwaysKept(ScoredSelector):
    """Always-kept positions with a repeat and one outside the prompt."""

    def always_kept(self, n):
        return [0, 0, n + 65]

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        return torch.zeros(n_kv, n)


@dataclass(frozen=True)
class ZeroKeep(Selector):
    """Keeps no entry (its own n_keep)."""

    def n_keep(self, action, n):
        return 0

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class CheckRaises(Selector):
    """A bug in the user's check, met when the config's strata are checked."""

    def check(self, action, n, n_keep):
        raise RuntimeError(f"cannot act on {n} tokens")

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)
