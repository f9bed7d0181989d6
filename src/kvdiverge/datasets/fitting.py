"""Length fitting under tokenizers and chat templates, and the data-layer errors.

A *length function* maps a prompt (the user message) to its tokenized length ``n`` under a
model's chat template (``n`` is the tokenized prompt length; `docs/method.md`, "The
language-model study"). Every document must satisfy ``n + reserve <= target_tokens``, RULER's
budget rule with the generation horizon H as the reserve; HELMET truncates its context to the
same budget (docs/datasets.md, "Datasets").

A study of several models fits its documents under all of their tokenizers at once
(:class:`LongestLength`): the length fitted is the longest of the models' own chat-wrapped
lengths, so a document that fits fits every model (docs/datasets.md, "Lengths under every
model"). The stratum's label stays nominal; each model's own length is recorded
(:func:`model_lengths`) and is what its rollouts use.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "DatasetError",
    "LengthFitError",
    "LengthFn",
    "LongestLength",
    "MissingSourceError",
    "ModelLength",
    "check_model_windows",
    "derive_seed",
    "describe_length",
    "largest_fitting",
    "model_lengths",
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
        needed = describe_length(length_fn, render(""), "the length tokenizer")
        raise LengthFitError(
            f"the prompt without its context needs {needed}, over the budget of {budget}"
        )
    lo, hi, best = 0, len(context), 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if length_fn(render(context[:mid])) <= budget:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return render(context[:best]), best


# ---- several models -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelLength:
    """One model of the study: its config name, the chat-wrapped length of a prompt under its
    own tokenizer and chat template, and its context window (None: unknown, unchecked)."""

    name: str
    length_fn: LengthFn
    window: int | None = None


class LongestLength:
    """The length a study of several models fits its documents with:
    ``L(p) = max_m n_m(p)`` over the models' own chat-wrapped lengths ``n_m``.

    Since ``L(p) <= budget`` exactly when ``n_m(p) <= budget`` for every model, a prompt fitted
    under ``L`` fits each model's budget under that model's own tokenizer (RULER's searches
    and HELMET's truncation need no change). The last few prompts' lengths are remembered, so
    that describing a prompt just measured (:meth:`describe`) tokenizes it no second time.
    """

    def __init__(self, models: Sequence[ModelLength], remember: int = 8) -> None:
        if not models:
            raise ValueError("LongestLength needs at least one model")
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise ValueError(f"LongestLength: model names repeat: {names}")
        self.models = tuple(models)
        self._remember = remember
        self._seen: OrderedDict[str, dict[str, int]] = OrderedDict()

    def lengths(self, prompt: str) -> dict[str, int]:
        """Each model's chat-wrapped length of ``prompt``, by model name."""
        found = self._seen.get(prompt)
        if found is None:
            found = {m.name: int(m.length_fn(prompt)) for m in self.models}
            self._seen[prompt] = found
            while len(self._seen) > self._remember:
                self._seen.popitem(last=False)
        else:
            self._seen.move_to_end(prompt)
        return dict(found)

    def __call__(self, prompt: str) -> int:
        return max(self.lengths(prompt).values())

    def describe(self, prompt: str) -> str:
        """The binding model's length first, then the others', e.g. ``4100 tokens under qwen
        (llama: 3990)``."""
        lengths = self.lengths(prompt)
        name = max(lengths, key=lambda k: lengths[k])
        others = ", ".join(f"{k}: {v}" for k, v in lengths.items() if k != name)
        return f"{lengths[name]} tokens under {name}" + (f" ({others})" if others else "")


def describe_length(length_fn: LengthFn, prompt: str, name: str) -> str:
    """``<n> tokens under <name>``; under a :class:`LongestLength`, the binding model and
    every other model's length (for one-line errors)."""
    describe = getattr(length_fn, "describe", None)
    if callable(describe):
        return describe(prompt)
    return f"{length_fn(prompt)} tokens under {name}"


def check_model_windows(models: Sequence[ModelLength], stratum: str, target_tokens: int) -> None:
    """Every model's context window holds the stratum's nominal length, so that a document
    fitted to ``target_tokens`` (prompt plus the generation reserve) fits each window; one-line
    :class:`LengthFitError` naming the stratum and the model otherwise. Runs before any
    document is built."""
    for m in models:
        if m.window is not None and m.window < target_tokens:
            raise LengthFitError(
                f"{stratum}: target_tokens {target_tokens} exceeds the context window of "
                f"{m.name} ({m.window} positions); lower target_tokens to at most {m.window} "
                "or leave the model out"
            )


def model_lengths(
    doc_ids: Sequence[str],
    prompts: Sequence[str],
    lengths: LongestLength,
    target_tokens: int,
    reserve: int,
) -> dict[str, list[int]]:
    """Each model's chat-wrapped length of every finished document, by model name (in the
    documents' order), checked: ``n_m + reserve <= target_tokens`` and ``n_m + reserve <=
    window_m`` for every model m and document. Raises :class:`LengthFitError` with one line
    naming the document, the model and the lengths otherwise."""
    out: dict[str, list[int]] = {m.name: [] for m in lengths.models}
    for doc_id, prompt in zip(doc_ids, prompts, strict=True):
        found = lengths.lengths(prompt)
        for m in lengths.models:
            n = found[m.name]
            limit, what = target_tokens, f"target_tokens {target_tokens}"
            if m.window is not None and m.window < limit:
                limit, what = m.window, f"the context window of {m.window} positions"
            if n + reserve > limit:
                raise LengthFitError(
                    f"{doc_id}: {n} tokens under {m.name} + generation_reserve {reserve} = "
                    f"{n + reserve} exceeds {what} (all models: "
                    + ", ".join(f"{k}: {v}" for k, v in found.items())
                    + ")"
                )
            out[m.name].append(n)
    return out
