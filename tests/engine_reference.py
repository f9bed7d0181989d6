"""The engine's test oracle: plain transformers decoding over an explicitly gathered cache.

Shared by ``tests/engine/test_engine.py`` and ``benchmarks/device_check.py`` (which runs it on a
GPU).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


@torch.no_grad()
def reference_logits(model, ids, kept, tokens) -> torch.Tensor:
    """Plain transformers decoding over an explicitly gathered per-sequence cache.

    The prompt is prefilled, the kept positions of every layer and KV head are gathered into a
    fresh DynamicCache of batch 1, and ``tokens`` are fed one by one at positions n, n+1, ….
    Returns the logits of steps 1..len(tokens)+1 (step 1: after the prompt), on the model's
    device.
    """
    n = len(ids)
    device = next(model.parameters()).device
    prompt = torch.tensor([ids], device=device)
    full = model(prompt, use_cache=True).past_key_values
    cache = DynamicCache()
    for layer, entry in enumerate(full.layers):
        index = kept[layer].to(device)[None, :, :, None].expand(-1, -1, -1, entry.keys.shape[-1])
        cache.update(entry.keys.gather(2, index), entry.values.gather(2, index), layer)
    out = [model(prompt).logits[0, -1]]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]], device=device),
            position_ids=torch.tensor([[n + j]], device=device),
            past_key_values=cache,
            use_cache=True,
        )
        out.append(result.logits[0, -1])
    return torch.stack(out)


@torch.no_grad()
def aged_reference_logits(model, ids, tokens, prompt, age) -> torch.Tensor:
    """Plain transformers decoding of one row over a DynamicCache of batch 1 whose entries the
    caller sets: the prompt part is ``prompt(keys, values)`` of the prompt's own full cache (per
    layer, each (H_kv, n, d)); after every call the generated part is ``age(keys, values)`` of
    the row's own generated entries as the model wrote them (full precision, (H_kv, t, d),
    oldest first). ``tokens`` are fed at positions n, n+1, …. Returns the logits of steps
    1..len(tokens)+1 (step 1: the prefill's), on the model's device."""
    n = len(ids)
    device = next(model.parameters()).device
    out = model(torch.tensor([ids], device=device), use_cache=True)
    cache = DynamicCache()
    for layer, entry in enumerate(out.past_key_values.layers):
        k, v = prompt(entry.keys[0], entry.values[0])
        cache.update(k[None], v[None], layer)
    widths = [layer.keys.shape[2] for layer in cache.layers]
    written = [([], []) for _ in cache.layers]
    logits = [out.logits[0, -1]]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]], device=device),
            position_ids=torch.tensor([[n + j]], device=device),
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(result.logits[0, -1])
        for layer, width, (keys, values) in zip(cache.layers, widths, written, strict=True):
            keys.append(layer.keys[0, :, -1:].clone())  # the call's own entry, as written
            values.append(layer.values[0, :, -1:].clone())
            k, v = age(torch.cat(keys, dim=1), torch.cat(values, dim=1))
            layer.keys = torch.cat([layer.keys[:, :, :width], k[None]], dim=2)
            layer.values = torch.cat([layer.values[:, :, :width], v[None]], dim=2)
    return torch.stack(logits)


def law_differences(model, ids, kept, everything, rollout, replicate: int) -> dict[str, float]:
    """Largest |engine − plain| next-token probability of one replicate, per stream.

    ``rollout``: a :class:`kvdiverge.engine.ActionPaths` with logits (``keep_logits``);
    ``kept``/``everything``: the action's and the full kept positions. The streams: P on X's
    history over the full cache, Q on Y's and Q on X's history over the kept cache.
    """
    x, y = rollout.x_token[replicate, :-1], rollout.y_token[replicate, :-1]
    plain = {
        "p": reference_logits(model, ids, everything, x),
        "q": reference_logits(model, ids, kept, y),
        "q_fixed": reference_logits(model, ids, kept, x),
    }
    out = {}
    for name, logits in plain.items():
        expected = logits.double().softmax(-1).cpu()
        got = torch.from_numpy(rollout.logits[name][replicate]).double().softmax(-1)
        out[name] = float((got - expected).abs().max())
    return out


def random_prompt(gen: torch.Generator, n_kv: int, n: int, d: int, layers: int):
    """A random prompt cache for the attention function's own tests: per layer (keys, values)
    of shape (n_kv, n, d), and a prefill-like namespace over them (``keys``, ``values``, ``n``,
    ``head_dim``) for ``gather_prefix`` and ``kept_mask``."""
    from types import SimpleNamespace

    prompt = [
        (torch.randn(n_kv, n, d, generator=gen), torch.randn(n_kv, n, d, generator=gen))
        for _ in range(layers)
    ]
    prefill = SimpleNamespace(
        keys=[k for k, _ in prompt], values=[v for _, v in prompt], n=n, head_dim=d
    )
    return prompt, prefill
