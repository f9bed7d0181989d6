"""Budgets: how many prompt entries an action keeps per layer and KV head (see
:mod:`kvdiverge.eviction`).

A float budget in (0, 1] is a fraction of n floored in exact rational arithmetic; an integer
budget >= 1 is absolute."""

from __future__ import annotations

import math
import numbers
import typing
from fractions import Fraction
from typing import Any

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    pass


class ActionError(ValueError):
    """An action spec is invalid, or cannot be applied to a prompt; the message is one line."""


# ---- budgets ------------------------------------------------------------------------------------
def _budget_value(budget: Any, where: str) -> int | Fraction:
    """An absolute budget (int ≥ 1) or an exact fraction in (0, 1]; one-line errors."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ActionError(f"{where}: budget must be a number, got {budget!r}")
    if isinstance(budget, numbers.Integral):
        if budget < 1:
            raise ActionError(f"{where}: an integer budget must be >= 1, got {budget}")
        return int(budget)
    if not math.isfinite(budget) or not (0.0 < budget <= 1.0):
        raise ActionError(
            f"{where}: a float budget is a fraction of n in (0, 1], got {budget!r} "
            "(write an integer for an absolute budget)"
        )
    return Fraction(repr(float(budget)))


def budget_tokens(n: int, budget: float | int, where: str = "budget") -> int:
    """Entries kept for prompt length n, in exact integer arithmetic.

    Float in (0, 1]: ``floor(budget · n)`` with the budget read as the exact decimal it prints
    as (0.9 → 9/10). Integer ≥ 1: ``min(budget, n)``.
    """
    value = _budget_value(budget, where)
    if isinstance(value, int):
        return min(value, n)
    kept = (value.numerator * n) // value.denominator
    if kept < 1:
        raise ActionError(f"{where}: budget {budget!r} keeps no entry of a {n}-token prompt")
    return kept
