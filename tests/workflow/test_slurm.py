"""The cluster path for real (docs/running.md, "Running on a SLURM cluster"): the command the docs
show, run through `profiles/slurm` on a one-node SLURM cluster started on this machine
(tests/slurm_cluster.py: Debian's packages, installed here when missing and possible; skipped,
with the reason, when not).

One run submits the tiny config's documents (every stratum) and the development rollouts of
one stratum; its files must match a local run of the same targets, the rollout jobs must have
run in the `gpu` partition with one GPU, the documents jobs in `cpu`. A second run extends the
default config.yaml with a partial config file, so that a job reading anything but exactly the
run's config would fail or compute something else.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
import yaml
from slurm_cluster import Cluster, slurm_unavailable
from workflow_helpers import ROOT, SNAKEMAKE, workflow_copy

pytestmark = pytest.mark.slow

TINY = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
STRATUM = "ruler-1024"
CONFIG = ("--configfile", "configs/tiny.yaml", "--replace-workflow-config")
# The site options of a cluster without accounting (`sacct` disabled): no account, job states
# from `squeue`; and the first status check after 5 s rather than 40.
NO_ACCOUNTING = ("--slurm-no-account", "--slurm-status-command", "squeue")
QUICK_STATUS = ("--slurm-init-seconds-before-status-checks", "5")
SMALL_FINITE_STATE = {
    "finite_state": {
        "n_systems": 3,
        "horizon": 8,
        "n_states": 3,
        "n_tokens": 4,
        "alt_strength": 0.3,
        "n_reps": 1500,
        "window_depths": [1, 2, 8],
        "interval_figure_systems": [0, 2],
    }
}


def _strata() -> list[str]:
    return [f"{s['env']}-{s['label']}" for s in TINY["datasets"]["strata"]]


def _documents() -> list[str]:
    return [f"results/documents/{stratum}.parquet" for stratum in _strata()]


def _trajectories() -> list[str]:
    """The development trajectory files of STRATUM: every study (one rollout group each in the
    tiny config), every model and action."""
    return [
        f"results/{study}/{model}/dev/trajectories/{action}/{STRATUM}.parquet"
        for study, spec in TINY["studies"].items()
        for model in TINY["models"]
        for action in spec["actions"]
    ]


def _cluster_snakemake(work: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # the node's GPU is a stand-in (/dev/null): its rollout jobs run on the CPU on purpose
    # (without this, device: auto on a job given a GPU refuses the CPU: docs/running.md)
    env["KVDIVERGE_CPU_FALLBACK"] = "1"
    return subprocess.run(
        [SNAKEMAKE, *args], cwd=work, capture_output=True, text=True, env=env, timeout=timeout
    )


# Measured in every run (the job's seconds, which the sample-size plan reads), and the digest of
# the metadata that holds them: a trajectory file differs from another run's only there.
MEASURED = {b"kvdiverge.timing", b"kvdiverge.metadata_sha256"}


def _same_trajectories(a: Path, b: Path) -> None:
    """The same table, schema and metadata, but for the measured seconds (MEASURED)."""
    ta, tb = pq.read_table(a), pq.read_table(b)
    assert pl.from_arrow(ta).equals(pl.from_arrow(tb)), a
    meta_a = {k: v for k, v in ta.schema.metadata.items() if k not in MEASURED}
    meta_b = {k: v for k, v in tb.schema.metadata.items() if k not in MEASURED}
    assert meta_a == meta_b, a
    assert ta.schema.remove_metadata() == tb.schema.remove_metadata(), a


def _jobs_by_rule(cluster: Cluster) -> dict[str, list[dict[str, str]]]:
    """Every job the cluster ran, by Snakemake rule (from the job comment
    `rule_<name>_wildcards_<values>`), with `scontrol show job`'s fields."""
    jobs: dict[str, list[dict[str, str]]] = {}
    for row in cluster.queue():
        match = re.match(r"rule_(.+?)(?:_wildcards_.*)?$", row["Comment"])
        assert match, row
        jobs.setdefault(match.group(1), []).append(cluster.show_job(row["JobId"]))
    return jobs


def test_slurm_profile_runs_documents_and_rollouts_on_a_real_cluster(tmp_path):
    reason = slurm_unavailable(tmp_path / "apt.log")
    if reason is not None:
        pytest.skip(f"no SLURM cluster here: {reason}")
    targets = _documents() + _trajectories()

    (tmp_path / "local").mkdir()
    (tmp_path / "cluster").mkdir()
    local = workflow_copy(tmp_path / "local", config="default")
    work = workflow_copy(tmp_path / "cluster", config="default")
    # the local run of the same targets, on one core while the cluster runs (its jobs mostly wait)
    local_log = tmp_path / "local.log"
    with open(local_log, "w") as out:
        local_run = subprocess.Popen(
            [SNAKEMAKE, *targets, "--cores", "1", "--workflow-profile", "none", *CONFIG],
            cwd=local,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        )
    (tmp_path / "partial.yaml").write_text(yaml.safe_dump(SMALL_FINITE_STATE))
    pids: dict[str, int] = {}
    alive: list[str] = []
    try:
        with Cluster(tmp_path / "slurm") as cluster:
            pids = dict(cluster.pids)
            start = time.monotonic()
            command = ["--workflow-profile", "profiles/slurm", *CONFIG, *NO_ACCOUNTING]
            res = _cluster_snakemake(work, *targets, *command, *QUICK_STATUS)
            seconds = time.monotonic() - start
            text = res.stdout + res.stderr
            assert res.returncode == 0, text[-4000:] + cluster.logs()
            jobs = _jobs_by_rule(cluster)
            rollouts = [job for rule, found in jobs.items() if "rollout" in rule for job in found]
            shown = cluster.show_job_text(rollouts[0]["JobId"]) if rollouts else ""

            # config.yaml extended by a partial file: the job must see both, merged
            extended = [
                "--workflow-profile",
                "profiles/slurm",
                "--configfile",
                str(tmp_path / "partial.yaml"),
                *NO_ACCOUNTING,
                *QUICK_STATUS,
            ]
            start = time.monotonic()
            res = _cluster_snakemake(work, "results/finite_state/systems.csv", *extended)
            print(f"SLURM run of the extended config: {time.monotonic() - start:.0f} s")
            assert res.returncode == 0, (res.stdout + res.stderr)[-4000:] + cluster.logs()
            extended_jobs = _jobs_by_rule(cluster)
    except BaseException:
        local_run.kill()
        raise
    finally:  # the daemons are stopped by their pids on leaving `with`, whatever happened
        for name, pid in pids.items():
            try:
                os.kill(pid, 0)
                alive.append(f"{name} (pid {pid})")
            except ProcessLookupError:
                pass
        try:
            local_run.wait(timeout=900)
        except subprocess.TimeoutExpired:
            local_run.kill()
            local_run.wait()
    assert pids and not alive, alive
    assert local_run.returncode == 0, local_log.read_text()[-3000:]

    print(f"SLURM run: {seconds:.0f} s")
    print(f"scontrol show job of a rollout job:\n{shown}")

    # the files: documents byte for byte, trajectories but for the measured seconds
    for path in _documents():
        assert (work / path).read_bytes() == (local / path).read_bytes(), path
    for path in _trajectories():
        _same_trajectories(work / path, local / path)

    # one job per stratum for the documents, in the cpu partition without a GPU
    documents = jobs.pop("materialize_documents")
    assert len(documents) == len(_strata())
    for job in documents:
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
        assert job["Partition"] == "cpu", job
        assert "gpu" not in job.get("TresPerJob", "") + job.get("TresPerNode", ""), job
    # one development job per study and model, in the gpu partition with one GPU
    assert sorted(jobs) == sorted(f"dev_rollout_{study}" for study in TINY["studies"])
    assert len(rollouts) == len(TINY["studies"]) * len(TINY["models"])
    for job in rollouts:
        assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", job
        assert job["Partition"] == "gpu", job
        assert re.fullmatch(r"gres:gpu(:[^:,]+)?:1", job["TresPerJob"]), job

    # the extended config: the job computed the partial file's 3 systems
    (finite_state,) = extended_jobs["finite_state_systems"]
    assert finite_state["JobState"] == "COMPLETED" and finite_state["Partition"] == "cpu"
    systems = pl.read_csv(work / "results/finite_state/systems.csv")
    assert systems.height == SMALL_FINITE_STATE["finite_state"]["n_systems"]
