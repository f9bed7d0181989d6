"""One dispatch registry for the attention kernels, keyed by (layout, device, dtype, head size).

A *layout* is a purpose of an attention call inside :func:`kvdiverge.engine.attention.
shared_prefix_attention`:

* ``rows_own``: each decoding row against its own generated entries (dense, (B, H_kv, G, d));
* ``prompt_gathered``: a row group against its prompt part, no mask;
* ``prompt_ragged``: a row group against a ragged gathered part (padding masked per KV head);
* ``prompt_masked``: several row groups against a document's full prompt in one pass, each
  query row with its group's additive mask (a bias table and a row index).

Candidates are registered in order of preference (:func:`register`). The first time a key is
asked for (:func:`choose`), each candidate that claims the key is validated against the float32
reference (:mod:`kvdiverge.engine.kernels.reference`) on small random problems; the first that
agrees is kept for the process and the choice is logged once. A candidate that raises later is
dropped for that key (one warning) and the next one is chosen. The reference itself is the last
candidate of every layout and needs no validation (it is the oracle).

:func:`kernel_choices` says which kernel each layout used in this process so far; it is recorded
in every trajectory file's metadata.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvdiverge.engine.kernels.reference import agrees

__all__ = [
    "LAYOUTS",
    "Candidate",
    "choose",
    "drop",
    "kernel_choices",
    "register",
    "reset",
]

log = logging.getLogger(__name__)

LAYOUTS = ("rows_own", "prompt_gathered", "prompt_ragged", "prompt_masked")

Key = tuple[str, str, torch.dtype, int]  # (layout, device type, dtype, head size)


@dataclass(frozen=True)
class Candidate:
    """A kernel for some layouts: ``run`` computes (output, log-sum-exp) in the layout's
    convention (:mod:`kvdiverge.engine.kernels.library`); ``claims(key)`` whether it serves
    the key at all (device, dtype, head size, availability on this machine);
    ``validate(key)`` whether it agrees with the reference there (run once per key; by default
    :func:`kvdiverge.engine.kernels.reference.agrees` on the layout's validation problems).
    One name may serve several layouts through several candidates (one per convention)."""

    name: str
    layouts: tuple[str, ...]
    run: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    claims: Callable[[Key], bool]
    validate: Callable[[Key], bool] | None = None
    kind: str = "library"  # "native", "library" or "reference" (the oracle: never validated)

    @property
    def oracle(self) -> bool:
        return self.kind == "reference"


_CANDIDATES: list[Candidate] = []
_CHOSEN: dict[tuple[Key, bool, bool], Candidate] = {}
_DROPPED: dict[Key, set[str]] = {}
_USED: dict[str, list[str]] = {}  # layout → kernel names chosen for it, in order
_LOCK = threading.Lock()


def register(candidate: Candidate) -> None:
    """Add ``candidate`` after those registered before it (earlier ones are preferred); the
    oracle stays last."""
    unknown = set(candidate.layouts) - set(LAYOUTS)
    if unknown:
        raise ValueError(f"kernel {candidate.name}: unknown layouts {sorted(unknown)}")
    with _LOCK:
        _CANDIDATES[:] = [
            c for c in _CANDIDATES if (c.name, c.layouts) != (candidate.name, candidate.layouts)
        ]
        oracles = [c for c in _CANDIDATES if c.oracle]
        others = [c for c in _CANDIDATES if not c.oracle]
        if candidate.oracle:
            oracles.append(candidate)
        else:
            others.append(candidate)
        _CANDIDATES[:] = others + oracles
        _CHOSEN.clear()


def candidates(layout: str) -> list[Candidate]:
    """The registered candidates of ``layout``, in order of preference."""
    return [c for c in _CANDIDATES if layout in c.layouts]


def choose(
    layout: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int,
    *,
    fused: bool = True,
    native: bool = True,
    record: bool = True,
) -> Candidate:
    """The kernel for (``layout``, ``device``'s type, ``dtype``, ``head_size``): the first
    registered candidate that claims the key and agrees with the reference (validated once per
    process; the choice logged once). ``fused=False``: the reference itself; ``native=False``:
    no native kernel (``RolloutSettings.fused_attention`` and ``native_attention``).
    ``record=False``: a question about the choice, not a use (not in :func:`kernel_choices`)."""
    if layout not in LAYOUTS:
        raise ValueError(f"kernel layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")
    key: Key = (layout, torch.device(device).type, dtype, int(head_size))
    memo_key = (key, fused, native)
    pick = _CHOSEN.get(memo_key)
    if pick is None:
        with _LOCK:
            pick = next(
                (
                    c
                    for c in candidates(layout)
                    if (fused or c.oracle)
                    and (native or c.kind != "native")
                    and c.name not in _DROPPED.get(key, set())
                    and (c.oracle or (c.claims(key) and _validated(c, key)))
                ),
                None,
            )
            if pick is None:
                raise RuntimeError(f"no attention kernel for {key} (no reference registered)")
            _CHOSEN[memo_key] = pick
            log.info("attention kernel for %s on %s %s, head size %d: %s", *key, pick.name)
    if record:
        used = _USED.setdefault(layout, [])
        if pick.name not in used:
            used.append(pick.name)
    return pick


def _validated(cand: Candidate, key: Key) -> bool:
    memo = _VALIDATED.get((cand.name, key))
    if memo is None:
        try:
            if cand.validate is not None:
                memo = bool(cand.validate(key))
            else:
                layout, device, dtype, d = key
                memo = agrees(cand.run, layout, dtype, device, d)
        except Exception as exc:  # a candidate's own fault: it is never chosen
            log.warning("attention kernel %s: validation raised (%s)", cand.name, exc)
            memo = False
        _VALIDATED[(cand.name, key)] = memo
        if not memo:
            log.info("attention kernel %s: not used on %s (disagrees or fails)", cand.name, key)
    return memo


_VALIDATED: dict[tuple[str, Key], bool] = {}


def drop(
    candidate: Candidate,
    layout: str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_size: int,
    exc: BaseException,
) -> None:
    """``candidate`` failed at run time on this key: never chosen for it again (one warning)."""
    key: Key = (layout, torch.device(device).type, dtype, int(head_size))
    with _LOCK:
        _DROPPED.setdefault(key, set()).add(candidate.name)
        for memo_key in [m for m, c in _CHOSEN.items() if m[0] == key and c is candidate]:
            del _CHOSEN[memo_key]
    log.warning(
        "attention kernel %s failed on %s (%s); using the next candidate", candidate.name, key, exc
    )


def kernel_choices() -> dict[str, str]:
    """Which kernel each layout used in this process so far, e.g. ``{"prompt_masked":
    "native-avx512", "rows_own": "library-flash-cpu"}`` (several, comma-separated in the order
    first chosen, when a layout ran on several keys with different kernels); empty before any
    attention call."""
    return {layout: ", ".join(names) for layout, names in sorted(_USED.items())}


def reset() -> None:
    """Forget every choice, validation and drop (tests; a process normally never resets)."""
    with _LOCK:
        _CHOSEN.clear()
        _DROPPED.clear()
        _USED.clear()
        _VALIDATED.clear()
