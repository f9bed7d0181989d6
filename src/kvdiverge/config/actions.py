"""A config's actions (``actions.<name>``; ``docs/configuration.md``, "Actions"): the entries
parsed into :class:`~kvdiverge.eviction.ActionSpec` (:func:`configured_actions`, what the
rollout rules and the parse-time checks read), their budgets checked against the strata's
prompt lengths (:func:`check_budgets`), and two forms of an entry besides its selector, budget
and parameters: a display ``label``, and a budget sweep ``budgets``. Both are handled once at
parse time by :func:`kvdiverge.config.check_config` (:func:`actions_problem`, after the schema
check).

* ``label``: free text of at most :data:`~kvdiverge.config.names.MAX_LABEL` printable
  characters that the study's figures (legends, tick labels) and tables (rows, headers, summary
  sentences) show in place of the action's name (:func:`~kvdiverge.config.names.label_problem`,
  the rule ``kvdiverge compare``'s labels follow too). The name (the mapping key) still names
  files, folders and wildcards and is the ``action`` of ``estimands.csv``, so a label never
  reaches a path and relabelling reruns no rollout (the label is no selector parameter:
  :func:`selector_entry` leaves it out of the action's spec, its lock and its trajectory
  metadata). Labels are distinct across actions (each against the others' labels or, without
  one, names) and hold no ``" - "``, the separator of a contrast's two actions (``"b - a"``).
* ``budgets``: a list of distinct budgets (fractions in (0, 1] or token counts >= 1) in place of
  ``budget``. The entry expands, in place, into one action per budget named ``<name>@<budget>``
  (``snapkv-sweep@0.25``; a valid name whenever ``<name>`` is, :mod:`kvdiverge.config.names`),
  each the entry with that ``budget`` (and the label ``<label>@<budget>`` when the entry has a
  label); a study's ``actions`` and ``groups`` that name the sweep name all its actions there,
  in budget order. An expanded config holds no sweep, so expanding again changes nothing.

:func:`budget_sweeps` finds, among a study's compared actions, every method (the selector and
its parameters, budget aside) run at two budgets or more, for the study's sweep figure
(:mod:`kvdiverge.plots.sweep`), whether the actions came from a sweep or were written one by one.

Namesake: :mod:`kvdiverge.compare.actions` reads ``kvdiverge compare``'s command-line action
items (``[LABEL=]SELECTOR[@BUDGET]...``); this module reads a config file's ``actions`` entries.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvdiverge.config.errors import ConfigError
from kvdiverge.config.names import label_problem
from kvdiverge.eviction import (
    DISPLAY_KEYS,
    ActionError,
    ActionSpec,
    check_action,
    is_decoding,
    is_transform,
    keeps_everything,
    parse_action,
    selector_entry,
)

__all__ = [
    "DISPLAY_KEYS",
    "action_labels",
    "actions_problem",
    "budget_sweeps",
    "budget_text",
    "check_budgets",
    "configured_actions",
    "is_budget",
    "selector_entry",
]

_BUDGETS = "a non-empty list of distinct budgets (fractions in (0, 1] or token counts >= 1)"


def configured_actions(config: Mapping[str, Any]) -> dict[str, ActionSpec]:
    """Every configured action parsed (its entry without the display keys,
    :func:`~kvdiverge.eviction.selector_entry`), by name, in config order; a bad entry is one
    :class:`~kvdiverge.config.errors.ConfigError` line ``config.actions.<name>...``."""
    out = {}
    for name, spec in config.get("actions", {}).items():
        try:
            out[name] = parse_action(selector_entry(spec), name=name)  # no label
        except ActionError as exc:
            raise ConfigError(f"config.{exc}".replace("\n", " ")) from exc
    return out


def check_budgets(config: Mapping[str, Any], actions: Mapping[str, ActionSpec]) -> None:
    """Every action a study runs, at every stratum's longest prompt (target_tokens −
    generation_reserve under the length tokenizer): it evicts something, keeps at least one
    entry, and leaves room for what its selector always keeps (window, sinks); one
    :class:`~kvdiverge.config.errors.ConfigError` line naming the action and the stratum."""
    datasets = config.get("datasets", {})
    reserve = datasets.get("generation_reserve", 128)
    used = dict.fromkeys(a for s in config.get("studies", {}).values() for a in s["actions"])
    for name in used:
        action = actions[name]
        if keeps_everything(action) or is_transform(action) or is_decoding(action):
            continue  # no kept count to check
        for stratum in datasets.get("strata", []):
            label = f"{stratum['env']}-{stratum['label']}"
            n = stratum["target_tokens"] - reserve
            where = (
                f"config.actions.{name}: in stratum {label} (prompts of at most {n} tokens: "
                f"target_tokens {stratum['target_tokens']} - generation_reserve {reserve})"
            )
            if n < 1:
                continue  # DatasetsConfig names the stratum
            try:
                keep = action.n_keep(n)
                if keep >= n:
                    raise ConfigError(
                        f"{where}: budget {action.budget!r} keeps every entry, so the action "
                        "equals full retention there; lower the budget or lengthen the stratum"
                    )
                check_action(action, n, keep)
            except ActionError as exc:
                message = str(exc).split(": ", 1)[-1]
                raise ConfigError(f"{where}: {message}") from exc


def budget_text(budget: float | int) -> str:
    """A budget as it appears in an expanded name: ``0.25``, ``512``."""
    return repr(budget)


def is_budget(b: Any) -> bool:
    """Whether ``b`` is one budget of a sweep: a fraction of the prompt in (0, 1] (a float) or
    a token count >= 1 (an int; never a bool). A config's ``budgets`` and ``kvdiverge
    compare --budgets`` take the same values."""
    if isinstance(b, bool):
        return False
    return (isinstance(b, float) and 0 < b <= 1) or (isinstance(b, int) and b >= 1)


def _sweep_problem(name: str, spec: Mapping[str, Any]) -> str | None:
    where = f"config.actions.{name}"
    if "budget" in spec:
        return f"{where}: expected `budget` (one action) or `budgets` (a sweep), not both"
    budgets = spec["budgets"]
    if (
        not isinstance(budgets, list)
        or not budgets
        or not all(is_budget(b) for b in budgets)
        or len({(type(b), b) for b in budgets}) < len(budgets)
    ):
        return f"{where}.budgets: expected {_BUDGETS}, got {budgets!r}"
    return None


def _expand(config: dict[str, Any], origin: dict[str, str]) -> str | None:
    """Expand the sweeps in place, recording each expanded action's sweep in ``origin``."""
    actions = config.get("actions")
    if not isinstance(actions, dict) or not any(
        isinstance(s, Mapping) and "budgets" in s for s in actions.values()
    ):
        return None
    expanded: dict[str, Any] = {}
    sweeps: dict[str, list[str]] = {}
    for name, spec in actions.items():
        if not (isinstance(spec, Mapping) and "budgets" in spec):
            continue
        if problem := _sweep_problem(name, spec):
            return problem
        sweeps[name] = []
        for b in spec["budgets"]:
            entry = {k: v for k, v in spec.items() if k != "budgets"} | {"budget": b}
            if "label" in spec:
                entry["label"] = f"{spec['label']}@{budget_text(b)}"
            own = f"{name}@{budget_text(b)}"
            if own in actions or own in expanded:
                return (
                    f"config.actions.{name}: its budget {budget_text(b)} is named {own!r}, "
                    "which is already an action; rename one"
                )
            expanded[own] = entry
            sweeps[name].append(own)
            origin[own] = name
    out: dict[str, Any] = {}
    for name, spec in actions.items():
        out |= {own: expanded[own] for own in sweeps[name]} if name in sweeps else {name: spec}
    config["actions"] = out

    def replaced(names: Any) -> Any:
        if not isinstance(names, list):
            return names
        return [own for n in names for own in (sweeps.get(n, [n]) if isinstance(n, str) else [n])]

    for study, spec in (config.get("studies") or {}).items():
        if not isinstance(spec, dict):
            continue
        spec["actions"] = replaced(spec.get("actions"))
        for group, members in (spec.get("groups") or {}).items():
            spec["groups"][group] = replaced(members)
        for key in ("control", "baseline"):
            if spec.get(key) in sweeps:
                return (
                    f"config.studies.{study}.{key}: {spec[key]!r} is a budget sweep; expected "
                    f"one action, e.g. {sweeps[spec[key]][0]!r}"
                )
    return None


def _label_problem(
    actions: Mapping[str, Any], origin: Mapping[str, str], unique: bool = True
) -> str | None:
    seen: dict[str, str] = {}
    for name, spec in actions.items():
        if "label" not in spec:
            continue
        label = spec["label"]
        if problem := label_problem(label):
            return f"config.actions.{origin.get(name, name)}.label: {problem}"
    for name, spec in actions.items() if unique else ():
        shown = spec.get("label", name)
        if shown in seen:
            labelled, other = (name, seen[shown]) if "label" in spec else (seen[shown], name)
            return (
                f"config.actions.{origin.get(labelled, labelled)}.label: {shown!r} is also the "
                f"{'label' if 'label' in actions[other] else 'name'} of action {other!r}; "
                "expected a label unique across actions"
            )
        seen[shown] = name
    return None


def actions_problem(config: dict[str, Any]) -> str | None:
    """Expand the budget sweeps of a schema-checked ``config`` in place, then check every label;
    the one line refusing either (naming ``config.actions.<name>.budgets`` or ``.label``), or
    None (module docstring). A sweep's labels are checked as expanded (``<label>@<budget>``)."""
    actions = config.get("actions")
    if not isinstance(actions, Mapping):
        return None
    if problem := _label_problem(actions, {}, unique=False):  # a sweep's own label first
        return problem
    origin: dict[str, str] = {}
    if problem := _expand(config, origin):
        return problem
    return _label_problem(config["actions"], origin)


def action_labels(config: Mapping[str, Any], names: Any = None) -> dict[str, str]:
    """Each action's display label by name (its ``label``, else its name); ``names`` limits
    and orders them (default: every configured action)."""
    actions = config.get("actions", {})
    names = list(actions) if names is None else list(names)
    return {n: str(actions.get(n, {}).get("label", n)) for n in names}


def _method(spec: Mapping[str, Any]) -> str:
    """The method of an action entry: its selector and parameters, budget and label aside, as
    text (``snapkv``, ``recent+sinks=2``)."""
    params = {k: v for k, v in spec.items() if k not in ("selector", "budget", *DISPLAY_KEYS)}
    parts = [f"{k}={json.dumps(v, sort_keys=True, default=str)}" for k, v in params.items()]
    return "+".join([str(spec.get("selector")), *parts])


def budget_sweeps(config: Mapping[str, Any], study: str) -> dict[str, tuple[str, float | int]]:
    """The study's compared actions (not its control) whose method runs at two budgets or more:
    action name -> (the method's name in the figure, budget), in the study's order.

    A method is the selector with its parameters (budget and label aside), its budgets of one
    kind: fractions of the prompt or token counts (``snapkv-512`` and ``snapkv-half`` are no
    sweep); where a study sweeps methods over fractions, its token-count sweeps are left out of
    the figure (one x axis: the kept percentage). It is named by what its actions' labels (or
    names) share before ``@<budget>`` when they all share it (``snapkv-sweep`` for
    ``snapkv-sweep@0.25`` and ``snapkv-sweep@0.5``, or the sweep's own label), else by the
    method itself (``snapkv``, ``recent+sinks=2``). An action repeating a budget its method
    already has is left out (the first in the study's order stays)."""
    spec = config["studies"][study]
    actions = config.get("actions", {})
    labels = action_labels(config)
    control = spec.get("control", "full")
    by_method: dict[tuple[str, str], dict[float | int, str]] = {}
    for name in spec["actions"]:
        entry = actions[name]
        budget = entry.get("budget")
        if name == control or budget is None or entry.get("selector") == "full":
            continue
        kind = "fraction" if isinstance(budget, float) else "tokens"
        by_method.setdefault((_method(entry), kind), {}).setdefault(budget, name)
    swept = {key: budgets for key, budgets in by_method.items() if len(budgets) >= 2}
    if any(kind == "fraction" for _, kind in swept):  # one x axis: the kept percentage
        swept = {key: budgets for key, budgets in swept.items() if key[1] == "fraction"}
    out: dict[str, tuple[str, float | int]] = {}
    for (method, _), budgets in swept.items():
        heads = [
            labels[n].removesuffix(f"@{budget_text(b)}")
            for b, n in budgets.items()
            if labels[n].endswith(f"@{budget_text(b)}")
        ]
        shared = len(heads) == len(budgets) and len(set(heads)) == 1 and heads[0]
        shown = heads[0] if shared else method
        if shown in {m for m, _ in out.values()}:  # two methods never share a line
            shown = method
        for b, n in budgets.items():
            out[n] = (shown, b)
    order = {n: i for i, n in enumerate(spec["actions"])}
    return dict(sorted(out.items(), key=lambda item: order[item[0]]))
