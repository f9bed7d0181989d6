"""The pipeline's decoding temperature (issue 31, item 4): ``rollout.temperature`` in the config
(default 1; 0 greedy, where every study runs K = 1 with a note), refused in one line where the
rollouts cannot run it, passed to every rollout job, recorded in the trajectory metadata and in
the study's lock; a greedy tiny-config run's reference X is the model's greedy generation."""

from __future__ import annotations

import copy

import numpy as np
import polars as pl
import pytest
import torch
import yaml
from workflow_helpers import (
    ROOT,
    package_env,
    place_fixture_documents,
    run_snakemake,
    workflow_copy,
)

from kvdiverge.analysis.planning import PlanningError, development_paths, variance_components
from kvdiverge.analysis.prespecification import read_lock
from kvdiverge.config import ConfigError, check_config
from kvdiverge.io.trajectories import read_trajectories, read_trajectory_metadata

SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
FIXTURE = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())


def _config(**rollout) -> dict:
    config = copy.deepcopy(BASE)
    config.setdefault("rollout", {}).update(rollout)
    return config


def test_the_default_temperature_is_one_and_changes_nothing():
    config = _config()
    config["rollout"].pop("temperature", None)
    assert check_config(config, SCHEMA) == []
    assert config["rollout"]["temperature"] == 1
    assert config["studies"]["study1"]["K_dev"] == BASE["studies"]["study1"].get("K_dev", 32)


@pytest.mark.parametrize("T", [0.5, 1, 2.0])
def test_a_positive_temperature_keeps_the_replicates(T):
    config = _config(temperature=T)
    before = {s: dict(spec) for s, spec in config["studies"].items()}
    assert check_config(config, SCHEMA) == []
    for study, spec in config["studies"].items():
        assert spec["K_dev"] == before[study].get("K_dev", 32)


def test_greedy_runs_one_replicate_with_one_note_per_study():
    config = _config(temperature=0)
    config["studies"]["study2"].update(K=4, K_dev=8, K_control=2)
    notes = check_config(config, SCHEMA)
    assert notes[1] == (
        "config.studies.study2: rollout.temperature 0 (greedy): every replicate is the same "
        "path, so K = K_dev = K_control = 1 (not K 4, K_dev 8, K_control 2)"
    )
    assert len(notes) == len(config["studies"])
    for spec in config["studies"].values():
        assert (spec["K"], spec["K_dev"], spec["K_control"]) == (1, 1, 1)
    # the effective config (the report's run reads it again) passes the checks as it is
    assert check_config(copy.deepcopy(config), SCHEMA) == []


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {"temperature": -0.5},
            "config.rollout.temperature: expected a value >= 0, got -0.5",
        ),
        (
            {"temperature": "greedy"},
            "config.rollout.temperature: expected number, got 'greedy'",
        ),
        (
            {"temperature": float("inf")},
            "config.rollout.temperature: expected a finite number >= 0 (0: greedy), got inf",
        ),
        (
            {"temperature": float("nan")},
            "config.rollout.temperature: expected a finite number >= 0 (0: greedy), got nan",
        ),
        (
            {"temperature": 0, "coupling": "swrb"},
            "config.rollout.temperature: 0 (greedy), but rollout.coupling swrb needs T > 0: "
            "greedy kernels are point masses, so the SWRB trunk has nothing to branch; expected "
            "a temperature > 0, or coupling shared-reference, which covers greedy decoding",
        ),
    ],
)
def test_a_temperature_the_rollouts_cannot_run_is_one_line(edit, message):
    config = _config(**edit)
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    assert str(info.value) == message


@pytest.mark.parametrize("T", [0.5, 1, 2.0])
def test_swrb_runs_at_any_positive_temperature(T):
    config = _config(temperature=T, coupling="swrb")
    assert check_config(config, SCHEMA) == []
    assert config["rollout"]["temperature"] == T


def test_one_development_path_per_document_only_when_greedy():
    config = _config(temperature=0.5)
    config["studies"]["study1"]["K_dev"] = 1
    with pytest.raises(ConfigError) as info:
        check_config(config, SCHEMA)
    assert str(info.value) == (
        "config.studies.study1.K_dev: expected a value >= 2, got 1 (the plan needs the "
        "within-document variance; 1 only at rollout.temperature 0)"
    )
    config = _config(temperature=0)
    config["studies"]["study1"]["K_dev"] = 1
    check_config(config, SCHEMA)


def test_the_lock_records_the_temperature():
    from kvdiverge.analysis.prespecification import prespecified
    from kvdiverge.eviction import parse_action

    for T in (0, 0.5):
        config = _config(temperature=T)
        check_config(config, SCHEMA)
        actions = {
            n: parse_action({"name": n, **a}).as_dict() for n, a in config["actions"].items()
        }
        spec = prespecified(config, "study1", ["ruler-1024"], actions)
        assert spec["design"]["temperature"] == T


SMALL = {
    "rollout": {"H": 8, "temperature": 0},
    "datasets": {
        "strata": [{"env": "ruler", "label": "1024", "target_tokens": 1024}],
        "cohorts": {"dev": 2, "study1": 3, "study2": 2},
    },
    "analysis": {
        "contrasts": {"study1": [["recent-half", "snapkv-half"]], "study2": []},
        "prediction": {"pairs": {"study1": ["recent-half", "snapkv-half"]}},
        "planning": {"max_K": 3},
    },
    "studies": {  # K_dev 2 and K_control 2 asked: greedy runs 1
        "study1": {"actions": ["snapkv-half", "recent-half", "full"], "K": "plan", "K_dev": 2},
        "study2": {"actions": ["recent-90", "full"], "K": 2, "K_dev": 2},
    },
}


@pytest.mark.slow
def test_a_greedy_pipeline_run_rolls_out_the_models_greedy_generation(tmp_path):
    from kvdiverge.models import chat_prompt_ids, load_model, load_tokenizer

    work = workflow_copy(tmp_path, package=True)
    place_fixture_documents(work)
    override = tmp_path / "greedy.yaml"
    override.write_text(yaml.safe_dump(SMALL))
    model = "tiny-llama"
    actions = SMALL["studies"]["study1"]["actions"]
    paths = {a: f"results/study1/{model}/trajectories/{a}/ruler-1024.parquet" for a in actions}
    rules = ["build_demo_model", "dev_rollout_study1", "plan_sample_sizes", "prespecify"]
    res = run_snakemake(
        work,
        *paths.values(),
        "--allowed-rules",
        *rules,
        "rollout_study1",
        "--configfile",
        str(override),
        env=package_env(work),
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (
        "config.studies.study1: rollout.temperature 0 (greedy): every replicate is the same "
        "path, so K = K_dev = K_control = 1 (not K plan, K_dev 2, K_control 2)"
    ) in res.stderr.splitlines()
    lock = read_lock(work / "results/study1/lock.json")
    assert lock["design"]["temperature"] == 0
    assert lock["design"]["K"] == 1 and lock["design"]["K_control"] == 1
    dev = work / paths["snapkv-half"].replace("/trajectories/", "/dev/trajectories/")
    assert read_trajectory_metadata(dev)["temperature"] == 0
    # the plan from one path per document: no within-document variance
    paths_dev = development_paths(dev, "ruler-1024")
    assert paths_dev.group_by("doc_id").len()["len"].to_list() == [1, 1]

    tok = load_tokenizer(str(work / "data/models" / model))
    lm = load_model(str(work / "data/models" / model), device="cpu", dtype="float32")
    docs = pl.read_parquet(FIXTURE).filter(pl.col("cohort") == "study1")
    prompts = dict(docs.select("doc_id", "prompt").rows())
    H = SMALL["rollout"]["H"]
    xs = {}
    for action, path in paths.items():
        meta = read_trajectory_metadata(work / path)
        assert meta["temperature"] == 0 and meta["K"] == {"study1": 1}
        frame = read_trajectories(work / path).sort("doc_id", "replicate", "t")
        assert sorted(frame["doc_id"].unique()) == sorted(prompts)
        assert frame["replicate"].n_unique() == 1
        assert set(frame["tv_rollout"].unique().to_list()) <= {0.0, 1.0}  # δ_t ∈ {0, 1}
        xs[action] = frame
    eos = list(read_trajectory_metadata(work / paths["full"])["eos_ids"])
    first = next(iter(xs.values()))
    for doc_id, prompt in prompts.items():
        x = first.filter(pl.col("doc_id") == doc_id)
        ids = chat_prompt_ids(tok, prompt)
        generated = lm.generate(
            torch.tensor([list(ids)]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=H,
            eos_token_id=eos,
            pad_token_id=min(eos),
        )[0, len(ids) :].tolist()
        ended = int(np.argmax(x["x_eos"].to_numpy())) if x["x_eos"].any() else H
        assert x["x_token"].to_list()[:ended] == generated[:ended], doc_id
        for frame in xs.values():  # one reference X, shared by every action
            other = frame.filter(pl.col("doc_id") == doc_id)["x_token"].to_list()
            assert other == x["x_token"].to_list()


def test_the_plan_refuses_one_path_per_document_unless_greedy(tmp_path):
    from kvdiverge.io.trajectories import write_trajectories

    rows = []
    for doc in ("a", "b"):
        for t in range(1, 4):
            rows.append(
                {"doc_id": doc, "replicate": 0, "t": t, "x_token": 5, "y_token": 5 if doc == "a"
                 else 6, "tv_rollout": 0.0 if doc == "a" else 1.0, "tv_fixed": 0.0}
            )  # fmt: skip
    frame = _trajectory(rows)
    meta = {
        "model": {"name": "m", "path": "m"}, "revision": None, "action": {"name": "x"},
        "H": 3, "K": {"dev": 1}, "seed": 0, "coupling": "shared-reference", "dtype": "float32",
        "device": "cpu",
    }  # fmt: skip
    write_trajectories(frame, tmp_path / "t1.parquet", meta | {"temperature": 1.0})
    with pytest.raises(PlanningError, match="the plan needs K_dev >= 2 paths per document"):
        development_paths(tmp_path / "t1.parquet", "s")
    write_trajectories(frame, tmp_path / "t0.parquet", meta | {"temperature": 0})
    paths = development_paths(tmp_path / "t0.parquet", "s")
    stats = paths.group_by("doc_id", "stratum").agg(
        pl.col("mismatch").mean(), mismatch_sq=(pl.col("mismatch") ** 2).mean(), n_paths=pl.len()
    )
    var = variance_components(stats)
    assert var["sigma_within2"] == 0 and var["K_dev"] == 1 and var["sigma_between2"] > 0


def _trajectory(rows: list[dict]) -> pl.DataFrame:
    from kvdiverge.io.trajectories import TRAJECTORY_SCHEMA

    full = []
    for r in rows:
        mism = r["x_token"] != r["y_token"]
        full.append(
            {
                "doc_id": r["doc_id"], "replicate": r["replicate"], "t": r["t"],
                "x_token": r["x_token"], "y_token": r["y_token"], "mismatch": mism,
                "tv_rollout": r["tv_rollout"], "tv_fixed": r["tv_fixed"], "x_eos": False,
                "y_eos": False, "n_prompt": 10, "n_kept": 5,
            }
        )  # fmt: skip
    return pl.DataFrame(full).select(
        [pl.col(c).cast(t) for c, t in TRAJECTORY_SCHEMA.items() if c in full[0]]
    )
