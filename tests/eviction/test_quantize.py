"""The built-in KIVI quantizer (kvdiverge.eviction.quantize) against an independent
quantize-dequantize written here: loops over heads, channels, tokens and groups in numpy, from
KIVI's definition (keys per channel in groups of G tokens, values per token in groups of G
channels, asymmetric min/max with a zero point, a full-precision window of recent entries)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdiverge.eviction import ActionError, parse_action
from kvdiverge.eviction.quantize import kivi_keys, kivi_layer_bytes, kivi_values


def _group(x: np.ndarray, bits: int, dtype: np.dtype) -> np.ndarray:
    """One group, quantized and dequantized: zero point min, scale (max − min)/(2^b − 1), both
    stored in ``dtype``; codes rounded half to even and clipped; float64 arithmetic."""
    lo, hi = float(x.min()), float(x.max())
    top = 2**bits - 1
    zero = float(np.asarray(lo).astype(dtype))
    scale = float(np.asarray((hi - lo) / top).astype(dtype))
    if scale == 0:
        return np.full_like(x, zero)
    codes = np.clip(np.round((x - zero) / scale), 0, top)
    return zero + codes * scale


def reference_kivi(
    keys: np.ndarray, values: np.ndarray, bits: int, group: int, residual: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values (H, n, d) of one layer as KIVI's quantizer leaves them (dequantized)."""
    dtype = keys.dtype
    h, n, d = keys.shape
    quantized = n - min(residual, n)
    n_k = quantized - quantized % group  # an incomplete key group stays in full precision
    k, v = keys.astype(np.float64), values.astype(np.float64)
    k_out, v_out = k.copy(), v.copy()
    for head in range(h):
        for channel in range(d):
            for start in range(0, n_k, group):
                rows = slice(start, start + group)
                k_out[head, rows, channel] = _group(k[head, rows, channel], bits, dtype)
        for token in range(quantized):
            for start in range(0, d, group):
                cols = slice(start, start + group)
                v_out[head, token, cols] = _group(v[head, token, cols], bits, dtype)
    return k_out.astype(dtype), v_out.astype(dtype)


def reference_bytes(n, n_kv, d, bits, group, residual, itemsize) -> int:
    """Bytes counted entry by entry: every quantized element b bits (packed per head and
    tensor, rounded up to bytes), two numbers per group, every other element full size."""
    quantized = n - min(residual, n)
    n_k = quantized - quantized % group
    total = 0
    for _ in range(n_kv):
        key_bits = sum(bits for _ in range(n_k) for _ in range(d))
        value_bits = sum(bits for _ in range(quantized) for _ in range(d))
        groups = len(range(0, n_k, group)) * d + quantized * len(range(0, d, group))
        full = (n - n_k) * d + (n - quantized) * d
        total += -(-key_bits // 8) + -(-value_bits // 8) + (2 * groups + full) * itemsize
    return total


CASES = [
    # bits, group, residual, n (n not a multiple of the group; residual longer than the prompt)
    (2, 4, 0, 13),
    (4, 4, 3, 13),
    (8, 8, 5, 32),
    (2, 8, 0, 8),
    (4, 16, 64, 20),
    (4, 2, 1, 7),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits, group, residual, n", CASES)
def test_kivi_equals_independent_quantizer(dtype, bits, group, residual, n):
    gen = torch.Generator().manual_seed(bits * 100 + n)
    keys = (torch.randn(3, n, 16, generator=gen) * 3).to(dtype)
    values = torch.randn(3, n, 16, generator=gen).to(dtype)
    keys[1, :, 2] = 0.75  # a constant channel: scale 0, every entry its zero point
    values[2, 0] = -1.5  # a constant token
    before = (keys.clone(), values.clone())
    got_k = kivi_keys(keys, bits, group, residual)
    got_v = kivi_values(values, bits, group, residual)
    want_k, want_v = reference_kivi(keys.numpy(), values.numpy(), bits, group, residual)
    assert np.array_equal(got_k.numpy(), want_k)
    assert np.array_equal(got_v.numpy(), want_v)
    assert got_k.dtype == dtype and got_v.dtype == dtype
    assert torch.equal(keys, before[0]) and torch.equal(values, before[1])  # inputs untouched
    # the full-precision part is the input itself, bit for bit
    quantized = n - min(residual, n)
    assert torch.equal(got_v[:, quantized:], values[:, quantized:])
    assert torch.equal(
        got_k[:, quantized - quantized % group :], keys[:, quantized - quantized % group :]
    )


def test_kivi_error_within_half_a_step_and_shrinks_with_bits():
    """Each dequantized value lies within half a quantization step of its input (plus float
    rounding), so the error falls with the bit width."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(2, 40, 32, generator=gen, dtype=torch.float64)
    errors = []
    for bits in (2, 4, 8):
        out = kivi_values(values, bits, 8, 0)
        groups = values.reshape(2, 40, 4, 8)
        step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
        err = (out - values).abs().reshape(2, 40, 4, 8)
        assert bool((err <= step[..., None] / 2 + 1e-12).all())
        errors.append(float(err.max()))
    assert errors[0] > errors[1] > errors[2] > 0


@pytest.mark.parametrize("bits, group, residual, n", CASES)
def test_bytes_equal_counted_entries(bits, group, residual, n):
    for itemsize in (2, 4):
        got = kivi_layer_bytes(n, 3, 16, bits, group, residual, itemsize)
        assert got == reference_bytes(n, 3, 16, bits, group, residual, itemsize)


def test_bytes_of_4bit_against_full_precision():
    """SmolLM2's shape (3 KV heads, head size 64) at 1024 tokens, float32: a 4-bit cache with
    groups of 32 holds 1024·64·(4/8 + 2·4/32)·2 bytes per head, 0.1875 of the full 1024·64·4·2."""
    full = 3 * 1024 * 64 * 4 * 2
    got = kivi_layer_bytes(1024, 3, 64, 4, 32, 0, 4)
    assert got == 3 * (2 * 1024 * 64 // 2 + 2 * 2 * (1024 * 64 // 32) * 4)
    assert got / full == 0.1875


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"bits": 3}, "actions.q.bits: expected one of 2, 4, 8, got 3"),
        ({"bits": 4, "budget": 0.5}, "actions.q.budget: selector 'quantize' takes bits, not a"),
        ({"group_size": 0}, "actions.q.group_size: expected an integer >= 1, got 0"),
        ({"residual": -1}, "actions.q.residual: expected an integer >= 0, got -1"),
        ({"bits": 4.0}, "actions.q.bits: expected an integer, got 4.0"),
        ({"bitz": 4}, "actions.q.bitz: not a parameter of selector 'quantize'"),
    ],
)
def test_bad_parameters_are_one_line(entry, message):
    with pytest.raises(ActionError) as info:
        parse_action({"selector": "quantize", **entry}, name="q")
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_compare_spec_bits_and_options():
    from kvdiverge.compare.actions import CompareError, parse_actions

    parsed = parse_actions(
        "quantize@4bit,q2=quantize@2bit+group_size=16+residual=8,quantize+bits=8"
    )
    methods = [(a.label, a.action.method) for a in parsed]
    assert [(label, m.bits, m.group_size, m.residual) for label, m in methods] == [
        ("quantize@4bit", 4, 32, 0),
        ("q2", 2, 16, 8),
        ("quantize+bits=8", 8, 32, 0),
    ]
    assert all(a.action.budget is None for a in parsed)
    with pytest.raises(
        CompareError, match=r"^--actions: 'quantize@4bit\+bits=2': bits given twice$"
    ):
        parse_actions("quantize@4bit+bits=2")
    with pytest.raises(CompareError, match="takes bits, not a budget"):
        parse_actions("quantize@0.5")


def test_compression_config_passes_every_check():
    from pathlib import Path

    from kvdiverge.config import check_config, load_yaml_strict

    root = Path(__file__).resolve().parents[2]
    path = root / "configs" / "compression.yaml"
    cfg = load_yaml_strict(path)
    check_config(cfg, root / "workflow" / "schemas" / "config.schema.yaml", files=[path])
    actions = cfg["actions"]
    assert actions["kivi-4bit"]["bits"] == 4 and actions["kivi-2bit"]["bits"] == 2
    study = set(cfg["studies"]["study1"]["actions"])
    assert study == {
        "kivi-4bit",
        "kivi-2bit",
        "snapkv-24",
        "snapkv-18",
        "snapkv-half",
        "full",
        "decoding-knorm",
        "streaming-192",
        "merging-24",
        "kivi-2bit-r0",
        "kivi-2bit-gen",
        "quanto-4bit",
        "snapkv-157",
        "snapkv-138",
    }
    assert actions["streaming-192"]["selector"] == "streaming"
    assert actions["kivi-2bit-gen"]["generated"] is True
    # the contrast isolates the generated entries: the same prompt cache without them quantized
    gen, r0 = actions["kivi-2bit-gen"], actions["kivi-2bit-r0"]
    assert {k: v for k, v in gen.items() if k != "generated"} == r0
    assert ["kivi-2bit-gen", "kivi-2bit-r0"] in cfg["analysis"]["contrasts"]["study1"]
