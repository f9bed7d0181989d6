"""The full-retention control: it must give δ ≡ 0 and X ≡ Y, a correctness check.

Keeping every prompt entry leaves the kernel unchanged, so under the stepwise maximal coupling
the intervention replays the reference exactly: δ_t = f_t = 0 and X_t = Y_t at every step. The
engine runs the control through the same path as any evicting action (a gather of every
position, its own Y rows and logits, the coupling), so any deviation means the engine, the
cache gather, the attention or the coupling is wrong, and no estimand computed from that run
can be trusted (``docs/method.md``, "The full-retention control").

Tolerance. With one thread on CPU in float32 (every pipeline rollout job: ``threads: 1``) that
path is bit-exact, δ ≡ f ≡ 0, whatever K and K_control are: every row of a model call is
computed by the same instructions wherever it lies in the batch (tested in
``tests/engine/test_control_exact.py``). With several threads the matrix products split the batch's
rows between threads differently for the reference rows and the control's rows, and P and Q
differ by rounding (δ about 1e-6 on the demo models); a fused GPU or reduced-precision kernel
does the same. The file records device and dtype but not the thread count, so
:data:`CONTROL_TOLERANCE` bounds, per device and dtype, what the least exact run of that kind
gives: f_t (Q and P on the same history, comparable after a split too) at every step and δ_t up
to the path's first mismatch. A mismatch is then no failure in itself
(it happens with probability δ_t), unless δ_t = 0 at that step, which a correct coupling never
allows. A broken gather or attention moves δ by orders of magnitude more (tested).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.io.swrb_records import read_swrb_metadata, read_swrb_records, record_arrays
from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata

__all__ = [
    "CONTROL_TOLERANCE",
    "ControlCheckError",
    "check_full_retention_control",
    "check_swrb_control",
    "control_tolerance",
    "control_violations",
]

# Largest δ_t, f_t accepted from the control, by (device type, dtype). What is exact where:
# CPU float32 on one thread gives δ ≡ f ≡ 0 (the pipeline's jobs; tested); the float32
# entries cover several threads and CUDA's fused kernels (not yet run on a GPU in this project:
# benchmarks/device_check.py measures it); bf16/fp16 round in the model's dtype.
CONTROL_TOLERANCE: Mapping[tuple[str, str], float] = {
    ("cpu", "float64"): 1e-9,
    ("cpu", "float32"): 1e-4,  # exact on one thread, ~1e-6 measured on several
    ("cuda", "float32"): 1e-4,
    ("cpu", "bfloat16"): 2e-2,  # 8 mantissa bits: products rounded to ~4e-3 relative
    ("cuda", "bfloat16"): 2e-2,
    ("cpu", "float16"): 5e-3,  # 11 mantissa bits
    ("cuda", "float16"): 5e-3,
}


class ControlCheckError(RuntimeError):
    """The full-retention control shows δ ≠ 0, f ≠ 0 or X ≠ Y beyond its tolerance."""


def control_tolerance(metadata: Mapping[str, Any]) -> float:
    """The tolerance for a trajectory file's ``device`` and ``dtype`` metadata (0, exactness,
    for a combination not in :data:`CONTROL_TOLERANCE`)."""
    device = str(metadata.get("device", "cpu")).split(":")[0]
    dtype = str(metadata.get("dtype", "float32")).removeprefix("torch.")
    return CONTROL_TOLERANCE.get((device, dtype), 0.0)


def control_violations(
    trajectories: pl.LazyFrame | pl.DataFrame, tolerance: float = 0.0
) -> pl.DataFrame:
    """Rows of a control trajectory table that break δ ≡ 0, f ≡ 0, X ≡ Y.

    ``tolerance == 0``: every row with δ_t ≠ 0, f_t ≠ 0, I_t = 1 or X_t ≠ Y_t. ``tolerance > 0``:
    rows with f_t > tolerance, δ_t > tolerance at or before the path's first mismatch, a first
    mismatch at a step with δ_t = 0, a mismatch flag that contradicts the tokens, or a
    non-finite δ_t or f_t.
    """
    frame = trajectories.lazy() if isinstance(trajectories, pl.DataFrame) else trajectories
    if tolerance == 0:
        bad = (
            (pl.col("tv_rollout") != 0)
            | (pl.col("tv_fixed") != 0)
            | pl.col("mismatch")
            | (pl.col("x_token") != pl.col("y_token"))
        )
    else:
        split_before = (pl.col("x_token") != pl.col("y_token")).cast(pl.Int32).cum_sum().shift(
            1, fill_value=0
        ).over(["doc_id", "replicate"], order_by="t") > 0
        differ = pl.col("x_token") != pl.col("y_token")
        bad = (
            (pl.col("tv_fixed") > tolerance)
            | ((pl.col("tv_rollout") > tolerance) & ~split_before)
            | (differ & ~split_before & (pl.col("tv_rollout") == 0))
            | (pl.col("mismatch") != differ)
            | ~pl.col("tv_fixed").is_finite()
            | ~pl.col("tv_rollout").is_finite()
        )
    return (
        frame.filter(bad)
        .select("doc_id", "replicate", "t", "x_token", "y_token", "tv_rollout", "tv_fixed")
        .sort("doc_id", "replicate", "t")
        .collect()
    )


def check_full_retention_control(paths: Iterable[str | os.PathLike]) -> None:
    """Fail loudly, naming the file and the first offending document, replicate and step, if a
    full-retention control trajectory file deviates from δ ≡ 0, X ≡ Y beyond the tolerance of
    its device and dtype (:func:`control_tolerance`)."""
    for path in paths:
        tolerance = control_tolerance(read_trajectory_metadata(path))
        bad = control_violations(read_trajectories(path, lazy=True), tolerance)
        if bad.height:
            row = bad.row(0, named=True)
            n_docs = bad["doc_id"].n_unique()
            allowed = "δ ≡ 0, X ≡ Y" if tolerance == 0 else f"δ, f ≤ {tolerance:g}"
            raise ControlCheckError(
                f"{path}: full-retention control failed for document {row['doc_id']!r} "
                f"(replicate {row['replicate']}, step {row['t']}: X={row['x_token']}, "
                f"Y={row['y_token']}, δ={row['tv_rollout']:.3g}, f={row['tv_fixed']:.3g}); "
                f"{bad.height} step(s) in {n_docs} document(s) deviate from {allowed}"
            )


def check_swrb_control(paths: Iterable[str | os.PathLike]) -> None:
    """The same check for SWRB record files of the full-retention control (``rollout.coupling:
    swrb``): its trunk's overlap defects e_s = TV(P, Q) must be 0 at every step, up to the
    tolerance of the file's device and dtype (:func:`control_tolerance`); else one line naming
    the file and the first offending document, replicate and step."""
    for path in paths:
        tolerance = control_tolerance(read_swrb_metadata(path))
        arrays = record_arrays(read_swrb_records(path))
        e = arrays["e"]
        if e.size == 0:
            continue
        bad = ~np.isfinite(e) | (e > tolerance)
        if bad.any():
            row, step = np.argwhere(bad)[0]
            n_docs = len(set(arrays["doc_id"][bad.any(1)].tolist()))
            allowed = "e ≡ 0" if tolerance == 0 else f"e ≤ {tolerance:g}"
            raise ControlCheckError(
                f"{path}: full-retention control failed for document "
                f"{arrays['doc_id'][row]!r} (replicate {arrays['replicate'][row]}, step "
                f"{step + 1}: e={e[row, step]:.3g}, max e={np.nanmax(e):.3g}); {int(bad.sum())} "
                f"step(s) in {n_docs} document(s) deviate from {allowed}"
            )
