"""The model-family guard: attention the shared-prefix attention does not compute (a logit soft
cap as Gemma 2's, a sliding window shorter than the job, anything unknown) is refused in one line
at preflight and at the attention call; what it does compute passes and matches the model.

The Gemma-2 models are small and randomly initialised (transformers' Gemma2Config), saved with
the committed tiny-llama tokenizer; with the soft cap turned off, the engine's greedy reference
equals the model's own greedy ``generate``, so the guard refuses only what would be wrong.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Gemma2Config, Gemma2ForCausalLM, MistralConfig, Qwen2Config

from kvdiverge.cli import main
from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.engine.families import (
    UnsupportedAttentionError,
    attention_config_problem,
    check_attention_call,
    check_loaded_attention,
    probe_attention_arguments,
    sliding_window_of,
)
from kvdiverge.engine.preflight import PreflightError, check_model_folder, check_model_source
from kvdiverge.eviction import parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "models" / "tiny-llama"
PROMPT = "The river flows north past the old mill. The special magic number is 482913. " * 3
SOFTCAP_LINE = (
    "the model's attention uses an attention logit soft cap (attn_logit_softcapping = 50.0, "
    "as Gemma 2's), which the shared-prefix attention does not compute "
    '(docs/models.md, "Model families")'
)


def _gemma2(folder: Path, softcap: float | None, sliding_window: int = 4096) -> Path:
    """A 2-layer random Gemma-2 (one sliding, one full layer) with tiny-llama's tokenizer."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    config = Gemma2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        max_position_embeddings=8192,
        sliding_window=sliding_window,
        attn_logit_softcapping=softcap,
        final_logit_softcapping=30.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(3)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():  # weights large enough that the soft cap changes the scores
        for p in model.parameters():
            p.normal_(0, 0.5 if p.ndim > 1 else 0.1)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TOKENIZER / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def gemma_softcap(tmp_path_factory):
    return _gemma2(tmp_path_factory.mktemp("gemma2") / "softcap", softcap=50.0)


@pytest.fixture(scope="module")
def gemma_plain(tmp_path_factory):
    return _gemma2(tmp_path_factory.mktemp("gemma2") / "plain", softcap=None)


# ---- the config ---------------------------------------------------------------------------------
def test_config_problems_by_family():
    gemma = Gemma2Config().to_dict()
    assert attention_config_problem(gemma, None) == (
        "an attention logit soft cap (attn_logit_softcapping = 50.0, as Gemma 2's)"
    )
    assert sliding_window_of(gemma) == 4096
    # Qwen2: a sliding_window value, but no layer slides (use_sliding_window false)
    qwen = Qwen2Config(sliding_window=4096, use_sliding_window=False).to_dict()
    assert sliding_window_of(qwen) is None and attention_config_problem(qwen, 10**6) is None
    # Mistral: every layer slides; refused only when the job needs more positions
    mistral = MistralConfig(sliding_window=4096).to_dict()
    assert sliding_window_of(mistral) == 4096
    assert attention_config_problem(mistral, 4096) is None
    assert attention_config_problem(mistral, 4097) == (
        "a sliding window of 4096 positions, shorter than the 4097 positions the job needs "
        "(its longest prompt plus H)"
    )
    assert attention_config_problem(mistral, None) is None  # unknown: left to the call check
    assert sliding_window_of({"sliding_window": 128, "layer_types": ["full_attention"]}) is None
    raw = {"text_config": {"attention_chunk_size": 8192}}
    assert attention_config_problem(raw, None) == (
        "chunked attention (attention_chunk_size = 8192, as Llama 4's)"
    )
    assert attention_config_problem({"alibi": False, "attention_chunk_size": None}, 10) is None


def test_attention_call_arguments():
    ok = {"position_ids": torch.zeros(1, 1), "use_cache": True, "sliding_window": None}
    check_attention_call(ok | {"softcap": None, "s_aux": None, "new_thing": None}, 10)
    check_attention_call({"sliding_window": 10}, 10)  # the window holds all 10 keys
    check_attention_call({"sliding_window": 10}, lambda: 10)
    with pytest.raises(UnsupportedAttentionError) as err:
        check_attention_call({"softcap": 50.0}, 10)
    assert str(err.value) == (
        "the model's attention asks for an attention logit soft cap (softcap = 50.0, as Gemma "
        "2's), which the shared-prefix attention does not compute "
        '(docs/models.md, "Model families")'
    )
    with pytest.raises(UnsupportedAttentionError, match="a sliding window of 9 positions, "):
        check_attention_call({"sliding_window": 9}, lambda: 10)
    with pytest.raises(UnsupportedAttentionError, match=r"the argument s_aux|attention sinks"):
        check_attention_call({"s_aux": torch.zeros(2)}, 10)
    with pytest.raises(UnsupportedAttentionError, match="asks for the argument new_thing = 3,"):
        check_attention_call({"new_thing": 3}, 10)


# ---- preflight ----------------------------------------------------------------------------------
def test_preflight_refuses_gemma2_with_a_softcap_in_one_line(gemma_softcap, gemma_plain):
    config_file = gemma_softcap / "config.json"
    assert json.loads(config_file.read_text())["attn_logit_softcapping"] == 50.0
    with pytest.raises(PreflightError) as err:
        check_model_folder(gemma_softcap, "config.models.gemma.path")
    assert str(err.value) == f"config.models.gemma.path: {config_file}: {SOFTCAP_LINE}"
    # the sliding window (4096) against the job's positions; without a soft cap, 4096 pass
    assert check_model_folder(gemma_plain, "w", 4096) == {"max_positions": 8192}
    with pytest.raises(PreflightError, match="a sliding window of 4096 positions, shorter than"):
        check_model_source({"path": str(gemma_plain)}, "w", 4097)


def test_kvdiverge_compare_refuses_gemma2_with_a_softcap_in_one_line(
    gemma_softcap, tmp_path, capsys
):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT, "answers": ["482913"]}) + "\n")
    argv = ["compare", "--model", str(gemma_softcap), "--prompts", str(prompts)]
    argv += ["--actions", "recent@0.5", "--H", "4", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvdiverge compare: --model: {gemma_softcap / 'config.json'}: {SOFTCAP_LINE}"
    assert not (tmp_path / "out").exists()


# ---- the engine ---------------------------------------------------------------------------------
def _greedy(folder: Path, H: int = 8):
    model, tok = load_model(str(folder)), load_tokenizer(str(folder))
    ids = chat_prompt_ids(tok, PROMPT)
    settings = RolloutSettings(H, 5, temperature=0.0, drop_ended=False)
    full = parse_action({"selector": "full"}, name="full")
    return (
        model,
        ids,
        lambda: paths_under_actions(
            model, ids, [full], "doc", 1, eos_token_ids(model, tok), settings
        )["full"],
    )


def test_the_engine_refuses_a_softcap_at_the_first_call(gemma_softcap):
    """Past preflight (the call itself): the first decoding call of the shared-prefix attention
    refuses the soft cap in one line."""
    _, _, run = _greedy(gemma_softcap)
    with pytest.raises(UnsupportedAttentionError, match=r"^the model's attention asks for an "):
        run()


def test_gemma2_without_a_softcap_matches_generate(gemma_plain):
    """What passes the guard is computed exactly: Gemma 2 without the soft cap (its sliding
    window holding the whole job, its scaling and final soft cap the model's own) gives the
    greedy path of ``generate``."""
    model, ids, run = _greedy(gemma_plain)
    rollout = run()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
    expected = out[0, len(ids) :].tolist()
    assert rollout.x_token[0].tolist() == expected


# ---- the loaded model's arguments -------------------------------------------------------------
def test_the_probe_finds_what_each_family_passes(gemma_softcap, gemma_plain):
    """One two-token forward through a recording attention function: Llama passes nothing that
    changes attention; Gemma 2 its soft cap and (on its sliding layers) the window; the model's
    own attention implementation is back afterwards."""
    llama = load_model(str(TOKENIZER))
    seen = probe_attention_arguments(llama)
    assert {k for k, v in seen.items() if v is not None} <= {"position_ids", "use_cache"}
    assert llama.config._attn_implementation == "sdpa"
    check_loaded_attention(llama, "config.models.tiny-llama.path", 10**6)
    capped = load_model(str(gemma_softcap))
    assert probe_attention_arguments(capped)["softcap"] == 50.0
    with pytest.raises(UnsupportedAttentionError) as err:
        check_loaded_attention(capped, "config.models.gemma.path", 100)
    assert str(err.value).startswith(
        "config.models.gemma.path: the model's attention asks for an attention logit soft cap "
        "(softcap = 50.0, as Gemma 2's)"
    )
    plain = load_model(str(gemma_plain))
    assert probe_attention_arguments(plain)["sliding_window"] == 4096
    check_loaded_attention(plain, "w", 4096)
    with pytest.raises(UnsupportedAttentionError, match=r"^w: .*a sliding window of 4096 "):
        check_loaded_attention(plain, "w", 4097)
