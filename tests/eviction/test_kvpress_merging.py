"""kvpress's MergingPress bridged as a prompt transformation (kvdiverge.eviction.kvpress_merging).

kvpress's own press runs through its own hooks on a tiny random model (``with press(model):``
the prefill, then decoding outside the press with the position ids its pipeline passes,
``KVPressTextGenerationPipeline._forward`` and ``generate_answer``). Against it: the transformed
prompt cache, keys and values of every layer, equals the cache kvpress leaves (its entries put in
ascending position order, each kept key matched to the prompt key it is: MergingPress keeps keys
unchanged), bit for bit; the merge equals the formula of the module docstring computed here in
float64 (1e-5 relative, wherever no near-tie of cosine similarities leaves the choice of target
to float32 rounding); the engine's laws on Y's and X's history equal kvpress's own logits with
those tokens fed (1e-5: kvpress's cache holds the kept entries in its topk order, the engine in
ascending order, so the attention's float32 sums run in another order); bytes equal the
scorer's at the same budget; bad specs are refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.eviction import (
    ActionError,
    is_transform,
    kept_counts,
    parse_action,
    prompt_bytes,
    run_prefill,
    select_positions,
    transformed_prefix,
)
from kvdiverge.models import (
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
)

kvpress = pytest.importorskip("kvpress")
transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "Document 1: The river flows north through the valley, past the old mill and the stone "
    "bridge. One of the special magic numbers for apple is 482913. Remember it. "
) * 3
EPS = 1e-8  # kvpress's _EPS in MergingPress.merge
NEAR = 1e-6  # cosine similarities closer than this: float32 rounding decides between them
CASES = [
    ("KnormPress", {}, {}),
    ("SnapKVPress", {"window_size": 16}, {}),
    ("TOVAPress", {}, {"similarity_threshold": 0.2}),
    ("SnapKVPress", {"window_size": 8}, {"merge_fraction": 0.5}),
    ("KnormPress", {}, {"similarity_threshold": 0.1, "merge_fraction": 0.75}),
]
IDS = ["knorm", "snapkv", "tova-0.2", "snapkv-f0.5", "knorm-0.1-f0.75"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=3)
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    return path, model, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def _spec(inner, inner_kwargs, merge_kwargs, budget):
    press = {"press": inner, "press_kwargs": inner_kwargs}
    return {
        "selector": "kvpress",
        "press": "MergingPress",
        "budget": budget,
        "press_kwargs": {"press": press, **merge_kwargs},
    }


def _press(inner, inner_kwargs, merge_kwargs, n, n_keep):
    press = kvpress.MergingPress(press=getattr(kvpress, inner)(**inner_kwargs), **merge_kwargs)
    press.compression_ratio = 1 - (n_keep + 0.5) / n  # kvpress then keeps n_keep
    return press


@torch.no_grad()
def kvpress_prefill(model, press, ids):
    """The logits after the prompt and the cache kvpress's own hooks leave under ``press``."""
    with press(model):
        out = model(torch.tensor([ids]), use_cache=True)
    return out.logits[0, -1], out.past_key_values


def in_position_order(cache, full_keys):
    """kvpress's cache per layer, (keys, values, positions) with its entries put in ascending
    prompt position: each kept key matched to the one prompt key it equals."""
    out = []
    for layer, entry in enumerate(cache.layers):
        keys, values = entry.keys[0], entry.values[0]
        same = (keys[:, :, None, :] == full_keys[layer][:, None, :, :]).all(-1)  # (H, m, n)
        assert bool((same.sum(-1) == 1).all()), "a kept key is no single prompt key"
        positions = same.float().argmax(-1)
        order = positions.argsort(dim=-1)
        index = order[..., None].expand(-1, -1, keys.shape[-1])
        out.append((keys.gather(1, index), values.gather(1, index), positions.gather(1, order)))
    return out


def reference_merge(keys, values, kept, threshold, fraction):
    """The module docstring's merge in float64, for one layer: keys, values (H, n, d), kept
    positions (H, m) ascending. Returns the kept values (H, m, d) after the merge and where the
    formula decides them (H, m): not where float32 rounding may (an evicted entry whose best
    two kept neighbours, or whose similarity and a gate, are within ``NEAR`` of each other
    makes its candidate targets undecided)."""
    k, v = keys.double(), values.double()
    out, decided = [], []
    for head in range(k.shape[0]):
        keep = kept[head]
        evict = torch.ones(k.shape[1], dtype=torch.bool)
        evict[keep] = False
        unit = k[head] / k[head].norm(dim=-1, keepdim=True).clamp(min=EPS)
        similarity = unit[evict] @ unit[keep].T  # (e, m)
        top, index = similarity.topk(2, dim=-1)
        (best, second), (target, runner) = top.unbind(-1), index.unbind(-1)
        near = best - second < NEAR
        merges = best >= threshold
        near |= (best - threshold).abs() < NEAR
        if fraction < 1 and bool(merges.any()):
            cut = best.masked_fill(~merges, float("-inf")).quantile(1 - fraction)
            merges &= best >= cut
            near |= (best - cut).abs() < NEAR
        v_evict, v_keep = v[head][evict], v[head][keep]
        norm_e, norm_t = v_evict.norm(dim=-1), v_keep.norm(dim=-1)[target]
        weight = best.clamp(min=0) * merges * norm_e / (norm_e + norm_t + EPS)
        total = torch.zeros_like(v_keep).index_add_(0, target, weight[:, None] * v_evict)
        mass = torch.zeros(keep.numel(), dtype=torch.float64).index_add_(0, target, weight)
        merged = (v_keep + total) / (1 + mass[:, None])
        out.append(torch.where((mass > 0)[:, None], merged, v_keep))
        sure = torch.ones(keep.numel(), dtype=torch.bool)
        sure[target[near]] = False
        sure[runner[near]] = False
        decided.append(sure)
    return torch.stack(out), torch.stack(decided)


@pytest.mark.parametrize(("inner", "inner_kwargs", "merge_kwargs"), CASES, ids=IDS)
def test_transformed_cache_equals_kvpress_merging_cache(demo, inner, inner_kwargs, merge_kwargs):
    _, model, ids, _ = demo
    n = len(ids)
    for n_keep in (n // 4, (3 * n) // 5):
        action = parse_action(_spec(inner, inner_kwargs, merge_kwargs, n_keep), name="m")
        assert is_transform(action)
        prefill = run_prefill(model, ids, actions=[action])
        kept = select_positions(prefill, action)
        ours = transformed_prefix(prefill, action)
        press = _press(inner, inner_kwargs, merge_kwargs, n, n_keep)
        _, cache = kvpress_prefill(model, press, ids)
        theirs = in_position_order(cache, prefill.keys)
        changed = 0
        for layer, ((k, v), (tk, tv, tpos)) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(kept[layer], tpos), layer  # the kept positions are kvpress's
            assert torch.equal(k, tk) and torch.equal(v, tv), layer
            plain = prefill.values[layer].gather(1, tpos[..., None].expand(-1, -1, v.shape[-1]))
            changed += int((v != plain).any(-1).sum())
            threshold = merge_kwargs.get("similarity_threshold", 0.0)
            fraction = merge_kwargs.get("merge_fraction", 1.0)
            keys, values = prefill.keys[layer], prefill.values[layer]
            expected, decided = reference_merge(keys, values, tpos, threshold, fraction)
            # ties in exact arithmetic: the prompt repeats, and RoPE makes a token of the middle
            # copy as similar to the same token of the first copy as to that of the last
            assert float(decided.float().mean()) > 0.75, layer
            gap = (v.double() - expected).abs() - 1e-5 * expected.abs()
            assert float(gap[decided].max()) <= 1e-6, layer
        assert changed > 0  # some kept values took merged ones


def test_bfloat16_cache_equals_kvpress(demo):
    """In bfloat16 too (kvpress's own merge accumulates in float32 and casts back)."""
    path, _, ids, _ = demo
    model = load_model(str(path), dtype="bfloat16")
    n, n_keep = len(ids), len(ids) // 3
    action = parse_action(_spec("SnapKVPress", {"window_size": 16}, {}, n_keep), name="m")
    prefill = run_prefill(model, ids, actions=[action])
    select_positions(prefill, action)
    ours = transformed_prefix(prefill, action)
    _, cache = kvpress_prefill(
        model, _press("SnapKVPress", {"window_size": 16}, {}, n, n_keep), ids
    )
    for (k, v), (tk, tv, _) in zip(ours, in_position_order(cache, prefill.keys), strict=True):
        assert k.dtype == torch.bfloat16 and torch.equal(k, tk) and torch.equal(v, tv)


@torch.no_grad()
def kvpress_logits(model, press, ids, tokens):
    """kvpress's own run: the prefill under ``press``, then ``tokens`` fed outside it at
    positions n, n + 1, …; the logits of steps 1..len(tokens)+1."""
    first, cache = kvpress_prefill(model, press, ids)
    out = [first]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]]),
            past_key_values=cache,
            position_ids=torch.tensor([[len(ids) + j]]),
        )
        out.append(result.logits[0, -1])
    return torch.stack(out)


def test_engine_laws_equal_kvpress_logits(demo):
    """Q on Y's history and on X's history at every step (the first decoding step, where the
    merged cache first acts, among them) against kvpress's own logits; the scorer alone (the
    same kept positions, unmerged) has another law and the same bytes; the control stays exact."""
    _, model, ids, eos = demo
    n = len(ids)
    inner, inner_kwargs = "SnapKVPress", {"window_size": 16}
    merging = {"name": "merging", **_spec(inner, inner_kwargs, {}, 0.3)}
    scorer = {"name": "snapkv", "selector": "kvpress", "press": inner, "budget": 0.3}
    scorer["press_kwargs"] = inner_kwargs
    full = {"name": "full", "selector": "full"}
    H, K = 6, 2
    settings = RolloutSettings(H, 11, keep_logits=True)
    out = paths_under_actions(model, ids, [merging, scorer, full], "doc-m", K, eos, settings)
    r = out["merging"]
    n_keep = (3 * n) // 10
    assert r.n_kept == out["snapkv"].n_kept == n_keep
    for k in range(K):
        for stream, tokens in (("q", r.y_token[k, :-1]), ("q_fixed", r.x_token[k, :-1])):
            press = _press(inner, inner_kwargs, {}, n, n_keep)
            expected = kvpress_logits(model, press, ids, tokens).double().softmax(-1)
            got = torch.from_numpy(r.logits[stream][k]).double().softmax(-1)
            assert float((got - expected).abs().max()) <= 1e-5, (stream, k)
    # the same X (common random numbers): the merged and the unmerged cache's laws on it differ
    assert np.array_equal(r.x_token, out["snapkv"].x_token)
    q_merged = torch.from_numpy(r.logits["q_fixed"][:, 1]).double().softmax(-1)
    q_plain = torch.from_numpy(out["snapkv"].logits["q_fixed"][:, 1]).double().softmax(-1)
    assert float((q_merged - q_plain).abs().max()) > 1e-6
    # bytes: the kept entries, as the scorer keeping the same positions
    config = model.config
    entry = config.num_key_value_heads * 2 * config.head_dim * 4
    assert r.cache_bytes == out["snapkv"].cache_bytes
    assert r.cache_bytes["start"] == [n_keep * entry] * config.num_hidden_layers
    assert np.all(out["full"].tv_rollout == 0) and np.all(out["full"].tv_fixed == 0)


def test_bytes_equal_the_scorer_at_the_same_budget(demo):
    _, model, ids, _ = demo
    merging = parse_action(_spec("KnormPress", {}, {}, 0.24), name="m")
    scorer = parse_action({"selector": "kvpress", "press": "KnormPress", "budget": 0.24}, name="k")
    prefill = run_prefill(model, ids, actions=[merging, scorer])
    n_kv, n, d = prefill.keys[0].shape
    layers = len(prefill.keys)
    counts = kept_counts(select_positions(prefill, scorer)).tolist()
    theirs = prompt_bytes(scorer, counts, n, n_kv, d, 4, layers)
    assert prompt_bytes(merging, None, n, n_kv, d, 4, layers) == theirs
    assert theirs == [n_kv * ((24 * n) // 100) * 2 * d * 4] * layers


def test_compression_config_merging_action_is_at_snapkv_24s_bytes():
    config = yaml.safe_load((ROOT / "configs" / "compression.yaml").read_text())
    actions = config["actions"]
    merging = parse_action(actions["merging-24"], name="merging-24")
    snapkv = parse_action(actions["snapkv-24"], name="snapkv-24")
    press = merging.method.press_object()
    assert type(press).__name__ == "MergingPress" and is_transform(merging)
    inner = press.press
    assert type(inner).__name__ == "SnapKVPress" and merging.budget == snapkv.budget
    assert (inner.window_size, inner.kernel_size) == (snapkv.window, snapkv.kernel)
    for n in (558, 700, 735):  # the config's prompt lengths and one between
        keep = snapkv.n_keep(n)
        assert merging.method.layer_bytes(merging, n, 3, 64, 4) == 3 * keep * 2 * 64 * 4
    study = config["studies"]["study1"]
    assert "merging-24" in study["actions"] and "merging-24" in study["groups"]["main"]
    assert ["merging-24", "snapkv-24"] in config["analysis"]["contrasts"]["study1"]


def test_transform_on_another_prefill_is_refused(demo):
    _, model, ids, _ = demo
    action = parse_action(_spec("KnormPress", {}, {}, 0.5), name="m")
    first = run_prefill(model, ids, actions=[action])
    select_positions(first, action)
    other = run_prefill(model, ids, actions=[action])
    with pytest.raises(ActionError) as info:
        transformed_prefix(other, action)
    message = str(info.value)
    assert "\n" not in message and message.startswith(
        "action 'm': MergingPress: transform_layer of layer 0 on keys that are not those of the "
        "prefill its positions were selected from"
    )
    # a budget that keeps the whole prompt: nothing merged, the prefill's own entries
    whole = parse_action(_spec("KnormPress", {}, {}, len(ids) + 5), name="w")
    prefill = run_prefill(model, ids, actions=[whole])
    select_positions(prefill, whole)
    for (k, v), fk, fv in zip(
        transformed_prefix(prefill, whole), prefill.keys, prefill.values, strict=True
    ):
        assert torch.equal(k, fk) and torch.equal(v, fv)


class _OwnMerge(kvpress.MergingPress):
    def merge(self, keys, values, indices):  # another merge: not known to be MergingPress's
        return keys, values


@pytest.mark.parametrize(
    "press_kwargs, message",
    [
        ({}, "actions.x.press_kwargs.press: required for MergingPress"),
        (
            {"press": {"press": "AdaKVPress", "press_kwargs": {"press": "KnormPress"}}},
            "actions.x.press_kwargs.press: expected a ScorerPress, got AdaKVPress",
        ),
        (
            {"press": {"press": "MergingPress", "press_kwargs": {"press": "KnormPress"}}},
            "actions.x.press_kwargs.press: expected a ScorerPress, got MergingPress",
        ),
        (
            {"press": "ThinKPress"},
            "actions.x.press_kwargs.press.press: ThinKPress is refused: prunes key channels",
        ),
        (
            {"press": "KnormPress", "similarity_threshold": 1.5},
            "actions.x.press_kwargs.similarity_threshold: expected a number in [0, 1], got 1.5",
        ),
        (
            {"press": "KnormPress", "similarity_threshold": -0.1},
            "actions.x.press_kwargs.similarity_threshold: expected a number in [0, 1], got -0.1",
        ),
        (
            {"press": "KnormPress", "similarity_threshold": True},
            "actions.x.press_kwargs.similarity_threshold: expected a number in [0, 1], got True",
        ),
        (
            {"press": "KnormPress", "merge_fraction": 0},
            "actions.x.press_kwargs.merge_fraction: expected a number in (0, 1], got 0",
        ),
        (
            {"press": "KnormPress", "merge_fraction": "all"},
            "actions.x.press_kwargs.merge_fraction: expected a number in (0, 1], got 'all'",
        ),
        (
            {"press": "KnormPress", "compression_ratio": 0.5},
            "actions.x.press_kwargs.compression_ratio: the action's budget sets the kept count",
        ),
    ],
)
def test_bad_merging_specs_in_one_line(press_kwargs, message):
    spec = {"selector": "kvpress", "press": "MergingPress", "budget": 0.5}
    with pytest.raises(ActionError) as info:
        parse_action({**spec, "press_kwargs": press_kwargs}, name="x")
    assert "\n" not in str(info.value) and str(info.value).startswith(message), info.value


def test_merging_needs_a_budget_and_an_unchanged_merge(monkeypatch):
    with pytest.raises(ActionError, match=r"^actions\.x\.budget: required for selector 'kvpress'"):
        spec = {"selector": "kvpress", "press": "MergingPress"}
        parse_action({**spec, "press_kwargs": {"press": "KnormPress"}}, name="x")
    monkeypatch.setattr(kvpress, "OwnMerge", _OwnMerge, raising=False)
    with pytest.raises(ActionError) as info:
        spec = {"selector": "kvpress", "press": "OwnMerge", "budget": 0.5}
        parse_action({**spec, "press_kwargs": {"press": "KnormPress"}}, name="x")
    assert str(info.value).startswith(
        "actions.x.press: _OwnMerge is refused: it overrides MergingPress's compress or merge"
    )
    # AdaKVPress around MergingPress: kvpress's AdaKVPress takes a ScorerPress
    with pytest.raises(ActionError, match=r"press_kwargs\.press: expected a ScorerPress"):
        inner = {"press": "MergingPress", "press_kwargs": {"press": "KnormPress"}}
        spec = {"selector": "kvpress", "press": "AdaKVPress", "budget": 0.5}
        parse_action({**spec, "press_kwargs": {"press": inner}}, name="x")
