"""The memory plan's decoding-time terms (kvdiverge.engine.memory_plan): a decoding action's
masks of what each row keeps, counted against the engine's own allocation
(kvdiverge.engine.decoding_compression.CompressingRowCache), the plan growing by exactly those
bytes and its gathered prompt part for such an action, and job_kept's held parts."""

from __future__ import annotations

import torch

from kvdiverge.engine.decoding_compression import CompressingRowCache, DecodingSpec
from kvdiverge.engine.memory_plan import (
    HeldPart,
    ModelShape,
    decoding_mask_bytes,
    job_kept,
    kv_bytes,
    plan_job,
)
from kvdiverge.eviction import parse_action

SHAPE = ModelShape(
    layers=3,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=50,
    tied=True,
    qkv_bias=False,
    dtype_bytes=4,
)


def test_masks_equal_the_compressing_row_cache_allocation():
    """The bool masks a batch with a decoding action holds: every batch row's prompt part (the
    longest decoding part) and its own entries (H − 1), per layer and KV head."""
    n, H, rows = 37, 9, 7
    L, n_kv = SHAPE.layers, SHAPE.kv_heads
    for width in (n, 20):  # the whole prompt (DecodingPress), a shorter part
        positions = [torch.arange(width).expand(n_kv, width) for _ in range(L)]
        spec = DecodingSpec(action=None, interval=2, max_entries=0, n=n, positions=positions)
        initial = [(0, 0, False)] + [(1, r, True) for r in range(rows - 1)]
        cache = CompressingRowCache(
            L, rows, n_kv, SHAPE.head_dim, max(H - 1, 1), torch.float32, torch.device("cpu"),
            groups=[None, spec], initial=initial,
        )  # fmt: skip
        held = sum(t.numel() * t.element_size() for t in cache.own_kept + cache.prompt_kept)
        assert held == decoding_mask_bytes(SHAPE, rows, width, H)
        assert held == L * rows * n_kv * (width + H - 1)


def test_the_plan_grows_by_the_masks_and_the_part_of_a_decoding_action():
    """One document, the control and an action keeping the whole prompt: as a selection it adds
    nothing (the identity); as a decoding action, its gathered prompt part in the prompt caches
    and, in the decoding state, its masks and each layer's prompt bias over its Y and Z rows."""
    n, H, K = 400, 33, 40
    args = (SHAPE, [n], None, ["full", "dec"], K, K, "full", H, 1000)
    plain = plan_job(*args[:2], [[n, n]], *args[3:])
    decoding = plan_job(*args[:2], [[n, HeldPart(n, decoding=True)]], *args[3:])
    rows = 1 + 2 * 2  # one group (K = K_control): X, and Y and Z of each action
    assert plain.rows == decoding.rows == [K * rows]
    assert plain.parts["decoding masks"] == 0
    assert plain.parts["row caches"] > 0  # the decoding state is the peak here
    L, n_kv, G = SHAPE.layers, SHAPE.kv_heads, SHAPE.heads // SHAPE.kv_heads
    masks = L * (K * rows) * n_kv * (n + H - 1)  # bool, every batch row
    bias = L * 4 * (2 * K) * (n_kv * n + G)  # float32 bias, int32 index, over Y and Z rows
    assert decoding.parts["decoding masks"] == masks + bias
    part = 2 * L * n_kv * n * SHAPE.head_dim * 4
    assert decoding.parts["prompt caches"] - plain.parts["prompt caches"] == part
    assert decoding.peak - plain.peak == masks + bias + part
    # two documents in one batch: the masks over all rows and the longest part, a bias each
    two = plan_job(SHAPE, [n, n // 2], [[n, HeldPart(n, True)], [n // 2, HeldPart(n // 2, True)]],
                   ["full", "dec"], K, K, "full", H, 1000)  # fmt: skip
    assert two.rows == [2 * K * rows]
    expected = L * (2 * K * rows) * n_kv * (n + H - 1)
    expected += L * 4 * (2 * K) * (n_kv * n + G) + L * 4 * (2 * K) * (n_kv * (n // 2) + G)
    assert two.parts["decoding masks"] == expected


def test_a_transformation_is_gathered_whatever_its_share():
    """KIVI's dequantized prompt (n entries) is a part of its own, not the identity."""
    n, H, K = 400, 33, 2
    plain = plan_job(SHAPE, [n], [[n, n]], ["full", "q"], K, K, "full", H, 64)
    held = plan_job(SHAPE, [n], [[n, HeldPart(n)]], ["full", "q"], K, K, "full", H, 64)
    assert held.parts["decoding masks"] == 0
    assert held.parts["prompt caches"] - plain.parts["prompt caches"] == kv_bytes(SHAPE, n)


def test_job_kept_marks_held_parts():
    specs = {
        "full": {"selector": "full"},
        "snapkv": {"selector": "snapkv", "budget": 0.5},
        "kivi": {"selector": "quantize", "bits": 4, "group_size": 8},
        "stream": {"selector": "streaming", "sinks": 4, "window": 60},
    }
    actions = [parse_action(spec, name=name) for name, spec in specs.items()]
    kept = job_kept(actions, 200)
    assert kept == [200, 100, 200, 200]
    assert [type(k) for k in kept] == [int, int, HeldPart, HeldPart]
    assert [getattr(k, "decoding", None) for k in kept] == [None, None, False, True]
