"""Prompt attention layouts (engine.attention.PromptPass, RolloutSettings.prompt_attention):
the masked pass — all rows of a document in one product against its full prompt, each action's
evicted entries masked per layer and KV head — gives every row today's laws (the gathered
layout) to float rounding and the independent masked forward's, reruns are bit-identical, the
control stays exact with one thread, and a masked action holds a mask, not a copy."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from engine_reference import law_differences, random_prompt

import kvdiverge.engine.attention as attention
from kvdiverge.engine import RolloutSettings, batched_paths, paths_under_actions
from kvdiverge.engine.document import DocumentRollout, gather_prefix, kept_mask
from kvdiverge.engine.kernels import native as native_kernel
from kvdiverge.engine.kernels import registry
from kvdiverge.engine.settings import MASKED_MIN_FRACTION
from kvdiverge.eviction import kept_positions, parse_action, run_prefill
from kvdiverge.models import (
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
)

transformers.utils.logging.disable_progress_bar()

PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 5
ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 0.5, "window": 32}, name="snapkv-half"),
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({"selector": "snapkv", "budget": 20, "window": 8}, name="snapkv-20"),
    parse_action({"selector": "full"}, name="full"),
]
LAWS = ("p", "q", "q_fixed")

NATIVE = native_kernel.library() is not None  # built here (AVX-512, a compiler, not turned off)


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=11)
    tok = load_tokenizer(str(path))
    model = load_model(str(path))
    return model, tok, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def _run(model, ids, eos, layout, H=14, K=4, actions=ACTIONS):
    settings = RolloutSettings(H, 7, keep_logits=True, prompt_attention=layout)
    return paths_under_actions(model, ids, actions, "doc-m", K, eos, settings)


def _probs(logits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(logits).double().softmax(-1)


def test_masked_and_auto_layouts_equal_the_gathered_one(demo):
    """Every row's laws under the masked pass and under auto equal the gathered layout's to
    float rounding (the same tokens, so the laws are comparable); the control is exact."""
    model, _, ids, eos = demo
    gathered = _run(model, ids, eos, "gathered")
    for layout in ("masked", "auto"):
        other = _run(model, ids, eos, layout)
        for a in ACTIONS:
            want, got = gathered[a.name], other[a.name]
            assert np.array_equal(want.x_token, got.x_token), (layout, a.name)
            assert np.array_equal(want.y_token, got.y_token), (layout, a.name)
            assert (want.n_kept, want.rows_per_replicate) == (got.n_kept, got.rows_per_replicate)
            for name in LAWS:
                diff = (_probs(want.logits[name]) - _probs(got.logits[name])).abs().max()
                assert float(diff) <= 1e-5, (layout, a.name, name)
            np.testing.assert_allclose(got.tv_rollout, want.tv_rollout, atol=1e-5)
            np.testing.assert_allclose(got.tv_fixed, want.tv_fixed, atol=1e-5)
        # one thread: the control's rows share the X rows' product, so δ ≡ f ≡ 0 exactly
        full = other["full"]
        assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
        assert np.array_equal(full.x_token, full.y_token)


def test_masked_layout_equals_the_independent_masked_forward(demo):
    """P on X's history, Q on Y's and Q on X's history under the masked pass equal plain
    transformers decoding over an explicitly gathered cache (tests/engine_reference.py)."""
    model, _, ids, eos = demo
    runs = _run(model, ids, eos, "masked", H=16, K=3, actions=ACTIONS[:1] + ACTIONS[2:3])
    everything = kept_positions(model, ids, {"selector": "full"})
    for a in (ACTIONS[0], ACTIONS[2]):
        kept = kept_positions(model, ids, a)
        for k in range(3):
            for name, diff in law_differences(
                model, ids, kept, everything, runs[a.name], k
            ).items():
                assert diff <= 1e-5, (a.name, name, k)


def test_masked_reruns_are_bit_identical_and_batches_equal_one_document_runs(demo):
    model, tok, ids, eos = demo
    first, again = _run(model, ids, eos, "masked"), _run(model, ids, eos, "masked")
    for name in first:
        for field in ("x_token", "y_token", "tv_rollout", "tv_fixed", "x_eos", "y_eos"):
            assert np.array_equal(getattr(first[name], field), getattr(again[name], field))
        for law in LAWS:
            assert np.array_equal(first[name].logits[law], again[name].logits[law])
    # several documents in one call: each its own masked pass over its own prompt
    other = chat_prompt_ids(tok, PROMPT[::-1][:300])
    settings = RolloutSettings(10, 2, prompt_attention="masked")
    docs = [("a", ids, 3), ("b", other, 2)]
    batched = dict(batched_paths(model, docs, ACTIONS, eos, settings))
    for doc_id, doc_ids, k in docs:
        alone = paths_under_actions(model, doc_ids, ACTIONS, doc_id, k, eos, settings)
        for a in ACTIONS:
            got, want = batched[doc_id][a.name], alone[a.name]
            assert np.array_equal(got.x_token, want.x_token)
            assert np.array_equal(got.y_token, want.y_token)
            np.testing.assert_allclose(got.tv_rollout, want.tv_rollout, atol=1e-5)
            np.testing.assert_allclose(got.tv_fixed, want.tv_fixed, atol=1e-5)


def test_one_pass_per_document_over_its_full_prompt(demo):
    """Under the masked layout each call holds one pass per document: the X rows and every
    action's Y and Z rows against the prefill's own prompt tensors (never copied); an action
    holds a (H_kv, n) bool mask per layer, no gathered copy. Under auto an action keeping less
    than MASKED_MIN_FRACTION is gathered, the others join the pass."""
    model, _, ids, eos = demo
    seen = []
    real = attention.shared_prefix_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        prefix = kwargs.get("kvd_prefix")
        if prefix is not None and module.layer_idx == 0:
            seen.append(
                (query.shape[0], [(p.groups, p.prompt[0][0], p.masks) for p in prefix.passes])
            )
        return real(module, query, key, value, attention_mask, **kwargs)

    interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    previous = interface[attention.ATTENTION_NAME]
    interface[attention.ATTENTION_NAME] = spy
    pre = run_prefill(model, ids, actions=ACTIONS)
    try:
        settings = RolloutSettings(5, 1, prompt_attention="masked")
        paths_under_actions(model, ids, ACTIONS, "doc-p", 3, eos, settings, prefill=pre)
    finally:
        interface[attention.ATTENTION_NAME] = previous
    assert len(seen) == 4
    for rows, ((groups, keys, masks),) in (call for call in seen):
        assert groups == [0, 1, 2, 3, 4] and keys is pre.keys[0]
        assert masks[0] is None and masks[4] is None  # X and the control keep everything
        assert all(
            m[0].dtype == torch.bool and m[0].shape == pre.keys[0].shape[:2] for m in masks[1:4]
        )
        assert 15 <= rows <= 27  # X, each action's Y and the Z rows split so far
    doc = DocumentRollout.plan("doc-p", ids, ACTIONS, 3, "shared-reference")
    doc.prepare(model, RolloutSettings(5, 1, prompt_attention="auto"), pre)
    for a, act in zip(ACTIONS, doc.interventions, strict=True):
        fraction = doc.kept[a.name].ge(0).sum(-1).float().mean() / pre.n
        assert act.masked == (float(fraction) >= MASKED_MIN_FRACTION), a.name
        assert (act.prefix is None) == act.masked  # a masked action holds no gathered copy
    assert MASKED_MIN_FRACTION == 0.25  # the halves and the control masked, the small set gathered
    assert [act.masked for act in doc.interventions] == [True, True, False, True]


def test_masked_pass_equals_gathered_parts_with_ragged_and_empty_heads():
    """The attention function itself: a pass over the full prompt with per-group masks (a
    ragged kept set with heads of different counts, a head keeping nothing, a group keeping
    everything) equals the gathered layout (ragged parts padded with their mask) to rounding,
    on the native prompt kernel, the library's fused kernel and the plain path."""
    gen = torch.Generator().manual_seed(3)
    n_kv, groups, d, n, layers = 2, 3, 16, 40, 2
    prompt, prefill = random_prompt(gen, n_kv, n, d, layers)
    kept = torch.full((layers, n_kv, n), -1, dtype=torch.long)
    kept[0, 0, :10] = torch.arange(0, 30, 3)  # ragged: head 0 keeps 10, head 1 keeps 25
    kept[0, 1, :25] = torch.arange(15, 40)
    kept[1, 0, :5] = torch.tensor([1, 7, 8, 20, 39])
    kept[1, 1, :12] = torch.arange(12)
    everything = torch.arange(n).expand(layers, n_kv, n)
    rows = [torch.tensor([0, 3]), torch.tensor([1, 4, 5]), torch.tensor([2])]
    batch, own = 6, 4
    q = torch.randn(batch, n_kv * groups, 1, d, generator=gen)
    key, value = (torch.randn(batch, n_kv, own, d, generator=gen) for _ in range(2))
    modules = [SimpleNamespace(layer_idx=layer) for layer in range(layers)]
    ragged = gather_prefix(prefill, kept)
    assert len(ragged[0]) == 3  # the gathered ragged part carries its padding mask
    parts = [prompt, ragged, gather_prefix(prefill, everything)]
    masks = [None, kept_mask(prefill, kept), kept_mask(prefill, everything)]
    assert masks[2] is None and int(masks[1][0].sum()) == 35
    for fused, native in ((True, True), (True, False), (False, False)):
        gathered = attention.SharedPrefix(rows, parts, fused, native=native)
        masked = attention.SharedPrefix(
            rows, [prompt] * 3, fused, [attention.PromptPass([0, 1, 2], prompt, masks)], native
        )
        registry.reset()
        for module in modules:
            want = attention.shared_prefix_attention(
                module, q, key, value, None, kvd_prefix=gathered
            )[0]
            got = attention.shared_prefix_attention(module, q, key, value, None, kvd_prefix=masked)[
                0
            ]
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        choices = registry.kernel_choices()
        expected = "reference-float32" if not fused else None
        if fused and native and NATIVE:
            expected = "native-avx512"
        elif fused:
            expected = "library-flash-cpu"
        assert choices["prompt_masked"] == expected, (fused, native, choices)
        assert choices["prompt_ragged"] == expected, (fused, native, choices)
    # a KV head keeping nothing: output 0 and lse −inf there (the fused kernels' NaN replaced
    # without a host synchronisation), merged exactly, on every kernel
    empty = kept.clone()
    empty[1, 0] = -1
    empty_masks = kept_mask(prefill, empty)
    part = attention.PromptPass([0], prompt, [empty_masks])
    plain = attention.SharedPrefix(rows[1:2], [gather_prefix(prefill, empty)], False)
    for fused, native in ((True, True), (True, False)):
        shared = attention.SharedPrefix(rows[1:2], [prompt], fused, [part], native)
        for module in modules:
            got = attention.shared_prefix_attention(module, q, key, value, None, kvd_prefix=shared)
            want = attention.shared_prefix_attention(module, q, key, value, None, kvd_prefix=plain)
            assert torch.isfinite(got[0][rows[1]]).all()
            torch.testing.assert_close(got[0][rows[1]], want[0][rows[1]], atol=1e-6, rtol=1e-5)
    assert shared.kept_entries() == [pytest.approx((35 + 0 + 12) / 4)]  # per layer and head


def test_bad_prompt_attention_is_one_line():
    with pytest.raises(ValueError) as info:
        RolloutSettings(4, 1, prompt_attention="dense")
    assert str(info.value) == (
        "prompt_attention: expected one of auto, gathered, masked, got 'dense'"
    )
