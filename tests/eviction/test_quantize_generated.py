"""Quantizing each row's own generated entries as they age (``selector: quantize`` with
``generated: true``; kvdiverge.eviction.quantize, kvdiverge.engine.generated_quantization;
docs/compression.md, "Quantized caches"), against an independent reference: the numpy
quantizer of tests/eviction/test_quantize.py applied, after every call, to the full-precision
generated entries this file keeps itself. The engine's laws P, Q on Y's history and Q on X's
history at every step equal a plain transformers forward over a DynamicCache holding the
quantized prompt and that row's own quantized generated entries; the X rows and the full
control are bit-identical to a run without the option; each row's entries are its own, through
batch compaction and Z-row copies; the bytes against a hand count; bad values in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from engine_reference import aged_reference_logits
from test_quantize import reference_kivi

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.engine.attention import RowCache
from kvdiverge.engine.batches import batched_paths
from kvdiverge.engine.generated_quantization import (
    GeneratedQuantization,
    GeneratedQuantizer,
)
from kvdiverge.eviction import ActionError, parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 2
FULL = {"name": "full", "selector": "full"}
# (bits, group size, window): a window of 3 (keys quantized by whole groups of 4 once they
# have left it), and none (every value quantized right after the call that wrote it)
GEN2 = {"selector": "quantize", "bits": 2, "group_size": 4, "residual": 3}
GEN4 = {"selector": "quantize", "bits": 4, "group_size": 8, "residual": 0}


def action(entry: dict, name: str, generated: bool) -> dict:
    return {"name": name, **entry, "generated": generated}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen"])
def demo(request):
    path = ROOT / "data" / "models" / request.param
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    return model, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def kivi(entry: dict):
    """(keys, values) (H_kv, n, d) → KIVI's cache of them, by the numpy reference."""

    def transform(keys, values):
        rk, rv = reference_kivi(
            keys.numpy(), values.numpy(), entry["bits"], entry["group_size"], entry["residual"]
        )
        return torch.from_numpy(rk), torch.from_numpy(rv)

    return transform


def law_differences(model, ids, rollout, entry, replicate, generated=True):
    """Largest |engine − plain| next-token probability of one replicate, per stream: P over the
    full cache; Q on Y's and on X's history over the quantized prompt and (``generated``) the
    row's own generated entries quantized after every call."""
    x, y = rollout.x_token[replicate, :-1], rollout.y_token[replicate, :-1]
    quantized = kivi(entry)
    age = quantized if generated else (lambda k, v: (k, v))
    plain = {
        "p": aged_reference_logits(model, ids, x, lambda k, v: (k, v), lambda k, v: (k, v)),
        "q": aged_reference_logits(model, ids, y, quantized, age),
        "q_fixed": aged_reference_logits(model, ids, x, quantized, age),
    }
    out = {}
    for name, logits in plain.items():
        expected = logits.double().softmax(-1)
        got = torch.from_numpy(rollout.logits[name][replicate]).double().softmax(-1)
        out[name] = float((got - expected).abs().max())
    return out


@pytest.mark.parametrize("entry", [GEN2, GEN4], ids=["2bit-window3", "4bit-window0"])
def test_laws_equal_plain_forward_with_rows_quantizing_their_own_entries(demo, entry):
    """Every stream's law at every step, before and after divergence, equals the plain forward
    over the quantized prompt and the row's own generated entries quantized as they age (1e-5);
    the action without the option, in the same run, equals the forward whose generated entries
    stay in full precision; the two differ (the option acts); the full control is exact."""
    model, ids, eos = demo
    H, K = 20, 3
    gen, plain = action(entry, "gen", True), action(entry, "plain", False)
    settings = RolloutSettings(H, 5, keep_logits=True)
    out = paths_under_actions(model, ids, [gen, plain, FULL], "doc-g", K, eos, settings)
    r, p, full = out["gen"], out["plain"], out["full"]
    assert r.tv_rollout[:, 1:].max() > 1e-3
    for k in range(K):
        for name, difference in law_differences(model, ids, r, entry, k).items():
            assert difference <= 1e-5, ("gen", name, k, difference)
        for name, difference in law_differences(model, ids, p, entry, k, False).items():
            assert difference <= 1e-5, ("plain", name, k, difference)
    # on the same history (X's), quantizing the generated entries changes the law
    on_x = np.abs(r.logits["q_fixed"] - p.logits["q_fixed"]).max()
    assert on_x > 1e-4
    assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
    assert np.array_equal(full.x_token, full.y_token)
    assert np.array_equal(full.x_token, r.x_token)  # the same reference stream (CRN)


def test_x_rows_and_full_control_bit_identical_to_a_run_without_the_option(demo):
    """The X rows (tokens and P's logits) and the full control's every array are the same bits
    with and without ``generated: true`` beside them."""
    model, ids, eos = demo
    settings = RolloutSettings(18, 8, keep_logits=True)
    runs = {
        generated: paths_under_actions(
            model, ids, [action(GEN2, "q", generated), FULL], "doc-b", 3, eos, settings
        )
        for generated in (True, False)
    }
    with_, without = runs[True], runs[False]
    assert not np.array_equal(with_["q"].y_token, without["q"].y_token) or not np.array_equal(
        with_["q"].tv_rollout, without["q"].tv_rollout
    )  # the option changes the action's own rows
    assert np.array_equal(with_["q"].x_token, without["q"].x_token)
    assert np.array_equal(with_["q"].logits["p"], without["q"].logits["p"])
    for field in ("x_token", "y_token", "tv_rollout", "tv_fixed", "x_eos", "y_eos"):
        assert np.array_equal(getattr(with_["full"], field), getattr(without["full"], field))
    for name in ("p", "q", "q_fixed"):
        assert np.array_equal(with_["full"].logits[name], without["full"].logits[name])
    assert np.all(with_["full"].tv_rollout == 0)
    assert with_["full"].cache_bytes == without["full"].cache_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_each_row_holds_its_own_entries_through_compaction_and_z_copies(dtype):
    """The engine's quantizer on a row cache driven by hand: after every call each row of the
    action's group holds exactly the numpy KIVI cache of its own full-precision entries (a Z row
    started from a copy of row 1 at call 7 inherits row 1's history, then goes on with its own;
    row 1 leaves the batch at call 12, the rows moving to the front); the X row is untouched;
    rows with other entries hold other quantized entries."""
    gen = torch.Generator().manual_seed(5)
    layers, n_kv, d, calls = 2, 2, 16, 22
    spec = GeneratedQuantization(bits=2, group_size=4, residual=3)
    cache = RowCache(layers, 4, n_kv, d, calls, dtype, torch.device("cpu"))
    cache.rows = 3
    quantizer = GeneratedQuantizer([None, spec])
    group = [0, 1, 1]  # per batch row: 0 the X row, 1 the action's rows
    written = [[([], []) for _ in range(layers)] for _ in range(3)]  # per row and layer
    for call in range(1, calls + 1):
        if call == 7:  # a Z row from row 1's history
            cache.copy_rows(torch.tensor([1]), torch.tensor([3]))
            cache.rows = 4
            group.append(1)
            written.append([(list(k), list(v)) for k, v in written[1]])
        if call == 12:  # row 1 ends and leaves: rows 0, 3, 2 move to the front
            keep = [0, 3, 2]
            cache.keep_rows(torch.tensor(keep))
            group, written = [group[i] for i in keep], [written[i] for i in keep]
        for layer in range(layers):
            k = (torch.randn(cache.rows, n_kv, 1, d, generator=gen) * 2).to(dtype)
            v = torch.randn(cache.rows, n_kv, 1, d, generator=gen).to(dtype)
            cache.update(k, v, layer)
            for row in range(cache.rows):
                written[row][layer][0].append(k[row].numpy())
                written[row][layer][1].append(v[row].numpy())
        rows = [torch.tensor([r for r, g in enumerate(group) if g == i]) for i in (0, 1)]
        quantizer.after_call(cache, SimpleNamespace(rows=rows))
        t = cache.lengths[0]
        for row in range(cache.rows):
            for layer in range(layers):
                keys = np.concatenate(written[row][layer][0], axis=1)
                values = np.concatenate(written[row][layer][1], axis=1)
                if group[row]:
                    keys, values = reference_kivi(keys, values, 2, 4, 3)
                assert np.array_equal(cache.keys[layer][row, :, :t].numpy(), keys), (call, row)
                assert np.array_equal(cache.values[layer][row, :, :t].numpy(), values)
    z, y = group.index(1), len(group) - 1  # the Z row (now row 1) and row 2
    assert not torch.equal(cache.values[0][z, :, :10], cache.values[0][y, :, :10])


def test_rows_that_diverge_hold_different_quantized_entries(demo, monkeypatch):
    """In a rollout, the action's rows whose Y histories differ hold different quantized
    generated entries at the last call (each is quantized from its own row)."""
    model, ids, eos = demo
    seen = []
    original = GeneratedQuantizer.after_call

    def recording(self, cache, shared):
        original(self, cache, shared)
        rows = shared.rows[1]  # the action's group (the unit's X rows are group 0)
        n_v = self.done[1][1]
        seen.append([cache.values[layer][rows, :, :n_v].clone() for layer in range(2)])

    monkeypatch.setattr(GeneratedQuantizer, "after_call", recording)
    out = paths_under_actions(
        model, ids, [action(GEN2, "q", True)], "doc-r", 4, eos, RolloutSettings(16, 1)
    )
    r = out["q"]
    assert (r.x_token != r.y_token).any()  # some replicate's Y left X's path
    last = seen[-1][0]
    assert last.shape[2] > 0 and last.shape[0] >= 2
    distinct = {tuple(last[i].flatten().tolist()) for i in range(last.shape[0])}
    assert len(distinct) > 1


def test_bytes_against_a_hand_count(demo):
    """At the start the quantized prompt; at step H = 21 a row also holds its 20 generated
    entries as KIVI at 2 bits, groups of 4, window 3 leaves them: 17 values and 16 keys (4
    whole groups) quantized, 3 values and 4 keys in full precision."""
    model, ids, eos = demo
    n_kv, d = model.config.num_key_value_heads, model.config.head_dim
    layers = model.config.num_hidden_layers
    H = 21
    actions = [action(GEN2, "gen", True), action(GEN2, "plain", False)]
    out = paths_under_actions(model, ids, actions, "doc-n", 1, eos, RolloutSettings(H, 0))
    gen, plain = out["gen"].cache_bytes, out["plain"].cache_bytes
    assert gen["start"] == plain["start"] and len(gen["start"]) == layers
    itemsize = 4  # float32 on the CPU
    per_head = (
        -(-16 * d * 2 // 8)  # 16 keys × d channels × 2 bits, packed
        + -(-17 * d * 2 // 8)  # 17 values × d channels × 2 bits, packed
        + 2 * itemsize * (16 // 4 * d + 17 * (d // 4))  # zero point and scale per group
        + itemsize * ((20 - 16) * d + (20 - 17) * d)  # the full-precision keys and values
    )
    assert gen["end"] == [start + n_kv * per_head for start in gen["start"]]
    assert plain["end"] == [start + 20 * n_kv * 2 * d * itemsize for start in plain["start"]]
    assert n_kv * per_head < 20 * n_kv * 2 * d * itemsize


def test_batched_documents_equal_one_document_runs(demo):
    """The rollout job's path (several documents per model call, prompts of other lengths, the
    action's row groups in each unit) gives the action its one-document values and bytes."""
    model, ids, eos = demo
    settings = RolloutSettings(14, 4)
    acts = [action(GEN2, "gen", True), action(GEN4, "gen4", True), FULL]
    docs = [("d0", ids, 2), ("d1", ids[: len(ids) - 9], 2)]
    batched = dict(batched_paths(model, docs, acts, eos, settings))
    for doc_id, prompt, K in docs:
        one = paths_under_actions(model, prompt, acts, doc_id, K, eos, settings)
        for name in ("gen", "gen4", "full"):
            assert np.array_equal(batched[doc_id][name].y_token, one[name].y_token), name
            assert np.allclose(batched[doc_id][name].tv_rollout, one[name].tv_rollout, atol=1e-6)
            assert batched[doc_id][name].cache_bytes == one[name].cache_bytes


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"selector": "quantize", "generated": 1}, "actions.q.generated: expected true or false"),
        ({"selector": "quantize", "generated": "on"}, "actions.q.generated: expected true or"),
        ({"selector": "quantize", "generated": None}, "actions.q.generated: expected true or"),
        (
            {"selector": "snapkv", "budget": 0.5, "generated": True},
            "actions.q.generated: not a parameter of selector 'snapkv'",
        ),
    ],
)
def test_bad_values_refused_in_one_line(entry, message):
    with pytest.raises(ActionError) as info:
        parse_action(entry, name="q")
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_compare_spec_and_default():
    """``generated`` is off unless asked for; ``kvdiverge compare`` takes it as a parameter."""
    from kvdiverge.compare.actions import CompareError, parse_actions

    assert parse_action({"selector": "quantize"}, name="q").generated is False
    parsed = parse_actions("quantize@2bit+generated=true+residual=32")
    method = parsed[0].action.method
    assert (method.bits, method.residual, method.generated) == (2, 32, True)
    with pytest.raises(CompareError, match="generated: expected true or false, got 2$"):
        parse_actions("quantize@2bit+generated=2")
