"""User selectors for the reliability cases (tests/eviction/test_reliability_selectors.py), one
fault each. Named in an action as ``reliability_helpers:<Class>`` (tests/ is on the import path
of the tests and of the job subprocesses they start)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvdiverge.eviction import ScoredSelector, Selector


def _first(prefill, n_keep: int) -> torch.Tensor:
    n_layers, n_kv = len(prefill.keys), prefill.keys[0].shape[0]
    return torch.arange(n_keep).expand(n_layers, n_kv, n_keep).clone()


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
