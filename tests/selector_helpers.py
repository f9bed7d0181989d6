"""User selectors, one fault each, for the selector tests (tests/eviction/test_user_selectors.py,
tests/engine/test_job_selector_refusals.py): selectors that break the output contract, raise or
change the shared prefill, then selectors that shadow an action field, score at extreme values,
are not deterministic, or leave their device or torch's settings. Named in an action as
``selector_helpers:<Class>`` (tests/ is on the import path of the tests and of the job
subprocesses they start)."""

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


# ---- action fields, extreme scores, determinism, devices and global state ------------------
@dataclass(frozen=True)
class ShadowBudget(Selector):
    """A parameter field named like the action's budget."""

    budget: float = 0.25

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class ShadowSelector(Selector):
    """A parameter field named like the action's selector."""

    selector: str = "snapkv"

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class ShadowNKeep(Selector):
    """A parameter field named like an attribute of the action (``action.n_keep``)."""

    n_keep: int = 3

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class LargeScores(ScoredSelector):
    """Always keeps the first ``sinks`` positions, which it scores 0; every other position gets
    ``scale`` in ``dtype``, a score at which ``max + 1`` rounds back to ``max``."""

    sinks: int = 4
    scale: float = 300.0
    dtype: str = "bfloat16"

    def always_kept(self, n):
        return range(self.sinks)

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        scores = torch.full((n_kv, n), self.scale, dtype=getattr(torch, self.dtype))
        scores[:, : self.sinks] = 0
        return scores


@dataclass(frozen=True)
class LargeIntegerScores(ScoredSelector):
    """Integer scores at int64's top, the always-kept last positions scored lowest."""

    window: int = 3

    def always_kept(self, n):
        return range(n - self.window, n)

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        scores = torch.full((n_kv, n), torch.iinfo(torch.int64).max, dtype=torch.int64)
        scores[:, -self.window :] = torch.iinfo(torch.int64).min
        return scores


@dataclass(frozen=True)
class Unseeded(Selector):
    """Random positions from torch's global generator, a new draw at every call."""

    def positions(self, prefill, action, n_keep):
        n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
        draws = torch.rand(n_layers, n_kv, prefill.n).argsort(dim=-1)[..., :n_keep]
        return draws.sort(dim=-1).values


@dataclass(frozen=True)
class Seeded(Selector):
    """A seeded random method: random positions drawn from its own generator, seeded by
    ``seed`` once per instance (so two calls differ, and two runs are identical)."""

    deterministic: ClassVar[bool] = False
    seed: int = 0

    def positions(self, prefill, action, n_keep):
        generator = self.__dict__.get("_generator")
        if generator is None:
            generator = torch.Generator().manual_seed(self.seed)
            object.__setattr__(self, "_generator", generator)
        n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
        draws = torch.rand(n_layers, n_kv, prefill.n, generator=generator).argsort(dim=-1)
        return draws[..., :n_keep].sort(dim=-1).values


@dataclass(frozen=True)
class RandomWithoutSeed(Selector):
    """Declares itself random but takes no seed."""

    deterministic: ClassVar[bool] = False

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep)


@dataclass(frozen=True)
class MetaPositions(Selector):
    """Positions on the meta device (no values)."""

    def positions(self, prefill, action, n_keep):
        return _first(prefill, n_keep).to("meta")


@dataclass(frozen=True)
class MetaScores(ScoredSelector):
    """Scores on the meta device (no values)."""

    def score(self, prefill, action, layer):
        n_kv, n = prefill.keys[layer].shape[:2]
        return torch.zeros(n_kv, n, device="meta")


@dataclass(frozen=True)
class ChangesDefaultDtype(Selector):
    """Switches torch's default dtype to float64 and leaves it so."""

    def positions(self, prefill, action, n_keep):
        torch.set_default_dtype(torch.float64)
        return _first(prefill, n_keep)


CALLS: list[str] = []
"""Each call of :class:`Counted`'s positions, by action name."""


@dataclass(frozen=True)
class Counted(Selector):
    """A deterministic selector that records every call of its positions in :data:`CALLS`."""

    def positions(self, prefill, action, n_keep):
        CALLS.append(action.name)
        return _first(prefill, n_keep)
