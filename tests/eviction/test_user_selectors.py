"""A user's selector (kvdiverge.eviction.contract, kvdiverge.eviction): one that breaks the output
contract, raises, or changes the shared prefill stops before any decoding with one line naming
the action and the selector; action fields are the config's alone; the always-kept positions
are kept by construction whatever the scores' size and dtype; a non-deterministic method is
refused (a seeded random one declares itself); positions on the meta device or a changed default
dtype are one line naming the selector. The same refusals in a rollout job:
tests/engine/test_job_selector_refusals.py.

The selectors are in tests/selector_helpers.py, one fault each; the model is the committed
tiny-llama demo model (2 layers, 2 KV heads) on a 34-token prompt.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import transformers
import yaml
from refusal_helpers import one_line

from kvdiverge.eviction import ActionError, parse_action, run_prefill, select_positions
from kvdiverge.models import chat_prompt_ids, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPT = "The river flows north past the old mill. The magic number is 482913."
N, KEEP = 34, 8  # prompt tokens, the actions' budget

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
    """The action ``name`` running ``selector_helpers:<cls>`` at ``budget`` with ``params``."""
    spec = {"selector": f"selector_helpers:{cls}", "budget": budget, **params}
    return parse_action(spec, name=name)


def where(cls: str) -> str:
    return f"action 'mine': selector 'selector_helpers:{cls}'"


EXACT = f"exactly {KEEP} per layer and KV head (the action's budget)"


CASES = {
    "Duplicates": f"position 3 more than once at layer 0, KV head 0; expected distinct "
    f"positions, {EXACT}",
    "Everything": f"positions returned {N} positions per layer and KV head; expected {KEEP} "
    f"(the action's budget) of the {N}-token prompt",
    "Single": f"positions returned 1 positions per layer and KV head; expected {KEEP} (the "
    f"action's budget) of the {N}-token prompt",
    "Negative": f"position -5 at layer 1, KV head 0; expected prompt positions in [0, {N}) "
    "(-1 only as trailing padding)",
    "Padded": f"-1 padding at layer 0, KV head 1; expected {EXACT}",
    "OutOfRange": f"position {N} at layer 0, KV head 0; expected prompt positions in [0, {N}) "
    "(-1 only as trailing padding)",
    "FloatPositions": "positions returned a torch.float32 tensor; expected integer positions",
    "WrongShape": f"positions returned shape (2, {KEEP}); expected (2, 2, {KEEP}) (layers, KV "
    "heads, kept positions)",
    "NotATensor": "positions returned list; expected an integer torch.Tensor (2, 2, m)",
    "Raises": "positions raised ZeroDivisionError: integer division or modulo by zero",
    "ScalesValues": "positions changed the shared prefill (its keys, values, window queries or "
    "logits); a selector must not modify the prefill, which every action and the reference "
    "rollout read (copy a tensor before changing it)",
    "NaNScores": "score of layer 0: score nan at KV head 0, position 3; expected finite scores "
    "(NaN and inf are refused)",
    "InfScores": "score of layer 0: score inf at KV head 1, position 5; expected finite scores "
    "(NaN and inf are refused)",
    "ScoreRaises": "score raised KeyError: 'window'",
    "BadAlwaysKept": f"always_kept returned [0, 0, 99]; expected at most {KEEP} distinct integer "
    f"positions in [0, {N})",
    "RaggedShort": f"layer 1 keeps {2 * KEEP - 1} entries over its 2 KV heads; expected "
    f"{2 * KEEP}, as the selector declares (kept_per_layer)",
    "RaggedGap": "-1 before a position at layer 0, KV head 0; expected -1 only as trailing padding",
}


@pytest.mark.parametrize("cls", list(CASES))
def test_a_contract_violation_is_one_line_naming_action_and_selector(cls, model, ids):
    spec = action(cls)
    prefill = run_prefill(model, ids, actions=[spec])
    with pytest.raises(ActionError) as info:
        select_positions(prefill, spec)
    assert one_line(info) == f"{where(cls)}: {CASES[cls]}"


def test_an_exception_of_user_code_keeps_its_traceback(model, ids):
    spec = action("Raises")
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), spec)
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # chained: the log shows it


def test_an_observer_that_changes_the_cache_is_stopped_during_the_prefill(model, ids):
    spec = action("ObserveScalesKeys")
    with pytest.raises(ActionError) as info:
        run_prefill(model, ids, actions=[spec])
    assert one_line(info) == (
        "action 'mine': observe changed layer 0's keys, values or position embeddings during "
        "the prefill; a selector must not modify what the model and every other action read"
    )


def test_a_selector_that_changes_the_prefill_leaves_no_trace_in_the_other_actions(model, ids):
    """Before the check, the corrupted values reached every later action and the reference X;
    now the selector is stopped, and an honest selector after it still sees the original."""
    clean = run_prefill(model, ids)
    values = [v.clone() for v in clean.values]
    with pytest.raises(ActionError):
        select_positions(clean, action("ScalesValues"))
    assert not torch.equal(clean.values[0], values[0])  # it did change them: stopped, not hidden
    fresh = run_prefill(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(fresh.values, values, strict=True))


def test_valid_output_is_accepted_in_canonical_form(model, ids):
    prefill = run_prefill(model, ids)
    kept = select_positions(prefill, action("Valid"))  # descending int32: allowed
    assert kept.dtype == torch.long
    assert torch.equal(kept, torch.arange(KEEP).expand(2, 2, KEEP))
    ragged = select_positions(prefill, action("RaggedValid"))
    counts = (ragged >= 0).sum(-1)
    assert counts.tolist() == [[KEEP + 1, KEEP - 1], [KEEP + 1, KEEP - 1]]
    assert bool((ragged[:, 1, -2:] == -1).all())  # head 1's padding stays at the end
    # the digest was checked after each selector, and the prefill is as it was
    assert torch.equal(prefill.verified, prefill.digest())


def test_built_in_selectors_pass_the_contract(model, ids):
    specs = [
        parse_action({"selector": "snapkv", "budget": 12, "window": 4}, name="snapkv"),
        parse_action({"selector": "recent", "budget": 0.5, "sinks": 2}, name="recent"),
        parse_action({"selector": "full"}, name="full"),
    ]
    prefill = run_prefill(model, ids, actions=specs)
    counts = [int((select_positions(prefill, a) >= 0).sum(-1).unique()) for a in specs]
    assert counts == [12, N // 2, N]


def test_the_digest_sees_any_changed_value_and_exchanged_rows(model, ids):
    prefill = run_prefill(model, ids)
    base = prefill.digest()
    keys = prefill.keys[1]
    keep = keys.clone()
    keys[1, 7, 3] = torch.nextafter(keys[1, 7, 3], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(prefill.digest(), base)
    keys.copy_(keep)
    assert torch.equal(prefill.digest(), base)
    keys[0, [2, 9]] = keys[0, [9, 2]].clone()  # two positions exchanged
    assert not torch.equal(prefill.digest(), base)
    keys.copy_(keep)
    prefill.last_logits[0] = float("nan")
    changed = prefill.digest()
    assert not torch.equal(changed, base) and torch.equal(prefill.digest(), changed)  # NaN-safe


def test_digest_cost_is_small_beside_the_prefill():
    """SmolLM2-135M's cache for a 4096-token prompt (30 layers, 3 KV heads, head size 64,
    float32): the digest reads it once, at about the cost of summing it (~40-60 ms on one
    thread of the shared VM; the prefill of that prompt takes seconds). Compared with a plain
    sum in the same process, the best of three each, as the VM's load varies."""
    from kvdiverge.eviction import Prefill

    keys = [torch.randn(3, 4096, 64) for _ in range(30)]
    prefill = Prefill(keys, [k.clone() for k in keys], [], torch.randn(49152), 4096, 3, 64)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    summed = best(lambda: [t.sum() for t in prefill.keys + prefill.values])
    assert best(prefill.digest) < 4 * summed + 0.05


def test_a_selector_n_keep_below_one_is_one_line(model, ids):
    spec = action("ZeroKeep")
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), spec)
    assert one_line(info) == (
        f"{where('ZeroKeep')}: n_keep returned 0 for a {N}-token prompt; expected an integer >= 1"
    )


def test_user_code_failing_at_parse_time_is_one_config_line():
    """The config's budget check runs the selector's own check against every stratum."""
    import yaml

    from kvdiverge.config import ConfigError, check_config

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["actions"]["mine"] = {"selector": "selector_helpers:CheckRaises", "budget": 0.5}
    cfg["studies"]["study1"]["actions"].append("mine")
    with pytest.raises(ConfigError) as info:
        check_config(cfg, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    assert one_line(info) == (
        "config.actions.mine: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): selector 'selector_helpers:CheckRaises': "
        "check raised RuntimeError: cannot act on 992 tokens"
    )


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
        f"actions.mine.selector: 'selector_helpers:{cls}' declares a parameter field "
        f"{field!r}, which is an action key; expected parameter names other than name, "
        "selector, budget, budgets, label,"
    ), message
    assert message.endswith(
        "(the action's own fields come from the config alone: rename the field)"
    )


def test_the_pipeline_config_refuses_a_shadowing_field_in_one_line():
    from kvdiverge.config import ConfigError, check_config

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["actions"]["mine"] = {"selector": "selector_helpers:ShadowBudget", "budget": 0.5}
    cfg["studies"]["study1"]["actions"].append("mine")
    with pytest.raises(ConfigError) as info:
        check_config(cfg, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    assert one_line(info).startswith(
        "config.actions.mine.selector: 'selector_helpers:ShadowBudget' declares a "
        "parameter field 'budget', which is an action key"
    )


def test_compare_refuses_a_shadowing_field_in_one_line():
    from kvdiverge.compare.actions import CompareError, parse_actions

    with pytest.raises(CompareError) as info:
        parse_actions("mine=selector_helpers:ShadowBudget@0.5")
    assert one_line(info).startswith(
        "--actions: actions.mine.selector: 'selector_helpers:ShadowBudget' declares a "
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
        "actions.mine.selector: 'selector_helpers:RandomWithoutSeed' declares "
        "deterministic = False; expected an integer `seed` parameter field (seed: int = ...) "
        "from which it draws"
    )


def test_a_deterministic_user_selector_is_called_twice_on_its_first_prompt_only(model, ids):
    from selector_helpers import CALLS

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
