"""configs/compression.yaml's equal-byte pair for transformers' quantized cache: quanto-4bit
beside snapkv-157 (docs/compression.md, "Bytes"). The bytes are counted here by hand from the
definitions (quanto's packed codes, scale and shift per group; an eviction's kept entries) and
compared with what the pipeline records (``PromptTransform.layer_bytes``, ``prompt_bytes``)."""

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


def test_the_pair_is_in_the_main_group_and_contrasted():
    config = yaml.safe_load(CONFIG.read_text())
    study = config["studies"]["study1"]
    for name in ("quanto-4bit", "snapkv-157"):
        assert name in study["actions"] and name in study["groups"]["main"], name
    assert ["quanto-4bit", "snapkv-157"] in config["analysis"]["contrasts"]["study1"]
    assert (
        config["rollout"]["H"]
        <= max(config["actions"]["quanto-4bit"].get("residual_length", 128), 2) + 1
    )
