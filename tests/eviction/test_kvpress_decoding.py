"""kvpress's DecodingPress bridged (kvdiverge.eviction.kvpress_decoding): kvpress's own press runs
through its own hooks on a tiny model, prefill then decoding with the position ids its pipeline
passes (``KVPressTextGenerationPipeline.generate_answer``), and its cache is read after every
step (each kept key vector matched to the entry it was). Against it, step by step: the bridge's
schedule and kept entries applied by this file to a plain cache (the same positions in the same
order, each step), and the engine's laws on Y's and on X's history (1e-5) up to any step whose
kept set kvpress's own scores leave undetermined (a tie at the boundary, :data:`TIE_GAP`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers import DynamicCache

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.eviction import ActionError, parse_action
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

PROMPT = (
    "Document 1: The river flows north through the valley, past the old mill and the stone "
    "bridge. One of the special magic numbers for apple is 482913. Remember it, then answer."
)
PRESSES = [  # (base press, its kwargs, compression_interval, target_size or one per model type)
    ("KnormPress", {}, 3, {"llama": 32, "qwen2": 34}),
    ("KeyDiffPress", {}, 2, 20),
    ("StreamingLLMPress", {"n_sink": 4}, 4, 16),
]
TIE_GAP = 1e-4
"""Smallest gap, relative to the score, between the last kept and the first evicted entry's
kvpress score at a compression for the kept set to be determined by the scores. The engine's keys
are its own forward's, which differ from the transformers forward's kvpress runs on in rounding
(a few float32 ulps on the demo models), so its scores do too; a gap far above that orders both
alike. Below it, and in an exact tie, the choice is torch.topk's, whose order among equal values
is unspecified and depends on the whole score vector and the CPU's vector width: KnormPress's
scores tie exactly for a repeated token in the first layer (equal keys before RoPE, which keeps
the norm), and which of them are kept changes the law by far more than 1e-5."""


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=3)
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    return model, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def _target(model, target):
    """The target_size for ``model``. KnormPress's differs per demo model: its first layer's
    scores tie for every repeated token (exactly, or within a float32 ulp), and most target sizes
    put a tie at the boundary of some compression of this prompt's rows; each is one whose rows
    the engine test checks at all but one or two of its 56 steps (:data:`TIE_GAP`)."""
    return target[model.config.model_type] if isinstance(target, dict) else target


def _spec(base, kwargs, interval, target):
    inner = {"press": base, "press_kwargs": kwargs}
    press_kwargs = {"base_press": inner, "compression_interval": interval, "target_size": target}
    return {"selector": "kvpress", "press": "DecodingPress", "press_kwargs": press_kwargs}


def _press(base, kwargs, interval, target):
    return kvpress.DecodingPress(
        base_press=getattr(kvpress, base)(**kwargs),
        compression_interval=interval,
        target_size=target,
    )


@torch.no_grad()
def kvpress_run(model, press, ids, tokens=None, steps=12):
    """kvpress's own decoding under ``press``: the prefill, then ``tokens`` fed (greedy ones when
    None) at positions n, n + 1, …; per step its logits, per layer the positions its cache holds
    in its order ((H_kv, m) after the step's compression), and the smallest relative gap between
    the m-th and (m+1)-th of its base press's scores at the step's compressions (inf if none)."""
    n = len(ids)
    layers = model.model.layers
    held = [torch.arange(n).expand(model.config.num_key_value_heads, n) for _ in layers]
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    scored: dict[int, torch.Tensor] = {}
    base = press.base_press
    own_score = base.score

    def score(module, *args):  # the base press's own scores, as its compress uses them
        scores = own_score(module, *args)
        scored[module.layer_idx] = scores[0].detach().clone()
        return scores

    def snapshot(module, args, kwargs, output):  # runs before kvpress's hook: uncompressed
        if kwargs["hidden_states"].shape[1] == 1:
            cache = kwargs["past_key_values"].layers[module.layer_idx]
            before[module.layer_idx] = cache.keys[0].clone()

    def match(module, args, kwargs, output):  # runs after it: what kvpress kept, in its order
        if kwargs["hidden_states"].shape[1] != 1:
            return
        i = module.layer_idx
        pos = torch.cat([held[i], torch.full((held[i].shape[0], 1), step[0])], dim=1)
        kept = kwargs["past_key_values"].layers[i].keys[0]
        same = (kept[:, :, None, :] == before[i][:, None, :, :]).all(-1)  # (H, m, L)
        assert bool((same.sum(-1) == 1).all()), "a kept key is no entry of the cache"
        held[i] = pos.gather(1, same.float().argmax(-1))
        scores = scored.pop(i, None)
        m = kept.shape[1]
        if scores is not None and m < scores.shape[-1]:
            top = scores.double().sort(dim=-1, descending=True).values
            gap = (top[:, m - 1] - top[:, m]) / top[:, m - 1].abs().clamp_min(1e-30)
            gaps[-1] = min(gaps[-1], float(gap.min()))

    hooks = [layer.self_attn.register_forward_hook(snapshot, with_kwargs=True) for layer in layers]
    cache = DynamicCache()
    step = [0]
    logits, positions, gaps = [], [], []
    base.score = score
    try:
        with press(model):
            hooks += [
                layer.self_attn.register_forward_hook(match, with_kwargs=True) for layer in layers
            ]
            out = model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            logits.append(out.logits[0, -1])
            count = steps if tokens is None else len(tokens)
            for j in range(count):
                token = int(logits[-1].argmax()) if tokens is None else int(tokens[j])
                step[0] = n + j
                gaps.append(float("inf"))
                out = model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[n + j]]),
                )
                logits.append(out.logits[0, -1])
                positions.append([h.clone() for h in held])
    finally:
        del base.score
        for hook in hooks:
            hook.remove()
    return torch.stack(logits), positions, gaps


@torch.no_grad()
def bridged_positions(model, action, ids, tokens):
    """The bridge's schedule and kept entries applied to a plain DynamicCache fed ``tokens``:
    per step, per layer, the positions held in their order."""
    n = len(ids)
    interval, _ = action.method.schedule(action)
    cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    held = [torch.arange(n).expand(layer.keys.shape[1], n) for layer in cache.layers]
    out = []
    for j, token in enumerate(tokens):
        model(
            input_ids=torch.tensor([[int(token)]]),
            past_key_values=cache,
            position_ids=torch.tensor([[n + j]]),
        )
        for i, layer in enumerate(cache.layers):
            held[i] = torch.cat([held[i], torch.full((held[i].shape[0], 1), n + j)], dim=1)
            if (j + 1) % interval:
                continue
            keys, values = layer.keys[0], layer.values[0]
            kept = action.method.compress(action, i, keys, values, held[i])
            index = kept[None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
            held[i] = held[i].gather(1, kept)
        out.append([h.clone() for h in held])
    return out


@pytest.mark.parametrize("base, kwargs, interval, target", PRESSES)
def test_kept_entries_equal_kvpress_step_by_step(demo, base, kwargs, interval, target):
    model, ids, _ = demo
    target = _target(model, target)
    assert len(ids) > target
    action = parse_action(_spec(base, kwargs, interval, target), name="dec")
    logits, theirs, _ = kvpress_run(model, _press(base, kwargs, interval, target), ids, steps=12)
    tokens = logits[:-1].argmax(-1)
    ours = bridged_positions(model, action, ids, tokens)
    compressed = 0
    for step, (mine, kv) in enumerate(zip(ours, theirs, strict=True)):
        for layer, (a, b) in enumerate(zip(mine, kv, strict=True)):
            assert torch.equal(a, b), (step, layer)
        compressed += mine[0].shape[1] < len(ids) + step + 1
    assert compressed >= 12 // interval - 1  # kvpress compressed, and so did the bridge


@pytest.mark.parametrize("base, kwargs, interval, target", PRESSES)
def test_engine_laws_equal_kvpress_decoding(demo, base, kwargs, interval, target):
    """The engine's Q on Y's history and on X's history equal kvpress's own logits with those
    tokens fed (its hooks compressing its cache), step by step up to a step whose kept set
    kvpress's scores leave undetermined (:data:`TIE_GAP`), and more than half of all steps; the
    full control stays exact."""
    model, ids, eos = demo
    target = _target(model, target)
    spec = {"name": "dec", **_spec(base, kwargs, interval, target)}
    full = {"name": "full", "selector": "full"}
    H, K = 14, 2
    out = paths_under_actions(
        model, ids, [spec, full], "doc-k", K, eos, RolloutSettings(H, 7, keep_logits=True)
    )
    r = out["dec"]
    assert r.tv_rollout[:, 1:].max() > 1e-4
    checked = total = 0
    for k in range(K):
        for stream, tokens in (("q", r.y_token[k, :-1]), ("q_fixed", r.x_token[k, :-1])):
            press = _press(base, kwargs, interval, target)
            theirs, _, gaps = kvpress_run(model, press, ids, tokens)
            # feeding token j (logits row j + 1) compresses after the attention: a tie there
            # changes the cache, and so the law, from row j + 2 on
            ties = [j for j, gap in enumerate(gaps) if gap <= TIE_GAP]
            upto = ties[0] + 2 if ties else len(theirs)
            expected = theirs[:upto].double().softmax(-1)
            got = torch.from_numpy(r.logits[stream][k][:upto]).double().softmax(-1)
            assert float((got - expected).abs().max()) <= 1e-5, (stream, k)
            checked, total = checked + upto, total + len(theirs)
    assert 2 * checked > total, (checked, total)  # most steps are determined and checked
    assert np.all(out["full"].tv_rollout == 0) and np.all(out["full"].tv_fixed == 0)
    # bytes: each Y row held at most target + interval entries per KV head at its last call
    config = model.config
    entry = config.num_key_value_heads * 2 * config.head_dim * 4
    assert max(max(row) for row in r.cache_bytes["end_rows"]) <= (target + interval) * entry


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            {"press_kwargs": {"base_press": "SnapKVPress"}},
            "actions.d.press_kwargs.base_press: SnapKVPress is refused under DecodingPress",
        ),
        (
            {"budget": 0.5, "press_kwargs": {"base_press": "KnormPress"}},
            "actions.d.budget: DecodingPress compresses each row's cache during decoding",
        ),
        (
            {"press_kwargs": {"base_press": "KnormPress", "target_size": 0}},
            "actions.d.press_kwargs: DecodingPress: target_size must be greater than 0",
        ),
    ],
)
def test_bad_decoding_press_specs_in_one_line(entry, message):
    with pytest.raises(ActionError) as info:
        parse_action({"selector": "kvpress", "press": "DecodingPress", **entry}, name="d")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
