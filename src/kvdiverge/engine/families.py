"""The model families the shared-prefix attention computes exactly, and the guard against the rest.

The engine's decoding attention (:func:`kvdiverge.engine.attention.shared_prefix_attention`)
computes ``softmax(q·kᵀ·scaling)·v`` over the whole prompt and the row's own entries: the
attention of Llama, Qwen2, Mistral (within its window) and their kin. Some families ask for
more through the arguments of the attention call (transformers passes them to every attention
function) or through their config:

* a logit soft cap (``softcap``; ``attn_logit_softcapping`` in the config: Gemma 2), which
  transforms the scores as ``cap·tanh(s/cap)`` before the softmax;
* a sliding window (``sliding_window``) shorter than the positions a job needs (its longest
  prompt plus H): the model would see fewer keys than the engine gives it;
* attention sinks (``s_aux``), chunked attention (``attention_chunk_size``), ALiBi biases;
* any other argument with a value that the engine does not know.

Dropping any of them would run silently and give laws that are not the model's. Each is
refused in one line: from the config at preflight (:func:`attention_config_problem`, before any
weights load); from the arguments the loaded model passes, found by one two-token forward
before any rollout (:func:`check_loaded_attention`); and from every call itself
(:func:`check_attention_call`, which the attention function runs on each call). Arguments
whose value is None, or a window that holds every key, are the plain attention and pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "IGNORED_CALL_ARGUMENTS",
    "REFUSED_CONFIG_KEYS",
    "UnsupportedAttentionError",
    "attention_config_problem",
    "check_attention_call",
    "check_loaded_attention",
    "probe_attention_arguments",
    "sliding_window_of",
]

IGNORED_CALL_ARGUMENTS = frozenset(
    {
        "position_ids",  # the positions are already in the rotated queries and keys
        "cache_position",
        "past_key_values",
        "past_key_value",
        "use_cache",
        "output_attentions",
        "is_causal",  # one query per row: every key of the row precedes it
    }
)
"""Arguments of an attention call that do not change its result for one decoding query per row
(transformers passes them for the cache and the mask)."""

_CALL_MEANING = {
    "softcap": "an attention logit soft cap (softcap = {value}, as Gemma 2's)",
    "s_aux": "attention sinks (s_aux)",
    "sinks": "attention sinks",
    "sliding_window": "a sliding window of {value} positions",
}

REFUSED_CONFIG_KEYS = {
    "attn_logit_softcapping": "an attention logit soft cap (attn_logit_softcapping = {value}, "
    "as Gemma 2's)",
    "attention_chunk_size": "chunked attention (attention_chunk_size = {value}, as Llama 4's)",
    "alibi": "ALiBi position biases (alibi = {value})",
    "use_alibi": "ALiBi position biases (use_alibi = {value})",
}
"""config.json keys whose (non-null, non-false) value asks for attention the engine does not
compute, with what each means."""


class UnsupportedAttentionError(ValueError):
    """The model asks its attention for something the shared-prefix attention does not compute
    (one line)."""


def _sections(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    text = config.get("text_config")
    return [config, *([text] if isinstance(text, Mapping) else [])]


def sliding_window_of(config: Mapping[str, Any]) -> int | None:
    """The sliding window some layer of a model applies (config.json as a dict), else None.

    A layer slides when ``layer_types`` names it ``sliding_attention``; without
    ``layer_types`` every layer slides when ``sliding_window`` is set and ``use_sliding_window``
    is not false (Mistral's configs have no such flag; Qwen2's say false).
    """
    for section in _sections(config):
        window = section.get("sliding_window")
        if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
            continue
        types = section.get("layer_types")
        if isinstance(types, list | tuple):
            if "sliding_attention" in types:
                return window
            continue
        if section.get("use_sliding_window", True) is not False:
            return window
    return None


def attention_config_problem(config: Mapping[str, Any], positions: int | None) -> str | None:
    """What in a model config (config.json as a dict) the shared-prefix attention does not
    compute, in words, or None: a key of :data:`REFUSED_CONFIG_KEYS` set, or a sliding window
    shorter than ``positions`` (the longest prompt plus H; None: unknown, left to the call
    check)."""
    for section in _sections(config):
        for key, meaning in REFUSED_CONFIG_KEYS.items():
            value = section.get(key)
            if value is not None and value is not False:
                return meaning.format(value=value)
    window = sliding_window_of(config)
    if window is not None and positions is not None and window < positions:
        return (
            f"a sliding window of {window} positions, shorter than the {positions} positions "
            "the job needs (its longest prompt plus H)"
        )
    return None


def check_attention_call(kwargs: Mapping[str, Any], n_keys: int | Callable[[], int]) -> None:
    """Refuse an attention call whose arguments ask for more than plain attention over at most
    ``n_keys`` keys per query (the prompt part and the row's own entries; a function giving it
    is called only for a sliding window): a soft cap or attention sinks that are set, a sliding
    window shorter than ``n_keys`` (a query at position i sees the keys j with i - j < window,
    as transformers' masks), or any argument the engine does not know
    (:data:`IGNORED_CALL_ARGUMENTS`) with a value other than None. One-line
    :class:`UnsupportedAttentionError` naming the argument."""
    for name, value in kwargs.items():
        if value is None or name in IGNORED_CALL_ARGUMENTS:
            continue
        if name == "sliding_window" and isinstance(value, int) and not isinstance(value, bool):
            n_keys = n_keys() if callable(n_keys) else n_keys
            if value >= n_keys:
                continue
        meaning = _CALL_MEANING.get(name, f"the argument {name} = {value!r}")
        what = meaning.format(value=value)
        if name == "sliding_window":
            what += f", shorter than the {n_keys} keys of this step"
        raise UnsupportedAttentionError(
            f"the model's attention asks for {what}, which the shared-prefix attention does "
            'not compute (docs/models.md, "Model families")'
        )


_PROBE = "kvdiverge_argument_probe"


def probe_attention_arguments(model: Any) -> dict[str, Any]:
    """The keyword arguments a loaded model's layers pass to their attention function, found by
    one forward of two tokens through a recording function that computes plain SDPA attention
    (the model's own implementation is restored after). Per argument the first value other
    than None, and for ``sliding_window`` the smallest window of any layer."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seen: dict[str, Any] = {}

    def record(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        for name, given in kwargs.items():
            if name == "sliding_window" and isinstance(seen.get(name), int):
                if isinstance(given, int) and not isinstance(given, bool):
                    seen[name] = min(seen[name], given)
            elif seen.get(name) is None:
                seen[name] = given
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )

    AttentionInterface.register(_PROBE, record)
    old = model.config._attn_implementation
    device = next(model.parameters()).device
    model.set_attn_implementation(_PROBE)
    try:
        with torch.no_grad():
            model(torch.zeros((1, 2), dtype=torch.long, device=device), use_cache=False)
    finally:
        model.set_attn_implementation(old)
    return seen


def check_loaded_attention(model: Any, where: str, positions: int) -> None:
    """After loading, before any rollout: the arguments the model passes to its attention
    (:func:`probe_attention_arguments`) ask for nothing the shared-prefix attention does not
    compute over ``positions`` keys (the job's longest prompt plus H;
    :func:`check_attention_call`). One-line :class:`UnsupportedAttentionError` starting with
    ``where``."""
    try:
        check_attention_call(probe_attention_arguments(model), positions)
    except UnsupportedAttentionError as exc:
        raise UnsupportedAttentionError(f"{where}: {exc}") from None
