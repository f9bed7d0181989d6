"""Decoding temperature (issue 31, item 4): the kernels are softmax(logits / T), the coupling
unchanged in form; T = 1 is the untempered kernel bit for bit; T = 0 is greedy decoding, whose
reference stream X equals the model's own greedy ``generate``; the temperature reaches the
trajectory metadata of ``kvdiverge compare``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from kvdiverge.engine import RolloutSettings, paths_under_action
from kvdiverge.eviction import parse_action
from kvdiverge.io.trajectories import read_trajectory_metadata
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer
from kvdiverge.theory.coupling import (
    maximal_coupling_joint,
    maximal_coupling_step,
    merge_eos,
    tempered_kernel,
    tv,
)

transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPT = (
    "The river flows north through the valley, past the old mill and the stone bridge. "
    "The special magic number is 482913. What is the special magic number? "
) * 3
RECENT = parse_action({"name": "recent-half", "selector": "recent", "budget": 0.5})


@pytest.fixture(scope="module")
def demo():
    tok = load_tokenizer(str(MODEL))
    model = load_model(str(MODEL), device="cpu", dtype="float32")
    return model, tok, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def test_tempered_kernels():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, 0.25, 0.0, 4.0]])
    one = tempered_kernel(logits, 1.0)
    assert torch.equal(one, logits.double().softmax(dim=-1))  # T = 1: bit for bit
    half = tempered_kernel(logits, 0.5)
    expected = np.exp(2 * logits.double().numpy())
    expected /= expected.sum(-1, keepdims=True)
    np.testing.assert_allclose(half.numpy(), expected, rtol=1e-14, atol=0)
    np.testing.assert_allclose(tempered_kernel(logits.numpy(), 0.5), expected, rtol=1e-14)
    greedy = tempered_kernel(logits, 0)
    assert greedy.dtype == torch.float64
    assert greedy.tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]  # the tie 3.0/3.0 goes to id 1
    assert tempered_kernel(logits.numpy(), 0).tolist() == greedy.tolist()
    with pytest.raises(ValueError, match="temperature: expected a number >= 0, got -1"):
        tempered_kernel(logits, -1)


def test_the_coupling_joint_law_at_half_temperature_by_enumeration():
    """The accept sampler's joint law over a fine grid of its three uniforms equals the maximal
    coupling of the tempered kernels (and not of the untempered ones)."""
    lp = np.array([0.2, 1.0, -0.5, 0.7, 0.0])
    lq = np.array([1.1, -0.3, 0.4, 0.6, -1.0])
    p, q = tempered_kernel(lp, 0.5), tempered_kernel(lq, 0.5)
    n = 120
    grid = (np.arange(n) + 0.5) / n
    u = np.stack(np.meshgrid(grid, grid, grid, indexing="ij"), axis=-1).reshape(-1, 3)
    x, y = maximal_coupling_step(
        np.broadcast_to(p, (len(u), 5)), np.broadcast_to(q, (len(u), 5)), u
    )
    joint = np.zeros((5, 5))
    np.add.at(joint, (x, y), 1.0 / len(u))
    exact = maximal_coupling_joint(p, q)
    assert np.abs(joint - exact).max() < 2.5 / n
    assert joint.trace() == pytest.approx(1 - tv(p, q), abs=2.5 / n)
    untempered = maximal_coupling_joint(tempered_kernel(lp), tempered_kernel(lq))
    assert np.abs(joint - untempered).max() > 0.1


def test_the_engine_decodes_with_the_tempered_kernels(demo):
    """At T = 0.5 every step's δ_t is the TV of softmax(logits / 0.5) of P and Q."""
    model, _, ids, eos = demo
    deltas = {}
    for T in (0.5, 1.0):
        settings = RolloutSettings(H=4, seed=3, keep_logits=True, temperature=T)
        r = paths_under_action(model, ids, RECENT, "doc", 3, eos, settings)
        p = merge_eos(tempered_kernel(torch.from_numpy(r.logits["p"]), T), eos)
        q = merge_eos(tempered_kernel(torch.from_numpy(r.logits["q"]), T), eos)
        np.testing.assert_allclose(r.tv_rollout, tv(p, q).numpy(), rtol=1e-5, atol=1e-7)
        deltas[T] = r.tv_rollout[:, 1:]
    assert deltas[0.5].max() > 0 and np.abs(deltas[0.5] - deltas[1.0]).max() > 1e-3


def test_greedy_reference_equals_the_models_greedy_generate(demo):
    model, _, ids, eos = demo
    H = 12
    settings = RolloutSettings(H=H, seed=5, temperature=0)
    r = paths_under_action(model, ids, RECENT, "doc", 2, eos, settings)
    again = paths_under_action(
        model, ids, RECENT, "doc", 2, eos, RolloutSettings(H=H, seed=99, temperature=0)
    )
    assert np.array_equal(r.x_token[0], r.x_token[1])  # every replicate the same path
    assert np.array_equal(r.x_token, again.x_token) and np.array_equal(r.y_token, again.y_token)
    assert set(np.unique(r.tv_rollout)) <= {0.0, 1.0}  # point masses: δ_t ∈ {0, 1}
    generated = model.generate(
        torch.tensor([list(ids)]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=H,
        eos_token_id=list(eos),
        pad_token_id=min(eos),
    )[0, len(ids) :].tolist()
    ended = r.x_eos[0].argmax() if r.x_eos[0].any() else H
    assert r.x_token[0, :ended].tolist() == generated[:ended]
    if ended < H:
        assert generated[ended] in eos


def test_compare_records_the_temperature_and_runs_one_replicate_when_greedy(tmp_path):
    from kvdiverge.compare import compare

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "answers": ["482913"]}) + "\n")
    lines = []
    out = tmp_path / "out"
    result = compare(MODEL, prompts, ["recent@0.5"], K=3, H=4, draws=10, temperature=0,
                     out=out, log=lines.append)  # fmt: skip
    assert lines[0] == "temperature 0 (greedy): every replicate is the same path, so K = 1 (not 3)"
    meta = read_trajectory_metadata(out / "trajectories" / "recent@0.5.parquet")
    assert meta["temperature"] == 0 and meta["K"] == {"study1": 1}
    assert result.generations["replicate"].to_list() == [0]


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), True])
def test_a_bad_temperature_is_one_line(tmp_path, value):
    from kvdiverge.compare import CompareError, compare

    with pytest.raises(CompareError) as err:
        compare(MODEL, tmp_path / "p.jsonl", "recent@0.5", temperature=value, out=tmp_path / "o")
    assert str(err.value) == (
        f"--temperature: expected a finite number >= 0 (0: greedy), got {value!r}"
    )
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="temperature: expected a finite number >= 0"):
        RolloutSettings(H=4, seed=0, temperature=value)
