"""The kvpress bridge: a kvpress press's own scoring inside the project's one prefill.

An action ``{selector: kvpress, press: KnormPress, budget: 0.5, press_kwargs: {...}}`` runs the
press's own ``score(module, hidden_states, keys, values, attentions, kwargs)`` on every
attention layer during the prefill, with the arguments kvpress's forward hook would pass (the
layer's input hidden states, its full post-RoPE keys and values, the attention probabilities
when the model returns them, the attention forward's kwargs), and keeps the top ``n_keep``
positions per layer and KV head, where ``n_keep`` is the project's exact integer budget
(:func:`kvdiverge.eviction.budget_tokens`), not kvpress's ``int(n · (1 − ratio))``. A press
whose scores depend on its compression ratio (StreamingLLMPress, CriticalKVPress) is given the
ratio ``1 − (n_keep + ½)/n``, for which kvpress itself keeps exactly ``n_keep``. kvpress is an
optional dependency (``pip install -e '.[kvpress]'``), imported only when such an action is
parsed.

What is bridged (kvpress 0.5.5):

* every ``ScorerPress`` that only defines ``score`` (KnormPress, TOVAPress, SnapKVPress,
  StreamingLLMPress, ExpectedAttentionPress, ObservedAttentionPress, KeyDiffPress, LagKVPress,
  CURPress, LeverageScorePress, CompactorPress, NonCausalAttnPress, CapPress, RandomPress with
  a seed, CriticalKVPress around one of them; QFilterPress, KVzapPress and
  ExpectedAttentionStatsPress load their weights from the Hugging Face Hub). ObservedAttention
  needs the attention probabilities: when the model does not return them (SDPA), they are
  recomputed per layer from the layer's inputs with the model's own eager attention function,
  O(H · n²) memory per layer;
* PyramidKVPress: per-layer counts, PyramidKV's own ``get_layer_budget`` at the ratio
  ``1 − n_keep/n`` (they average ``n_keep`` up to rounding);
* AdaKVPress around a ScorerPress: per-head counts, AdaKV's allocation (a safeguard of
  ``alpha_safeguard · n_keep`` per head, then the layer's ``H_kv · (n − n_keep)`` lowest scores
  across heads evicted), so each layer keeps ``H_kv · n_keep`` entries in all;
* MergingPress around a ScorerPress: a prompt transformation (``transforms``): the inner
  press's top ``n_keep`` positions per layer and KV head, keys unchanged, each evicted value
  folded into its most cosine-similar kept neighbour by kvpress's own ``MergingPress.merge``
  (:mod:`kvdiverge.eviction.kvpress_merging`).

Presses that are not one eviction after the prefill are refused in one line saying why
(:data:`REFUSED`). Nested presses (AdaKVPress's and CriticalKVPress's ``press``) are written
as a press name or as ``{press: NAME, press_kwargs: {...}}``, MergingPress's ``press`` too.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvdiverge.eviction.budgets import ActionError
from kvdiverge.eviction.contract import check_scores
from kvdiverge.eviction.kvpress_decoding import check_base_press, decoding_kept, decoding_schedule
from kvdiverge.eviction.kvpress_merging import (
    check_merging_kwargs,
    merged_entries,
    merging_indices,
    merging_layer_bytes,
)
from kvdiverge.eviction.selectors import ScoredSelector, _check_budget_field, register_selector

if TYPE_CHECKING:
    from kvdiverge.eviction.prefill import LayerInputs, Prefill
    from kvdiverge.eviction.selectors import ActionSpec

if TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

__all__ = ["KvpressSelector", "REFUSED", "attention_probabilities"]

_PREFILL_DECODING = (
    "a prefill press and a DecodingPress in one; its prefill press keeps kvpress's own "
    "int(n·(1 − ratio)) entries, not an action's budget (not yet bridged: DecodingPress alone is)"
)
_RATIO_DECODING = (
    "sets its target size at each step from the tokens seen so far (not yet bridged: "
    "DecodingPress with a fixed target_size is)"
)
_RECONSTRUCTS = (
    "scores entries by reconstructing the context with forward passes of its own, not inside "
    "one prefill"
)
_NOT_YET = "not yet bridged"

# kvpress press classes (and their subclasses) that the bridge refuses, with the reason.
REFUSED: dict[str, str] = {
    "CompressionRatioDecodingPress": _RATIO_DECODING,
    "CAMPress": "merges evicted values into the next kept neighbours while decoding, by a "
    "Bernoulli mask drawn from torch's global generator at each compression from the "
    "attention summed over the decoding steps; the decoding bridge keeps subsets of each row's "
    f"entries and passes no attention ({_NOT_YET})",
    "PrefillDecodingPress": _PREFILL_DECODING,
    "KVzipPress": _RECONSTRUCTS,
    "FastKVzipPress": _RECONSTRUCTS,
    "RestoreKVPress": _RECONSTRUCTS,
    "ThinKPress": "prunes key channels, not positions",
    "KeyRerotationPress": "re-rotates the kept keys, so the cache is not the prompt's own entries",
    "DMSPress": "evicts by a score threshold, so the kept count is not the action's budget",
    "FinchPress": "needs a delimiter token and the question after it, and runs its own prefill",
    "KVComposePress": "runs its own prefill (its own __call__)",
    "ComposedPress": f"applies presses one after another ({_NOT_YET}: give each its own action)",
    "PerLayerCompressionPress": f"per-layer ratios replace the action's budget ({_NOT_YET})",
    "ChunkPress": f"sets its kept count chunk by chunk, not from the budget ({_NOT_YET})",
    "BlockPress": f"compresses block by block ({_NOT_YET})",
    "ChunkKVPress": f"selects whole chunks, not positions ({_NOT_YET})",
    "SimLayerKVPress": f"keeps whole layers or sinks plus recent ones by a threshold ({_NOT_YET})",
    "DuoAttentionPress": f"per-head streaming patterns loaded from files ({_NOT_YET})",
    "LUKVPress": f"per-layer and per-head budgets from a precomputed curve ({_NOT_YET})",
    "CriticalAdaKVPress": f"head-wise two-stage allocation ({_NOT_YET})",
}

_SCORED, _PYRAMID, _ADAKV, _DECODE, _MERGING = "scored", "pyramid", "adakv", "decoding", "merging"


def _kvpress(where: str) -> Any:
    try:
        import kvpress
    except ImportError as exc:
        raise ActionError(
            f"{where}: the kvpress selector needs kvpress (pip install -e '.[kvpress]'): {exc}"
        ) from exc
    return kvpress


def _press_kind(cls: type, where: str) -> str:
    """How the bridge runs a press class, or a one-line refusal saying why it cannot."""
    from kvpress import AdaKVPress, DecodingPress, MergingPress, PyramidKVPress, ScorerPress

    for base in cls.__mro__:
        if base.__name__ in REFUSED and base.__module__.startswith("kvpress"):
            raise ActionError(f"{where}: {cls.__name__} is refused: {REFUSED[base.__name__]}")
    if issubclass(cls, MergingPress):  # a prompt transformation (kvpress_merging)
        if all(getattr(cls, m) is getattr(MergingPress, m) for m in ("compress", "merge")):
            return _MERGING
        raise ActionError(
            f"{where}: {cls.__name__} is refused: it overrides MergingPress's compress or merge, "
            "so it is not known to leave MergingPress's cache"
        )
    if issubclass(cls, DecodingPress):  # compression during decoding (kvpress_decoding)
        own = ("compress", "forward_hook", "_resolve_target_size")
        if all(getattr(cls, m) is getattr(DecodingPress, m) for m in own):
            return _DECODE
        raise ActionError(
            f"{where}: {cls.__name__} is refused: it overrides DecodingPress's compression, so "
            "it is not known to keep DecodingPress's entries"
        )
    if issubclass(cls, PyramidKVPress):
        return _PYRAMID
    if issubclass(cls, AdaKVPress):
        return _ADAKV
    if issubclass(cls, ScorerPress) and cls.compress is ScorerPress.compress:
        return _SCORED
    raise ActionError(
        f"{where}: {cls.__name__} is refused: it is not a ScorerPress whose compress keeps the "
        "top-scored positions, so it is not known to be one eviction after the prefill"
    )


def _build_press(press: Any, press_kwargs: Any, where: str) -> tuple[Any, str]:
    """A press instance and its kind from a class name and keyword arguments."""
    kvpress = _kvpress(f"{where}.press")
    cls = getattr(kvpress, press, None) if isinstance(press, str) and press else None
    if not (isinstance(cls, type) and issubclass(cls, kvpress.BasePress)):
        raise ActionError(
            f"{where}.press: expected the name of a kvpress press class (e.g. KnormPress), "
            f"got {press!r}"
        )
    kind = _press_kind(cls, f"{where}.press")
    if not isinstance(press_kwargs, Mapping):
        raise ActionError(f"{where}.press_kwargs: expected a mapping, got {press_kwargs!r}")
    kwargs = dict(press_kwargs)
    if "compression_ratio" in kwargs:
        raise ActionError(
            f"{where}.press_kwargs.compression_ratio: the action's budget sets the kept count; "
            "remove compression_ratio"
        )
    if kind == _MERGING:
        check_merging_kwargs(kwargs, where)
    for key in ("press", "base_press"):  # a wrapper's inner press
        if key in kwargs:
            kwargs[key] = _inner_press(kwargs[key], f"{where}.press_kwargs.{key}")
    try:
        built = cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ActionError(f"{where}.press_kwargs: {cls.__name__}: {reason}") from exc
    _check_press_sizes(built, where)
    if kind == _DECODE:
        check_base_press(built, where)
    return built, kind


def _decoding_class(press: Any, where: str) -> bool:
    """Whether ``press`` names a kvpress DecodingPress class (or a subclass)."""
    kvpress = _kvpress(f"{where}.press")
    cls = getattr(kvpress, press, None) if isinstance(press, str) and press else None
    return isinstance(cls, type) and issubclass(cls, kvpress.DecodingPress)


def _inner_press(inner: Any, inner_where: str) -> Any:
    """A wrapper's inner press, a name or ``{press: NAME, press_kwargs: {...}}``, built."""
    if isinstance(inner, Mapping):
        extra = sorted(set(inner) - {"press", "press_kwargs"})
        if extra:
            raise ActionError(f"{inner_where}.{extra[0]}: expected press and press_kwargs")
        inner_press, inner_kind = _build_press(
            inner.get("press"), inner.get("press_kwargs", {}), inner_where
        )
    else:
        inner_press, inner_kind = _build_press(inner, {}, inner_where)
    if inner_kind in (_ADAKV, _DECODE, _MERGING):
        name = type(inner_press).__name__
        raise ActionError(f"{inner_where}: expected a ScorerPress, got {name}")
    return inner_press


SIZES = ("window_size", "kernel_size", "lag_size")
"""Press attributes that count positions and must be at least 1 (0 fails inside the press, after
the model loads, with a raw torch error)."""


def _check_press_sizes(press: Any, where: str) -> None:
    """Each integer :data:`SIZES` attribute of the press (not of the presses it wraps, which are
    built, and checked, on their own) is >= 1: one line naming the keyword otherwise."""
    for attr in SIZES:
        size = getattr(press, attr, None)
        if isinstance(size, int) and not isinstance(size, bool) and size < 1:
            raise ActionError(
                f"{where}.press_kwargs.{attr}: {type(press).__name__}'s {attr} is {size}; "
                "expected an integer >= 1"
            )


def _chain(press: Any) -> list[Any]:
    """The press and the presses it wraps (``press.press``), outermost first."""
    out = [press]
    while hasattr(out[-1], "press"):
        out.append(out[-1].press)
    return out


def attention_probabilities(layer: LayerInputs) -> torch.Tensor:
    """The layer's causal attention probabilities (1, H, n, n), as eager attention returns them.

    Queries are formed from the layer's input as the attention module forms them (q_proj,
    q_norm where the model has one, RoPE with the layer's position embeddings) and passed with
    the layer's keys and values and a 0/−max additive causal mask (transformers' eager mask) to
    the model's own ``eager_attention_forward``: float32 softmax cast back to the model's dtype.
    """
    import torch

    module = layer.module
    namespace = sys.modules[type(module).__module__]
    hidden = layer.hidden_states
    n = hidden.shape[1]
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    q = q.transpose(1, 2)
    cos, sin = layer.kwargs["position_embeddings"]
    q, _ = namespace.apply_rotary_pos_emb(q, q, cos, sin)
    mask = torch.zeros((1, 1, n, n), dtype=q.dtype, device=q.device)
    future = torch.ones((n, n), dtype=torch.bool, device=q.device).triu(1)
    mask = mask.masked_fill(future, torch.finfo(q.dtype).min)
    _, weights = namespace.eager_attention_forward(
        module, q, layer.keys, layer.values, mask, scaling=module.scaling, dropout=0.0
    )
    return weights


def _adakv_kept(scores: torch.Tensor, n_keep: int, alpha: float) -> torch.Tensor:
    """AdaKV's head-wise allocation (kvpress's ``AdaKVPress.compress``) with ``n_keep`` per head
    on average: kept mask (H_kv, n)."""
    import torch

    bsz, n_kv, k_len = scores.shape
    n_safe = int(n_keep * alpha)
    if alpha > 0:
        n_safe = max(1, n_safe) if n_keep > 0 else 0
    top = torch.topk(scores, n_safe, dim=-1).indices
    scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
    n_pruned = n_kv * (k_len - n_keep)
    pruned = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
    kept = torch.ones(n_kv * k_len, dtype=torch.bool, device=scores.device)
    kept[pruned] = False
    return kept.view(n_kv, k_len)


def _pad(rows: list[list[torch.Tensor]]) -> torch.Tensor:
    """Per layer and head ascending positions → (L, H_kv, m), padded at the end with −1."""
    import torch

    width = max(r.numel() for layer in rows for r in layer)
    out = torch.full(
        (len(rows), len(rows[0]), width), -1, dtype=torch.long, device=rows[0][0].device
    )
    for i, layer in enumerate(rows):
        for j, r in enumerate(layer):
            out[i, j, : r.numel()] = r
    return out


@register_selector
@dataclass(frozen=True)
class KvpressSelector(ScoredSelector):
    """A kvpress press as a selector: ``press`` names its class in kvpress, ``press_kwargs``
    its parameters (without ``compression_ratio``: the action's budget sets the kept count)."""

    name: ClassVar[str] = "kvpress"
    observes: ClassVar[bool] = True
    press: str = ""
    press_kwargs: dict[str, Any] = field(default_factory=dict)

    def _built(self, where: str | None = None) -> tuple[Any, str]:
        built = self.__dict__.get("_press_object")
        if built is None:
            where = f"selector kvpress ({self.press!r})" if where is None else where
            built = _build_press(self.press, self.press_kwargs, where)
            object.__setattr__(self, "_press_object", built)
        return built

    def press_object(self) -> Any:
        """The kvpress press instance (built once)."""
        return self._built()[0]

    @property
    def transforms(self) -> bool:
        """Whether the action's prompt cache is tensors of its own (MergingPress's merged
        values, :mod:`kvdiverge.eviction.kvpress_merging`), not the kept entries themselves."""
        return self._built()[1] == _MERGING

    @property
    def decodes(self) -> bool:
        """Whether the press compresses each row's cache during decoding (DecodingPress,
        :mod:`kvdiverge.eviction.kvpress_decoding`), not once after the prefill."""
        return self._built()[1] == _DECODE

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is None and _decoding_class(self.press, where):
            self._built(where)  # a DecodingPress sets its own sizes: its own lines, if any
            return
        _check_budget_field(action, where)
        if not self.press:
            raise ActionError(f"{where}.press: required: the name of a kvpress press class")
        if self._built(where)[1] == _DECODE:
            raise ActionError(
                f"{where}.budget: {self.press} compresses each row's cache during decoding to "
                "its target_size and takes no budget; omit budget (set press_kwargs.target_size "
                "and compression_interval)"
            )

    def n_keep(self, action: ActionSpec, n: int) -> int:
        """A DecodingPress keeps the whole prompt after the prefill."""
        return n if self.decodes else super().n_keep(action, n)

    def schedule(self, action: ActionSpec) -> tuple[int, int]:
        """A DecodingPress's (interval, max_entries) (:func:`decoding_schedule`)."""
        return decoding_schedule(self.press_object())

    def compress(self, action, layer, keys, values, positions):
        """A DecodingPress's kept entries of one row's layer cache (:func:`decoding_kept`)."""
        return decoding_kept(self.press_object(), keys, values)

    def check(self, action: ActionSpec, n: int, n_keep: int) -> None:
        for press in _chain(self.press_object()):
            for attr in ("window_size", "n_sink"):
                size = getattr(press, attr, None)
                if isinstance(size, int) and not isinstance(size, bool) and n <= size:
                    raise ActionError(
                        f"action {action.name!r}: prompt of {n} tokens is too short for "
                        f"{type(press).__name__}'s {attr} {size}"
                    )

    def prepare(self, model: torch.nn.Module, action: ActionSpec) -> None:
        """As kvpress's ``press(model)`` does: ``post_init_from_model``, and each attention
        module gets the model's ``rotary_emb``."""
        try:
            self.press_object().post_init_from_model(model)
        except Exception as exc:  # e.g. weights a press loads from the Hub
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise ActionError(
                f"action {action.name!r}: {self.press} setup failed: {reason}"
            ) from exc
        language = getattr(model.model, "language_model", model.model)
        for layer in language.layers:
            layer.self_attn.rotary_emb = language.rotary_emb

    def ratio(self, n: int, n_keep: int) -> float:
        """The compression ratio the press is given for an n-token prompt keeping n_keep."""
        kind = self._built()[1]
        return 1 - n_keep / n if kind == _PYRAMID else 1 - (n_keep + 0.5) / n

    def observe(self, action: ActionSpec, layer: LayerInputs, n_keep: int) -> Any:
        import torch
        from kvpress import ObservedAttentionPress

        press, kind = self._built()
        n = layer.keys.shape[2]
        press.compression_ratio = self.ratio(n, n_keep)  # MergingPress: its inner press's
        scorer = press.press if kind in (_ADAKV, _MERGING) else press
        attentions = layer.attentions
        if attentions is None and any(isinstance(p, ObservedAttentionPress) for p in _chain(press)):
            attentions = attention_probabilities(layer)
        # presses that draw random sketches (LeverageScorePress, CompactorPress, CURPress with
        # use_random_leverage, RandomPress without a seed) draw from torch's global generator:
        # seeded per layer here, so that reruns are identical and other draws are untouched
        devices = [layer.keys.device] if layer.keys.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(layer.layer)
                scores = scorer.score(
                    layer.module,
                    layer.hidden_states,
                    layer.keys,
                    layer.values,
                    attentions,
                    layer.kwargs,
                )
        except AssertionError as exc:
            reason = " ".join(str(exc).split()) or "assertion failed"
            raise ActionError(f"action {action.name!r}: {self.press}.score: {reason}") from exc
        if kind != _SCORED:  # the ragged kinds use the scores here (ScoredSelector checks the rest)
            check_scores(scores[0], action, layer.layer, layer.keys.shape[1], n)
        if kind == _PYRAMID:
            return scores[0], int(press.get_layer_budget(layer.module, n))
        if kind == _ADAKV:
            return _adakv_kept(scores, n_keep, press.alpha_safeguard)
        return scores[0]

    def score(self, prefill: Prefill, action: ActionSpec, layer: int) -> torch.Tensor:
        return prefill.observed[action.name][layer]

    def kept_per_layer(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> list[int] | None:
        """Ragged kinds: AdaKV keeps ``H_kv · n_keep`` entries per layer; PyramidKV keeps its
        layer budget (``get_layer_budget``, at most n) in each KV head of the layer."""
        kind = self._built()[1]
        n_kv, n = prefill.keys[0].shape[0], prefill.n
        if kind == _ADAKV:
            return [n_kv * n_keep] * len(prefill.keys)
        if kind == _PYRAMID:
            return [n_kv * min(count, n) for _, count in prefill.observed[action.name]]
        return None

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        import torch

        kind = self._built()[1]
        observed = prefill.observed[action.name]
        if kind == _SCORED:
            return super().positions(prefill, action, n_keep)
        if kind == _MERGING:  # the prefill that transform_layer then merges (held weakly)
            object.__setattr__(self, "_merging_prefill", weakref.ref(prefill))
            kept = [merging_indices(scores, n_keep).sort(dim=-1).values for scores in observed]
            return torch.stack(kept)
        rows = []
        for entry in observed:
            if kind == _PYRAMID:
                scores, count = entry
                kept = scores.topk(min(count, scores.shape[-1]), dim=-1).indices.sort(-1).values
                rows.append(list(kept))
            else:
                rows.append([mask.nonzero()[:, 0] for mask in entry])
        return _pad(rows)

    def check_shape(self, action: ActionSpec, n: int, n_kv: int, head_dim: int) -> None:
        """MergingPress acts on every shape (:meth:`PromptTransform.check_shape`)."""
        return None

    def transform_layer(
        self,
        action: ActionSpec,
        layer: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """MergingPress's cache of one layer (:func:`merged_entries`): the kept positions of
        :meth:`positions` on the same prefill (kvpress's topk order of the inner press's
        scores), the prefill's keys and values merged by kvpress's own ``merge``."""
        n = keys.shape[1]
        n_keep = self.n_keep(action, n)
        if n_keep >= n:  # nothing evicted, nothing merged (the prefill did not observe it)
            return keys.clone(), values.clone()
        ref = self.__dict__.get("_merging_prefill")
        prefill = ref() if ref is not None else None
        if prefill is None or layer >= len(prefill.keys) or prefill.keys[layer] is not keys:
            raise ActionError(
                f"action {action.name!r}: MergingPress: transform_layer of layer {layer} on keys "
                "that are not those of the prefill its positions were selected from; expected "
                "select_positions(prefill, action) and then transformed_prefix(prefill, action)"
            )
        indices = merging_indices(prefill.observed[action.name][layer], n_keep)
        return merged_entries(self.press_object(), keys, values, indices)

    def layer_bytes(
        self, action: ActionSpec, n: int, n_kv: int, head_dim: int, itemsize: int
    ) -> int:
        """MergingPress keeps ``n_keep`` entries per KV head (:func:`merging_layer_bytes`)."""
        return merging_layer_bytes(self.n_keep(action, n), n_kv, head_dim, itemsize)
