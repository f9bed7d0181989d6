"""Eviction selectors and budgets (kvdiverge.eviction; kvpress reference)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from kvdiverge.eviction import (
    SELECTORS,
    ActionError,
    ScoredSelector,
    Selector,
    budget_tokens,
    kept_positions,
    parse_action,
    register_selector,
    run_prefill,
    select_positions,
)
from kvdiverge.models import build_demo_model, chat_prompt_ids, load_model, load_tokenizer

PROMPT = (
    "Document 1: The river flows north through the valley, past the old mill and the stone "
    "bridge. One of the special magic numbers for apple is 482913. Remember it. "
) * 6

transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=3)
    tok = load_tokenizer(str(path))
    return path, load_model(str(path)), chat_prompt_ids(tok, PROMPT)


def snapkv_from_definition(
    attn_probs: np.ndarray, groups: int, window: int, kernel: int, n_keep: int
) -> np.ndarray:
    """SnapKV kept positions computed directly from a layer's attention probabilities.

    ``attn_probs`` (H, n, n): the model's own (eager) softmax attention. Scores per the kvpress
    definition: window rows, prefix columns, mean over the window queries, zero-padded average
    pooling (sum of the k neighbours / k), mean over the query heads of each KV head; keep the
    window plus the top (n_keep − w) prefix positions. Returns (H_kv, n_keep) sorted, plus the
    smallest score gap at the cut (to show the comparison is not decided by ties).
    """
    n_heads, n, _ = attn_probs.shape
    prefix_len = n - window
    half = kernel // 2
    kept, gaps = [], []
    for kv in range(n_heads // groups):
        score = np.zeros(prefix_len)
        for h in range(kv * groups, (kv + 1) * groups):
            mean_over_window = attn_probs[h, prefix_len:, :prefix_len].mean(axis=0)
            pooled = np.array(
                [
                    sum(
                        mean_over_window[i]
                        for i in range(j - half, j + half + 1)
                        if 0 <= i < prefix_len
                    )
                    / kernel
                    for j in range(prefix_len)
                ]
            )
            score += pooled / groups
        order = np.argsort(-score, kind="stable")
        top = order[: n_keep - window]
        gaps.append(score[order[n_keep - window - 1]] - score[order[n_keep - window]])
        kept.append(np.sort(np.concatenate([top, np.arange(prefix_len, n)])))
    return np.stack(kept), min(gaps)


@pytest.mark.parametrize(
    ("budget", "window", "kernel"), [(0.5, 64, 5), (150, 64, 5), (0.9, 16, 3), (0.3, 32, 7)]
)
def test_snapkv_matches_definition(demo, budget, window, kernel):
    path, model, ids = demo
    n = len(ids)
    action = {"name": "s", "selector": "snapkv", "budget": budget, "window": window}
    action["kernel"] = kernel
    kept = kept_positions(model, ids, action)
    n_keep = budget_tokens(n, budget)
    eager = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager")
    with torch.no_grad():
        attentions = eager(torch.tensor([ids]), output_attentions=True).attentions
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    assert kept.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads, n_keep)
    assert kept.dtype == torch.long
    for layer, probs in enumerate(attentions):
        expected, gap = snapkv_from_definition(
            probs[0].double().numpy(), groups, window, kernel, n_keep
        )
        # the cut is not a floating-point tie: scores are ~1/n, fp32 rounding ~1e-10
        assert gap > 1e-8
        np.testing.assert_array_equal(kept[layer].numpy(), expected)


def test_recent_keeps_sinks_and_tail(demo):
    _, model, ids = demo
    n = len(ids)
    for budget, sinks in [(0.5, 4), (0.9, 4), (100, 4), (0.5, 0), (0.5, 7)]:
        kept = kept_positions(model, ids, {"name": "r", "selector": "recent", "budget": budget})
        n_keep = budget_tokens(n, budget)
        kept = kept_positions(
            model, ids, {"name": "r", "selector": "recent", "budget": budget, "sinks": sinks}
        )
        expected = list(range(sinks)) + list(range(n - (n_keep - sinks), n))
        assert kept.shape[-1] == n_keep
        for row in kept.reshape(-1, n_keep):
            assert row.tolist() == expected


def test_snapkv_and_recent_keep_the_same_count(demo):
    _, model, ids = demo
    for budget in (0.5, 0.9, 200):
        s = kept_positions(model, ids, {"name": "s", "selector": "snapkv", "budget": budget})
        r = kept_positions(model, ids, {"name": "r", "selector": "recent", "budget": budget})
        assert s.shape == r.shape
        assert bool((s.diff(dim=-1) > 0).all())  # ascending and unique


def test_full_and_budget_at_least_n_keep_everything(demo):
    _, model, ids = demo
    n = len(ids)
    everything = torch.arange(n)
    for action in (
        {"name": "full", "selector": "full"},
        {"name": "s", "selector": "snapkv", "budget": n},
        {"name": "s", "selector": "snapkv", "budget": 10**6},
        {"name": "s", "selector": "snapkv", "budget": 1.0},
        {"name": "r", "selector": "recent", "budget": n + 1},
    ):
        kept = kept_positions(model, ids, action)
        assert kept.shape[-1] == n
        assert bool((kept == everything).all())


def test_budget_arithmetic_edge_cases():
    # fractions are floored exactly, never through binary floating point
    for n in range(2, 3000):
        assert budget_tokens(n, 0.9) == (9 * n) // 10
        assert budget_tokens(n, 0.5) == n // 2
    # multiples of ten keep exactly 9n/10
    assert [budget_tokens(n, 0.9) for n in (10, 100, 1230)] == [9, 90, 1107]
    # binary floating point would get some of them wrong; exact arithmetic does not
    wrong = [n for n in range(1, 3000) if int(n * 0.7) != (7 * n) // 10]
    assert wrong and all(budget_tokens(n, 0.7) == (7 * n) // 10 for n in wrong)
    # absolute budgets: n just above 512 keeps 512, n <= budget keeps all
    assert budget_tokens(513, 512) == 512
    assert budget_tokens(512, 512) == 512
    assert budget_tokens(300, 512) == 300
    with pytest.raises(ActionError, match="keeps no entry"):
        budget_tokens(1, 0.5)
    for bad in (0, -3, 1.5, 0.0, -0.5, True, "half", float("nan")):
        with pytest.raises(ActionError):
            budget_tokens(100, bad)


def test_action_validation_is_one_clear_line():
    cases = [
        ({"selector": "h2o", "budget": 0.5}, "selector"),
        ({"selector": "snapkv"}, "budget"),
        ({"selector": "snapkv", "budget": 32}, "observation window"),
        ({"selector": "snapkv", "budget": 0.5, "kernel": 4}, "kernel"),
        ({"selector": "recent", "budget": 2}, "sink"),
        ({"selector": "recent", "budget": 512.0}, "fraction"),
        ({"selector": "full", "budget": 0.5}, "omit budget"),
    ]
    for spec, fragment in cases:
        with pytest.raises(ActionError, match=fragment) as info:
            parse_action(spec, name="bad")
        assert "\n" not in str(info.value) and "actions.bad" in str(info.value)
    spec = parse_action({"selector": "snapkv", "budget": 512}, name="snapkv-512")
    assert spec.as_dict()["budget"] == 512 and spec.window == 64 and spec.kernel == 5


def test_short_prompts_are_clear_errors(demo):
    _, model, ids = demo
    short = ids[:40]
    with pytest.raises(ActionError, match="too short for the 64-token observation window"):
        kept_positions(model, short, {"name": "s", "selector": "snapkv", "budget": 0.5})
    with pytest.raises(ActionError, match="fewer than the 64-token observation window"):
        kept_positions(model, ids, {"name": "s", "selector": "snapkv", "budget": 0.1})
    with pytest.raises(ActionError, match="too short for the 4 sink"):
        kept_positions(model, ids[:4], {"name": "r", "selector": "recent", "budget": 0.5})
    with pytest.raises(ActionError, match="fewer than the 4 sink"):
        kept_positions(model, ids[:7], {"name": "r", "selector": "recent", "budget": 0.5})


def test_a_new_selector_is_one_small_class(demo):
    _, model, ids = demo

    @register_selector
    class FirstSelector(Selector):
        """Keep the first n_keep positions (a test selector)."""

        name = "first-test"

        def positions(self, prefill, action, n_keep):
            idx = torch.arange(n_keep)
            return idx.expand(len(prefill.keys), prefill.keys[0].shape[0], n_keep).clone()

    try:
        kept = kept_positions(model, ids, {"name": "f", "selector": "first-test", "budget": 0.5})
        assert kept[0, 0].tolist() == list(range(len(ids) // 2))
    finally:
        del SELECTORS["first-test"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_snapkv_kept_sets_equal_kvpress_own_compression(demo, dtype):
    """kvpress's SnapKVPress, applied through its own hooks to the same model and prompt, keeps
    exactly the positions the project's selector keeps, per layer and KV head, also in
    bfloat16 (where the order and dtypes of the score arithmetic decide near-ties)."""
    from kvpress import SnapKVPress

    from kvdiverge.eviction import run_prefill, select_positions

    path, _, ids = demo
    model = load_model(str(path), dtype=dtype)
    n, window = len(ids), 32
    for ratio in (0.5, 0.25, 0.75):
        n_keep = int(n * (1 - ratio))  # kvpress's kept count, given as an integer budget
        press = SnapKVPress(compression_ratio=ratio, window_size=window, kernel_size=5)
        with torch.no_grad(), press(model):
            cache = model(torch.tensor([ids]), use_cache=True).past_key_values
        action = parse_action(
            {"name": "s", "selector": "snapkv", "budget": n_keep, "window": window, "kernel": 5}
        )
        prefill = run_prefill(model, ids, window)
        ours = select_positions(prefill, action)
        for layer, entry in enumerate(cache.layers):
            full, pressed = prefill.keys[layer], entry.keys[0]  # (H_kv, n, d), (H_kv, n_keep, d)
            assert pressed.shape[1] == n_keep
            for head in range(full.shape[0]):
                same = (pressed[head][:, None, :] == full[head][None, :, :]).all(-1)
                theirs = same.float().argmax(-1).sort().values  # positions of kvpress's keys
                assert same.any(-1).all()
                assert torch.equal(theirs, ours[layer, head].to(theirs.device)), (ratio, layer)


def test_selectors_own_their_parameters():
    """Each selector declares its parameters and defaults; an action records them all."""
    snap = parse_action({"selector": "snapkv", "budget": 0.5, "window": 32}, name="s")
    assert snap.as_dict() == {
        "name": "s",
        "selector": "snapkv",
        "budget": 0.5,
        "window": 32,
        "kernel": 5,
    }
    assert snap.window == 32 and snap.method.window == 32 and snap.params["kernel"] == 5
    recent = parse_action({"selector": "recent", "budget": 0.5}, name="r")
    assert recent.as_dict() == {"name": "r", "selector": "recent", "budget": 0.5, "sinks": 4}
    full = parse_action({"selector": "full"}, name="full")
    assert full.as_dict() == {"name": "full", "selector": "full", "budget": None}
    assert full.keeps_everything and not snap.keeps_everything and full.n_keep(37) == 37
    # old callers: SELECTORS[name] runs the action's own selector (its own window)
    assert SELECTORS["snapkv"].query_window(snap) == 32
    with pytest.raises(ActionError, match="32-token observation window"):
        SELECTORS["snapkv"].check(snap, 20, 10)
    cases = [
        (
            {"selector": "recent", "budget": 0.5, "window": 8},
            "actions.bad.window: not a parameter of selector 'recent' (its parameters: sinks)",
        ),
        (
            {"selector": "snapkv", "budget": 0.5, "window": 8.0},
            "actions.bad.window: expected an integer, got 8.0",
        ),
        (
            {"selector": "recent", "budget": 0.5, "sinks": True},
            "actions.bad.sinks: expected an integer, got True",
        ),
        ({"selector": "full", "sinks": 4}, "actions.bad.sinks: not a parameter of selector"),
    ]
    for spec, message in cases:
        with pytest.raises(ActionError) as info:
            parse_action(spec, name="bad")
        assert str(info.value).startswith(message), str(info.value)


def test_scored_selector_keeps_always_kept_then_top_scores(demo):
    """The scored-selector base: always-kept positions, then the top-scored rest, sorted."""
    _, model, ids = demo
    n = len(ids)

    @register_selector
    @dataclass(frozen=True)
    class KeyNorm(ScoredSelector):
        name = "keynorm-test"
        sinks: int = 3

        def always_kept(self, n):
            return range(self.sinks)

        def score(self, prefill, action, layer):
            return prefill.keys[layer].float().norm(dim=-1)

    try:
        action = parse_action({"selector": "keynorm-test", "budget": 0.25}, name="k")
        prefill = run_prefill(model, ids)
        kept = select_positions(prefill, action)
        assert kept.shape[-1] == budget_tokens(n, 0.25)
        for layer, keys in enumerate(prefill.keys):
            norms = keys.float().norm(dim=-1)
            for head, positions in enumerate(kept[layer]):
                assert positions[:3].tolist() == [0, 1, 2]
                assert bool((positions.diff() > 0).all())
                evicted = torch.ones(n, dtype=torch.bool)
                evicted[positions] = False
                # every kept position scores at least as high as every evicted one (ties: the
                # prompt repeats, so equal tokens have equal key norms in layer 0)
                assert norms[head, positions[3:]].min() >= norms[head, evicted].max()
    finally:
        del SELECTORS["keynorm-test"]
