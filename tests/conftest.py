"""Suite-wide settings.

The README's test command runs two pytest-xdist workers on a 2-core machine. Each worker keeps
one torch thread, and the processes it starts (Snakemake runs, training jobs) inherit
``OMP_NUM_THREADS=1``, so that the two workers do not oversubscribe the cores. Tests that compare
results across thread counts set their own counts explicitly.
"""

import json
import os
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (``pytestmark = pytest.mark.usefixtures(...)``), the
    count restored after it: the results such modules compare are the one-thread engine's (the
    full control bit-exact, the native prompt kernel), also when run without xdist."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shared_base(tmp_path_factory) -> Path:
    """The folder that the pytest-xdist workers of one session share (their base folders'
    parent); without xdist the session's own base folder, so that a later session never
    reuses what an earlier one built there."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> tuple[Path, dict]:
    """SmolLM2 materialized once per test session from the embedded default's source
    (``config.yaml``: the package's wheel, checksums verified, converted by transformers), and
    its provenance record. Workers share it under a lock: the first builds it, the others wait
    and reuse it."""
    from kvdiverge.models.sources import materialize_model

    shared = shared_base(tmp_path_factory)
    folder = shared / "smollm2"
    with FileLock(str(shared / "smollm2.lock")):
        if not (folder / "provenance.json").exists():
            source = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]["smollm2"]
            materialize_model(source["source"], folder, where="config.models.smollm2.source")
        return folder, json.loads((folder / "provenance.json").read_text())
