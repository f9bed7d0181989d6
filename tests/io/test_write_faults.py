"""Faults while writing (kvdiverge.io): a write killed by SIGKILL leaves only a temporary that the
next job removes, a write is durable (file and folder synced around the rename), and a job
killed part-way resumes from its scratch area with identical outputs, never from a scratch area
of other settings."""

from __future__ import annotations

import os
import signal

import polars as pl
from refusal_helpers import run_python

from kvdiverge.io import JobScratch, atomic_path, clean_stale_temporaries


def test_sigkill_inside_an_atomic_write_leaves_a_temporary_that_the_next_job_removes(tmp_path):
    target = tmp_path / "out" / "table.csv"
    killed = run_python(
        """
        import os, signal, sys
        from kvdiverge.io import atomic_path
        with atomic_path(sys.argv[1]) as tmp:
            tmp.write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        str(target),
    )
    assert killed.returncode == -signal.SIGKILL
    left = list(target.parent.iterdir())
    assert not target.exists() and len(left) == 1 and left[0].name.startswith(".table.csv.")
    unrelated = target.parent / ".table.csv.notes"  # not a temporary's name: kept
    unrelated.write_text("x")
    assert clean_stale_temporaries([target]) == left
    assert sorted(p.name for p in target.parent.iterdir()) == [".table.csv.notes"]


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", "")), replace(a, b)))
    target = tmp_path / "out.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("data")
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(".out.txt.") and events[2][1] == tmp_path.name


JOB = """
import os, signal, sys
import polars as pl
from kvdiverge.io import JobScratch, atomic_path

out, kill_at = sys.argv[1], int(sys.argv[2])
docs = [f"ruler-1/dev/{i:03d}" for i in range(5)]
scratch = JobScratch({"a": out + ".a", "b": out + ".b"}, key={"H": 8, "seed": 1})
ran = []
for i, doc in enumerate(docs):
    if scratch.done(doc):
        continue
    if i == kill_at:  # killed in the middle of this document's save
        with atomic_path(scratch.root / "partial.parquet") as tmp:
            tmp.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
    frames = {a: pl.DataFrame({"doc_id": [doc] * 3, "x": [i * 10 + j for j in range(3)]})
              for a in ("a", "b")}
    scratch.save(doc, frames, info={"seconds": i})
    ran.append(doc)
saved = scratch.load_all()
for a in ("a", "b"):
    pl.concat([saved[d][0][a] for d in docs]).write_parquet(out + "." + a)
scratch.clear()
print(",".join(ran))
"""


def test_a_killed_job_resumes_from_its_scratch_area_with_identical_outputs(tmp_path):
    whole = run_python(JOB, str(tmp_path / "whole"), "-1")
    assert whole.returncode == 0, whole.stderr
    killed = run_python(JOB, str(tmp_path / "killed"), "3")
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed.a").exists()
    scratch = JobScratch(
        {"a": tmp_path / "killed.a", "b": tmp_path / "killed.b"}, {"H": 8, "seed": 1}
    )
    assert scratch.doc_ids() == [f"ruler-1/dev/{i:03d}" for i in range(3)]
    resumed = run_python(JOB, str(tmp_path / "killed"), "-1")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split() == ["ruler-1/dev/003,ruler-1/dev/004"]  # only the rest ran
    for a in ("a", "b"):
        assert (tmp_path / f"killed.{a}").read_bytes() == (tmp_path / f"whole.{a}").read_bytes()
    assert not scratch.root.exists()  # cleared once the outputs are written


def test_a_scratch_area_of_other_settings_is_never_resumed(tmp_path):
    outs = {"a": tmp_path / "t.parquet"}
    first = JobScratch(outs, key={"H": 8})
    first.save("d/1", {"a": pl.DataFrame({"x": [1]})})
    assert JobScratch(outs, key={"H": 8}).done("d/1")
    assert not JobScratch(outs, key={"H": 16}).done("d/1")  # changed settings: cleared
    assert JobScratch({"a": tmp_path / "u.parquet"}, key={"H": 16}).root != first.root
