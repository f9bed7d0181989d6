"""Run the real Snakemake workflow in a temporary copy of the repository (shared by tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")


TINY_CONFIG = ROOT / "configs" / "tiny.yaml"


def workflow_copy(
    tmp_path: Path, package: bool = False, config: str = "tiny", smollm2: Path | None = None
) -> Path:
    """A working copy of the workflow under ``tmp_path/wf``: Snakefile, config.yaml, configs/,
    workflow/, envs/, profiles/ and the tracked data (fixtures, committed demo models).

    ``config="tiny"`` (the tests' fixture) makes ``configs/tiny.yaml`` — the two trained tiny
    demo models — the copy's ``config.yaml``; ``config="default"`` keeps the embedded default
    (SmolLM2, materialized by the workflow). ``smollm2``, a folder materialized from the
    default's source (the session fixture ``smollm2_folder``), is copied to
    ``data/models/smollm2`` with fresh modification times, so that the workflow takes it as
    built after its script and does not convert the model again.

    With ``package=True`` the ``kvdiverge`` package is copied to ``wf/pkg`` too; run snakemake
    with :func:`package_env` so that the copy is imported (and fingerprinted) instead of the
    installed one, and a test can edit a module without touching the repository.
    """
    if config not in ("tiny", "default"):
        raise ValueError(f"config: expected 'tiny' or 'default', got {config!r}")
    work = tmp_path / "wf"
    work.mkdir()
    shutil.copy(ROOT / "Snakefile", work / "Snakefile")
    shutil.copy(TINY_CONFIG if config == "tiny" else ROOT / "config.yaml", work / "config.yaml")
    ignore = shutil.ignore_patterns("__pycache__", ".*.tmp", ".*.parquet")
    for folder in ("workflow", "envs", "configs", "profiles", "data/fixtures"):
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, work / folder, ignore=ignore)
    for model in sorted((ROOT / "data" / "models").glob("tiny-*")):
        shutil.copytree(model, work / "data" / "models" / model.name, ignore=ignore)
    if smollm2 is not None:
        target = work / "data" / "models" / "smollm2"
        shutil.copytree(smollm2, target, copy_function=shutil.copyfile)  # mtimes: now
        os.utime(target)
    if package:
        shutil.copytree(
            ROOT / "src" / "kvdiverge",
            work / "pkg" / "kvdiverge",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    return work


FIXTURE_DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
"""The fixture stratum's documents (tiny-llama's chat-wrapped lengths fit every tiny config)."""


def place_fixture_documents(work: Path) -> Path:
    """The fixture stratum's documents placed where rule materialize_documents writes them
    (``results/documents/ruler-1024.parquet`` of the copy ``work``), so that a run starts at the
    rollouts; the placed file's path."""
    target = work / "results" / "documents" / "ruler-1024.parquet"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(FIXTURE_DOCUMENTS, target)
    return target


def write_stand_in_model(folder: Path, positions: int = 131072) -> Path:
    """A folder that passes the parse-time model checks (kvdiverge.engine.preflight) without weights
    worth loading: config.json with a context window of ``positions``, an empty but whole
    safetensors file, a tokenizer config with a chat template. For dry runs only."""
    import json
    import struct

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": positions}))
    header = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ x }}"}))
    return folder


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


def fixture_stratum_config(H: int, max_K: int, studies: dict, **extra) -> dict:
    """A config override for the tiny workflow on the fixture's stratum alone (ruler-1024 of
    tests/data/documents; each study's plan reads every stratum's development files): horizon
    ``H``, study 1's contrast and prediction pair recent-half against SnapKV-half, the plan
    bounded at ``max_K``, the given ``studies``, and any further top-level keys."""
    return {
        **extra,
        "rollout": {"H": H},
        "datasets": {
            "strata": [{"env": "ruler", "label": "1024", "target_tokens": 1024}],
            "cohorts": {"dev": 2, "study1": 3, "study2": 2},
        },
        "analysis": {
            "contrasts": {"study1": [["recent-half", "snapkv-half"]], "study2": []},
            "prediction": {"pairs": {"study1": ["recent-half", "snapkv-half"]}},
            "planning": {"max_K": max_K},
        },
        "studies": studies,
    }
