"""The actions of ``kvdiverge compare``: ``[LABEL=]SELECTOR[@BUDGET][+KEY=VALUE]...`` items, their
labels, the baseline, and the file names labels become.

An item is ``LABEL=SPEC`` when the text before its first ``=`` holds no ``+``
(``mine=my_methods:SinkStride@0.5``, ``snapkv=snapkv@0.5``); otherwise the whole item is the
spec and its own label (``snapkv@0.5+window=16``). The label is the action's name: legends,
table rows, the ``action`` column of every table. File names take the label through
:func:`path_name`, which escapes every character outside letters, digits and ``._-~@+=``, so no
label or parameter value (``+tag=/../../x``) reaches a path unescaped.

A given label follows the config's rule of display labels
(:func:`kvdiverge.config.names.label_problem`: at most
:data:`~kvdiverge.config.names.MAX_LABEL` printable characters, no ``" - "``), refused in the
config's words after ``--actions label:``; so does ``LABEL@b`` of a budget sweep. A spec that is
its own label is the action's text and takes no such limit. Labels are unique, also as file
names on a case-insensitive file system (:func:`parse_actions`): unlike a config's labels,
which stand beside the actions' names, these are the names.

``@<N>bit`` sets a prompt transformation's ``bits`` in place of a budget:
``quantize@4bit+group_size=32+residual=128`` is KIVI's quantized prompt cache at 4 bits
(``docs/compression.md``); for ``quantized-cache``, whose field is transformers' ``nbits``, it
sets ``nbits`` (``quantized-cache@4bit+backend=hqq``).

Namesake: :mod:`kvdiverge.config.actions` reads a config file's ``actions`` entries for the
pipeline; this module reads the command line's items.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import sys
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kvdiverge.eviction import ActionError, ActionSpec, parse_action

__all__ = [
    "CompareError",
    "LabelledAction",
    "add_cwd_to_path",
    "parse_action_list",
    "parse_actions",
    "parse_budgets",
    "path_name",
    "split_items",
    "sweep_budgets",
    "with_baseline",
    "baseline_method",
    "contrast_pairs",
]

_MAX_FILE_STEM = 120


class CompareError(ValueError):
    """A bad input of :func:`kvdiverge.compare.compare` (one line naming the option or file)."""


@dataclass(frozen=True)
class LabelledAction:
    """One action of a comparison: its ``label`` (the action's name), the ``spec`` text it was
    given as, and the parsed :class:`~kvdiverge.eviction.ActionSpec` (``action.name`` is the
    label)."""

    label: str
    spec: str
    action: ActionSpec

    @property
    def file_stem(self) -> str:
        """The label escaped for a file name (:func:`path_name`)."""
        return path_name(self.label)


def path_name(label: str) -> str:
    """``label`` as one path component: percent-escaped outside letters, digits and
    ``._-~@+=`` (``/`` → ``%2F``, ``:`` → ``%3A``, ``%`` → ``%25``: distinct labels stay
    distinct), a leading dot escaped (no ``.``, ``..`` or hidden file), and a long name cut to
    its first characters plus a hash of the whole label."""
    text = urllib.parse.quote(label, safe="@+=~")
    if text.startswith("."):
        text = "%2E" + text[1:]
    if len(text) > _MAX_FILE_STEM:
        digest = hashlib.sha256(label.encode()).hexdigest()[:16]
        text = f"{text[: _MAX_FILE_STEM - 17]}~{digest}"
    return text


def _value(text: str) -> Any:
    """A parameter value as YAML reads it (``16`` → int, ``0.5`` → float, ``true`` → bool)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _check_label(label: str, option: str) -> None:
    """The config's rule of display labels (module docstring), in its words after
    ``<option> label:``."""
    from kvdiverge.config.names import label_problem

    if problem := label_problem(label):
        raise CompareError(f"{option} label: {problem}")


def _split_label(item: str, option: str) -> tuple[str, str]:
    head, eq, rest = item.partition("=")
    if not eq or "+" in head:
        return item, item
    label = head.strip()
    if not label:
        raise CompareError(f"{option}: {item!r}: expected LABEL=SPEC with a label before '='")
    _check_label(label, option)
    spec = rest.strip()
    if not spec:
        raise CompareError(f"{option}: {item!r}: expected an action after {label + '='!r}")
    return label, spec


def _parse_spec(label: str, spec: str, option: str) -> ActionSpec:
    head, *params = _split_plus(spec)
    selector, at, budget = head.partition("@")
    entry: dict[str, Any] = {"selector": selector}
    if at and re.fullmatch(r"[0-9]+bit", budget.strip()):  # quantize@4bit: bits, no budget
        entry["nbits" if selector == "quantized-cache" else "bits"] = int(budget.strip()[:-3])
    elif at:
        entry["budget"] = _value(budget)
    for p in params:
        key, eq, value = p.partition("=")
        if not eq or not key:
            raise CompareError(f"{option}: {spec!r}: expected KEY=VALUE after '+', got {p!r}")
        if key in entry:
            raise CompareError(f"{option}: {spec!r}: {key} given twice")
        entry[key] = _value(value)
    try:
        return parse_action(entry, name=label)
    except ActionError as exc:
        hint = ""
        if "cannot import module" in str(exc):
            where = "the current folder, " if os.getcwd() in sys.path else ""
            hint = f" (looked in {where}PYTHONPATH and the installed packages)"
        elif ".press: " in str(exc) and isinstance(entry.get("press"), str):
            hint = _press_suggestion(entry["press"])
        raise CompareError(f"{option}: {exc}{hint}") from None


def _split_outside(text: str, sep: str) -> list[str]:
    """``text`` split at each ``sep`` outside brackets, braces and quotes."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth = max(0, depth - 1)
        elif ch == sep and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return items


def _split_plus(spec: str) -> list[str]:
    """``spec`` split at the ``+`` outside brackets, braces and quotes."""
    return _split_outside(spec, "+")


def split_items(text: str) -> list[str]:
    """``text`` split at the commas outside brackets, braces and quotes, so that a parameter
    value may be a YAML mapping or list: ``kvpress@0.5+press=X+press_kwargs={a: 1, b: 2},full``
    is two items."""
    return [t.strip() for t in _split_outside(text, ",")]


def _press_suggestion(press: str) -> str:
    """``; did you mean 'KnormPress'?`` for a misspelt kvpress press (empty when none is close
    or kvpress is not installed)."""
    import difflib

    try:
        import kvpress
    except ImportError:
        return ""
    names = [
        n for n in dir(kvpress) if n.endswith("Press") and isinstance(getattr(kvpress, n), type)
    ]
    close = difflib.get_close_matches(press, names, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _items(text: str | Sequence[str], option: str) -> list[str]:
    items = split_items(text) if isinstance(text, str) else list(text)
    if not items or any(not isinstance(t, str) or not t.strip() for t in items):
        raise CompareError(f"{option}: expected comma-separated actions, got {text!r}")
    return [t.strip() for t in items]


def _check_labels(labelled: Sequence[LabelledAction], option: str) -> None:
    seen: dict[str, str] = {}
    files: dict[str, str] = {}
    for a in labelled:
        if a.label in seen:
            what = "action" if a.label == a.spec else "label"
            raise CompareError(f"{option}: {what} {a.label!r} given twice")
        seen[a.label] = a.spec
        key = a.file_stem.lower()  # case-insensitive file systems
        if key in files:
            raise CompareError(
                f"{option}: labels {files[key]!r} and {a.label!r} name the same file on a "
                "case-insensitive file system; rename one"
            )
        files[key] = a.label


def parse_actions(
    text: str | Sequence[str | ActionSpec], option: str = "--actions"
) -> list[LabelledAction]:
    """Labelled actions from ``a,b,c`` (or a list of items, or of parsed
    :class:`~kvdiverge.eviction.ActionSpec` objects, named by their ``name``; module
    docstring), each checked by
    :func:`kvdiverge.eviction.parse_action`; one-line :class:`CompareError` naming ``option``
    and the item. Labels are unique, also as file names on a case-insensitive file system."""
    out = []
    if not isinstance(text, str) and any(isinstance(t, ActionSpec) for t in text):
        items = list(text)  # parsed actions (e.g. an ActionSpec holding a selector instance)
    else:
        items = _items(text, option)
    for item in items:
        if isinstance(item, ActionSpec):
            out.append(LabelledAction(item.name, item.name, item))
            continue
        if not isinstance(item, str) or not item.strip():
            raise CompareError(
                f"{option}: expected action texts or ActionSpec objects, got {item!r}"
            )
        label, spec = _split_label(item.strip(), option)
        out.append(LabelledAction(label, spec, _parse_spec(label, spec, option)))
    _check_labels(out, option)
    return out


def parse_action_list(text: str | Sequence[str]) -> list[ActionSpec]:
    """The :class:`~kvdiverge.eviction.ActionSpec` of each item of :func:`parse_actions` (named
    by its label)."""
    return [a.action for a in parse_actions(text)]


def with_baseline(
    actions: list[LabelledAction], baseline: str | None
) -> tuple[list[LabelledAction], str | None]:
    """The compared actions and the baseline's label. ``baseline`` is the label of one of
    ``actions`` or an action item of its own (``snapkv=snapkv@0.5``), which goes first."""
    if baseline is None:
        return actions, None
    if not isinstance(baseline, str) or not baseline.strip():
        raise CompareError(f"--baseline: expected an action or an action's label, got {baseline!r}")
    baseline = baseline.strip()
    if baseline in {a.label for a in actions}:
        return actions, baseline
    if "," in baseline:
        raise CompareError(f"--baseline: expected one action, got {baseline!r}")
    label, spec = _split_label(baseline, "--baseline")
    own = LabelledAction(label, spec, _parse_spec(label, spec, "--baseline"))
    out = [own, *actions]
    _check_labels(out, "--baseline/--actions")
    return out, label


def add_cwd_to_path(specs: Sequence[str]) -> bool:
    """Append the current folder to ``sys.path`` (as ``python -m`` would have it) when a spec
    names a ``module:Class`` selector, so that a selector file beside the user imports without
    ``PYTHONPATH``; returns whether it was added."""
    cwd = os.getcwd()
    if not any(":" in s.split("+")[0] for s in specs) or cwd in sys.path or "" in sys.path:
        return False
    sys.path.append(cwd)
    return True


def _budget(text: str) -> float | int | str:
    """One budget as written: an integer (``512``) is a token count, anything else float()
    reads (``0.5``, ``1e-1``, ``1.0``) a fraction; otherwise the text itself (refused)."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_budgets(text: str | Sequence[float | int] | None) -> list[float | int] | None:
    """Budgets of a sweep from ``0.25,0.5,0.75`` (or a list): all fractions in (0, 1] or all
    token counts >= 1 (one axis: a fraction and a token count are different quantities, so
    ``1`` and ``1.0`` — one token and the whole prompt — are never mixed), distinct; one-line
    :class:`CompareError` naming ``--budgets``."""
    if text is None:
        return None
    items = [_budget(t.strip()) for t in text.split(",")] if isinstance(text, str) else list(text)
    expected = "expected comma-separated budgets (fractions in (0, 1] or token counts >= 1)"
    if not items:
        raise CompareError(f"--budgets: {expected}, got {text!r}")
    from kvdiverge.config import is_budget  # the config's `budgets` take the same values

    for b in items:
        if not is_budget(b):
            raise CompareError(f"--budgets: {expected}, got {b!r}")
    kinds = {isinstance(b, int) for b in items}
    if len(kinds) > 1:
        f = next(b for b in items if isinstance(b, float))
        n = next(b for b in items if isinstance(b, int))
        raise CompareError(
            f"--budgets: {f!r} is a fraction of the prompt and {n!r} a token count; expected "
            "one kind on one axis (all fractions in (0, 1], or all token counts)"
        )
    seen: set = set()
    for b in items:
        if b in seen:
            raise CompareError(f"--budgets: budget {b!r} given twice")
        seen.add(b)
    return items


def _method_name(a: LabelledAction) -> str:
    """The method of a swept action: its label, or its spec without the budget."""
    if a.label != a.spec:
        return a.label
    head, *params = _split_plus(a.spec)
    return "+".join([head.partition("@")[0], *params])


def sweep_budgets(
    actions: Sequence[LabelledAction], budgets: Sequence[float | int] | None, keep: str | None
) -> tuple[list[LabelledAction], dict[str, tuple[str, float | int]]]:
    """Each action with a budget (the baseline ``keep`` too: a paired grid, every action
    contrasted with the baseline at its own budget; not an action that keeps everything)
    repeated at every budget of the sweep: labelled ``LABEL@b`` (or its spec with the budget
    replaced when it has no label of its own). Returns the actions and, per swept label, its
    method (the label or spec without budget) and budget."""
    if not budgets:
        return list(actions), {}
    out: list[LabelledAction] = []
    sweep: dict[str, tuple[str, float | int]] = {}
    for a in actions:
        if a.action.keeps_everything or a.action.budget is None:
            out.append(a)
            continue
        head, *params = _split_plus(a.spec)
        selector = head.partition("@")[0]
        method = _method_name(a)
        for b in budgets:
            spec = "+".join([f"{selector}@{b}", *params])
            label = f"{a.label}@{b}" if a.label != a.spec else spec
            if a.label != a.spec:
                _check_label(label, "--budgets")
            action = dataclasses.replace(a.action, name=label, budget=b)
            try:
                action.method.validate(action, f"actions.{label}")
            except ActionError as exc:
                raise CompareError(f"--budgets: {exc}") from None
            out.append(LabelledAction(label, spec, action))
            sweep[label] = (method, b)
    _check_labels(out, "--budgets")
    return out, sweep


def baseline_method(actions: Sequence[LabelledAction], baseline: str | None) -> str | None:
    """The method name of the baseline ``baseline`` (a label of ``actions``, before a sweep):
    its label or spec without the budget; None without a baseline."""
    for a in actions:
        if a.label == baseline:
            return _method_name(a)
    return None


def contrast_pairs(
    swept: Sequence[LabelledAction],
    baseline: str | None,
    sweep: dict[str, tuple[str, float | int]],
    method: str | None = None,
) -> dict[str, str]:
    """Each compared action → the baseline it is contrasted with, by the config's rule of a
    paired grid (:func:`kvdiverge.config.baselines.paired_baselines`, what a study's
    ``baseline`` reads): without a sweep of the baseline, the baseline itself; with one
    (``method``: the baseline's method, :func:`baseline_method`), the baseline at the action's
    own budget, every contrast at equal budget. A swept baseline leaves no action of its own
    label, so an action not swept (no budget, or keeping everything) is then contrasted with
    no baseline; the baseline's own points are no contrast.

    These are the config's baseline pairs, not its study contrasts
    (:func:`kvdiverge.config.studies.study_contrasts`: a study's prespecified pairs among its
    compared actions, each pair of the estimands table): a comparison prespecifies nothing and
    sets every action against its one baseline."""
    from kvdiverge.config.baselines import paired_baselines

    return paired_baselines([a.label for a in swept], baseline, sweep, method)
