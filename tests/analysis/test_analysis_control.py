"""The full-retention control check: δ ≡ 0 and X ≡ Y, else a loud error naming the
document."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvdiverge.analysis.control import (
    ControlCheckError,
    check_full_retention_control,
    control_tolerance,
    control_violations,
)
from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)

LAMBDAS = {"full": 0.0, "strong": 0.6}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("control")
    pairs = {"ruler-a": stratum_pairs(5, LAMBDAS)}
    files = write_synthetic_study(
        root, "study1", "m", pairs, {"dev": (2, 4), "study1": (3, 4)}, H=16, seed=3, control="full"
    )
    return files


def _tamper(path, out, **change):
    frame = read_trajectories(path)
    row = (pl.col("doc_id") == frame["doc_id"][3]) & (pl.col("replicate") == 1) & (pl.col("t") == 5)
    frame = frame.with_columns(
        [pl.when(row).then(pl.lit(v)).otherwise(pl.col(k)).alias(k) for k, v in change.items()]
    )
    write_trajectories(frame, out, read_trajectory_metadata(path))
    return frame["doc_id"][3]


def test_clean_control_passes(study):
    paths = list(study["full"].values())
    check_full_retention_control(paths)
    assert control_violations(read_trajectories(paths[0])).height == 0


@pytest.mark.parametrize(
    "change",
    [
        {"tv_rollout": 1e-3},
        {"tv_fixed": 0.25},
        {"y_token": 999, "mismatch": True},
        {"y_token": 999},
    ],
)
def test_tampered_control_fails_naming_document(study, tmp_path, change):
    path = list(study["full"].values())[0]
    bad = tmp_path / "full.parquet"
    doc = _tamper(path, bad, **change)
    # Y ≠ X with I_t = 0 breaks the file contract itself: caught when the file is read
    with pytest.raises((ControlCheckError, TrajectoryFormatError)) as info:
        check_full_retention_control([bad])
    msg = str(info.value)
    assert str(bad) in msg and repr(doc) in msg and "step 5" in msg and "replicate 1" in msg
    assert "\n" not in msg


def test_document_stats_runs_the_control_check(study, tmp_path):
    path = list(study["full"].values())[0]
    bad = tmp_path / "full.parquet"
    _tamper(path, bad, tv_rollout=0.5)
    files = {"full": [bad], "strong": list(study["strong"].values())}
    with pytest.raises(ControlCheckError, match="full-retention control failed"):
        document_stats(files, list(study["documents"].values()), control="full")
    ok = {"full": list(study["full"].values()), "strong": files["strong"]}
    stats, _ = document_stats(ok, list(study["documents"].values()), control="full")
    assert set(stats["action"]) == {"full", "strong"}


def test_tolerance_by_device_and_dtype(study, tmp_path):
    assert control_tolerance({"device": "cpu", "dtype": "float32"}) == 1e-4
    assert control_tolerance({"device": "cuda:0", "dtype": "bfloat16"}) == 2e-2
    assert control_tolerance({"device": "mps", "dtype": "float32"}) == 0.0  # unknown: exact
    path = list(study["full"].values())[0]
    float32 = read_trajectory_metadata(path) | {"dtype": "float32"}

    def rewrite(source, out, **meta):
        write_trajectories(read_trajectories(source), out, float32 | meta)
        return out

    tampered = tmp_path / "tampered.parquet"
    _tamper(path, tampered, tv_rollout=1e-6, tv_fixed=1e-6)  # rounding of a threaded GEMM
    check_full_retention_control([rewrite(tampered, tmp_path / "cpu32.parquet")])
    strict = rewrite(tampered, tmp_path / "mps.parquet", device="mps")
    with pytest.raises(ControlCheckError, match="deviate from δ ≡ 0, X ≡ Y"):
        check_full_retention_control([strict])
    # a split by chance (δ > 0 at that step) is allowed; f must stay within the tolerance
    _tamper(path, tampered, tv_rollout=1e-6, y_token=999, mismatch=True)
    check_full_retention_control([rewrite(tampered, tmp_path / "chance.parquet")])
    for change in ({"tv_fixed": 1e-3}, {"y_token": 999, "mismatch": True}):
        _tamper(path, tampered, **change)  # f too large; a split at δ = 0
        with pytest.raises(ControlCheckError, match="deviate from δ, f ≤ 0.0001"):
            check_full_retention_control([rewrite(tampered, tmp_path / "bad.parquet")])
    _tamper(path, tampered, y_token=999)  # flags contradict the tokens: the file's contract
    with pytest.raises(TrajectoryFormatError, match="mismatch = False contradicts"):
        check_full_retention_control([rewrite(tampered, tmp_path / "bad.parquet")])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["gathered", "masked"])
def test_a_broken_gather_fails_the_pipelines_control_check(tmp_path, monkeypatch, layout):
    """The control runs through the gather (or, in the masked layout, its mask over the full
    prompt) and the shared-prefix attention like any action, so a defect there (values scaled
    by one half; a kept entry dropped from the mask) makes the pipeline's control check fail."""
    import torch

    import kvdiverge.engine.document as decode
    from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

    root = Path(__file__).resolve().parents[2]
    documents = root / "tests" / "data" / "documents" / "ruler-1024.parquet"
    model = {"name": "tiny-llama", "path": str(root / "data" / "models" / "tiny-llama")}
    actions = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}
    cohorts = {name: {"dev": 2} for name in actions}
    settings = RolloutSettings(8, 1, prompt_attention=layout)

    def job(folder):
        out = {name: tmp_path / folder / f"{name}.parquet" for name in actions}
        run_stratum_rollout_job(documents, out, model, actions, cohorts, settings)
        return {name: [path] for name, path in out.items()}

    document_stats(job("sound"), [documents], control="full")  # passes
    gather, mask = decode.gather_prefix, decode.kept_mask

    def broken(prefill, kept):
        return [(keys, 0.5 * values) for keys, values in gather(prefill, kept)]

    def broken_mask(prefill, kept):
        masks = mask(prefill, kept) or [
            torch.ones(k.shape[:2], dtype=torch.bool) for k in prefill.keys
        ]
        return [m.index_fill(1, torch.tensor([0]), False) for m in masks]

    monkeypatch.setattr(decode, "gather_prefix", broken)
    monkeypatch.setattr(decode, "kept_mask", broken_mask)
    with pytest.raises(ControlCheckError) as info:
        document_stats(job("broken"), [documents], control="full")
    assert "full-retention control failed" in str(info.value) and "\n" not in str(info.value)
