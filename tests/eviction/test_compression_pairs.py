"""configs/compression.yaml's equal-byte pairs: transformers' quantized cache quanto-4bit beside
snapkv-157, and KIVI's 2-bit cache without a window (kivi-2bit-r0, kivi-2bit-gen) beside
snapkv-138 (docs/compression.md, "Bytes"). The bytes are counted here by hand from the
definitions (packed codes, two numbers per group, full-precision entries; an eviction's kept
entries) and compared with what the pipeline records (``prompt_bytes``)."""

from __future__ import annotations

import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from kvdiverge.eviction import parse_action, prompt_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "compression.yaml"
LENGTHS = range(558, 736)  # the config's prompt lengths (its header: 558-735 tokens)
EVALUATION = (619, 567, 710, 735)  # its 4 evaluation prompts (helmet-768, ruler-768 study1)
N_KV, HEAD, ITEM = 3, 64, 4  # SmolLM2-135M: KV heads, head size, float32 bytes

needs_quanto = pytest.mark.skipif(
    importlib.util.find_spec("optimum") is None
    or importlib.util.find_spec("optimum.quanto") is None,
    reason="optimum-quanto is not installed (selector quantized-cache's quanto backend)",
)


def _quanto_axis0_bytes(n: int, nbits: int, group: int) -> int:
    """One layer's keys and values under quanto on axis 0, counted from the definition: the
    (1, N_KV, n, HEAD) tensor's N elements in N/G groups of G consecutive ones, the codes packed
    8/b to a byte down the N/G rows (a last, partial byte padded), and a scale and a shift of
    ITEM bytes per group."""
    rows = N_KV * n * HEAD // group
    per_byte = 8 // nbits
    codes = ((rows + per_byte - 1) // per_byte) * group
    return 2 * (codes + 2 * rows * ITEM)


def _full_bytes(n: int) -> int:
    return 2 * N_KV * n * HEAD * ITEM


@needs_quanto
def test_quanto_4bit_holds_snapkv_157s_bytes_on_the_configs_prompts():
    config = yaml.safe_load(CONFIG.read_text())
    actions = config["actions"]
    quanto = parse_action(actions["quanto-4bit"], name="quanto-4bit")
    snapkv = parse_action(actions["snapkv-157"], name="snapkv-157")
    assert quanto.method.name == "quantized-cache" and quanto.budget is None
    assert (quanto.method.backend, quanto.method.nbits, quanto.method.axis_key) == ("quanto", 4, 0)
    assert quanto.method.axis_value == 0 and quanto.method.q_group_size == HEAD
    q_shares, s_shares = [], []
    for n in LENGTHS:
        quanto.method.check_shape(quanto, n, N_KV, HEAD)  # every length passes: no refusal
        q_bytes = prompt_bytes(quanto, None, n, N_KV, HEAD, ITEM, layers=1)[0]
        assert q_bytes == _quanto_axis0_bytes(n, 4, HEAD), n
        keep = n * 157 // 1000  # floor(0.157 n), in exact arithmetic
        assert snapkv.n_keep(n) == keep, n
        s_bytes = prompt_bytes(snapkv, [[keep] * N_KV], n, N_KV, HEAD, ITEM, layers=1)[0]
        assert s_bytes == keep * 2 * N_KV * HEAD * ITEM
        q_shares.append(Fraction(q_bytes, _full_bytes(n)))
        s_shares.append(Fraction(s_bytes, _full_bytes(n)))
    # quanto's share is 40 bytes per 256 (32 of 4-bit codes, a float32 scale and shift per
    # 64-element group), up to the half byte row an odd 3n pads
    assert all(Fraction(5, 32) <= s <= Fraction(5, 32) + Fraction(1, 24 * 558) for s in q_shares)
    q_mean = sum(q_shares) / len(q_shares)
    s_mean = sum(s_shares) / len(s_shares)
    assert abs(float(s_mean - q_mean)) < 5e-4
    # 0.157 is the SnapKV budget of three decimals whose mean share is closest to quanto's
    means = {
        b: sum(Fraction(n * b // 1000, n) for n in LENGTHS) / len(LENGTHS) for b in range(150, 165)
    }
    assert min(means, key=lambda b: abs(means[b] - q_mean)) == 157


def _kivi_bytes(n: int, bits: int, group: int) -> int:
    """One layer of KIVI's cache without a window, counted from the definition per KV head: the
    keys' first n_k = floor(n/G)·G entries and all n values quantized, the codes packed b to a
    bit, two numbers of ITEM bytes per group ((n_k/G)·HEAD key groups, n·HEAD/G value groups),
    the n − n_k keys of the incomplete group in full precision."""
    n_k = n // group * group
    codes = -(-n_k * HEAD * bits // 8) + -(-n * HEAD * bits // 8)
    groups = n_k // group * HEAD + n * (HEAD // group)
    return N_KV * (codes + 2 * groups * ITEM + (n - n_k) * HEAD * ITEM)


def test_kivi_2bit_without_window_holds_snapkv_138s_bytes_on_the_evaluation_prompts():
    actions = yaml.safe_load(CONFIG.read_text())["actions"]
    r0 = parse_action(actions["kivi-2bit-r0"], name="kivi-2bit-r0")
    gen = parse_action(actions["kivi-2bit-gen"], name="kivi-2bit-gen")
    snapkv = parse_action(actions["snapkv-138"], name="snapkv-138")
    kivi = []
    for n in EVALUATION:
        expected = _kivi_bytes(n, 2, 32)
        for action in (r0, gen):  # the same prompt cache: generated entries aside
            assert prompt_bytes(action, None, n, N_KV, HEAD, ITEM, layers=1)[0] == expected
        kivi.append(Fraction(expected, _full_bytes(n)))
    assert all(Fraction(1, 8) <= s < Fraction(3, 20) for s in kivi)  # 0.125 up to n mod 32
    k_mean = sum(kivi) / len(kivi)
    means = {
        b: sum(Fraction(n * b // 1000, n) for n in EVALUATION) / len(EVALUATION)
        for b in range(125, 150)
    }
    assert min(means, key=lambda b: abs(means[b] - k_mean)) == 138
    for n in EVALUATION:
        assert snapkv.n_keep(n) == n * 138 // 1000
    assert abs(float(means[138] - k_mean)) < 5e-4


def test_the_pairs_are_rolled_out_and_contrasted():
    config = yaml.safe_load(CONFIG.read_text())
    study = config["studies"]["study1"]
    for name in ("quanto-4bit", "snapkv-157"):
        assert name in study["actions"] and name in study["groups"]["main"], name
    # a group of its own after the first two: their lock and trajectories stay
    assert list(study["groups"])[-1] == "bytes" and study["groups"]["bytes"] == ["snapkv-138"]
    contrasts = config["analysis"]["contrasts"]["study1"]
    assert ["quanto-4bit", "snapkv-157"] in contrasts
    assert ["kivi-2bit-r0", "snapkv-138"] in contrasts
    assert ["kivi-2bit-gen", "snapkv-138"] in contrasts
    assert (
        config["rollout"]["H"]
        <= max(config["actions"]["quanto-4bit"].get("residual_length", 128), 2) + 1
    )
