"""Prompt transformations as actions (kvdiverge.eviction.transforms; docs/engine.md, "Prompt
transformations"): the engine's laws under a transformed cache equal a plain transformers
forward with a DynamicCache holding the same tensors, computed here independently (the
quantizer of tests/eviction/test_quantize.py, a pair-merging transform written here); the reference
stream, the common random numbers and the full control are unchanged; bad transformations are
refused in one line before decoding."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl
import pytest
import torch
import transformers
from test_quantize import reference_kivi
from transformers import DynamicCache

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.engine.batches import batched_paths
from kvdiverge.eviction import ActionError, PromptTransform, parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 4
QUANT2 = {"name": "q2", "selector": "quantize", "bits": 2, "group_size": 8, "residual": 4}
QUANT8 = {"name": "q8", "selector": "quantize", "bits": 8, "group_size": 16}
FULL = {"name": "full", "selector": "full"}
SNAPKV = {"name": "snapkv-half", "selector": "snapkv", "budget": 0.5, "window": 16}


@dataclass(frozen=True)
class MergePairs(PromptTransform):
    """A toy merging transform: each pair of consecutive entries replaced by its mean (m = ⌈n/2⌉
    entries), to show that a cache of another length fits the same interface."""

    name: ClassVar[str] = "merge-pairs"

    def transform_layer(self, action, layer, keys, values, positions):
        return _merge_pairs(keys), _merge_pairs(values)

    def layer_bytes(self, action, n, n_kv, head_dim, itemsize):
        return n_kv * ((n + 1) // 2) * 2 * head_dim * itemsize


def _merge_pairs(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[1]
    even = t[:, : n - n % 2].reshape(t.shape[0], n // 2, 2, t.shape[2]).mean(dim=2)
    return torch.cat([even, t[:, n - n % 2 :]], dim=1)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen"])
def demo(request):
    path = ROOT / "data" / "models" / request.param
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    return model, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


@torch.no_grad()
def plain_logits(model, ids, transform, tokens) -> torch.Tensor:
    """Plain transformers decoding over a DynamicCache that holds ``transform(keys, values)``
    of the prompt's own full cache: logits of steps 1..len(tokens)+1."""
    n = len(ids)
    prompt = torch.tensor([ids])
    full = model(prompt, use_cache=True).past_key_values
    cache = DynamicCache()
    for layer, entry in enumerate(full.layers):
        k, v = transform(entry.keys[0], entry.values[0])
        cache.update(k[None], v[None], layer)
    out = [model(prompt).logits[0, -1]]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]]),
            position_ids=torch.tensor([[n + j]]),
            past_key_values=cache,
            use_cache=True,
        )
        out.append(result.logits[0, -1])
    return torch.stack(out)


def _kivi(bits, group, residual):
    def transform(k, v):
        rk, rv = reference_kivi(k.numpy(), v.numpy(), bits, group, residual)
        return torch.from_numpy(rk), torch.from_numpy(rv)

    return transform


def _identity(k, v):
    return k, v


def _largest_law_difference(model, ids, rollout, transform, replicate) -> dict[str, float]:
    x, y = rollout.x_token[replicate, :-1], rollout.y_token[replicate, :-1]
    plain = {
        "p": plain_logits(model, ids, _identity, x),
        "q": plain_logits(model, ids, transform, y),
        "q_fixed": plain_logits(model, ids, transform, x),
    }
    out = {}
    for name, logits in plain.items():
        expected = logits.double().softmax(-1)
        got = torch.from_numpy(rollout.logits[name][replicate]).double().softmax(-1)
        out[name] = float((got - expected).abs().max())
    return out


@pytest.mark.parametrize(
    "entry, transform",
    [
        (QUANT2, _kivi(2, 8, 4)),
        (QUANT8, _kivi(8, 16, 0)),
        ({"name": "merge", "selector": "test_prompt_transform:MergePairs"}, None),
    ],
)
def test_laws_equal_plain_forward_with_the_same_cache(demo, entry, transform):
    """P, Q on Y's history and Q on X's history at every step, before and after divergence,
    against plain decoding over the independently transformed cache; the full control in the
    same run stays bit-exact."""
    model, ids, eos = demo
    transform = transform or (lambda k, v: (_merge_pairs(k), _merge_pairs(v)))
    H, K = 16, 4
    settings = RolloutSettings(H, 3, keep_logits=True)
    out = paths_under_actions(model, ids, [entry, FULL], "doc-q", K, eos, settings)
    r, full = out[entry["name"]], out["full"]
    assert r.tv_rollout[:, 1:].max() > 0  # the transformed cache changes the law
    for k in range(K):
        for name, difference in _largest_law_difference(model, ids, r, transform, k).items():
            assert difference <= 1e-5, (name, k)
    # the full control: δ ≡ f ≡ 0 and Y ≡ X exactly, its X the transformed action's X (CRN)
    assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
    assert np.array_equal(full.x_token, full.y_token)
    assert np.array_equal(full.x_token, r.x_token)


def test_reference_and_crn_unchanged_beside_eviction(demo):
    """Adding a quantized action leaves the other actions' X, Y, δ and f as a run without it
    gives them (the same X rows, the same uniforms; values to float rounding, another batch)."""
    model, ids, eos = demo
    settings = RolloutSettings(12, 9)
    alone = paths_under_actions(model, ids, [SNAPKV, FULL], "doc-c", 3, eos, settings)
    both = paths_under_actions(model, ids, [SNAPKV, QUANT2, FULL], "doc-c", 3, eos, settings)
    for name in ("snapkv-half", "full"):
        assert np.array_equal(alone[name].x_token, both[name].x_token)
        assert np.array_equal(alone[name].y_token, both[name].y_token)
        assert np.allclose(alone[name].tv_rollout, both[name].tv_rollout, atol=1e-6)
    assert np.array_equal(both["q2"].x_token, both["snapkv-half"].x_token)
    assert both["q2"].n_kept == len(ids)


def test_batched_documents_equal_one_document_runs(demo):
    """The rollout job's path (several documents per model call) gives a quantized action the
    values of its one-document run."""
    model, ids, eos = demo
    settings = RolloutSettings(10, 4)
    docs = [("d0", ids, 2), ("d1", ids[: len(ids) - 7], 2)]
    batched = dict(batched_paths(model, docs, [QUANT2, FULL], eos, settings))
    for doc_id, prompt, K in docs:
        one = paths_under_actions(model, prompt, [QUANT2, FULL], doc_id, K, eos, settings)
        for name in ("q2", "full"):
            assert np.array_equal(batched[doc_id][name].y_token, one[name].y_token)
            assert np.allclose(batched[doc_id][name].tv_rollout, one[name].tv_rollout, atol=1e-6)


@dataclass(frozen=True)
class WrongShape(PromptTransform):
    name: ClassVar[str] = "wrong-shape"

    def transform_layer(self, action, layer, keys, values, positions):
        return keys[:, :, :-1], values


@dataclass(frozen=True)
class InPlace(PromptTransform):
    name: ClassVar[str] = "in-place"

    def transform_layer(self, action, layer, keys, values, positions):
        keys.mul_(0.5)
        return keys, values


@dataclass(frozen=True)
class NotFinite(PromptTransform):
    name: ClassVar[str] = "not-finite"

    def transform_layer(self, action, layer, keys, values, positions):
        return keys, values * float("nan")


@pytest.mark.parametrize(
    "cls, message",
    [
        ("WrongShape", "transform_layer of layer 0: keys of shape (2, "),
        ("InPlace", "transform_layer changed the shared prefill"),
        ("NotFinite", "transform_layer of layer 0: values holds NaN or infinite values"),
    ],
)
def test_bad_transform_refused_before_decoding(demo, cls, message):
    model, ids, eos = demo
    action = {"name": "bad", "selector": f"test_prompt_transform:{cls}"}
    with pytest.raises(ActionError) as info:
        paths_under_actions(model, ids, [action], "doc-bad", 2, eos, RolloutSettings(4, 0))
    text = str(info.value)
    assert text.startswith("action 'bad': selector 'test_prompt_transform:") and message in text
    assert "\n" not in text


def test_group_size_must_divide_head_size(demo):
    model, ids, eos = demo
    action = parse_action({"selector": "quantize", "group_size": 32}, name="q32")  # d = 16
    with pytest.raises(ActionError, match="group_size 32 does not divide the model's head size 16"):
        paths_under_actions(model, ids, [action], "doc-g", 2, eos, RolloutSettings(4, 0))


def test_cache_bytes_per_action(demo):
    """Bytes per layer, counted by hand: an eviction keeps n_keep entries × 2 × d × 4 bytes per
    KV head (float32), the control all n, the 2-bit quantizer its codes, scales and zero points
    and the full-precision rest; at the end of the horizon every row holds H − 1 generated
    entries more, in full precision."""
    model, ids, eos = demo
    H, n = 8, len(ids)
    config = model.config
    layers, n_kv = config.num_hidden_layers, config.num_key_value_heads
    d = config.head_dim
    out = paths_under_actions(
        model, ids, [SNAPKV, QUANT2, FULL], "doc-b", 1, eos, RolloutSettings(H, 0)
    )
    entry = 2 * d * 4
    generated = (H - 1) * n_kv * entry
    n_keep = n // 2
    # the 2-bit cache (groups of 8, residual 4): n_k keys and n_v values quantized
    n_v = n - 4
    n_k = n_v - n_v % 8
    quantized = n_kv * (
        (n_k * d * 2 + 7) // 8
        + (n_v * d * 2 + 7) // 8
        + (2 * ((n_k // 8) * d + n_v * (d // 8)) + ((n - n_k) + (n - n_v)) * d) * 4
    )
    expected = {"snapkv-half": n_kv * n_keep * entry, "full": n_kv * n * entry, "q2": quantized}
    for name, start in expected.items():
        got = out[name].cache_bytes
        assert got == {"start": [start] * layers, "end": [start + generated] * layers}, name
    assert out["q2"].cache_bytes["start"][0] < out["snapkv-half"].cache_bytes["start"][0]


def test_cache_bytes_table_by_hand():
    from kvdiverge.analysis.cache_bytes import cache_bytes_table

    full = {
        "a": {"start": [100, 100], "end": [120, 120]},
        "b": {"start": [50, 50], "end": [70, 70]},
    }
    half = {"a": {"start": [50, 50], "end": [70, 70]}, "b": {"start": [25, 25], "end": [45, 45]}}
    q4 = {"a": {"start": [20, 30], "end": [40, 50]}}
    table = cache_bytes_table(
        {
            "full": ({"selector": "full", "budget": None}, full),
            "snapkv-half": ({"selector": "snapkv", "budget": 0.5}, half),
            "q4": ({"selector": "quantize", "bits": 4, "budget": None}, q4),
        },
        control="full",
    )
    rows = {r["action"]: r for r in table.to_dicts()}
    assert rows["full"]["budget"] == "all" and rows["full"]["start_share"] == 1.0
    assert rows["snapkv-half"]["budget"] == "0.5" and rows["snapkv-half"]["n_docs"] == 2
    assert rows["snapkv-half"]["start_bytes"] == (100 + 50) / 2
    assert rows["snapkv-half"]["start_share"] == 0.5
    assert rows["snapkv-half"]["end_share"] == (140 / 240 + 90 / 140) / 2
    assert rows["q4"]["budget"] == "4 bits" and rows["q4"]["start_share"] == 50 / 200
    with pytest.raises(ValueError, match="document b has no bytes of the control 'q4'"):
        cache_bytes_table({"q4": ({}, q4), "full": ({}, full)}, control="q4")


@pytest.mark.parametrize("layout", ["masked", "auto"])
def test_transform_runs_gathered_whatever_the_layout(demo, layout):
    """The masked layout reads the prefill's own tensors: a transformation's rows attend to its
    own cache in the gathered layout under every setting (the same values as ``gathered``), and
    the identity shortcut never replaces them."""
    model, ids, eos = demo
    base = RolloutSettings(8, 2, prompt_attention="gathered")
    other = RolloutSettings(8, 2, prompt_attention=layout, identity_shortcut=True)
    want = paths_under_actions(model, ids, [QUANT2], "doc-l", 2, eos, base)["q2"]
    got = paths_under_actions(model, ids, [QUANT2], "doc-l", 2, eos, other)["q2"]
    assert np.array_equal(want.y_token, got.y_token)
    assert np.array_equal(want.tv_rollout, got.tv_rollout)
    assert got.tv_rollout[:, 1:].max() > 0


def test_compare_runs_quantized_actions(tmp_path):
    """``kvdiverge compare`` end to end with ``quantize@Nbit`` beside an eviction and a budget
    sweep (the quantized action is not swept: it has no budget)."""
    from kvdiverge.compare import compare
    from kvdiverge.io.trajectories import read_trajectory_metadata

    prompts = [
        {"prompt": PROMPT + " What is the magic number?", "answers": ["482913"]},
        {"prompt": PROMPT[:200] + " Where does the river flow?", "answers": ["north"]},
    ]
    compare(
        ROOT / "data" / "models" / "tiny-llama",
        prompts,
        "q4=quantize@4bit+group_size=8,recent@0.5",
        baseline="snapkv=snapkv@0.5+window=8",
        budgets=[0.25, 0.5],
        K=1,
        H=6,
        out=tmp_path / "out",
        draws=100,
        quiet=True,
    )
    files = sorted((tmp_path / "out" / "trajectories").glob("*.parquet"))
    names = sorted(f.stem for f in files)
    assert "q4" in names and not any(n.startswith("q4@") for n in names)
    meta = read_trajectory_metadata(next(f for f in files if f.stem == "q4"))
    assert meta["action"]["bits"] == 4 and meta["action"]["budget"] is None
    held = {f.stem: read_trajectory_metadata(f)["cache_bytes"]["documents"] for f in files}
    assert len(held["q4"]) == 2 and held["q4"].keys() == held["snapkv@0.5"].keys()
    for doc_id, record in held["q4"].items():  # 4 bits: fewer bytes than SnapKV-half
        assert 0 < sum(record["start"]) < sum(held["snapkv@0.5"][doc_id]["start"])
    assert "| q4 |" in (tmp_path / "out" / "summary.md").read_text()
    table = pl.read_csv(tmp_path / "out" / "cache_bytes.csv")
    rows = {r["action"]: r for r in table.to_dicts()}
    assert rows["q4"]["budget"] == "4 bits" and rows["snapkv@0.5"]["budget"] == "0.5"
    # an eviction's share is its kept fraction of each prompt (floored), at the start
    assert abs(rows["snapkv@0.5"]["start_share"] - 0.5) < 0.01
    assert 0 < rows["q4"]["start_share"] < rows["snapkv@0.5"]["start_share"]
    assert "| q4 | 4 bits | 2 |" in (tmp_path / "out" / "cache_bytes.md").read_text()


@dataclass(frozen=True)
class Drifting(PromptTransform):
    """Not deterministic: each call scales the keys by a new factor."""

    name: ClassVar[str] = "drifting"
    calls: list = field(default_factory=lambda: [0], compare=False)

    def transform_layer(self, action, layer, keys, values, positions):
        self.calls[0] += 1
        return keys * (1 + 0.001 * self.calls[0]), values.clone()

    def layer_bytes(self, action, n, n_kv, head_dim, itemsize):
        return n_kv * n * 2 * head_dim * itemsize


def test_nondeterministic_user_transform_refused(demo):
    model, ids, eos = demo
    action = {"name": "drift", "selector": "test_prompt_transform:Drifting"}
    with pytest.raises(ActionError, match="returned different tensors when called twice"):
        paths_under_actions(model, ids, [action], "doc-d", 2, eos, RolloutSettings(4, 0))
