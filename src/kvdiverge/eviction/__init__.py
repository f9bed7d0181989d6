"""KV-cache eviction: actions, budgets, selectors and their registry.

An action is (name, selector, budget, the selector's parameters), written in the config as one
dict such as ``{selector: snapkv, budget: 0.5, window: 64, kernel: 5}``. Eviction happens once,
after the prefill of the prompt: the action's selector returns, for every layer and KV head, the
prompt positions to keep (ascending). The budget gives ``n_keep`` for an n-token prompt:

* a float budget in (0, 1] is a fraction of n, floored in exact rational arithmetic
  (0.9 → ``(9 * n) // 10``, never ``int(n * 0.9)``);
* an integer budget ≥ 1 is absolute (everything is kept when n ≤ budget);
* a selector that keeps everything (``full``, the control) takes no budget.

A selector is a class whose fields are its parameters, as kvpress's presses are dataclasses
whose fields are theirs: it declares them with their defaults, checks them (:meth:`validate`),
and each action holds its own instance (:attr:`ActionSpec.method`). Most selectors score
positions: :class:`ScoredSelector` turns per-layer, per-KV-head scores into kept positions (the
positions it always keeps, then the top-scored rest up to ``n_keep``, sorted). ``recent``
(kvpress's StreamingLLMPress: sinks plus the most recent entries) and ``snapkv`` (kvpress's
SnapKVPress, ``docs/method.md``, "SnapKV") are short classes on it; ``full`` keeps everything.
``quantize`` (KIVI's quantized prompt cache, :mod:`kvdiverge.eviction.quantize`) is a prompt
transformation (:mod:`kvdiverge.eviction.transforms`): its cache is tensors of its own, not a
kept subset. ``kvpress`` runs a kvpress press's own ``score`` inside the project's prefill
(:mod:`kvdiverge.eviction.kvpress_bridge`), and ``selector: "package.module:Class"`` imports a
:class:`Selector` subclass of the user's own.

A selector may return ragged kept sets (counts that vary by layer or KV head, e.g. kvpress's
PyramidKV and AdaKV): each head's positions ascending, padded at the end with −1 to the
longest head, and declares its counts (:meth:`Selector.kept_per_layer`).

Whatever a selector returns is checked before any decoding, and the shared prefill is shown
unchanged after each selector (:mod:`kvdiverge.eviction.contract`): one :class:`ActionError`
line naming the action and the selector otherwise.

Modules: ``budgets``, ``prefill``, ``selectors``, ``run`` (running the prefill and the
selectors), ``contract``, ``builtin`` (``full``, ``recent``, ``snapkv``), ``kvpress_bridge``,
``kvpress_status`` (every press kvpress exports, bridged or refused), ``transforms`` and
``quantize``, ``decoding`` (compression during decoding: :class:`DecodingCompressor`, the
built-in ``streaming``), ``kvpress_decoding`` (kvpress's DecodingPress),
``kvpress_merging`` (kvpress's MergingPress, a prompt transformation) and ``quantized_cache``
(transformers' ``QuantizedCache`` backends, ``quantized-cache``, a prompt transformation).
"""

from __future__ import annotations

from kvdiverge.eviction.budgets import ActionError, budget_tokens
from kvdiverge.eviction.builtin import FullSelector, RecentSelector, SnapKVSelector, snapkv_scores
from kvdiverge.eviction.decoding import DecodingCompressor, StreamingCompressor, is_decoding
from kvdiverge.eviction.kvpress_bridge import KvpressSelector
from kvdiverge.eviction.prefill import LayerInputs, Prefill
from kvdiverge.eviction.quantize import QuantizeSelector
from kvdiverge.eviction.quantized_cache import QuantizedCacheSelector
from kvdiverge.eviction.run import kept_counts, kept_positions, run_prefill, select_positions
from kvdiverge.eviction.selectors import (
    DISPLAY_KEYS,
    SELECTORS,
    ActionSpec,
    ScoredSelector,
    Selector,
    check_action,
    keeps_everything,
    parse_action,
    register_selector,
    resolve_selector,
    selector_entry,
)
from kvdiverge.eviction.transforms import (
    PromptTransform,
    cache_bytes,
    is_transform,
    prompt_bytes,
    transformed_prefix,
)

__all__ = [
    "DISPLAY_KEYS",
    "SELECTORS",
    "ActionError",
    "ActionSpec",
    "DecodingCompressor",
    "FullSelector",
    "KvpressSelector",
    "LayerInputs",
    "Prefill",
    "PromptTransform",
    "QuantizeSelector",
    "QuantizedCacheSelector",
    "RecentSelector",
    "ScoredSelector",
    "Selector",
    "SnapKVSelector",
    "StreamingCompressor",
    "budget_tokens",
    "cache_bytes",
    "check_action",
    "is_decoding",
    "is_transform",
    "keeps_everything",
    "kept_counts",
    "kept_positions",
    "parse_action",
    "prompt_bytes",
    "register_selector",
    "resolve_selector",
    "run_prefill",
    "select_positions",
    "selector_entry",
    "snapkv_scores",
    "transformed_prefix",
]
