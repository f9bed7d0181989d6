"""Bad trajectory files, caught when read (kvdiverge.io.trajectories), eagerly and lazily, and so
before any estimand: each case one line naming the file, the document, replicate and step."""

from __future__ import annotations

import polars as pl
import pytest
from refusal_helpers import one_line

from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    write_trajectories,
)

# ---- trajectory files: caught when read ----------------------------------------------------------
H = 6


def _trajectories(docs=("ruler-1/dev/000", "ruler-1/study1/000"), k=None) -> pl.DataFrame:
    k = k or {"dev": 2, "study1": 3}
    rows = []
    for doc in docs:
        for rep in range(k[doc.split("/")[1]]):
            for t in range(1, H + 1):
                y = 7 if t >= 4 else 1
                rows.append(
                    {
                        "doc_id": doc,
                        "replicate": rep,
                        "t": t,
                        "x_token": 1,
                        "y_token": y,
                        "mismatch": y != 1,
                        "tv_rollout": 0.1 * t,
                        "tv_fixed": 0.05 * t,
                        "x_eos": t >= 5,
                        "y_eos": False,
                        "n_prompt": 100,
                        "n_kept": 50,
                    }
                )
    return pl.DataFrame(rows)


META = {
    "model": "m",
    "revision": None,
    "action": {"name": "snapkv-half"},
    "H": H,
    "K": {"dev": 2, "study1": 3},
    "seed": 1,
    "coupling": "shared-reference",
    "dtype": "float32",
    "device": "cpu",
    "n_documents": 2,
}


AT = "doc_id 'ruler-1/study1/000' replicate 1 step 3"


def _at_step(frame: pl.DataFrame, **change) -> pl.DataFrame:
    row = (
        (pl.col("doc_id") == "ruler-1/study1/000") & (pl.col("replicate") == 1) & (pl.col("t") == 3)
    )
    return frame.with_columns(
        [
            pl.when(row).then(pl.lit(v, dtype=frame[c].dtype)).otherwise(pl.col(c)).alias(c)
            for c, v in change.items()
        ]
    )


TRAJECTORY_CASES = {
    "NaN δ": (
        lambda f: _at_step(f, tv_rollout=float("nan")),
        {},
        f"{AT}: tv_rollout (δ) = nan, expected a finite value in [0, 1]",
    ),
    "δ above 1": (
        lambda f: _at_step(f, tv_rollout=1.5),
        {},
        f"{AT}: tv_rollout (δ) = 1.5, expected a finite value in [0, 1]",
    ),
    "negative f": (
        lambda f: _at_step(f, tv_fixed=-0.25),
        {},
        f"{AT}: tv_fixed (f) = -0.25, expected a finite value in [0, 1]",
    ),
    "infinite f": (
        lambda f: _at_step(f, tv_fixed=float("inf")),
        {},
        f"{AT}: tv_fixed (f) = inf, expected a finite value in [0, 1]",
    ),
    "mismatch flag contradicting the tokens": (
        lambda f: _at_step(f, mismatch=True),
        {},
        f"{AT}: mismatch = True contradicts x_token = 1, y_token = 1",
    ),
    "EOS flag cleared after EOS": (
        lambda f: f.with_columns(
            x_eos=pl.when((pl.col("replicate") == 1) & (pl.col("t") == 6))
            .then(False)
            .otherwise(pl.col("x_eos"))
        ),
        {},
        "doc_id 'ruler-1/dev/000' replicate 1 step 6: x_eos is false after EOS at step 5 "
        "(EOS flags stay true once set)",
    ),
    "cache larger than the prompt": (
        lambda f: _at_step(f, n_kept=101),
        {},
        f"{AT}: n_kept = 101, expected 1..n_prompt = 100",
    ),
    "missing step": (
        lambda f: f.filter(~((pl.col("doc_id") == "ruler-1/dev/000") & (pl.col("t") == 2))),
        {},
        "doc_id 'ruler-1/dev/000' replicate 0: 5 rows with steps 1..6, expected exactly one "
        "row for each t = 1..6",
    ),
    "repeated step": (
        lambda f: pl.concat([f, f.head(1)]),
        {},
        "doc_id 'ruler-1/dev/000' replicate 0: 7 rows with steps 1..6, expected exactly one "
        "row for each t = 1..6",
    ),
    "fewer replicates than the cohort's K": (
        lambda f: f.filter(
            ~((pl.col("doc_id") == "ruler-1/study1/000") & (pl.col("replicate") == 2))
        ),
        {},
        "doc_id 'ruler-1/study1/000': 2 replicates, expected 3 (metadata K[study1] = 3)",
    ),
    "replicates not numbered from 0": (
        lambda f: f.with_columns(replicate=pl.col("replicate") + 1),
        {},
        "doc_id 'ruler-1/dev/000': replicates 1..2 in 2 paths, expected replicates 0..1",
    ),
    "more documents than the metadata": (
        lambda f: f,
        {"n_documents": 1},
        "2 documents, but the metadata says n_documents = 1",
    ),
    "steps beyond the metadata's H": (
        lambda f: f,
        {"H": 5},
        "doc_id 'ruler-1/dev/000' replicate 0: 6 rows with steps 1..6, expected exactly one row "
        "for each t = 1..5",
    ),
    "null token": (
        lambda f: _at_step(f, y_token=None),
        {},
        "column 'y_token' has 1 null value(s)",
    ),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("case", list(TRAJECTORY_CASES))
def test_trajectory_case_caught_when_read(case, lazy, tmp_path):
    change, meta, expected = TRAJECTORY_CASES[case]
    path = tmp_path / "snapkv-half.parquet"
    write_trajectories(_trajectories(), path, META)
    read_trajectories(path, lazy=lazy)  # the intact file passes
    write_trajectories(change(_trajectories()), path, {**META, **meta})
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path, lazy=lazy)
    assert one_line(info) == f"{path}: {expected}"


def test_unreadable_trajectory_file(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"")  # what a killed writer without atomic writes would leave
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path)
    assert one_line(info).startswith(f"{path}: not a readable trajectory file (")
