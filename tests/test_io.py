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
