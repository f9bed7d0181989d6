"""A rollout job killed part-way (a real SIGKILL) resumes from its finished documents and
writes the same files as an uninterrupted run (kvdiverge.engine.rollout_job,
kvdiverge.io.JobScratch);
the same for an SWRB job (kvdiverge.engine.swrb_job)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
from kvdiverge.engine.swrb_job import run_swrb_job
from kvdiverge.io.swrb_records import read_swrb_metadata, read_swrb_records
from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
MODEL = {"name": "tiny-llama", "path": str(ROOT / "data" / "models" / "tiny-llama")}
ACTIONS = {
    "recent-half": {"selector": "recent", "budget": 0.5},
    "full": {"selector": "full"},
}
COHORTS = {"recent-half": {"dev": 2, "study1": 3}, "full": {"dev": 2, "study1": 2}}
SETTINGS = {"H": 12, "seed": 5}

# A killed job: the same call, made to pause for good after its first finished document (so
# that the kill lands between documents, deterministically).
PAUSING = """
import json, sys, time
import kvdiverge.io as io
save = io.JobScratch.save
def pausing(self, *args, **kwargs):
    save(self, *args, **kwargs)
    time.sleep(600)
io.JobScratch.save = pausing
spec = json.loads(sys.argv[1])
"""
KILLED = (
    PAUSING
    + """
from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
run_stratum_rollout_job(
    spec["documents"], spec["out"], spec["model"], spec["actions"], spec["cohorts"],
    RolloutSettings(**spec["settings"]), device="cpu", resume_key="test",
)
"""
)
KILLED_SWRB = (
    PAUSING
    + """
from kvdiverge.engine.swrb_job import run_swrb_job
run_swrb_job(
    spec["documents"], spec["out"], spec["model"], spec["actions"], spec["cohorts"],
    H=spec["H"], seed=spec["seed"], device="cpu", resume_key="test",
)
"""
)


def _outputs(folder: Path) -> dict[str, Path]:
    return {name: folder / f"{name}.parquet" for name in ACTIONS}


def _job_spec(out: dict[str, Path], **settings) -> dict:
    """The killed job's arguments, as JSON for its command line."""
    return {
        "documents": str(DOCUMENTS),
        "out": {k: str(v) for k, v in out.items()},
        "model": MODEL,
        "actions": ACTIONS,
        "cohorts": COHORTS,
        **settings,
    }


def _kill_after_first_document(script: str, spec: dict, folder: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", script, json.dumps(spec)])
    deadline = time.monotonic() + 300
    while not list(folder.glob(".*scratch-*/*/done.json")):
        assert job.poll() is None, "the job ended before its first document was kept"
        assert time.monotonic() < deadline, "no document finished in time"
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()


@pytest.mark.slow
def test_a_killed_rollout_job_resumes_with_identical_files(tmp_path, caplog):
    whole = _outputs(tmp_path / "whole")
    run_stratum_rollout_job(
        DOCUMENTS, whole, MODEL, ACTIONS, COHORTS, RolloutSettings(**SETTINGS), device="cpu",
        resume_key="test",
    )  # fmt: skip
    resumed = _outputs(tmp_path / "resumed")
    spec = _job_spec(resumed, settings=SETTINGS)
    folder = tmp_path / "resumed"
    _kill_after_first_document(KILLED, spec, folder)
    assert not any(path.exists() for path in resumed.values())  # no output was written
    kept = list(folder.glob(".*scratch-*/*/done.json"))
    assert len(kept) == 1
    with caplog.at_level("INFO", logger="kvdiverge.engine.rollout_job"):
        run_stratum_rollout_job(
            DOCUMENTS, resumed, MODEL, ACTIONS, COHORTS, RolloutSettings(**SETTINGS),
            device="cpu", resume_key="test",
        )  # fmt: skip
    assert "(1 resumed from" in caplog.text
    for name in ACTIONS:
        assert read_trajectories(resumed[name]).equals(read_trajectories(whole[name])), name
        a, b = read_trajectory_metadata(resumed[name]), read_trajectory_metadata(whole[name])
        assert a.pop("timing").keys() == b.pop("timing").keys()
        assert a == b
    assert not list(folder.glob(".*scratch-*"))  # cleared once the files are written
    # a changed job (another seed) never resumes from another job's documents
    again = _outputs(tmp_path / "again")
    _kill_after_first_document(KILLED, _job_spec(again, settings=SETTINGS), tmp_path / "again")
    caplog.clear()
    with caplog.at_level("INFO", logger="kvdiverge.engine.rollout_job"):
        run_stratum_rollout_job(
            DOCUMENTS, again, MODEL, ACTIONS, COHORTS, RolloutSettings(12, 6), device="cpu",
            resume_key="test",
        )  # fmt: skip
    assert "(0 resumed from" in caplog.text


@pytest.mark.slow
def test_a_killed_swrb_job_resumes_with_identical_files(tmp_path, caplog):
    run = {"H": 8, "seed": 5}
    whole = _outputs(tmp_path / "whole")
    run_swrb_job(DOCUMENTS, whole, MODEL, ACTIONS, COHORTS, device="cpu", resume_key="test", **run)
    resumed = _outputs(tmp_path / "resumed")
    _kill_after_first_document(KILLED_SWRB, _job_spec(resumed, **run), tmp_path / "resumed")
    assert not any(path.exists() for path in resumed.values())  # no output was written
    assert len(list((tmp_path / "resumed").glob(".*scratch-*/*/done.json"))) == 1
    with caplog.at_level("INFO", logger="kvdiverge.engine.rollout_job"):
        run_swrb_job(
            DOCUMENTS, resumed, MODEL, ACTIONS, COHORTS, device="cpu", resume_key="test", **run
        )
    assert "(1 resumed from" in caplog.text
    for name in ACTIONS:
        assert read_swrb_records(resumed[name]).equals(read_swrb_records(whole[name])), name
        assert read_swrb_metadata(resumed[name]) == read_swrb_metadata(whole[name])
    assert not list((tmp_path / "resumed").glob(".*scratch-*"))  # cleared after the files
