"""``rollout.max_batch_rows: auto`` (kvdiverge.engine.device_memory): accepted by the config
checks (not under SWRB), sized by the rollout job to the memory its device has free before the
model loads, recorded in every trajectory file as the configured ``auto`` (what the lock
registers and compares) beside the rows it ran with (``batch_rows``), refused in one line when
one replicate per call does not fit; and the batch plan it picks moves no path: the files equal
those of a job running one document per call (the control too). End to end on the tiny
workflow: the lock registers ``auto`` and the evaluation files pass its check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml

import kvdiverge.engine.device_memory as device_memory
import kvdiverge.models
from kvdiverge.analysis.prespecification import make_lock, prespecified
from kvdiverge.config import ConfigError, check_config
from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
from kvdiverge.engine.memory_plan import CONTEXT_BYTES, USABLE_FRACTION, job_plan_args, plan_job
from kvdiverge.engine.preflight import PreflightError
from kvdiverge.eviction import parse_action
from kvdiverge.io.documents import read_documents_table
from kvdiverge.io.locks import file_view, rollout_view
from kvdiverge.io.trajectories import read_trajectory_metadata
from kvdiverge.models import chat_prompt_ids, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
MODEL = {"name": "tiny-llama", "path": str(ROOT / "data" / "models" / "tiny-llama")}
ACTIONS = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}
COHORTS = {name: {"study1": 2} for name in ACTIONS}  # 3 documents, K = K_control = 2
H = 8
PER_DOCUMENT = (1 + 2 * len(ACTIONS)) * 2  # X, and Y and Z per action, per replicate


def _config(rows) -> dict:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["rollout"]["max_batch_rows"] = rows
    return config


def test_auto_passes_the_config_checks_and_other_values_are_refused():
    config = _config("auto")
    check_config(config, SCHEMA)
    assert config["rollout"]["max_batch_rows"] == "auto"
    with pytest.raises(ConfigError) as info:
        check_config(_config("big"), SCHEMA)
    assert str(info.value) == (
        "config.rollout.max_batch_rows: expected an integer >= 3 or 'auto', got 'big'"
    )
    swrb = _config("auto")
    swrb["rollout"]["coupling"] = "swrb"
    with pytest.raises(ConfigError, match=r"^config.rollout.max_batch_rows: auto, but rollout"):
        check_config(swrb, SCHEMA)


def _lengths() -> list[int]:
    """The job's documents' chat-wrapped prompt lengths under the model's own tokenizer, as the
    job measures them."""
    tokenizer = load_tokenizer(MODEL["path"])
    table = read_documents_table(DOCUMENTS).filter(pl.col("cohort") == "study1")
    return [len(chat_prompt_ids(tokenizer, prompt)) for prompt in table["prompt"]]


def _device_for_two_documents() -> float:
    """Device bytes whose usable part is exactly the plan's peak at two documents a call
    (a CPU plan: the native kernel's packed keys counted)."""
    specs = {name: parse_action(a, name=name) for name, a in ACTIONS.items()}
    args, window = job_plan_args(MODEL, specs, COHORTS, _lengths(), H)
    two = plan_job(*args, 2 * PER_DOCUMENT, window, packed=True)
    assert two.batches == 2 and two.rows == [2 * PER_DOCUMENT, PER_DOCUMENT]
    return (two.peak + CONTEXT_BYTES) / USABLE_FRACTION


def _run(tmp_path: Path, label: str, rows) -> dict[str, Path]:
    out = {name: tmp_path / label / f"{name}.parquet" for name in ACTIONS}
    settings = RolloutSettings(H, 5)
    run_stratum_rollout_job(
        DOCUMENTS, out, MODEL, ACTIONS, COHORTS, settings, device="cpu", max_batch_rows=rows
    )
    return out


def test_an_auto_job_sizes_its_rows_to_the_device_records_both_and_moves_no_path(
    tmp_path, monkeypatch
):
    device = _device_for_two_documents()
    monkeypatch.setattr(device_memory, "available_bytes", lambda d: (device, f"fake {d}"))
    auto = _run(tmp_path, "auto", "auto")
    one = _run(tmp_path, "one", PER_DOCUMENT)  # one document a call
    for name in ACTIONS:
        meta = read_trajectory_metadata(auto[name])
        assert (meta["max_batch_rows"], meta["batch_rows"]) == ("auto", 2 * PER_DOCUMENT)
        alone = read_trajectory_metadata(one[name])
        assert (alone["max_batch_rows"], alone["batch_rows"]) == (PER_DOCUMENT, PER_DOCUMENT)
        a, b = (pl.read_parquet(p[name]).sort("doc_id", "replicate", "t") for p in (auto, one))
        assert a.height == b.height == 3 * 2 * H
        exact = [c for c in a.columns if c not in ("tv_rollout", "tv_fixed")]
        assert a.select(exact).equals(b.select(exact)), name  # every token, flag and length
        for law in ("tv_rollout", "tv_fixed"):  # other rows in the matrix products: rounding
            np.testing.assert_allclose(a[law].to_numpy(), b[law].to_numpy(), atol=1e-5)
    # the lock registers the configured value, which is what the files record
    config = _config("auto")
    check_config(config, SCHEMA)
    specs = {n: parse_action(a, name=n).as_dict() for n, a in config["actions"].items()}
    spec = prespecified(config, "study2", ["ruler-1024"], specs, "c0de")
    plan = {"study": "study2", "K": 2, "K_planned": 2, "K_source": "plan", "notes": []}
    lock = make_lock(spec, {**plan, "plans": []}, models={"tiny-llama": {}})
    field = "rollout.settings.max_batch_rows"
    meta = read_trajectory_metadata(auto["full"])
    assert rollout_view(lock, "tiny-llama")[field] == file_view(meta)[field] == "auto"


def test_auto_that_cannot_hold_one_replicate_stops_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr(device_memory, "available_bytes", lambda d: (1e9, "fake memory"))
    loaded = []
    monkeypatch.setattr(kvdiverge.models, "load_model", lambda *a, **k: loaded.append(a))
    with pytest.raises(PreflightError) as info:
        _run(tmp_path, "small", "auto")
    line = str(info.value)
    assert "\n" not in line and not loaded
    assert line.startswith("rollout.max_batch_rows: auto: job the job needs ")
    assert "(one replicate per call)" in line and "but the device holds 1.0 GB" in line
    assert line.endswith("(fake memory, model tiny-llama)")
    with pytest.raises(PreflightError, match="^max_batch_rows: expected an integer >= 1 or 'auto'"):
        _run(tmp_path, "bad", "big")
    assert not loaded


def test_available_memory_on_a_cpu_is_at_most_its_total():
    free, where = device_memory.available_bytes("cpu")
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        pytest.skip("no /proc/meminfo")
    total = next(
        int(line.split()[1]) for line in meminfo.read_text().splitlines() if "MemTotal" in line
    )
    assert 0 < free <= total * 1024 and where.startswith("CPU ")


@pytest.mark.slow
def test_auto_end_to_end_the_lock_registers_auto_and_the_evaluation_files_pass_it(tmp_path):
    """The tiny workflow on the fixture stratum at ``max_batch_rows: auto``: the development
    rollouts, the plan, the lock (registering ``auto``) and the evaluation rollouts run; every
    evaluation file records ``auto`` and the rows it ran with, and passes the lock's check."""

    from workflow_helpers import (
        fixture_stratum_config,
        package_env,
        place_fixture_documents,
        run_snakemake,
        workflow_copy,
    )

    from kvdiverge.io.locks import check_trajectory, read_lock

    studies = {"study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2, "K_control": 1}}
    small = fixture_stratum_config(H=8, max_K=2, studies=studies)
    small["rollout"]["max_batch_rows"] = "auto"
    work = workflow_copy(tmp_path, package=True)
    place_fixture_documents(work)
    override = tmp_path / "auto.yaml"
    override.write_text(yaml.safe_dump(small))
    files = [
        work / f"results/study2/tiny-qwen/trajectories/{a}/ruler-1024.parquet"
        for a in ("recent-90", "full")
    ]
    rules = ["build_demo_model", "dev_rollout_study2", "plan_sample_sizes", "prespecify"]
    res = run_snakemake(
        work,
        *(str(f.relative_to(work)) for f in files),
        "--allowed-rules",
        *rules,
        "rollout_study2",
        "--configfile",
        str(override),
        env=package_env(work),
        timeout=900,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lock_path = work / "results/study2/lock.json"
    lock = read_lock(lock_path)
    assert lock["rollout"]["settings"]["max_batch_rows"] == "auto"
    for file in files:
        meta = read_trajectory_metadata(file)
        assert meta["max_batch_rows"] == "auto" and meta["batch_rows"] >= 3
        check_trajectory(file, meta, lock, lock_path)
    log = (work / "results/logs/rollout/study2/tiny-qwen/ruler-1024.log").read_text()
    assert "max_batch_rows auto: " in log and "rows a call" in log
