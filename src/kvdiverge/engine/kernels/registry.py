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
reference (:mod:`kvdiverge.engine.kernels.reference`) on small random problems and, on a CPU key,
checked to give every row the same bits wherever it lies in a call and however many rows the
call holds (:func:`~kvdiverge.engine.kernels.reference.stable`: the full control is bit-exact on
one CPU thread only so); the first that passes is kept for the process and the choice is logged
once. On CUDA (a machine with a CUDA
device; not with ``KVDIVERGE_KERNEL_TIMING=0``) every candidate that agrees is timed on one
problem of a decoding step's size (:func:`timing_problem`, :func:`measure`) and a later one
displaces the preferred only when :data:`TIMING_MARGIN` times faster (:func:`fastest`); the
milliseconds are logged and kept per GPU model, torch version and key in
``$KVDIVERGE_CACHE/kernel_timings.json``, so that every job on that GPU model (development and
evaluation, whose lock compares the kernels) makes the same choice. The CPU choice is not
timed. A candidate that raises later is dropped for that key (one warning) and the next one is
chosen. The reference itself is the last
candidate of every layout and needs no validation (it is the oracle).

:func:`kernel_choices` says which kernel each layout used in this process so far; it is recorded
in every trajectory file's metadata.

Namesake: :mod:`kvdiverge.datasets.registry` registers dataset environments, not kernels.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from kvdiverge.engine.kernels.reference import agrees, stable

__all__ = [
    "LAYOUTS",
    "Candidate",
    "choose",
    "drop",
    "fastest",
    "kernel_choices",
    "measure",
    "register",
    "reset",
    "timing_problem",
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
    :func:`kvdiverge.engine.kernels.reference.agrees` on the layout's validation problems); on a
    CPU key it must also pass :func:`kvdiverge.engine.kernels.reference.stable`.
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
            eligible = (
                c
                for c in candidates(layout)
                if (fused or c.oracle)
                and (native or c.kind != "native")
                and c.name not in _DROPPED.get(key, set())
                and (c.oracle or (c.claims(key) and _validated(c, key)))
            )
            pick = next(eligible, None)
            if pick is not None and not pick.oracle and _timed(key):
                pick = _timed_choice(key, [pick, *(c for c in eligible if not c.oracle)])
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
            layout, device, dtype, d = key
            if cand.validate is not None:
                memo = bool(cand.validate(key))
            else:
                memo = agrees(cand.run, layout, dtype, device, d)
            if memo and device == "cpu" and not stable(cand.run, layout, dtype, device, d):
                log.warning(
                    "attention kernel %s: a row's bits depend on its place in the call on %s",
                    cand.name,
                    key,
                )
                memo = False
        except Exception as exc:  # a candidate's own fault: it is never chosen
            log.warning("attention kernel %s: validation raised (%s)", cand.name, exc)
            memo = False
        _VALIDATED[(cand.name, key)] = memo
        if not memo:
            log.info("attention kernel %s: not used on %s (disagrees or fails)", cand.name, key)
    return memo


_VALIDATED: dict[tuple[str, Key], bool] = {}

TIMING_MARGIN = 1.2  # a later candidate displaces the preferred one only when this much faster
TIMED_CALLS = 5  # timed calls per candidate, after one warm-up call (the median is kept)


def _timed(key: Key) -> bool:
    """Whether the choice for ``key`` is timed: a CUDA key on a machine with CUDA, unless
    ``KVDIVERGE_KERNEL_TIMING=0``."""
    on = os.environ.get("KVDIVERGE_KERNEL_TIMING", "1") != "0"
    return key[1] == "cuda" and on and torch.cuda.is_available()


def timing_problem(
    layout: str, dtype: torch.dtype, device: torch.device | str, d: int
) -> tuple[torch.Tensor | None, ...]:
    """One random problem of a decoding step's size in ``layout``'s convention: ``rows_own``
    64 rows × 8 KV heads × 4 query heads against 128 own entries; the prompt layouts 8 KV heads
    and 256 query rows against 4096 prompt entries (``prompt_ragged``: the last 100 padded;
    ``prompt_masked``: a table of 4 masks dropping about half, rows cycling −1 to 3)."""
    gen = torch.Generator().manual_seed(1)
    if layout == "rows_own":
        q, k, v = (torch.randn((64, 8, s, d), generator=gen) for s in (4, 128, 128))
        return tuple(x.to(device, dtype) for x in (q, k, v))
    m, n = 256, 4096
    q, k, v = (torch.randn((8, s, d), generator=gen).to(device, dtype) for s in (m, n, n))
    table = rows = None
    if layout == "prompt_ragged":
        table = torch.zeros((1, 8, n))
        table[..., n - 100 :] = float("-inf")
        rows = torch.zeros(m, dtype=torch.int32)
    elif layout == "prompt_masked":
        drop = torch.rand((4, 8, n), generator=gen) < 0.5
        table = torch.zeros(drop.shape).masked_fill_(drop, float("-inf"))
        rows = torch.arange(m, dtype=torch.int32) % 5 - 1
    return q, k, v, None if table is None else table.to(device), rows


def measure(cand: Candidate, key: Key) -> float:
    """Median milliseconds of :data:`TIMED_CALLS` calls of ``cand`` on ``key``'s
    :func:`timing_problem`, after one warm-up call, the device synchronised around each."""
    layout, device, dtype, d = key
    problem = timing_problem(layout, dtype, device, d)
    args = (*problem[:3], d**-0.5, *problem[3:])
    cand.run(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMED_CALLS):
        start = time.perf_counter()
        cand.run(*args)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def fastest(validated: list[Candidate], ms: Mapping[str, float]) -> Candidate:
    """Among ``validated`` (in order of preference), the fastest by ``ms`` when it takes at most
    1/:data:`TIMING_MARGIN` of the preferred one's time, else the preferred one (times within
    the margin are noise, and a stable choice keeps a lock's kernels)."""
    best = min(validated, key=lambda c: ms[c.name])
    return best if ms[best.name] * TIMING_MARGIN <= ms[validated[0].name] else validated[0]


def _timings_file():
    from kvdiverge.engine.kernels.build import cache_dir

    return cache_dir() / "kernel_timings.json"


def _timed_choice(key: Key, validated: list[Candidate]) -> Candidate:
    """:func:`fastest` of ``validated`` on ``key``, timed once per GPU model, torch version and
    key (kept in the timings file), logged."""
    if len(validated) == 1:
        return validated[0]
    layout, _, dtype, d = key
    where = f"{torch.cuda.get_device_name()}|torch {torch.__version__}|{layout}|{dtype}|{d}"
    path, names = _timings_file(), sorted(c.name for c in validated)
    try:
        kept = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        kept = {}
    ms = kept.get(where)
    if not isinstance(ms, dict) or sorted(ms) != names:
        ms = {}
        for cand in validated:
            try:
                ms[cand.name] = measure(cand, key)
            except Exception as exc:  # a candidate's own fault: timed as never finishing
                log.warning("attention kernel %s: timing raised (%s)", cand.name, exc)
                ms[cand.name] = float("inf")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({**kept, where: ms}, indent=1, sort_keys=True))
            os.replace(partial, path)
        except OSError as exc:
            log.warning("attention kernel timings not kept in %s (%s)", path, exc)
    pick = fastest(validated, ms)
    shown = ", ".join(f"{name} {value:.3f} ms" for name, value in ms.items())
    log.info("attention kernels timed on %s (%s): %s", key, shown, pick.name)
    return pick


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
