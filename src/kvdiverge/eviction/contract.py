"""The selector output contract: what every selector returns is checked before any decoding.

A selector, built-in or the user's own (``selector: "package.module:Class"``, a kvpress press
through the bridge), returns kept positions from :meth:`Selector.positions`
(:func:`checked_positions` checks them) or, on a :class:`ScoredSelector`, scores per layer
(:func:`check_scores`). The contract, each violation one :class:`ActionError` line naming the
action, the selector and what was expected:

* kept positions: a torch tensor of an integer dtype, shape (layers, KV heads, m); every value
  a prompt position in [0, n) or −1, with −1 only as trailing padding of a head; the positions
  of each layer and KV head distinct; exactly the action's ``n_keep`` per layer and KV head
  (m = n_keep, no padding), or, for a ragged selector, for each layer the count in all its KV
  heads that the selector declares (:meth:`Selector.kept_per_layer`);
* scores: a real tensor of shape (KV heads, n), every value finite (NaN and ±inf refused).

Positions that pass are returned as int64 on the prefill's device, each head ascending (the
order is not part of the contract), −1 padding at the end.

The prefill is shared by every action of a document (and by the reference rollout X), so a
selector must not change it: :func:`check_unchanged` compares the prefill's digest
(:meth:`Prefill.digest`) after each selector with the one before. An exception raised inside a
selector's own code (:func:`user_call`) becomes one line naming the action, the selector's
method and the exception; the original traceback stays chained to it (``raise … from``), so a
job's log holds it (``kvdiverge.pipeline.logs``).
"""

from __future__ import annotations

import numbers
import sys
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from kvdiverge.eviction.budgets import ActionError

if typing.TYPE_CHECKING:  # torch is imported where it runs: parsing a config does not load it
    import torch

    from kvdiverge.eviction.prefill import Prefill

# an action is a kvdiverge.eviction.selectors.ActionSpec (which imports this module)
ActionSpec = Any

__all__ = [
    "WholePrompt",
    "check_scores",
    "check_unchanged",
    "checked_n_keep",
    "checked_positions",
    "selector_label",
    "user_call",
]

T = TypeVar("T")


def selector_label(action: ActionSpec) -> str:
    """``selector 'snapkv'``, ``selector 'pkg.mod:Class'``, ``selector 'kvpress' (KnormPress)``."""
    press = getattr(getattr(action, "method", None), "press", None)
    extra = f" ({press})" if action.selector == "kvpress" and isinstance(press, str) else ""
    return f"selector {action.selector!r}{extra}"


class WholePrompt:
    """The selection step of a method that keeps the whole prompt (a prompt transformation, a
    decoding compressor): every position kept (``n_keep(n) = n``), and no ``budget`` taken; one
    is refused in one line saying what the method does (:attr:`acts_on`) and what sets its
    memory instead (:attr:`sized_by`). Put before :class:`~kvdiverge.eviction.Selector` among
    a method's bases."""

    acts_on: ClassVar[str] = "acts on the whole prompt"
    sized_by: ClassVar[str] = "its parameters set its memory"

    def validate(self, action: ActionSpec, where: str) -> None:
        if action.budget is not None:
            raise ActionError(
                f"{where}.budget: selector {action.selector!r} {self.acts_on} and takes no "
                f"budget; omit budget ({self.sized_by})"
            )

    def n_keep(self, action: ActionSpec, n: int) -> int:
        return n

    def positions(self, prefill: Prefill, action: ActionSpec, n_keep: int) -> torch.Tensor:
        """Every prompt position of every layer and KV head: (layers, H_kv, n), 0..n − 1."""
        import torch

        n_layers, n_kv, n = len(prefill.keys), prefill.keys[0].shape[0], prefill.n
        return torch.arange(n, device=prefill.keys[0].device).expand(n_layers, n_kv, n).clone()


def _where(action: ActionSpec) -> str:
    return f"action {action.name!r}: {selector_label(action)}"


def _memory_error(exc: BaseException) -> bool:
    """Out of memory is the machine's limit, not a bad input: it is never reworded."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def user_call(action: ActionSpec, method: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, the selector's ``method``; an exception it raises becomes one
    :class:`ActionError` line naming the action, the selector, the method and the exception
    (chained to it, so that the traceback is kept). ActionErrors (the selector's own one-line
    refusals) and out-of-memory errors pass unchanged."""
    dtype = _default_dtype()
    try:
        out = fn(*args)
    except ActionError:
        _check_default_dtype(action, method, dtype)
        raise
    except Exception as exc:
        _check_default_dtype(action, method, dtype)
        if _memory_error(exc):
            raise
        text = " ".join(str(exc).split())
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        raise ActionError(f"{_where(action)}: {method} raised {reason}") from exc
    _check_default_dtype(action, method, dtype)
    return out


def _default_dtype() -> Any:
    """torch's default dtype, or None when torch is not imported (config time)."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_default_dtype()


def _check_default_dtype(action: ActionSpec, method: str, before: Any) -> None:
    """A selector's method must leave torch's default dtype as it found it (every later tensor
    of the run would change precision): the dtype is restored and one line names the method."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    expected = torch.float32 if before is None else before
    after = torch.get_default_dtype()
    if after != expected:
        torch.set_default_dtype(expected)
        raise ActionError(
            f"{_where(action)}: {method} changed torch's default dtype from {expected} to "
            f"{after}; expected a selector to leave global torch settings unchanged (pass "
            "dtype= to the tensors it creates)"
        )


def checked_n_keep(action: ActionSpec, n: int) -> int:
    """The action's ``n_keep`` for an n-token prompt (the selector's :meth:`Selector.n_keep`),
    checked to be an integer >= 1."""
    n_keep = user_call(action, "n_keep", action.method.n_keep, action, n)
    if isinstance(n_keep, bool) or not isinstance(n_keep, numbers.Integral) or n_keep < 1:
        raise ActionError(
            f"{_where(action)}: n_keep returned {n_keep!r} for a {n}-token prompt; expected an "
            "integer >= 1"
        )
    return int(n_keep)


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    import torch

    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def check_scores(
    scores: Any, action: ActionSpec, layer: int, n_kv: int, n: int, device: Any = None
) -> None:
    """Scores of one layer (``ScoredSelector.score``): a real tensor (n_kv, n) with values (not
    on the meta device; ``device``: the prefill's, named in the refusal), every value finite."""
    import torch

    where = f"{_where(action)}: score of layer {layer}"
    if not isinstance(scores, torch.Tensor):
        raise ActionError(f"{where}: returned {type(scores).__name__}; expected a torch.Tensor")
    _check_device(scores, device, where, "scores")
    if scores.dtype.is_complex or scores.dtype == torch.bool:
        raise ActionError(f"{where}: returned a {scores.dtype} tensor; expected real scores")
    if tuple(scores.shape) != (n_kv, n):
        raise ActionError(
            f"{where}: returned shape {tuple(scores.shape)}; expected ({n_kv}, {n}) (KV heads, "
            "prompt positions)"
        )
    if scores.dtype.is_floating_point:
        bad = ~torch.isfinite(scores)
        if bool(bad.any()):
            head, position = (int(i) for i in bad.nonzero()[0])
            value = float(scores[head, position])
            raise ActionError(
                f"{where}: score {value} at KV head {head}, position {position}; expected "
                "finite scores (NaN and inf are refused)"
            )


def _check_device(tensor: torch.Tensor, device: Any, where: str, what: str) -> None:
    """A selector's tensor holds values: a meta tensor (or any tensor without storage) is
    refused; one on another real device is moved to the prefill's by the caller."""
    if tensor.device.type == "meta":
        shown = "" if device is None else f" (on the prefill's device {device})"
        raise ActionError(
            f"{where}: returned {what} on the meta device, which holds no values; expected a "
            f"tensor with values{shown}"
        )


def _first(mask: torch.Tensor) -> tuple[int, int]:
    layer, head = (int(i) for i in mask.nonzero()[0][:2])
    return layer, head


def checked_positions(
    kept: Any,
    prefill: Prefill,
    action: ActionSpec,
    n_keep: int,
    per_layer: Any = None,
) -> torch.Tensor:
    """The selector's kept positions checked against the contract (module docstring), as int64
    on the prefill's device with each head ascending. ``per_layer``: a ragged selector's
    declared count per layer over its KV heads (:meth:`Selector.kept_per_layer`), else None."""
    import torch

    where = _where(action)
    n, n_layers, n_kv = prefill.n, len(prefill.keys), prefill.keys[0].shape[0]
    ragged = per_layer is not None
    what = (
        f"the counts it declares per layer (kept_per_layer), at most {n} per head"
        if ragged
        else f"exactly {n_keep} per layer and KV head (the action's budget)"
    )
    if not isinstance(kept, torch.Tensor):
        raise ActionError(
            f"{where}: positions returned {type(kept).__name__}; expected an integer "
            f"torch.Tensor ({n_layers}, {n_kv}, m)"
        )
    if not _is_integer_dtype(kept.dtype):
        raise ActionError(
            f"{where}: positions returned a {kept.dtype} tensor; expected integer positions"
        )
    _check_device(kept, prefill.keys[0].device, f"{where}: positions", "positions")
    shape = tuple(kept.shape)
    width_ok = (shape[2] <= n) if ragged and len(shape) == 3 else (len(shape) == 3)
    if len(shape) != 3 or shape[:2] != (n_layers, n_kv) or not width_ok:
        width = f"m <= {n}" if ragged else str(n_keep)
        expected = f"({n_layers}, {n_kv}, {width})"
        raise ActionError(
            f"{where}: positions returned shape {shape}; expected {expected} (layers, KV heads, "
            "kept positions)"
        )
    if not ragged and shape[2] != n_keep:
        raise ActionError(
            f"{where}: positions returned {shape[2]} positions per layer and KV head; expected "
            f"{n_keep} (the action's budget) of the {n}-token prompt"
        )
    kept = kept.to(device=prefill.keys[0].device, dtype=torch.long)
    outside = (kept < -1) | (kept >= n)
    if bool(outside.any()):
        layer, head = _first(outside)
        value = int(kept[layer, head][outside[layer, head]][0])
        raise ActionError(
            f"{where}: position {value} at layer {layer}, KV head {head}; expected prompt "
            f"positions in [0, {n}) (-1 only as trailing padding)"
        )
    valid = kept >= 0
    if not ragged and not bool(valid.all()):
        layer, head = _first(~valid)
        raise ActionError(f"{where}: -1 padding at layer {layer}, KV head {head}; expected {what}")
    gap = valid[..., 1:] & ~valid[..., :-1]
    if bool(gap.any()):
        layer, head = _first(gap)
        raise ActionError(
            f"{where}: -1 before a position at layer {layer}, KV head {head}; expected -1 only "
            "as trailing padding"
        )
    ordered = torch.where(valid, kept, n).sort(dim=-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] < n)
    if bool(twice.any()):
        layer, head = _first(twice)
        row = ordered[layer, head]
        value = int(row[1:][twice[layer, head]][0])
        raise ActionError(
            f"{where}: position {value} more than once at layer {layer}, KV head {head}; "
            f"expected distinct positions, {what}"
        )
    if ragged:
        declared = [int(c) for c in per_layer]
        if len(declared) != n_layers:
            raise ActionError(
                f"{where}: kept_per_layer declared {len(declared)} counts; expected one per "
                f"layer ({n_layers})"
            )
        counts = valid.sum(dim=(1, 2)).tolist()
        for layer, (got, want) in enumerate(zip(counts, declared, strict=True)):
            if got != want:
                raise ActionError(
                    f"{where}: layer {layer} keeps {got} entries over its {n_kv} KV heads; "
                    f"expected {want}, as the selector declares (kept_per_layer)"
                )
    return torch.where(ordered < n, ordered, -1)


def check_unchanged(prefill: Prefill, before: torch.Tensor, action: ActionSpec, method: str) -> Any:
    """The prefill's digest after the selector's ``method`` ran; one :class:`ActionError` line
    when it differs from ``before`` (the selector changed what the other actions read)."""
    import torch

    after = prefill.digest()
    if after.shape != before.shape or not torch.equal(after, before):
        raise ActionError(
            f"{_where(action)}: {method} changed the shared prefill (its keys, values, window "
            "queries or logits); a selector must not modify the prefill, which every action "
            "and the reference rollout read (copy a tensor before changing it)"
        )
    return after
