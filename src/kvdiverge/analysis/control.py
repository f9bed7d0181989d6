"""The full-retention control (SPEC §5): it must give δ ≡ 0 and X ≡ Y, a correctness check.

Keeping every prompt entry leaves the kernel unchanged, so under the stepwise maximal coupling
the intervention replays the reference exactly: δ_t = f_t = 0 and X_t = Y_t at every step. Any
deviation means the engine, the cache gather or the coupling is wrong, and no estimand computed
from that run can be trusted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import polars as pl

from kvdiverge.trajectories import read_trajectories

__all__ = ["ControlCheckError", "check_full_retention_control", "control_violations"]


class ControlCheckError(RuntimeError):
    """The full-retention control shows δ ≠ 0, f ≠ 0 or X ≠ Y."""


def control_violations(trajectories: pl.LazyFrame | pl.DataFrame) -> pl.DataFrame:
    """Rows of a control trajectory table where δ_t ≠ 0, f_t ≠ 0, I_t = 1 or X_t ≠ Y_t."""
    frame = trajectories.lazy() if isinstance(trajectories, pl.DataFrame) else trajectories
    bad = (
        (pl.col("tv_rollout") != 0)
        | (pl.col("tv_fixed") != 0)
        | pl.col("mismatch")
        | (pl.col("x_token") != pl.col("y_token"))
    )
    return (
        frame.filter(bad)
        .select("doc_id", "replicate", "t", "x_token", "y_token", "tv_rollout", "tv_fixed")
        .sort("doc_id", "replicate", "t")
        .collect()
    )


def check_full_retention_control(paths: Iterable[str | os.PathLike]) -> None:
    """Fail loudly, naming the file and the first offending document, replicate and step, if a
    full-retention control trajectory file shows δ ≠ 0 or X ≠ Y anywhere (SPEC §5)."""
    for path in paths:
        bad = control_violations(read_trajectories(path, lazy=True))
        if bad.height:
            row = bad.row(0, named=True)
            n_docs = bad["doc_id"].n_unique()
            raise ControlCheckError(
                f"{path}: full-retention control failed for document {row['doc_id']!r} "
                f"(replicate {row['replicate']}, step {row['t']}: X={row['x_token']}, "
                f"Y={row['y_token']}, δ={row['tv_rollout']:.3g}, f={row['tv_fixed']:.3g}); "
                f"{bad.height} step(s) in {n_docs} document(s) deviate from δ ≡ 0, X ≡ Y"
            )
