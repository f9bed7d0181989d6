"""Compression during decoding (kvdiverge.eviction.decoding, kvdiverge.engine.decoding_compression;
docs/engine.md, "Compression during decoding"): the engine's laws P, Q on Y's history and Q on
X's history at every step equal a plain transformers forward over a per-row DynamicCache that
this file compresses itself, from the definitions, after every call; the full control beside a
decoding action stays bit-exact, and so does a compressor that never evicts; rows that diverge
keep different entries; bytes per row; bad specs and bad compressors in one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch
import transformers

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.engine.batches import batched_paths
from kvdiverge.eviction import ActionError, DecodingCompressor, parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 2
FULL = {"name": "full", "selector": "full"}
SINKS, WINDOW = 4, 40
STREAM = {"name": "stream", "selector": "streaming", "sinks": SINKS, "window": WINDOW}
LOG: list[tuple[int, int, tuple]] = []  # (layer, entries, kept positions) per compress call


@dataclass(frozen=True)
class KeepLargestKeys(DecodingCompressor):
    """Every ``interval`` calls, each row keeps the ``keep`` entries of each layer and KV head
    whose post-RoPE keys have the largest first channel (a data-dependent rule: rows with other
    histories keep other entries; not the norm, which RoPE leaves equal for a repeated token, so
    that ties cannot make the reference's order differ), in position order; logs each call's
    kept positions."""

    name: ClassVar[str] = "largest-keys"
    keep: int = 48
    interval: int = 3

    def schedule(self, action):
        return self.interval, 0

    def compress(self, action, layer, keys, values, positions):
        m = min(self.keep, keys.shape[1])
        top = keys[..., 0].topk(m, dim=-1).indices
        kept = top.gather(1, positions.gather(1, top).argsort(dim=-1))
        LOG.append((layer, keys.shape[1], tuple(positions.gather(1, kept).flatten().tolist())))
        return kept


LARGEST = {"name": "largest", "selector": "test_decoding_compression:KeepLargestKeys"}


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen"])
def demo(request):
    path = ROOT / "data" / "models" / request.param
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    return model, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


# ---- the independent reference: one row's plain forward, compressed here ------------------------
def streaming_rule(keys, positions):
    """StreamingLLM's kept positions per KV head from the definition: the SINKS lowest and the
    WINDOW highest positions once more than SINKS + WINDOW are held."""
    if positions.shape[1] <= SINKS + WINDOW:
        return None
    out = []
    for head in positions:
        ranked = sorted(head.tolist())
        out.append(ranked[:SINKS] + ranked[-WINDOW:])
    return torch.tensor(out)


def largest_rule(keep):
    def rule(keys, positions):
        chosen = []
        for h in range(keys.shape[0]):
            first = [float(keys[h, j, 0]) for j in range(keys.shape[1])]
            best = sorted(range(len(first)), key=lambda j: -first[j])[: min(keep, len(first))]
            chosen.append(sorted(int(positions[h, j]) for j in best))
        return torch.tensor(chosen)

    return rule


@torch.no_grad()
def plain_logits(model, ids, tokens, rule, interval=0):
    """Plain transformers decoding of one row over a DynamicCache (batch 1) that holds the
    prompt, then the row's own entries; after every call (every ``interval``-th, if given) each
    layer's cache is cut to the positions ``rule(keys, positions)`` names (None: all). Logits of
    steps 1..len(tokens)+1."""
    n = len(ids)
    prompt = torch.tensor([ids])
    out = model(prompt, use_cache=True)
    cache = out.past_key_values
    held = [torch.arange(n).expand(layer.keys.shape[1], n) for layer in cache.layers]
    logits = [out.logits[0, -1]]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]]),
            position_ids=torch.tensor([[n + j]]),
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(result.logits[0, -1])
        for i in range(len(held)):  # the call's own entry, at position n + j
            held[i] = torch.cat([held[i], torch.full((held[i].shape[0], 1), n + j)], dim=1)
        if interval and (j + 1) % interval:
            continue
        for i, layer in enumerate(cache.layers):
            keep = rule(layer.keys[0], held[i])
            if keep is None:
                continue
            index = torch.stack(
                [(held[i][h][:, None] == keep[h][None]).nonzero()[:, 0] for h in range(len(keep))]
            )
            gather = index[None, :, :, None].expand(-1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
            held[i] = keep
    return torch.stack(logits)


def largest_differences(model, ids, rollout, rule, replicate, interval=0):
    x, y = rollout.x_token[replicate, :-1], rollout.y_token[replicate, :-1]
    plain = {
        "p": plain_logits(model, ids, x, lambda k, p: None),
        "q": plain_logits(model, ids, y, rule, interval),
        "q_fixed": plain_logits(model, ids, x, rule, interval),
    }
    out = {}
    for name, logits in plain.items():
        expected = logits.double().softmax(-1)
        got = torch.from_numpy(rollout.logits[name][replicate]).double().softmax(-1)
        out[name] = float((got - expected).abs().max())
    return out


@pytest.mark.parametrize(
    "entry, rule, interval",
    [(STREAM, streaming_rule, 0), (LARGEST, largest_rule(48), 3)],
    ids=["streaming", "largest-keys"],
)
def test_laws_equal_plain_forward_with_the_same_compressed_cache(demo, entry, rule, interval):
    """Every stream's law at every step, before and after divergence, equals the plain forward
    over that row's own compressed cache (1e-5); the full control in the same run is exact."""
    model, ids, eos = demo
    H, K = 24, 3
    assert len(ids) > SINKS + WINDOW
    out = paths_under_actions(
        model, ids, [entry, FULL], "doc-d", K, eos, RolloutSettings(H, 5, keep_logits=True)
    )
    r, full = out[entry["name"]], out["full"]
    assert r.tv_rollout[:, 1:].max() > 1e-3  # the compression changes the law
    for k in range(K):
        for name, difference in largest_differences(model, ids, r, rule, k, interval).items():
            assert difference <= 1e-5, (name, k, difference)
    assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
    assert np.array_equal(full.x_token, full.y_token)
    assert np.array_equal(full.x_token, r.x_token)  # the same reference stream (CRN)


def test_a_compressor_that_never_evicts_is_the_full_control(demo):
    """A window longer than the horizon's cache evicts nothing: δ ≡ f ≡ 0 and Y ≡ X bit for bit,
    as the full control."""
    model, ids, eos = demo
    wide = {"name": "wide", "selector": "streaming", "sinks": 4, "window": len(ids) + 64}
    out = paths_under_actions(model, ids, [wide, FULL], "doc-w", 3, eos, RolloutSettings(16, 2))
    for name in ("wide", "full"):
        assert np.all(out[name].tv_rollout == 0) and np.all(out[name].tv_fixed == 0), name
        assert np.array_equal(out[name].x_token, out[name].y_token)


def test_rows_that_diverge_keep_different_entries(demo):
    """Two replicates whose Y histories differ, compressed at the same call from the same
    prompt, keep different positions (the rule reads each row's own keys)."""
    model, ids, eos = demo
    LOG.clear()
    out = paths_under_actions(model, ids, [LARGEST], "doc-r", 4, eos, RolloutSettings(20, 1))
    r = out["largest"]
    assert (r.x_token != r.y_token).any()  # some replicate's Y left X's path
    by_call: dict[tuple[int, int], set] = {}
    for layer, length, kept in LOG:
        by_call.setdefault((layer, length), set()).add(kept)
    assert any(len(kept) > 1 for kept in by_call.values())


def test_bytes_per_row(demo):
    """The prompt part at the start; at the end each replicate's Y row holds what its
    compressor left it (streaming: SINKS + WINDOW entries per KV head, after the last call's
    compression counted before it: SINKS + WINDOW + 1), × 2 × d × 4 bytes per KV head."""
    model, ids, eos = demo
    config = model.config
    n_kv, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    H, K = 12, 2
    out = paths_under_actions(model, ids, [STREAM], "doc-b", K, eos, RolloutSettings(H, 0))
    held = out["stream"].cache_bytes
    entry = n_kv * 2 * d * 4
    assert held["start"] == [len(ids) * entry] * layers
    assert held["end"] == [(SINKS + WINDOW + 1) * entry] * layers
    assert held["end_rows"] == [[(SINKS + WINDOW + 1) * entry] * layers] * K


def test_batched_documents_equal_one_document_runs(demo):
    """The rollout job's path (several documents per model call, of other prompt lengths)
    gives a decoding action its one-document values."""
    model, ids, eos = demo
    settings = RolloutSettings(14, 4)
    docs = [("d0", ids, 2), ("d1", ids[: len(ids) - 9], 2)]
    batched = dict(batched_paths(model, docs, [LARGEST, STREAM, FULL], eos, settings))
    for doc_id, prompt, K in docs:
        one = paths_under_actions(model, prompt, [LARGEST, STREAM, FULL], doc_id, K, eos, settings)
        for name in ("largest", "stream", "full"):
            assert np.array_equal(batched[doc_id][name].y_token, one[name].y_token), name
            assert np.allclose(batched[doc_id][name].tv_rollout, one[name].tv_rollout, atol=1e-6)
            assert batched[doc_id][name].cache_bytes == one[name].cache_bytes


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"selector": "streaming", "budget": 0.5}, "actions.s.budget: selector 'streaming'"),
        ({"selector": "streaming", "window": 0}, "actions.s.window: expected an integer >= 1"),
        ({"selector": "streaming", "sinks": -1}, "actions.s.sinks: expected an integer >= 0"),
        ({"selector": "streaming", "window": 2.5}, "actions.s.window: expected an integer"),
    ],
)
def test_bad_specs_refused_in_one_line(entry, message):
    with pytest.raises(ActionError) as info:
        parse_action(entry, name="s")
    assert message in str(info.value) and "\n" not in str(info.value)


@dataclass(frozen=True)
class Twice(KeepLargestKeys):
    def compress(self, action, layer, keys, values, positions):
        return torch.zeros((keys.shape[0], 2), dtype=torch.long)


@dataclass(frozen=True)
class NoSchedule(KeepLargestKeys):
    def schedule(self, action):
        return 0, 0


@pytest.mark.parametrize(
    "cls, message",
    [
        ("Twice", "compress of layer 0 returned an index twice in a KV head"),
        ("NoSchedule", "schedule returned (0, 0); expected (interval, max_entries)"),
    ],
)
def test_bad_compressor_refused_in_one_line(demo, cls, message):
    model, ids, eos = demo
    action = {"name": "bad", "selector": f"test_decoding_compression:{cls}"}
    with pytest.raises(ActionError) as info:
        paths_under_actions(model, ids, [action], "doc-x", 2, eos, RolloutSettings(8, 0))
    text = str(info.value)
    assert text.startswith("action 'bad': selector 'test_decoding_compression:") and message in text
    assert "\n" not in text


@pytest.mark.parametrize("entry", [STREAM, {"name": "q", "selector": "quantize", "group_size": 8}])
def test_swrb_refuses_caches_other_than_a_kept_subset(demo, entry):
    """SWRB gathers kept subsets of the prompt: a decoding compressor or a prompt transformation
    is refused in one line before the prefill, not run as the full cache."""
    from kvdiverge.engine.swrb_rollout import swrb_rollout_document

    model, ids, eos = demo
    with pytest.raises(ActionError) as info:
        swrb_rollout_document(model, ids, [entry], "doc-s", 2, eos, 8, 0)
    text = str(info.value)
    assert text.startswith(f"action {entry['name']!r}: selector ") and "SWRB runs prompt" in text
    assert "\n" not in text
