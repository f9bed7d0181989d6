"""Length fitting under a tokenizer and chat template, and the data-layer errors.

A *length function* maps a prompt (the user message) to its tokenized length ``n`` under the
length model's chat template (``n`` is the tokenized prompt length; `docs/method.md`, "The
language-model study"). Every document must satisfy ``n + reserve <= target_tokens``, RULER's
budget rule with the generation horizon H as the reserve; HELMET truncates its context to the
same budget (docs/datasets.md, "Datasets").
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

__all__ = [
    "DatasetError",
    "LengthFitError",
    "LengthFn",
    "MissingSourceError",
    "derive_seed",
    "largest_fitting",
    "ruler_unit_search",
    "truncate_context",
]

LengthFn = Callable[[str], int]


class DatasetError(ValueError):
    """A dataset configuration or source cannot produce the requested documents (one line)."""


class LengthFitError(DatasetError):
    """No prompt of the task fits the stratum's token budget under the length tokenizer."""


class MissingSourceError(DatasetError, FileNotFoundError):
    """A configured data file or folder does not exist; the message names where it comes from."""


def derive_seed(*parts: object) -> int:
    """A 63-bit seed from the master seed and names (stable across runs and platforms)."""
    digest = hashlib.sha256("\x1f".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def largest_fitting(n_tokens: Callable[[int], int], budget: int, lo: int, hi: int) -> int | None:
    """RULER's binary search: the largest unit count in ``[lo, hi]`` whose probe prompt has
    ``n_tokens(units) <= budget``, or None if none does.

    Each call of ``n_tokens`` may build a fresh random prompt, as RULER's probes do.
    """
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if n_tokens(mid) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def ruler_unit_search(
    n_tokens: Callable[[int], int],
    budget: int,
    min_units: int,
    inc: int,
    upper_factor: int = 3,
    max_units: int | None = None,
) -> int | None:
    """Unit count for a RULER task by RULER's binary search.

    Tokens per unit are estimated from one prompt with ``inc`` units; the search runs over
    ``[min_units, max(upper_factor * budget / tokens_per_unit, 2 * inc)]`` (RULER starts at
    ``inc``; short budgets need fewer units than that, so the lower end is the task's minimum),
    and the upper end is doubled while it still fits, up to ``max_units`` (a source with a
    finite number of units, e.g. qa's documents). Returns None when not even ``min_units`` fits.
    """
    probe_units = max(inc, min_units)
    tokens_per_unit = max(n_tokens(probe_units), 1) / probe_units
    hi = max(int(upper_factor * budget / tokens_per_unit), 2 * probe_units)
    # at short budgets the template dominates the probe and the estimate undershoots: widen
    # the bracket until its upper end no longer fits, so the search keeps RULER's meaning
    if max_units is not None:
        if n_tokens(max_units) <= budget:
            return max_units
        hi = min(hi, max_units)
    while n_tokens(hi) <= budget and (max_units is None or hi < max_units):
        hi = hi * 2 if max_units is None else min(hi * 2, max_units)
    return largest_fitting(n_tokens, budget, min_units, hi)


def truncate_context(
    render: Callable[[str], str], context: str, length_fn: LengthFn, budget: int
) -> tuple[str, int]:
    """HELMET's truncation: cut only the context from its end until the rendered prompt fits
    ``budget`` tokens; returns (prompt, characters of context kept).

    HELMET removes the excess token count using the tokenizer's offset mapping; with only a
    length function, the cut is the longest character prefix that fits (binary search).
    Raises :class:`LengthFitError` when even an empty context does not fit.
    """
    full = render(context)
    if length_fn(full) <= budget:
        return full, len(context)
    if length_fn(render("")) > budget:
        raise LengthFitError(
            f"the prompt without its context needs {length_fn(render(''))} tokens, over the "
            f"budget of {budget}"
        )
    lo, hi, best = 0, len(context), 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if length_fn(render(context[:mid])) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return render(context[:best]), best
