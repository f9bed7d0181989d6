"""The lock registers the rollouts and a history that cannot be erased quietly
(docs/prespecification.md, "Fixed by the lock" and "Registrations"): the rollout side and its
refusals, files with foreign settings, the chained history under an OS file lock, a hand-edited
lock, the kernel's source in the rerun fingerprints, and the warning when one study mixes
numerics. The same refusals end to end: tests/workflow/test_registration_workflow.py."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from registration_helpers import ROLLOUT_MODEL, file_meta, rollout_models

from kvdiverge.analysis.prespecification import (
    check_lock,
    make_lock,
    prespecified,
    register,
)
from kvdiverge.analysis.prespecification import (
    rollout_models as lock_models,
)
from kvdiverge.config import validate_config
from kvdiverge.eviction import parse_action
from kvdiverge.io.locks import (
    PrespecificationError,
    check_history,
    check_rollout,
    check_trajectory,
    history_path,
    lock_hash,
    read_history,
    read_lock,
    rollout_view,
)
from kvdiverge.io.model_digest import model_digests
from kvdiverge.io.trajectories import provenance_mix

ROOT = Path(__file__).resolve().parents[2]
PLAN = {"study": "study2", "K": 2, "K_planned": 2, "K_source": "plan", "notes": [], "plans": []}
CODE = "c0de0000c0de0000"


def _config() -> dict:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    return config


def _spec(config: dict | None = None, code: str = CODE) -> dict:
    config = config or _config()
    actions = {
        name: parse_action(spec, name=name).as_dict() for name, spec in config["actions"].items()
    }
    return prespecified(config, "study2", ["ruler-1024"], actions, code)


def _content(config: dict | None = None, plan: dict = PLAN, code: str = CODE) -> dict:
    config = config or _config()
    return make_lock(_spec(config, code), plan, models=rollout_models(config["models"]))


def _registered(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "study2" / "lock.json"
    return path, register(_content(), path)


# ---- the rollout side ------------------------------------------------------------------------
def test_the_lock_holds_the_rollout_side_and_its_hash_covers_it():
    lock = _content()
    side = lock["rollout"]
    assert side["code"] == CODE and side["models"]["smollm2"] == ROLLOUT_MODEL
    config = _config()
    assert side["settings"] == {
        "H": config["rollout"]["H"],
        "seed": config["seed"],
        "coupling": config["rollout"]["coupling"],
        "temperature": config["rollout"]["temperature"],
        "max_batch_rows": config["rollout"]["max_batch_rows"],
    }
    # every part of the rollout side changes the hash, so the evaluation seed
    assert _content(code="0" * 16)["hash"] != lock["hash"]
    config["rollout"]["max_batch_rows"] = 7
    assert _content(config)["hash"] != lock["hash"]
    other = rollout_models(_config()["models"])
    other["smollm2"]["weights"] = "f" * 64
    assert make_lock(_spec(), PLAN, models=other)["hash"] != lock["hash"]
    view = rollout_view(lock, "smollm2")
    assert view["rollout.code"] == CODE and view["design.K"] == 2
    assert view["rollout.models.smollm2.dtype"] == "float32"
    assert view["design.actions.recent-90"]["budget"] == 0.9


@pytest.mark.parametrize(
    ("field", "now"),
    [
        ("rollout.code", "0123456789abcdef"),  # the engine's code changed: a seed offset, say
        ("rollout.settings.H", 999),
        ("rollout.settings.seed", 1),
        ("rollout.settings.temperature", 0),
        ("rollout.models.smollm2.weights", "e" * 64),
        ("rollout.models.smollm2.device", "cuda"),
        ("rollout.models.smollm2.dtype", "bfloat16"),
        ("design.actions.recent-90", {"name": "recent-90", "selector": "recent", "budget": 0.8}),
    ],
)
def test_an_evaluation_rollout_that_would_run_otherwise_is_refused(tmp_path, field, now):
    path, lock = _registered(tmp_path)
    view = rollout_view(lock, "smollm2")
    check_rollout(lock, path, "smollm2", view)  # what it registered passes
    check_rollout(lock, path, "smollm2", {"rollout.models.smollm2.device": "cpu"})
    with pytest.raises(PrespecificationError) as info:
        check_rollout(lock, path, "smollm2", {**view, field: now})
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"{path}: this evaluation rollout of smollm2 would run {field} = "
        f"{json.dumps(now, sort_keys=True)[:40]}"
    )
    assert "but the lock registered" in message
    where = 'docs/prespecification.md, "Changing it honestly"'
    assert message.endswith(
        f"register anew: delete {path} and rerun the workflow (a new registration, appended to "
        f"{history_path(path)}, with a new evaluation seed; {where})"
    )
    with pytest.raises(PrespecificationError, match="model 'other' is not registered"):
        check_rollout(lock, path, "other", {})


def test_a_device_index_and_a_kernel_layout_the_other_never_ran_are_no_difference(tmp_path):
    path, lock = _registered(tmp_path)
    entry = "rollout.models.smollm2"
    check_rollout(lock, path, "smollm2", {f"{entry}.kernel": {"prompt_gathered": "library"}})
    with pytest.raises(PrespecificationError, match=f"would run {entry}.kernel"):
        check_rollout(lock, path, "smollm2", {f"{entry}.kernel": {"prompt_masked": "library"}})


@pytest.mark.parametrize(
    ("changed", "field"),
    [
        ({"H": 999}, "rollout.settings.H"),
        ({"seed": 1}, "rollout.settings.seed"),
        ({"temperature": 0}, "rollout.settings.temperature"),
        ({"K": {"study2": 64}}, "K"),
        ({"code": "0123456789abcdef"}, "rollout.code"),
        ({"model_digest": {"weights": "e" * 64, "tokenizer": "b" * 64}}, "weights"),
        ({"dtype": "bfloat16"}, "rollout.models.smollm2.dtype"),
        ({"kernel": {"prompt_masked": "library-flash-cpu"}}, "rollout.models.smollm2.kernel"),
        ({"libraries": {**ROLLOUT_MODEL["libraries"], "torch": "2.1.0"}}, "libraries"),
    ],
)
def test_trajectory_files_with_foreign_settings_fail_check_lock(tmp_path, changed, field):
    path, lock = _registered(tmp_path)
    files = {
        "recent.parquet": file_meta(lock, "recent-90", "smollm2"),
        "full.parquet": file_meta(lock, "full", "smollm2"),
    }
    assert check_lock(path, _spec(), files)["hash"] == lock["hash"]
    foreign = {**files, "recent.parquet": {**files["recent.parquet"], **changed}}
    with pytest.raises(PrespecificationError) as info:
        check_lock(path, _spec(), foreign)
    message = str(info.value)
    assert message.startswith("recent.parquet: records ") and field in message, message
    assert message.endswith(
        "delete recent.parquet and rerun the workflow (its rollout job runs again under the lock)"
    )


def test_a_file_of_another_model_or_action_fails_check_lock(tmp_path):
    path, lock = _registered(tmp_path)
    meta = file_meta(lock, "recent-90", "smollm2")
    other = {**meta, "model": {"name": "llama", "path": "x"}}
    with pytest.raises(PrespecificationError, match="model 'llama', which .* does not register"):
        check_trajectory("a.parquet", other, lock, path)
    other = {**meta, "action": {**meta["action"], "name": "snapkv-512"}}
    with pytest.raises(PrespecificationError, match="action 'snapkv-512', which"):
        check_trajectory("a.parquet", other, lock, path)


def test_the_lock_takes_the_numerics_of_the_development_rollouts(tmp_path):
    folder = ROOT / "data" / "models" / "tiny-qwen"
    digest = model_digests(folder)
    assert digest == model_digests(folder)  # cached, the same
    assert len(digest["weights"]) == len(digest["tokenizer"]) == 64
    dev = {
        f"{s}.parquet": {
            "model_digest": digest,
            "device": "cpu",
            "dtype": "float32",
            "libraries": ROLLOUT_MODEL["libraries"],
            "kernel": {"prompt_masked": "native-avx512"} if s == "a" else {"rows_own": "lib"},
        }
        for s in ("a", "b")
    }
    models = lock_models({"tiny-qwen": dev}, {"tiny-qwen": digest})
    assert models["tiny-qwen"] == {
        **digest,
        "device": "cpu",
        "dtype": "float32",
        "libraries": ROLLOUT_MODEL["libraries"],
        "kernel": {"prompt_masked": "native-avx512", "rows_own": "lib"},
    }
    mixed = {**dev, "b.parquet": {**dev["b.parquet"], "dtype": "bfloat16"}}
    with pytest.raises(PrespecificationError, match="b.parquet: its development rollout ran dtype"):
        lock_models({"tiny-qwen": mixed}, {"tiny-qwen": digest})
    changed = {"weights": "0" * 64, "tokenizer": digest["tokenizer"]}
    with pytest.raises(PrespecificationError, match="a.parquet: rolled out with model digest"):
        lock_models({"tiny-qwen": dev}, {"tiny-qwen": changed})
    # a copy whose weights differ by one byte has another weights digest, the same tokenizer's
    copy = tmp_path / "tiny-qwen"
    shutil.copytree(folder, copy)
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    other = model_digests(copy)
    assert other["weights"] != digest["weights"] and other["tokenizer"] == digest["tokenizer"]
    assert model_digests("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # a hub id


# ---- the chained history ---------------------------------------------------------------------
def test_each_registration_names_the_previous_one_and_unchanged_content_is_not_new(tmp_path):
    path, first = _registered(tmp_path)
    assert first["chain"] == {"number": 1, "previous": None}
    assert first["hash"] == lock_hash(first) and read_lock(path) == first
    again = register(_content(), path)
    assert again["hash"] == first["hash"] and len(read_history(history_path(path))) == 1
    second = register(_content(plan={**PLAN, "K_planned": 3}), path)
    assert second["chain"] == {"number": 2, "previous": first["hash"]}
    assert second["registration"]["reason"] == "design.K changed (was 2, now 3)"
    assert check_history(read_lock(path), path)[-1]["hash"] == second["hash"]
    # the same content as registration 1, registered third: a new hash (its chain), a new seed
    third = register(_content(), path)
    assert third["chain"]["number"] == 3 and third["hash"] != first["hash"]


def test_a_lock_whose_chain_does_not_match_the_history_stops(tmp_path):
    path, first = _registered(tmp_path)
    register(_content(plan={**PLAN, "K_planned": 3}), path)
    history = history_path(path)
    lines = history.read_text().splitlines()
    # the first registration's lock put back: not the last registration
    (path).write_text(json.dumps(first))
    with pytest.raises(PrespecificationError) as info:
        check_history(read_lock(path), path)
    assert str(info.value).startswith(
        f"{path}: lock {first['hash']} is not the last registration of {history} (registered: "
    )
    # a registration removed from the middle, or the lines reordered
    register(_content(plan={**PLAN, "K_planned": 4}), path)
    lines = history.read_text().splitlines()
    for broken in ([lines[0], lines[2]], [lines[1], lines[0], lines[2]]):
        history.write_text("\n".join(broken) + "\n")
        with pytest.raises(PrespecificationError, match=r"lock_history\.jsonl:[12]: registration"):
            check_history(read_lock(path), path)
        with pytest.raises(PrespecificationError, match="the history is append-only: restore it"):
            register(_content(), path)
    # a registration edited in place
    entry = json.loads(lines[1])
    entry["lock"]["design"]["K"] = 9
    history.write_text("\n".join([lines[0], json.dumps(entry), lines[2]]) + "\n")
    with pytest.raises(PrespecificationError, match=r":2: the registration's content does not"):
        check_history(read_lock(path), path)


def test_an_erased_history_stops_the_next_registration_and_every_check(tmp_path):
    path, lock = _registered(tmp_path)
    evaluation = tmp_path / "study2" / "smollm2" / "trajectories" / "full" / "ruler-1024.parquet"
    evaluation.parent.mkdir(parents=True)
    evaluation.write_bytes(b"x")
    history_path(path).unlink()
    with pytest.raises(PrespecificationError) as info:
        check_history(read_lock(path), path)
    assert str(info.value).startswith(
        f"{path}: no registration history beside it ({history_path(path)} is missing: erased?)"
    )
    with pytest.raises(PrespecificationError) as info:
        check_lock(path, _spec(), {})
    assert "no registration history beside it" in str(info.value)
    path.unlink()
    with pytest.raises(PrespecificationError) as info:
        register(_content(), path, evaluation_files=[evaluation])
    assert str(info.value) == (
        f"{history_path(path)}: no registration history, but evaluation trajectories of the "
        f"study exist ({evaluation}): the history was erased; it is append-only and cannot be "
        f"rebuilt: restore it, or start the study over by deleting {path.parent} (its lock, "
        f"history and evaluation trajectories)"
    )
    assert not path.exists() and not history_path(path).exists()
    # who deletes everything starts over: registration 1, the first registration's hash
    evaluation.unlink()
    assert register(_content(), path, evaluation_files=[evaluation])["hash"] == lock["hash"]


def test_a_hand_edited_lock_is_refused_with_advice_that_works(tmp_path):
    path, lock = _registered(tmp_path)
    edited = json.loads(path.read_text())
    edited["design"]["K"] = 1
    path.write_text(json.dumps(edited))
    with pytest.raises(PrespecificationError) as info:
        read_lock(path)
    assert str(info.value) == (
        f"{path}: the lock's content does not match its hash {lock['hash']} (edited by hand?); "
        f"a lock is written only by rule prespecify: delete {path} and rerun the workflow, "
        "which writes the registered lock again (to change what is registered, change the "
        "config)"
    )
    # the hash recomputed by hand: the history does not hold it
    edited["hash"] = lock_hash(edited)
    path.write_text(json.dumps(edited))
    with pytest.raises(PrespecificationError, match="is not the last registration of"):
        check_history(read_lock(path), path)
    # the advice: rule prespecify (register) writes the registered lock again, nothing new
    path.unlink()
    assert register(_content(), path)["hash"] == lock["hash"]
    assert len(read_history(history_path(path))) == 1


def _register_many(args: tuple[str, int, int]) -> None:
    folder, worker, count = args
    sys.path.insert(0, str(Path(__file__).parent))
    for i in range(count):
        plan = {**PLAN, "notes": [f"writer {worker} entry {i}"]}
        register(_content(plan=plan), Path(folder) / "study2" / "lock.json")


def test_two_writers_sharing_one_output_folder_keep_every_entry(tmp_path):
    """Two processes (two working folders that share one output folder, outside Snakemake's
    lock) register 30 registrations each: the history keeps all 60, as one chain."""
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        pool.map(_register_many, [(str(tmp_path), w, 30) for w in range(2)])
    path = tmp_path / "study2" / "lock.json"
    history = read_history(history_path(path))
    assert len(history) == 60 and [e["number"] for e in history] == list(range(1, 61))
    notes = sorted(e["lock"]["plan"]["notes"][0] for e in history)
    assert notes == sorted(f"writer {w} entry {i}" for w in range(2) for i in range(30))
    assert check_history(read_lock(path), path)[-1]["hash"] == read_lock(path)["hash"]


# ---- fingerprints and provenance -------------------------------------------------------------
def _fingerprints(pkg: Path) -> dict[str, str]:
    code = (
        "import json, sys\n"
        "from kvdiverge.pipeline.provenance import script_fingerprint\n"
        "print(json.dumps({s: script_fingerprint(f'workflow/scripts/{s}.py') "
        "for s in ('rollout', 'swrb_rollout', 'estimands')}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(pkg), "KVDIVERGE_CACHE": str(pkg.parent / "cache")}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_kernel_source_is_part_of_the_fingerprint_of_every_rule_that_can_run_it(tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(ROOT / "src" / "kvdiverge", pkg / "kvdiverge")
    before = _fingerprints(pkg)
    sources = sorted((pkg / "kvdiverge" / "engine").rglob("*.c"))
    assert sources  # the native kernel's C source, wherever in the engine it lives
    with open(sources[0], "a") as handle:
        handle.write("\n/* an edit */\n")
    after = _fingerprints(pkg)
    assert after["rollout"] != before["rollout"]
    assert after["swrb_rollout"] != before["swrb_rollout"]
    assert after["estimands"] == before["estimands"]  # reaches no kernel


def test_the_estimands_step_warns_when_one_study_mixes_numerics():
    meta = {"kernel": {"prompt_masked": "native-avx512"}, "device": "cpu", "dtype": "float32"}
    files = {"a.parquet": meta, "b.parquet": {**meta, "kernel": {"prompt_masked": "library"}}}
    assert provenance_mix({"a.parquet": meta, "c.parquet": dict(meta)}) == []
    lines = provenance_mix(files)
    assert lines == [
        'the trajectory files mix kernel: {"prompt_masked": "native-avx512"} (1 file(s), e.g. '
        'a.parquet); {"prompt_masked": "library"} (1 file(s), e.g. b.parquet)'
    ]


def test_a_job_whose_loaded_model_or_kernels_differ_from_the_lock_is_refused():
    from kvdiverge.engine.rollout_job import check_registered_numerics

    model = {"name": "smollm2", "path": "data/models/smollm2"}
    check_registered_numerics(ROLLOUT_MODEL, model, {"dtype": "float32", "device": "cpu"})
    check_registered_numerics(ROLLOUT_MODEL, model, {"kernel": {"prompt_gathered": "x"}})
    with pytest.raises(PrespecificationError) as info:
        check_registered_numerics(ROLLOUT_MODEL, model, {"dtype": "bfloat16"})
    assert str(info.value) == (
        "rollout.models.smollm2.dtype: this evaluation rollout runs 'bfloat16', but the lock "
        "registered 'float32' (from the development rollouts); run it where the development "
        "ran, or register anew: delete the study's lock.json and rerun the workflow"
    )
    with pytest.raises(PrespecificationError, match=r"rollout\.models\.smollm2\.kernel: "):
        check_registered_numerics(ROLLOUT_MODEL, model, {"kernel": {"prompt_masked": "lib"}})
    with pytest.raises(PrespecificationError, match=r"rollout\.models\.smollm2\.device: "):
        check_registered_numerics(ROLLOUT_MODEL, model, {"device": "cuda:0"})
