"""The roofline's work counts (``kvdiverge.engine.roofline``): hand counts on a toy shape, and the
matrix products' FLOPs against torch's own FLOP counter on a real (tiny, random) Llama model."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from kvdiverge.engine.memory_plan import ModelShape
from kvdiverge.engine.roofline import (
    Work,
    causal_attention_work,
    coupling_work,
    kernel_work,
    lm_head_work,
    mlp_work,
    own_attention_work,
    projection_work,
    prompt_attention_work,
)

# L = 2 layers, h = 8, H = 2 query heads, G = 1 KV head, d = 4, I = 16, V = 10, float32
TOY = ModelShape(
    layers=2,
    hidden=8,
    heads=2,
    kv_heads=1,
    head_dim=4,
    intermediate=16,
    vocab=10,
    tied=True,
    qkv_bias=False,
    dtype_bytes=4,
)


def test_work_bound_is_the_larger_of_compute_and_memory() -> None:
    assert Work(100.0, 50.0).bound(10.0, 10.0) == 10.0  # compute: 100 / 10
    assert Work(100.0, 500.0).bound(10.0, 10.0) == 50.0  # memory: 500 / 10
    assert Work(1.0, 2.0) + Work(3.0, 4.0) == Work(4.0, 6.0)


def test_hand_counts_on_a_toy_shape() -> None:
    # projections: W = 8·(2 + 2)·4 + 2·4·8 = 128 + 64 = 192 a layer; 3 rows:
    # FLOPs 2·3·2·192 = 2304; bytes 4·2·192 = 1536 (weights) + 4·3·2·(4·8 + (4 + 2)·4) = 1344
    assert projection_work(TOY, 3) == Work(2304, 1536 + 1344)
    # MLP: 3·8·16 = 384 weights a layer; FLOPs 2·3·2·384 = 4608;
    # bytes 4·2·384 = 3072 + 4·3·2·(24 + 48) = 1728
    assert mlp_work(TOY, 3) == Work(4608, 3072 + 1728)
    # LM head: FLOPs 2·3·10·8 = 480; bytes 4·80 + 4·3·8 + 4·3·10 = 320 + 96 + 120
    assert lm_head_work(TOY, 3) == Work(480, 536)
    # prompt product: 3 rows attending to 5 + 5 + 2 = 12 entries, reading 5 entries, one masked
    # group of n = 5: FLOPs 4·4·2·2·12 = 768; bytes 2·2·1·5·4·4 = 320 (K, V) + 4·2·1·5 = 40
    # (mask) + 2·4·2·2·4·3 = 384 (queries, outputs)
    assert prompt_attention_work(TOY, 3, attended=12, read=5, masked=5) == Work(768, 744)
    # own entries: 3 rows of 6: FLOPs 4·4·2·2·18 = 1152; bytes 2·2·1·18·4·4 = 1152 + 384
    assert own_attention_work(TOY, 3, 6) == Work(1152, 1536)
    # causal prefill of n = 3: 6 pairs; FLOPs 4·4·2·2·6 = 384; bytes 4·2·3·4·(4 + 2) = 576
    assert causal_attention_work(TOY, 3) == Work(384, 576)
    # softmax of 3 rows over V = 10: float32 in, float64 out; the coupling reads float64 once
    assert kernel_work(3, 10) == Work(0, 3 * 10 * 12)
    assert coupling_work(3, 10) == Work(0, 3 * 10 * 8)


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[transformers.LlamaForCausalLM, ModelShape]:
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
        attn_implementation="eager",  # attention as two counted products
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    return model, ModelShape.from_config(config.to_dict(), dtype="float32")


def _counted(counts: dict, module: str, ops: tuple[str, ...]) -> int:
    """FLOPs torch counted for ``module`` (its submodules included) in the operators ``ops``."""
    return sum(v for op, v in counts.get(module, {}).items() if str(op).split(".")[-1] in ops)


def test_flops_match_torchs_counter_on_a_real_model(tiny_llama) -> None:
    model, shape = tiny_llama
    rows, cached = 5, 6
    with torch.no_grad():
        past = model(input_ids=torch.randint(0, 50, (rows, cached)), use_cache=True)
        with FlopCounterMode(display=False) as counter:
            model(
                input_ids=torch.randint(0, 50, (rows, 1)),
                past_key_values=past.past_key_values,
                use_cache=True,
            )
    counts = counter.get_flop_counts()
    top = "LlamaForCausalLM"
    mlp = sum(_counted(counts, f"{top}.model.layers.{i}.mlp", ("mm",)) for i in range(2))
    attn = sum(_counted(counts, f"{top}.model.layers.{i}.self_attn", ("mm",)) for i in range(2))
    products = sum(
        _counted(counts, f"{top}.model.layers.{i}.self_attn", ("bmm", "matmul")) for i in range(2)
    )
    assert mlp == mlp_work(shape, rows).flops
    assert attn == projection_work(shape, rows).flops
    assert _counted(counts, f"{top}.lm_head", ("mm",)) == lm_head_work(shape, rows).flops
    # each row attends to its cached entries and its own new one: cached + 1
    assert products == own_attention_work(shape, rows, cached + 1).flops


def test_weight_bytes_match_the_models_parameters(tiny_llama) -> None:
    model, shape = tiny_llama
    linear = {
        name: m.weight.numel() * 4
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    attn = sum(v for k, v in linear.items() if ".self_attn." in k)
    mlp = sum(v for k, v in linear.items() if ".mlp." in k)
    # with zero rows only the weights are read
    assert projection_work(shape, 0).bytes == attn
    assert mlp_work(shape, 0).bytes == mlp
    assert lm_head_work(shape, 0).bytes == linear["lm_head"]
