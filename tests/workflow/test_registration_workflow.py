"""The registration binds the rollouts, end to end on the tiny workflow's fixture stratum
(docs/prespecification.md, "Fixed by the lock" and "Registrations"): a changed seed offset in
the engine's own code, forced evaluation rollouts without a new registration, an erased
history and a hand-edited lock each stop in one line before any evaluation compute, and the
advice each line gives works."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml
from workflow_helpers import (
    fixture_stratum_config,
    package_env,
    place_fixture_documents,
    run_snakemake,
    workflow_copy,
)

from kvdiverge.io.locks import read_history, read_lock

SMALL = fixture_stratum_config(
    H=8,
    max_K=2,
    studies={
        "study1": {"actions": ["snapkv-half", "recent-half", "full"], "K": 2, "K_dev": 2},
        "study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2, "K_control": 1},
    },
)
STUDY = "study2"
MODEL = "tiny-qwen"
RULES = [
    "build_demo_model",
    "dev_rollout_study2",
    "plan_sample_sizes",
    "prespecify",
    "rollout_study2",
]


def _paths(work: Path) -> dict[str, Path]:
    return {
        action: work / f"results/{STUDY}/{MODEL}/trajectories/{action}/ruler-1024.parquet"
        for action in SMALL["studies"][STUDY]["actions"]
    }


def _run(work: Path, override: Path, *args: str, lock: bool = False) -> subprocess.CompletedProcess:
    """Snakemake for the study's evaluation files (and its lock with ``lock``, as the default
    target ``all`` asks for it)."""
    targets = [str(p.relative_to(work)) for p in _paths(work).values()]
    targets += [f"results/{STUDY}/lock.json"] if lock else []
    return run_snakemake(
        work,
        *targets,
        "--allowed-rules",
        *RULES,
        *args,
        "--configfile",
        str(override),
        env=package_env(work),
        timeout=900,
    )


def _error_line(res: subprocess.CompletedProcess) -> str:
    """The one line a failed job's script raised (``PrespecificationError: ...``)."""
    text = res.stdout + res.stderr
    lines = [x for x in text.splitlines() if "PrespecificationError: " in x]
    assert lines, text[-3000:]
    return lines[0].split("PrespecificationError: ", 1)[1]


@pytest.mark.slow
def test_the_registration_binds_the_rollouts_end_to_end(tmp_path):
    work = workflow_copy(tmp_path, package=True)
    place_fixture_documents(work)
    override = tmp_path / "small.yaml"
    override.write_text(yaml.safe_dump(SMALL))
    lock_path = work / f"results/{STUDY}/lock.json"
    history = lock_path.with_name("lock_history.jsonl")

    res = _run(work, override)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lock = read_lock(lock_path)
    side = lock["rollout"]
    assert set(side["models"]) == {"tiny-llama", "tiny-qwen"}
    entry = side["models"][MODEL]
    assert entry["device"] == "cpu" and entry["dtype"] == "float32"
    assert len(entry["weights"]) == 64 and len(entry["tokenizer"]) == 64
    assert set(entry["libraries"]) == {"torch", "transformers", "kvpress"} and entry["kernel"]
    assert side["settings"]["H"] == 8 and side["code"] and lock["chain"]["number"] == 1
    print(json.dumps(side, indent=2))  # the closing note's rollout side
    before = {a: p.read_bytes() for a, p in _paths(work).items()}

    # 1. forced evaluation rollouts with the rollout side unchanged: the same files, bit for bit
    res = _run(work, override, "--forcerun", "rollout_study2")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    from kvdiverge.io.trajectories import read_trajectories

    for action, path in _paths(work).items():
        assert read_trajectories(path).equals(read_trajectories_bytes(before[action], tmp_path))
    before = {a: p.read_bytes() for a, p in _paths(work).items()}  # their timing differs

    # 2. a changed seed offset in the engine's own code, the evaluation rollouts forced without
    # a new registration (rerun triggers by time only: prespecify does not run): refused
    settings = work / "pkg" / "kvdiverge" / "engine" / "settings.py"
    source = settings.read_text()
    assert source.count("crn_uniforms(seed, ") == 1
    settings.write_text(source.replace("crn_uniforms(seed, ", "crn_uniforms(seed + 1, "))
    res = _run(work, override, "--forcerun", "rollout_study2", "--rerun-triggers", "mtime")
    assert res.returncode != 0
    line = _error_line(res)
    assert line.startswith(
        f"results/{STUDY}/lock.json: this evaluation rollout of {MODEL} would run rollout.code = "
    ), line
    assert "but the lock registered" in line and "register anew: delete" in line
    # refused before the model loaded: no rollout ran, no file was written (Snakemake removed
    # the old outputs of the job it was made to run)
    log = (work / f"results/logs/rollout/{STUDY}/{MODEL}/ruler-1024.log").read_text()
    assert "attention kernel for" not in log and "documents (" not in log
    assert not any(p.exists() for p in _paths(work).values())

    # ... and with the default rerun triggers it is a new registration, with its reason
    res = _run(work, override)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    entries = read_history(history)
    assert [e["number"] for e in entries] == [1, 2]
    assert entries[1]["reason"].startswith("rollout.code changed")
    relocked = read_lock(lock_path)
    assert relocked["chain"] == {"number": 2, "previous": lock["hash"]}
    assert relocked["hash"] != lock["hash"]

    # 3. a hand-edited lock: refused by the evaluation rollout; the advice given works
    edited = json.loads(lock_path.read_text())
    edited["design"]["K"] = 1
    lock_path.write_text(json.dumps(edited))
    res = _run(work, override, "--forcerun", "rollout_study2")
    line = _error_line(res)
    assert res.returncode != 0 and "(edited by hand?)" in line
    assert f"delete results/{STUDY}/lock.json and rerun the workflow" in line
    lock_path.unlink()  # the advice
    res = _run(work, override)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert read_lock(lock_path)["hash"] == relocked["hash"]  # the registered lock, again
    assert len(read_history(history)) == 2  # nothing new was registered

    # 4. an erased history beside the evaluation trajectories: the re-lock stops
    history.unlink()
    lock_path.unlink()
    res = _run(work, override, lock=True)
    assert res.returncode != 0
    line = _error_line(res)
    assert line.startswith(
        f"results/{STUDY}/lock_history.jsonl: no registration history, but evaluation "
        "trajectories of the study exist"
    ), line
    assert not history.exists() or read_history(history) == []


def read_trajectories_bytes(data: bytes, tmp_path: Path):
    """A trajectory file's table from its bytes (kept before a rerun replaced the file)."""
    from kvdiverge.io.trajectories import read_trajectories

    path = tmp_path / "before.parquet"
    path.write_bytes(data)
    return read_trajectories(path)
