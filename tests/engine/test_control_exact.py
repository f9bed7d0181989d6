"""The full-retention control is bit-exact on one CPU thread in float32 whatever K and
K_control are (``docs/method.md``, "The full-retention control").

The control's X and Y rows share every model call; a row's values must therefore not depend on
where it lies in the batch or on how many rows the batch holds. The log-sum-exp merge of the
shared-prefix attention applies a sigmoid to each row's per-head weights, and torch's CPU loop
rounds the scalar tail after its blocks of two vectors differently: rows padded to 16 lanes put
the last row of an odd batch in that tail (study 2's K = 1 unit holds 3 rows), and the control
showed δ ≈ 1e-7 on a path or two. These tests fail with that padding.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import transformers

from kvdiverge.engine import RolloutSettings
from kvdiverge.engine.attention import SharedPrefix, shared_prefix_attention
from kvdiverge.engine.batches import batched_paths
from kvdiverge.eviction import parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
STUDY2 = (
    {"name": "snapkv-90", "selector": "snapkv", "budget": 0.9},
    {"name": "recent-90", "selector": "recent", "budget": 0.9},
    {"name": "full", "selector": "full"},
)


class _Layer(torch.nn.Module):
    layer_idx = 0


@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (28, 4)])
def test_attention_rows_equal_bits_wherever_they_lie(heads):
    """Identical rows (queries, own entries, prompt) give identical bits in batches of every
    size from 1 to 9, at every position (odd batches included): no row takes another code path."""
    n_heads, n_kv = heads
    d, n, t = 16, 45, 5
    gen = torch.Generator().manual_seed(3)
    prompt = [(torch.randn(n_kv, n, d, generator=gen), torch.randn(n_kv, n, d, generator=gen))]
    for _ in range(12):
        query = torch.randn(1, n_heads, 1, d, generator=gen) * 2
        key, value = (torch.randn(1, n_kv, t, d, generator=gen) for _ in range(2))
        for batch in range(1, 10):
            shared = SharedPrefix([torch.arange(batch)], [prompt])
            out, _ = shared_prefix_attention(
                _Layer(),
                query.expand(batch, -1, -1, -1),
                key.expand(batch, -1, -1, -1),
                value.expand(batch, -1, -1, -1),
                None,
                kvd_prefix=shared,
            )
            assert torch.equal(out, out[:1].expand_as(out)), (heads, batch)


@pytest.fixture(scope="module")
def tiny_llama():
    path = ROOT / "data" / "models" / "tiny-llama"
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    documents = pl.read_parquet(FIXTURE).head(6)
    prompts = [(r["doc_id"], chat_prompt_ids(tok, r["prompt"])) for r in documents.to_dicts()]
    return model, prompts, eos_token_ids(model, tok)


# (K, K_control, seed): with the 16-lane padding each of these runs gave δ ≠ 0 on one path
@pytest.mark.parametrize("K, K_control, seed", [(1, 2, 2), (1, 2, 4), (2, 1, 0), (2, 1, 2)])
def test_control_exact_when_K_and_K_control_differ(tiny_llama, K, K_control, seed):
    """Six documents of different lengths in one batch, study 2's actions at K, the control at
    K_control, H = 32 (rows end and leave the batch, so its size varies and is often odd): the
    control's δ and f are exactly 0 and X ≡ Y at every step of every path."""
    model, prompts, eos = tiny_llama
    actions = [parse_action(a) for a in STUDY2]
    counts = {a.name: K_control if a.name == "full" else K for a in actions}
    documents = [(doc_id, ids, counts) for doc_id, ids in prompts]
    ended = 0
    for _, results in batched_paths(model, documents, actions, eos, RolloutSettings(32, seed)):
        control = results["full"]
        assert control.x_token.shape == (K_control, 32)
        assert np.array_equal(control.x_token, control.y_token)
        assert not control.tv_rollout.any() and not control.tv_fixed.any()
        ended += int(control.x_eos[:, -1].sum())
    assert ended  # some paths end inside the horizon: their rows leave the batch
