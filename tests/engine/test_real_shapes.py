"""The engine on the paper's real shapes, on the CPU: randomly initialised Llama-3.1-8B- and
Qwen2.5-7B-shaped models (2 layers of the real widths, heads, head dim, vocabularies and RoPE
settings; Qwen's q/k/v biases) in float32 and bfloat16.

Per model and dtype, three documents of different lengths run in each call with both studies'
actions (an absolute and a half SnapKV budget, recent at half, SnapKV and recent at 90%, and the
full control) under both prompt layouts (masked and gathered):

* every stream's law (P on X's history over the full cache, Q on Y's and on X's over each
  action's kept cache) equals a plain transformers forward over an explicitly gathered
  ``DynamicCache`` (this file's oracle, independent of the engine), far more closely than
  eviction moves it;
* the full control is exact: Y = X and δ = f = 0 at every step (one torch thread);
* the two layouts write the same X paths, and on them the same laws to rounding (float32: the
  same Y paths too).

Short prompts (64-128 tokens), H = 3 and K <= 2 keep it to about 50 CPU-seconds per model
(measured on the loaded 2-core development machine: about 2 min 15 s of wall time each); the
widths are the real ones, so each row's output layer is the 8B model's, and each model holds
about 6 GB in float32. Measured there (relative max |engine - plain| logit; eviction's own
effect): float32 2.7e-6 (0.33), bfloat16 1.3e-2 (0.41).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvdiverge.engine import RolloutSettings, batched_paths
from kvdiverge.eviction import parse_action, run_prefill, select_positions

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread_module")]

LLAMA = LlamaConfig(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001, 128008, 128009],
)
QWEN = Qwen2Config(
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=2,
    num_attention_heads=28,
    num_key_value_heads=4,
    vocab_size=152064,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    sliding_window=131072,
    use_sliding_window=False,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=[151645, 151643],
)
SNAPKV = {"selector": "snapkv", "window": 16}
ACTIONS = [  # study 1 (an absolute budget as the paper's 512, halves) and study 2 (90%)
    parse_action({**SNAPKV, "budget": 40}, name="snapkv-40"),
    parse_action({**SNAPKV, "budget": 0.5}, name="snapkv-half"),
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({**SNAPKV, "budget": 0.9}, name="snapkv-90"),
    parse_action({"selector": "recent", "budget": 0.9}, name="recent-90"),
    parse_action({"selector": "full"}, name="full"),
]
LENGTHS = (64, 97, 128)
H = 3
# the half budgets run K = 2; the others K = 1, the control K_control = 2 (its own group)
REPLICATES = {"snapkv-40": 1, "snapkv-half": 2, "recent-half": 2, "snapkv-90": 1, "recent-90": 1}
REPLICATES["full"] = 2
# a plain forward against the engine's: max |Δ logit| over the vocabulary relative to the
# largest |logit|; float32 carries 24 bits, bfloat16 8 (2^-5: a few units in the last place)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2**-5}


def _random_model(config, seed: int) -> torch.nn.Module:
    """The model with uniform weights of standard deviation 0.02 (transformers' initializer
    range), norms at 1 and biases at 0.02 scale; the output layer is the embedding's rows in a
    random order (untied, as in both real models; filling it afresh would double the set-up)."""
    with torch.device("meta"):
        model = (LlamaForCausalLM if config.model_type == "llama" else Qwen2ForCausalLM)(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    half_width = 0.02 * 3**0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "lm_head.weight":
                continue
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.uniform_(-half_width, half_width, generator=gen)
        order = torch.randperm(config.vocab_size, generator=gen)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight.index_select(0, order))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # RoPE buffers
    return model.eval()


def _documents(seed: int, vocab: int):
    gen = torch.Generator().manual_seed(seed)
    return [
        (f"doc/{i}", torch.randint(1000, vocab - 1000, (n,), generator=gen).tolist(), REPLICATES)
        for i, n in enumerate(LENGTHS)
    ]


class _PlainForward:
    """The oracle: the prompt prefilled once by the model's own forward; a stream's cache is its
    kept positions gathered from that prefill into a fresh ``DynamicCache``, and its tokens are
    fed one at a time at positions n, n+1, …"""

    def __init__(self, model, ids):
        self.model, self.n = model, len(ids)
        with torch.no_grad():
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        self.first = out.logits[0, -1]
        self.layers = [(entry.keys, entry.values) for entry in out.past_key_values.layers]

    @torch.no_grad()
    def logits(self, kept: torch.Tensor, *histories) -> list[torch.Tensor]:
        """The logits of steps 1..len(history)+1 of each history (token lists of one length),
        over the cache of the ``kept`` positions (L, H_kv, n_keep); the histories decode side
        by side, each row with its own copy of the cache."""
        rows = len(histories)
        cache = DynamicCache()
        for layer, (keys, values) in enumerate(self.layers):
            index = kept[layer][None, :, :, None].expand(-1, -1, -1, keys.shape[-1])
            gathered = keys.gather(2, index), values.gather(2, index)
            cache.update(*(t.repeat(rows, 1, 1, 1) for t in gathered), layer)
        out = [self.first.expand(rows, -1)]
        for j, tokens in enumerate(zip(*histories, strict=True)):
            step = self.model(
                input_ids=torch.tensor([[int(t)] for t in tokens]),
                position_ids=torch.full((rows, 1), self.n + j),
                past_key_values=cache,
                use_cache=True,
            )
            out.append(step.logits[:, -1])
        return list(torch.stack(out, 1).float())


def _run(model, docs, eos, layout):
    settings = RolloutSettings(H, 17, keep_logits=True, prompt_attention=layout)
    return dict(batched_paths(model, docs, ACTIONS, eos, settings))


def _law_gaps(model, docs, results) -> tuple[float, float]:
    """Largest |engine − plain| logit over every stream, action, document and step, relative to
    the largest |plain logit|, and the smallest relative largest |Q − P| logit that eviction
    causes on the same plain forwards (what the first must be far below)."""
    worst, effect = 0.0, float("inf")
    for doc_id, ids, _ in docs:
        plain = _PlainForward(model, ids)
        prefill = run_prefill(model, ids, actions=ACTIONS)
        shape = (model.config.num_hidden_layers, model.config.num_key_value_heads, len(ids))
        everything = torch.arange(len(ids)).expand(shape)  # P: the full cache
        p_of: dict[tuple[int, ...], torch.Tensor] = {}  # X is shared by the actions
        for action in ACTIONS:
            if action.name == "full":  # its Q is P exactly (_assert_control_exact)
                continue
            rollout = results[doc_id][action.name]
            kept = select_positions(prefill, action)
            x, y = rollout.x_token[0, :-1], rollout.y_token[0, :-1]
            if tuple(x) not in p_of:
                (p_of[tuple(x)],) = plain.logits(everything, x)
            q, q_fixed = plain.logits(kept, y, x)
            streams = {"p": p_of[tuple(x)], "q": q, "q_fixed": q_fixed}
            for name, want in streams.items():
                got = torch.from_numpy(rollout.logits[name][0]).float()
                assert got.shape == want.shape == (H, model.config.vocab_size)
                scale = float(want.abs().max())
                worst = max(worst, float((got - want).abs().max()) / scale)
            # steps 2..H: eviction acts after the first token
            moved = float((streams["q_fixed"][1:] - streams["p"][1:]).abs().max())
            effect = min(effect, moved / float(streams["p"].abs().max()))
    return worst, effect


def _assert_control_exact(results):
    for doc_results in results.values():
        full = doc_results["full"]
        assert np.array_equal(full.x_token, full.y_token)
        assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
        assert full.n_kept == full.n_prompt


def _assert_layouts_agree(a, b, dtype):
    """The same X paths; on them P and Q (Q on X's history) agree to the dtype's rounding. In
    float32 Y's paths and δ, f are the same too; in bfloat16 a Y token may differ where a
    uniform falls within rounding of a CDF boundary (128K tokens: many boundaries)."""
    for doc_id in a:
        for name in a[doc_id]:
            ra, rb = a[doc_id][name], b[doc_id][name]
            assert np.array_equal(ra.x_token, rb.x_token), (doc_id, name)
            for stream in ("p", "q_fixed"):
                gap = np.abs(ra.logits[stream] - rb.logits[stream]).max()
                gap /= np.abs(ra.logits[stream]).max()
                assert gap <= TOLERANCE[dtype], (doc_id, name, stream, gap)
            if dtype == torch.float32:
                assert np.array_equal(ra.y_token, rb.y_token), (doc_id, name)
                np.testing.assert_allclose(ra.tv_rollout, rb.tv_rollout, atol=1e-5)
                np.testing.assert_allclose(ra.tv_fixed, rb.tv_fixed, atol=1e-5)


@pytest.mark.parametrize("config", [LLAMA, QWEN], ids=["llama-3.1-8b", "qwen2.5-7b"])
def test_real_shapes_laws_control_and_layouts(config):
    model = _random_model(config, seed=5)
    if config.model_type == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None  # q/k/v biases
        assert model.model.layers[0].self_attn.o_proj.bias is None
    else:
        assert model.config.rope_parameters["rope_type"] == "llama3"
    eos = list(config.eos_token_id)
    docs = _documents(3, config.vocab_size)
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        masked = _run(model, docs, eos, "masked")
        gathered = _run(model, docs, eos, "gathered")
        for results in (masked, gathered):
            _assert_control_exact(results)
            assert [r["full"].n_prompt for r in results.values()] == list(LENGTHS)
        _assert_layouts_agree(masked, gathered, dtype)
        worst, effect = _law_gaps(model, docs, masked)
        assert worst <= TOLERANCE[dtype], (dtype, worst)
        assert effect >= 10 * max(worst, TOLERANCE[dtype] / 10), (dtype, effect)  # can fail
        split = sum(
            int((r.x_token != r.y_token).any(axis=1).sum())
            for doc in masked.values()
            for r in doc.values()
        )
        print(f"{config.model_type} {dtype}: max |engine - plain| logit {worst:.2e} (relative), "
              f"eviction moves it by at least {effect:.2e}, {split} paths split")  # fmt: skip
