"""Run the real Snakemake workflow in a temporary copy of the repository (shared by tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


def workflow_copy(tmp_path: Path, package: bool = False) -> Path:
    """A working copy of the workflow under ``tmp_path/wf``: Snakefile, config.yaml, configs/,
    workflow/, envs/, profiles/ and the tracked data (fixtures, committed demo models).

    With ``package=True`` the ``kvdiverge`` package is copied to ``wf/pkg`` too; run snakemake
    with :func:`package_env` so that the copy is imported (and fingerprinted) instead of the
    installed one, and a test can edit a module without touching the repository.
    """
    work = tmp_path / "wf"
    work.mkdir()
    for name in ("Snakefile", "config.yaml"):
        shutil.copy(ROOT / name, work / name)
    for folder in ("workflow", "envs", "configs", "profiles", "data/fixtures", "data/models"):
        if (ROOT / folder).is_dir():
            shutil.copytree(
                ROOT / folder,
                work / folder,
                ignore=shutil.ignore_patterns("__pycache__", ".*.tmp", ".*.parquet"),
            )
    if package:
        shutil.copytree(
            ROOT / "src" / "kvdiverge",
            work / "pkg" / "kvdiverge",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return work


def package_env(work: Path) -> dict[str, str]:
    """Environment importing ``kvdiverge`` from the copy of ``workflow_copy(package=True)``."""
    path = [str(work / "pkg"), os.environ.get("PYTHONPATH", "")]
    return {"PYTHONPATH": os.pathsep.join(p for p in path if p)}


def run_snakemake(
    work: Path, *args: str, env: dict[str, str] | None = None, timeout: int = 900
) -> subprocess.CompletedProcess:
    """Run snakemake in ``work`` with 2 cores and no workflow profile.

    Targets must come before ``--configfile``/``--config`` (they take several values).
    """
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [SNAKEMAKE, "--cores", "2", "--workflow-profile", "none", *args],
        cwd=work,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
    )


def planned_jobs(result: subprocess.CompletedProcess) -> dict[str, int]:
    """Job counts per rule from the 'Job stats' table of a (dry) run; {} when nothing to do."""
    text = result.stdout + result.stderr
    if "Job stats:" not in text:
        return {}
    lines = text.split("Job stats:", 1)[1].splitlines()
    counts: dict[str, int] = {}
    for line in lines[3:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        if parts[0] != "total":
            counts[parts[0]] = int(parts[1])
    return counts
