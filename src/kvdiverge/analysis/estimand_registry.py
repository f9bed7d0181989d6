"""Every estimand, one entry each: the registry that the estimands
(:func:`kvdiverge.analysis.estimands.action_estimands`), the sample-size plan
(:mod:`kvdiverge.analysis.planning`), the tables and summaries (:mod:`kvdiverge.tables`) and
the README's glossary read.

An :class:`Estimand` names its column in ``estimands.csv`` (a profile's stem: ``div_cdf`` for
``div_cdf@t``), its symbol in tables, the description tables and summaries show, which
direction is better, its family, the document-level statistics it reads
(:mod:`kvdiverge.analysis.statistic_registry`), whether it is a mean, a ratio or a count of
document averages and of what, and its function of the document means. Adding an estimand is
one entry in :data:`ESTIMANDS` (or :func:`register_estimand`) plus its function, and, when it
needs a new per-path value, one :class:`~kvdiverge.analysis.statistic_registry.Statistic`.

Definitions: `docs/method.md`, "Estimands"; names: `docs/analysis.md`, "Estimand names".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdiverge.analysis.statistic_registry import STATISTICS, Clock

__all__ = [
    "ESTIMANDS",
    "Estimand",
    "estimand",
    "glossary_table",
    "mean_endpoints",
    "ratio",
    "ratio_denominators",
    "register_estimand",
]

Means = Mapping[str, np.ndarray]
Compute = Callable[[Means, Clock, int, Mapping[str, np.ndarray]], Any]
"""(document means by statistic, clock, n_docs, the estimands computed before it) → an array,
or for a profile a dict of its columns."""

BETTER = ("lower", "higher", "")
KINDS = ("mean", "ratio", "count", "product")
COMPUTED_BY = ("action", "contrast", "accuracy")


def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, NaN where the denominator is zero (an undefined ratio estimand)."""
    out = np.full(np.broadcast_shapes(np.shape(num), np.shape(den)), np.nan)
    np.divide(num, den, out=out, where=np.asarray(den) != 0)
    return out


@dataclass(frozen=True)
class Estimand:
    """One estimand.

    ``column``: its name in ``estimands.csv`` (a profile: the stem before ``@``); ``name``:
    its symbol in tables (``contrast_name`` for its contrast, default Δ + name);
    ``description``: the line tables and summaries show; ``better``: ``lower``, ``higher`` or
    ``""``; ``family``; ``statistics``: the document statistics it reads; ``kind``: ``mean``,
    ``ratio``, ``count`` or ``product`` of document averages, ``of``: of what; ``mean_of``: the
    statistic whose document average it is exactly (the plan's path value), if any;
    ``denominators``: a ratio's denominators (each a sum of (statistic, sign)) where they do
    not depend on the clock; ``profile``: a profile's index letter (``t`` in ``div_cdf@t``);
    ``unit``: ``share``, ``steps`` or ``count``; ``glossary``: its line in the README's
    glossary, if it has one; ``computed_by``: ``action`` (:func:`kvdiverge.analysis.estimands.
    action_estimands`, from ``compute``), ``contrast`` (contrasts only) or ``accuracy``
    (:mod:`kvdiverge.analysis.accuracy`)."""

    column: str
    name: str
    description: str
    better: str
    family: str
    statistics: tuple[str, ...]
    kind: str
    of: str
    compute: Compute | None = None
    mean_of: str | None = None
    denominators: tuple[tuple[tuple[str, float], ...], ...] = ()
    profile: str | None = None
    unit: str = "share"
    glossary: str | None = None
    computed_by: str = "action"
    contrast_name: str | None = None

    @property
    def shown_contrast(self) -> str:
        """Its symbol as a contrast."""
        return self.contrast_name or f"Δ{self.name}"


def _mean(column, name, description, better, family, stat, **kw) -> Estimand:
    return Estimand(
        column,
        name,
        description,
        better,
        family,
        (stat,),
        "mean",
        stat,
        lambda m, c, n, o: m[stat],
        mean_of=stat,
        **kw,
    )


def _blocks(m: Means, clock: Clock, n: int, o: Mapping) -> dict[str, np.ndarray]:
    return {
        f"block_tv@{lo}:{hi}": sum(m[f"delta@{t}"] for t in range(lo, hi + 1)) / (hi - lo + 1)
        for lo, hi in clock.blocks
    }


def _lags(clock: Clock, late: bool) -> range:
    d, w = clock.branch_depth, clock.window
    return range(d - w + 1, d + 1) if late else range(1, w + 1)


def _branch_window(late: bool) -> Compute:
    def compute(m: Means, clock: Clock, n: int, o: Mapping) -> np.ndarray:
        window = _lags(clock, late)
        return ratio(sum(m[f"branch@{j}"] for j in window) / clock.window, m["branch_cohort"])

    return compute


def _pre_window(late: bool) -> Compute:
    def compute(m: Means, clock: Clock, n: int, o: Mapping) -> np.ndarray:
        window = _lags(clock, late)
        num = sum(m[f"branch_pre@{j}"] for j in window)
        return ratio(num, sum(m[f"branch_pre_n@{j}"] for j in window))

    return compute


_COHORT = (("branch_cohort", 1.0),)
_RF = (("rollout_tv", 1.0), ("fixed_tv", -1.0))
_T, _D, _B, _S, _E, _L, _P, _G, _A = (
    "timing and occupation",
    "risks",
    "generation clock",
    "divergence clock",
    "EOS segments",
    "local agreement",
    "prediction (Table 4)",
    "gap decomposition",
    "accuracy",
)


def _segment(k: int) -> Estimand:
    desc = "R − F in EOS segment S0 (before either EOS)" if k == 0 else f"R − F in EOS segment S{k}"
    return Estimand(
        f"rf_S{k}",
        f"(R − F)_S{k}",
        desc,
        "",
        _E,
        (f"rf_seg{k}",),
        "mean",
        f"rf_seg{k}",
        lambda m, c, n, o: m[f"rf_seg{k}"],
        mean_of=f"rf_seg{k}",
    )


def _contrast(column: str, name: str, description: str, kind: str, of: str) -> Estimand:
    terms = ("diverged", "exposure", "post_mismatch")
    return Estimand(column, name, description, "", _G, terms, kind, of, computed_by="contrast")


# fmt: off
_BUILTIN = (
    _mean(
        "R_smc", "R_SMC", "token-mismatch risk R_SMC = O_H + Π_H", "lower", _T, "mismatch",
        glossary="token-mismatch risk: the share of the H steps at which the two tokens differ",
    ),
    Estimand(
        "O_H", "O_H", "occurrence O_H = P(τ ≤ H)/H", "lower", _T, ("diverged",), "mean",
        "diverged / H", lambda m, c, n, o: m["diverged"] / c.H,
        glossary="occurrence: the first mismatch's share of R_SMC, P(τ ≤ H)/H",
    ),
    _mean(
        "E_H", "E_H", "post-divergence exposure E_H", "lower", _T, "exposure",
        glossary="exposure: the share of the horizon left after the divergence",
    ),
    Estimand(
        "C_H", "C_H", "post-divergence mismatch rate C_H", "lower", _T,
        ("post_mismatch", "exposure"), "ratio", "post_mismatch / exposure",
        lambda m, c, n, o: ratio(m["post_mismatch"], m["exposure"]),
        denominators=((("exposure", 1.0),),),
        glossary="mismatch rate after the divergence: how often the diverged texts still "
        "differ; Π_H = E_H·C_H",
    ),
    _mean(
        "Pi_H", "Π_H", "post-divergence component Π_H = E_H·C_H", "lower", _T, "post_mismatch",
        glossary="what comes after the first mismatch: R_SMC = O_H + Π_H exactly",
    ),
    _mean(
        "div_prob", "P(τ ≤ H)", "divergence probability P(τ ≤ H)", "lower", _T, "diverged",
        glossary="the chance that the two generations differ at all within the horizon",
    ),
    Estimand(
        "mean_entry_time", "E[τ | τ ≤ H]", "mean entry time E[τ | τ ≤ H]", "higher", _T,
        ("tau_diverged", "diverged"), "ratio", "tau_diverged / diverged",
        lambda m, c, n, o: ratio(m["tau_diverged"], m["diverged"]),
        denominators=((("diverged", 1.0),),), unit="steps",
        glossary="the mean step of the first difference, among the paths that diverge",
    ),
    _mean(
        "R", "R", "rollout-TV risk R (mean rollout TV)", "lower", _D, "rollout_tv",
        glossary="total-variation distance of the two next-token laws along the generated texts",
    ),
    _mean(
        "F", "F", "fixed-history risk F", "lower", _D, "fixed_tv",
        glossary="total-variation distance of the two next-token laws along the reference's "
        "own text (teacher forcing)",
    ),
    Estimand(
        "R_minus_F", "R − F", "R − F", "", _D, ("rollout_tv", "fixed_tv"), "mean",
        "rollout_tv − fixed_tv", lambda m, c, n, o: m["rollout_tv"] - m["fixed_tv"],
        contrast_name="Δ(R − F)",
    ),
    _mean(
        "S_99", "S_.99", "saturation S_.99 = mean over t of P(δ_t > .99)", "lower", _T,
        "saturation",
        glossary="saturation: the share of steps at which the two next-token laws are almost "
        "disjoint (TV > 0.99)",
    ),
    Estimand(
        "div_cdf", "P(τ ≤ t)", "divergence CDF P(τ ≤ t)", "lower", _T, ("div_cdf",), "mean",
        "div_cdf@t",
        lambda m, c, n, o: {f"div_cdf@{t}": m[f"div_cdf@{t}"] for t in range(1, c.H + 1)},
        profile="t",
        glossary="the divergence CDF: the chance that the two generations have differed by step t",
    ),
    Estimand(
        "tv", "E[δ_t]", "generation clock E[δ_t]", "", _B, ("delta",), "mean", "delta@t",
        lambda m, c, n, o: {f"tv@{t}": m[f"delta@{t}"] for t in range(1, c.H + 1)}, profile="t",
    ),
    Estimand(
        "block_tv", "g_J", "block means of E[δ_t] (blocks a:b)", "", _B, ("delta",), "mean",
        "delta@t over the block's steps", _blocks, profile="a:b",
    ),
    Estimand(
        "block_tv_change", "g_last − g_first",
        "generation-clock change: last − first block of E[δ_t]", "", _B, ("delta",), "mean",
        "delta@t, last block minus first",
        lambda m, c, n, o: o[f"block_tv@{c.blocks[-1][0]}:{c.blocks[-1][1]}"]
        - o[f"block_tv@{c.blocks[0][0]}:{c.blocks[0][1]}"],
        contrast_name="Δg",
    ),
    _mean(
        "branch_cohort_fraction", "P(τ ≤ d)", "branch cohort P(τ ≤ d)", "", _S, "branch_cohort"
    ),
    Estimand(
        "branch_cohort_docs", "cohort docs", "documents in the branch cohort", "", _S,
        ("cohort_any",), "count", "documents with a path in the cohort",
        lambda m, c, n, o: m["cohort_any"] * n, unit="count",
    ),
    Estimand(
        "branch_cohort_paths", "cohort paths", "paths in the branch cohort", "", _S,
        ("cohort_paths",), "count", "paths in the cohort",
        lambda m, c, n, o: m["cohort_paths"] * n, unit="count",
    ),
    Estimand(
        "branch_tv", "b_j", "divergence clock b_j = E[δ_{τ+j} | τ ≤ d]", "", _S,
        ("branch", "branch_cohort"), "ratio", "branch@j / branch_cohort",
        lambda m, c, n, o: {
            f"branch_tv@{j}": ratio(m[f"branch@{j}"], m["branch_cohort"])
            for j in range(1, c.branch_depth + 1)
        },
        profile="j",
    ),
    Estimand(
        "branch_early", "b_early", "branch TV, early lag window", "", _S,
        ("branch", "branch_cohort"), "ratio", "mean branch@j over lags 1..w / branch_cohort",
        _branch_window(False), denominators=(_COHORT,),
    ),
    Estimand(
        "branch_late", "b_late", "branch TV, late lag window", "", _S,
        ("branch", "branch_cohort"), "ratio", "mean branch@j over lags d−w+1..d / branch_cohort",
        _branch_window(True), denominators=(_COHORT,),
    ),
    Estimand(
        "branch_contrast_B", "B(a)", "branch contrast B = late − early", "lower", _S,
        ("branch", "branch_cohort"), "ratio", "(late − early window of branch@j) / branch_cohort",
        lambda m, c, n, o: o["branch_late"] - o["branch_early"], denominators=(_COHORT,),
        glossary="late minus early TV after the divergence: positive when the disagreement "
        "grows, negative when it fades",
    ),
    Estimand(
        "branch_pre_tv", "b^pre_j", "divergence clock before EOS", "", _S,
        ("branch_pre", "branch_pre_n"), "ratio", "branch_pre@j / branch_pre_n@j",
        lambda m, c, n, o: {
            f"branch_pre_tv@{j}": ratio(m[f"branch_pre@{j}"], m[f"branch_pre_n@{j}"])
            for j in range(1, c.branch_depth + 1)
        },
        profile="j",
    ),
    Estimand(
        "branch_pre_early", "b^pre_early", "branch TV before EOS, early window", "", _S,
        ("branch_pre", "branch_pre_n"), "ratio", "Σ branch_pre@j / Σ branch_pre_n@j, lags 1..w",
        _pre_window(False),
    ),
    Estimand(
        "branch_pre_late", "b^pre_late", "branch TV before EOS, late window", "", _S,
        ("branch_pre", "branch_pre_n"), "ratio",
        "Σ branch_pre@j / Σ branch_pre_n@j, lags d−w+1..d", _pre_window(True),
    ),
    Estimand(
        "branch_pre_contrast_B", "B^pre(a)", "branch contrast before EOS", "", _S,
        ("branch_pre", "branch_pre_n"), "ratio", "late − early pre-EOS window",
        lambda m, c, n, o: o["branch_pre_late"] - o["branch_pre_early"],
    ),
    *(_segment(k) for k in range(4)),
    Estimand(
        "pre_eos_share", "S0 / (R − F)", "share of R − F before EOS", "", _E,
        ("rf_seg0", "rollout_tv", "fixed_tv"), "ratio", "rf_seg0 / (rollout_tv − fixed_tv)",
        lambda m, c, n, o: ratio(m["rf_seg0"], o["R_minus_F"]), denominators=(_RF,),
    ),
    Estimand(
        "eos_share", "1 − S0 / (R − F)", "share of R − F at or after EOS", "", _E,
        ("rf_seg0", "rollout_tv", "fixed_tv"), "ratio", "1 − rf_seg0 / (rollout_tv − fixed_tv)",
        lambda m, c, n, o: 1 - o["pre_eos_share"], denominators=(_RF,),
    ),
    Estimand(
        "local_agreement_run", "local run", "branch cohort: a run of agreements after τ", "",
        _L, ("local_run", "branch_cohort"), "ratio", "local_run / branch_cohort",
        lambda m, c, n, o: ratio(m["local_run"], m["branch_cohort"]), denominators=(_COHORT,),
    ),
    Estimand(
        "local_reentry", "local re-entry", "branch cohort: a mismatch after re-agreeing", "",
        _L, ("local_reentry", "branch_cohort"), "ratio", "local_reentry / branch_cohort",
        lambda m, c, n, o: ratio(m["local_reentry"], m["branch_cohort"]),
        denominators=(_COHORT,),
    ),
    Estimand(
        "flat_extrapolation", "flat", "flat extrapolation of the early-position mismatch", "",
        _P, ("prefix_mismatch",), "mean", "prefix_mismatch · H / prefix",
        lambda m, c, n, o: m["prefix_mismatch"] * c.H / c.prefix,
    ),
    Estimand(
        "R_minus_flat", "R − flat", "R − flat extrapolation", "", _P,
        ("rollout_tv", "prefix_mismatch"), "mean", "rollout_tv − flat_extrapolation",
        lambda m, c, n, o: m["rollout_tv"] - o["flat_extrapolation"],
    ),
    _contrast("gap_occurrence", "occurrence", "occurrence term ΔO_H of ΔR_SMC", "mean", "ΔO_H"),
    _contrast(
        "gap_exposure", "exposure", "exposure term ΔE_H·C̄_H of ΔR_SMC", "product", "ΔE_H·C̄_H"
    ),
    _contrast("gap_rate", "rate", "rate term ΔC_H·Ē_H of ΔR_SMC", "product", "ΔC_H·Ē_H"),
    _contrast(
        "occurrence_share", "occurrence share", "occurrence term / ΔR_SMC", "ratio",
        "gap_occurrence / ΔR_smc",
    ),
    _contrast(
        "exposure_share", "exposure share", "exposure term / ΔR_SMC", "ratio",
        "gap_exposure / ΔR_smc",
    ),
    _contrast("rate_share", "rate share", "rate term / ΔR_SMC", "ratio", "gap_rate / ΔR_smc"),
    Estimand(
        "accuracy_drop", "accuracy drop", "the full cache's task accuracy minus the evicted "
        "cache's", "lower", _A, (), "mean", "per-document accuracy of X minus that of Y",
        glossary="the full cache's task accuracy minus the evicted cache's",
        computed_by="accuracy",
    ),
)
# fmt: on

ESTIMANDS: dict[str, Estimand] = {e.column: e for e in _BUILTIN}
"""Every estimand by column (a profile by its stem), in the order of ``estimands.csv``."""


def register_estimand(entry: Estimand) -> Estimand:
    """Add ``entry`` to :data:`ESTIMANDS` (after the others); refused in one line naming it
    when its column is taken or has ``@``, a field is out of range, a statistic it reads is
    not registered, or an ``action`` estimand has no function."""
    where = f"estimand {entry.column!r}"
    if entry.column in ESTIMANDS:
        raise ValueError(f"{where} is already registered")
    if "@" in entry.column or not entry.column:
        raise ValueError(f"{where}: a column is a name without '@' (profiles set profile=)")
    for field, allowed in (
        ("better", BETTER),
        ("kind", KINDS),
        ("computed_by", COMPUTED_BY),
    ):
        if getattr(entry, field) not in allowed:
            raise ValueError(
                f"{where}: {field} must be one of {allowed}, got {getattr(entry, field)!r}"
            )
    unknown = [s for s in entry.statistics if s not in STATISTICS and s not in _EXTRA]
    if unknown and entry.computed_by == "action":
        raise ValueError(f"{where}: reads unregistered statistic(s) {', '.join(unknown)}")
    if entry.computed_by == "action" and entry.compute is None:
        raise ValueError(f"{where}: an action estimand needs its compute function")
    ESTIMANDS[entry.column] = entry
    return entry


_EXTRA = ("cohort_any", "cohort_paths", "n_paths")
"""Per-document columns beside the statistics that estimands may read."""


def estimand(column: str) -> Estimand | None:
    """The entry of an ``estimands.csv`` name (a profile's ``stem@x`` by its stem); ``None``
    for a name the registry does not hold."""
    return ESTIMANDS.get(column.split("@", 1)[0])


def mean_endpoints() -> dict[str, str]:
    """{estimand: statistic} of every action estimand that is exactly the document average of
    one statistic (the sample-size plan's path value for it)."""
    return {
        e.column: e.mean_of
        for e in ESTIMANDS.values()
        if e.mean_of and e.profile is None and e.computed_by == "action"
    }


def ratio_denominators() -> dict[str, tuple[tuple[tuple[str, float], ...], ...]]:
    """{estimand: denominators} of every action estimand whose denominators do not depend on
    the clock."""
    return {
        e.column: e.denominators
        for e in ESTIMANDS.values()
        if e.denominators and e.computed_by == "action"
    }


def glossary_table() -> str:
    """The README's glossary table ("| estimand (column name) | what it means | better |"):
    one row per estimand with a ``glossary`` line, in registry order."""
    lines = ["| estimand (column name) | what it means | better |", "|---|---|---|"]
    for e in ESTIMANDS.values():
        if e.glossary is None:
            continue
        column = f"{e.column}@{e.profile}" if e.profile else e.column
        name = e.name.replace("|", "\\|")
        lines.append(f"| {name} (`{column}`) | {e.glossary} | {e.better or '—'} |")
    return "\n".join(lines)
