"""Reliability, round three, for a user's selector: action fields are the config's alone, the
always-kept positions are kept by construction whatever the scores' size and dtype, a
non-deterministic method is refused (a seeded random one declares itself), and positions on the
meta device or a changed default dtype are one line naming the selector.

The selectors are in tests/reliability_helpers.py; the model is the committed tiny-llama demo
model (2 layers, 2 KV heads) on a 34-token prompt.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from kvdiverge.eviction import ActionError, parse_action, run_prefill, select_positions
from kvdiverge.models import chat_prompt_ids, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPT = "The river flows north past the old mill. The magic number is 482913."
N, KEEP = 34, 8

transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def model():
    return load_model(str(MODEL))


@pytest.fixture(scope="module")
def ids():
    ids = chat_prompt_ids(load_tokenizer(str(MODEL)), PROMPT)
    assert len(ids) == N
    return ids


def action(cls: str, name: str = "mine", budget: int = KEEP, **params):
    spec = {"selector": f"reliability_helpers:{cls}", "budget": budget, **params}
    return parse_action(spec, name=name)


def one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message, message
    return message


def where(cls: str) -> str:
    return f"action 'mine': selector 'reliability_helpers:{cls}'"


# ---- action fields are the config's alone -------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "field"),
    [("ShadowBudget", "budget"), ("ShadowSelector", "selector"), ("ShadowNKeep", "n_keep")],
)
def test_a_field_named_like_an_action_key_is_refused_at_parse_time(cls, field):
    with pytest.raises(ActionError) as info:
        action(cls)
    message = one_line(info)
    assert message.startswith(
        f"actions.mine.selector: 'reliability_helpers:{cls}' declares a parameter field "
        f"{field!r}, which is an action key; expected parameter names other than name, "
        "selector, budget, budgets, label,"
    ), message
    assert message.endswith(
        "(the action's own fields come from the config alone: rename the field)"
    )


def test_the_pipeline_config_refuses_a_shadowing_field_in_one_line():
    from kvdiverge.config import ConfigError, check_config

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["actions"]["mine"] = {"selector": "reliability_helpers:ShadowBudget", "budget": 0.5}
    cfg["studies"]["study1"]["actions"].append("mine")
    with pytest.raises(ConfigError) as info:
        check_config(cfg, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    assert one_line(info).startswith(
        "config.actions.mine.selector: 'reliability_helpers:ShadowBudget' declares a "
        "parameter field 'budget', which is an action key"
    )


def test_compare_refuses_a_shadowing_field_in_one_line():
    from kvdiverge.compare.actions import CompareError, parse_actions

    with pytest.raises(CompareError) as info:
        parse_actions("mine=reliability_helpers:ShadowBudget@0.5")
    assert one_line(info).startswith(
        "--actions: actions.mine.selector: 'reliability_helpers:ShadowBudget' declares a "
        "parameter field 'budget', which is an action key"
    )


def test_the_action_records_the_configs_budget_and_no_shadow():
    spec = parse_action({"selector": "recent", "budget": 0.5, "sinks": 2}, name="r")
    assert spec.as_dict() == {"name": "r", "selector": "recent", "budget": 0.5, "sinks": 2}


# ---- always-kept positions by construction ------------------------------------------------------
@pytest.mark.parametrize(
    ("dtype", "scale"),
    [("bfloat16", 300.0), ("float16", 2048.0), ("float32", 1.7e7), ("float64", 1e300)],
)
def test_always_kept_positions_survive_scores_where_max_plus_one_rounds_away(
    model, ids, dtype, scale
):
    """Every other score is ``scale``, where ``scale + 1 == scale`` in the dtype; the four sinks
    score 0 and must be kept in every layer and head, beside four of the others."""
    tdtype = getattr(torch, dtype)
    assert torch.tensor(scale, dtype=tdtype) + 1 == torch.tensor(scale, dtype=tdtype)
    spec = action("LargeScores", scale=scale, dtype=dtype)
    kept = select_positions(run_prefill(model, ids), spec)
    assert kept.shape == (2, 2, KEEP)
    assert (kept[..., :4] == torch.arange(4)).all(), kept
    assert (kept[..., 4:] >= 4).all()


def test_always_kept_positions_survive_integer_scores_at_the_dtypes_top(model, ids):
    kept = select_positions(run_prefill(model, ids), action("LargeIntegerScores"))
    assert (kept[..., -3:] == torch.arange(N - 3, N)).all(), kept
    assert kept.shape == (2, 2, KEEP)


# ---- determinism --------------------------------------------------------------------------------
def test_a_non_deterministic_selector_is_refused_on_its_first_prompt(model, ids):
    prefill = run_prefill(model, ids)
    with pytest.raises(ActionError) as info:
        select_positions(prefill, action("Unseeded"))
    message = one_line(info)
    assert message.startswith(
        f"{where('Unseeded')}: positions returned different kept positions when called twice "
        "on the same prefill (first at layer 0, KV head 0); expected a deterministic selector, "
        "or a seeded random one that declares deterministic = False and an integer `seed` "
        "parameter"
    ), message


def test_a_seeded_random_selector_runs_and_reruns_identically(model, ids):
    runs = []
    for _ in range(2):
        spec = action("Seeded", seed=7)
        prefill = run_prefill(model, ids)
        runs.append([select_positions(prefill, spec) for _ in range(2)])
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert not torch.equal(runs[0][0], runs[0][1])  # random: two calls differ


def test_a_random_selector_without_a_seed_is_refused_at_parse_time():
    with pytest.raises(ActionError) as info:
        action("RandomWithoutSeed")
    assert one_line(info) == (
        "actions.mine.selector: 'reliability_helpers:RandomWithoutSeed' declares "
        "deterministic = False; expected an integer `seed` parameter field (seed: int = ...) "
        "from which it draws"
    )


def test_a_deterministic_user_selector_is_called_twice_on_its_first_prompt_only(model, ids):
    from reliability_helpers import CALLS

    spec = action("Counted", name="counted")
    prefill = run_prefill(model, ids)
    first = select_positions(prefill, spec)
    assert CALLS.count("counted") == 2
    assert torch.equal(first, select_positions(run_prefill(model, ids), spec))
    assert CALLS.count("counted") == 3


def test_the_packages_own_selectors_are_called_once(model, ids, monkeypatch):
    from kvdiverge.eviction import SnapKVSelector

    calls = []
    original = SnapKVSelector.positions
    monkeypatch.setattr(
        SnapKVSelector, "positions", lambda *a: calls.append(1) or original(*a), raising=True
    )
    spec = parse_action({"selector": "snapkv", "budget": 16, "window": 4}, name="s")
    select_positions(run_prefill(model, ids, actions=[spec]), spec)
    assert calls == [1]


# ---- user code: other devices, global state -----------------------------------------------------
def test_positions_on_the_meta_device_are_one_line(model, ids):
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), action("MetaPositions"))
    assert one_line(info) == (
        f"{where('MetaPositions')}: positions: returned positions on the meta device, which "
        "holds no values; expected a tensor with values (on the prefill's device cpu)"
    )


def test_scores_on_the_meta_device_are_one_line(model, ids):
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), action("MetaScores"))
    assert one_line(info) == (
        f"{where('MetaScores')}: score of layer 0: returned scores on the meta device, which "
        "holds no values; expected a tensor with values (on the prefill's device cpu)"
    )


def test_a_selector_changing_the_default_dtype_is_one_line_and_restored(model, ids):
    assert torch.get_default_dtype() == torch.float32
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), action("ChangesDefaultDtype"))
    assert torch.get_default_dtype() == torch.float32
    assert one_line(info) == (
        f"{where('ChangesDefaultDtype')}: positions changed torch's default dtype from "
        "torch.float32 to torch.float64; expected a selector to leave global torch settings "
        "unchanged (pass dtype= to the tensors it creates)"
    )


def test_a_rollout_job_refuses_a_non_deterministic_selector_and_writes_nothing(tmp_path):
    """In the pipeline's rollout job: the first document's selection is made twice, before any
    decoding, and the difference stops the job (the job's process has not seen the selector)."""
    from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

    documents = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
    actions = {
        "full": {"selector": "full"},
        "mine": {"selector": "reliability_helpers:Unseeded", "budget": 0.5},
    }
    cohorts = {"full": {"dev": 1}, "mine": {"dev": 1}}
    out = {name: tmp_path / "out" / f"{name}.parquet" for name in actions}
    model = {"name": "tiny-llama", "path": str(MODEL)}
    with pytest.raises(ActionError) as info:
        run_stratum_rollout_job(
            documents, out, model, actions, cohorts, RolloutSettings(H=4, seed=1),
            device="cpu", resume_key="test",
        )  # fmt: skip
    assert one_line(info).startswith(
        f"{where('Unseeded')}: positions returned different kept positions when called twice"
    )
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.name != "key.json"]
    assert written == []
