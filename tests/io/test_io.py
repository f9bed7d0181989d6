"""Atomic writes: a failed write leaves the previous file untouched and no temporary behind."""

from __future__ import annotations

import pytest

from kvdiverge.io import atomic_path, atomic_write_text


def test_atomic_write_replaces(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    atomic_write_text(target, "one")
    atomic_write_text(target, "two")
    assert target.read_text() == "two"
    assert [p.name for p in target.parent.iterdir()] == ["out.txt"]


def test_failed_write_keeps_previous(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text("precious")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out.csv"]


def test_atomic_write_has_usual_permissions(tmp_path):
    import os

    umask = os.umask(0o022)
    try:
        target = tmp_path / "perm.txt"
        atomic_write_text(target, "x")
        assert (target.stat().st_mode & 0o777) == 0o644
    finally:
        os.umask(umask)


def test_stale_temporaries_are_only_atomic_paths_names(tmp_path):
    from kvdiverge.io import clean_stale_temporaries, temporary_pattern

    target = tmp_path / "a.parquet"
    pattern = temporary_pattern(target)
    assert pattern.fullmatch(".a.parquet.k2j_x9q0.parquet")
    assert pattern.fullmatch(".a.parquet.k2j_x9q0")
    assert not pattern.fullmatch(".a.parquet.scratch-0123456789ab")
    assert not pattern.fullmatch(".b.parquet.k2j_x9q0.parquet")
    (tmp_path / ".a.parquet.k2j_x9q0.parquet").write_text("")
    (tmp_path / ".b.parquet.k2j_x9q0.parquet").write_text("")
    removed = clean_stale_temporaries([target, tmp_path / "missing" / "c.csv"])
    assert [p.name for p in removed] == [".a.parquet.k2j_x9q0.parquet"]
    assert [p.name for p in tmp_path.iterdir()] == [".b.parquet.k2j_x9q0.parquet"]


def test_job_scratch_round_trip(tmp_path):
    import polars as pl

    from kvdiverge.io import JobScratch

    outs = {"full": tmp_path / "full" / "ruler-1k.parquet", "snap": tmp_path / "s" / "r.parquet"}
    scratch = JobScratch(outs, key={"H": 8})
    assert scratch.doc_ids() == [] and not scratch.done("ruler-1k/dev/000")
    frames = {"full": pl.DataFrame({"t": [1, 2]}, schema={"t": pl.Int16}), "snap": pl.DataFrame()}
    scratch.save("ruler-1k/dev/000", frames, info={"seconds": 1.5})
    assert scratch.done("ruler-1k/dev/000") and scratch.doc_ids() == ["ruler-1k/dev/000"]
    loaded, info = JobScratch(dict(reversed(outs.items())), key={"H": 8}).load("ruler-1k/dev/000")
    assert info == {"seconds": 1.5} and loaded["full"].equals(frames["full"])
    assert loaded["full"].schema == frames["full"].schema
    with pytest.raises(KeyError):
        scratch.load("ruler-1k/dev/001")
    (scratch.root / "ruler-1k%2Fdev%2F000" / "done.json").unlink()  # an interrupted save
    assert not JobScratch(outs, key={"H": 8}).done("ruler-1k/dev/000")
    scratch.clear()
    assert not scratch.root.exists()
