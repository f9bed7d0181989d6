"""What every study figure shares (:mod:`kvdiverge.plots.study`): the actions' styles, the
decomposition terms' styles, the estimands' profiles and branch windows, limits, labels and
legends."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from kvdiverge.analysis.bootstrap import MIN_INTERVAL_DOCUMENTS  # noqa: E402
from kvdiverge.plots.base import (  # noqa: E402
    PercentTicks,
    SeriesStyle,
    figure_legend,
    series_styles,
)
from kvdiverge.tables import (  # noqa: E402
    StudyTableError,
    require_estimands,
)

TERM_STYLES = {
    "occurrence": SeriesStyle("#E69F00", hatch=""),
    "exposure": SeriesStyle("#56B4E9", hatch="////"),
    "rate": SeriesStyle("#CC79A7", hatch="...."),
}
"""The decomposition's terms: colour and hatch (distinct from the actions' colours)."""
_DELTA_R = r"$\Delta R_{\mathrm{SMC}}$"


def action_styles(actions: Sequence[str], control: str | None = None) -> dict[str, SeriesStyle]:
    """One style per action by its position in ``actions`` (the study's order: its first two
    actions are the high-contrast blue/vermillion pair); the full-retention control is grey
    and dotted (:func:`kvdiverge.plots.base.series_styles`)."""
    return series_styles(actions, control)


def _actions_in(table: pl.DataFrame) -> list[str]:
    return [a for a in table["action"].unique(maintain_order=True).to_list() if a]


def _models_in(table: pl.DataFrame) -> list[str]:
    return table["model"].unique(maintain_order=True).to_list()


def _complete_styles(styles: Mapping[str, SeriesStyle] | None, actions: Sequence[str]) -> dict:
    """``styles`` extended with styles for the actions it lacks (after those it has)."""
    styles = dict(styles or {})
    missing = [a for a in actions if a not in styles]
    if missing:
        extra = series_styles([*styles, *missing])
        styles |= {a: extra[a] for a in missing}
    return styles


def note_missing_intervals(ax: plt.Axes, rows: pl.DataFrame | Sequence[Mapping]) -> bool:
    """Say in the panel, in one small line, when a row it draws rests on fewer than two
    documents: its interval is not available (none is drawn). Returns whether it did."""
    if isinstance(rows, pl.DataFrame):
        counts = rows["n_docs"].to_list() if "n_docs" in rows.columns else []
    else:
        counts = [r.get("n_docs") for r in rows]
    few = [int(n) for n in counts if n is not None and n < MIN_INTERVAL_DOCUMENTS]
    if not few:
        return False
    n = min(few)
    ax.text(
        0.02,
        0.02,
        f"interval not available: {n} document{'' if n == 1 else 's'}",
        transform=ax.transAxes,
        ha="left",
        va="bottom",
        fontsize=6.5,
        color="0.3",
    )
    return True


def profile(table: pl.DataFrame, prefix: str) -> pl.DataFrame:
    """Rows of a profile (``div_cdf@t``, ``tv@t``, ``branch_tv@j``: estimands named
    ``prefix@x``) with ``x`` (int) as a column, sorted by x."""
    marker = f"{prefix}@"
    rows = table.filter(pl.col("estimand").str.starts_with(marker))
    return (
        rows.with_columns(x=pl.col("estimand").str.slice(len(marker)).cast(pl.Int64, strict=False))
        .filter(pl.col("x").is_not_null())
        .sort("x")
    )


def _require_profile(table: pl.DataFrame, prefix: str, where: str, needed_by: str) -> pl.DataFrame:
    rows = profile(table, prefix)
    if rows.height == 0:
        raise StudyTableError(
            f"{where}: estimand {prefix + '@1'!r} missing (needed by {needed_by})"
        )
    return rows


def branch_windows(table: pl.DataFrame, where: str = "estimands") -> tuple[range, range]:
    """Early and late lag windows of the divergence clock, recovered from the table.

    The window w is the one for which ``branch_early`` = mean of ``branch_tv@1..w`` and
    ``branch_late`` = mean of ``branch_tv@d−w+1..d`` (d the deepest lag) on every pooled action
    row with finite values — these identities hold exactly by construction of the estimands.
    """
    require_estimands(table, ["branch_early", "branch_late"], where, "the branch windows")
    lags = _require_profile(table, "branch_tv", where, "the branch windows")
    pooled = lags.filter((pl.col("stratum") == "pooled") & (pl.col("action") != ""))
    depth = int(pooled["x"].max())
    wide = pooled.pivot(on="x", index=["model", "action"], values="value", sort_columns=False)
    keys = ["model", "action"]
    ends = table.filter(
        (pl.col("stratum") == "pooled")
        & (pl.col("action") != "")
        & pl.col("estimand").is_in(["branch_early", "branch_late"])
    ).pivot(on="estimand", index=keys, values="value")
    joined = wide.join(ends, on=keys)
    b = joined.select([str(j) for j in range(1, depth + 1)]).to_numpy()
    early, late = joined["branch_early"].to_numpy(), joined["branch_late"].to_numpy()
    usable = np.isfinite(b).all(1) & np.isfinite(early) & np.isfinite(late)
    b, early, late = b[usable], early[usable], late[usable]
    fits = []
    for w in range(1, depth // 2 + 1):
        ok_early = np.allclose(b[:, :w].mean(1), early, rtol=1e-9, atol=1e-12)
        ok_late = np.allclose(b[:, depth - w :].mean(1), late, rtol=1e-9, atol=1e-12)
        if ok_early and ok_late:
            fits.append(w)
    if not fits:
        raise StudyTableError(
            f"{where}: branch_early/branch_late are not window means of branch_tv@j for any "
            f"window 1..{depth // 2}"
        )
    default = max(1, round(depth / 4))  # 16 of 64 lags, when flat profiles tie
    w = fits[0] if len(fits) == 1 or default not in fits else default
    return range(1, w + 1), range(depth - w + 1, depth + 1)


def _level_label(levels: Sequence[float]) -> str:
    found = sorted({round(float(v), 10) for v in levels if v is not None and np.isfinite(v)})
    return "/".join(f"{100 * v:.10g}%" for v in found) if found else "unstated"


def _fit_limits(
    values: Sequence[float] | np.ndarray,
    floor: float | None = 0.0,
    ceiling: float | None = 1.0,
    pad: float = 0.06,
) -> tuple[float, float]:
    """Axis limits fitted to ``values`` (the plotted values and interval ends): from ``floor``
    when nothing lies below it, up to the largest value plus a margin, never past ``ceiling``
    by more than the margin."""
    v = np.asarray([x for x in values if x is not None and math.isfinite(x)], dtype=float)
    if v.size == 0:
        return (floor if floor is not None else 0.0, ceiling if ceiling is not None else 1.0)
    lo, hi = float(v.min()), float(v.max())
    if floor is not None and lo >= floor:
        lo = floor
    if hi - lo < 1e-9:  # one value (all zero, say): a window of 5 points above or around it
        half = max(abs(hi), 0.05) / 2
        lo, hi = (lo, lo + 2 * half) if lo == floor else (lo - half, hi + half)
    span = hi - lo
    low = lo - (0.02 if floor is not None and lo == floor else pad) * span
    high = hi + pad * span
    if ceiling is not None:
        high = min(high, ceiling + 0.02 * span)
    return low, high


def _percent(ax: plt.Axes, symbol: str = "%") -> None:
    ax.yaxis.set_major_formatter(PercentTicks(symbol))


def _action_legend(
    fig: plt.Figure,
    actions: Sequence[str],
    styles: Mapping[str, SeriesStyle],
    title: str,
    labels: Mapping[str, str] | None = None,
    **kw,
) -> None:
    """The figure's legend of ``actions``, each shown as its label (``labels``, default its
    name)."""
    handles = [Line2D([], [], lw=1.6, **styles[a].line()) for a in actions]
    figure_legend(fig, handles, shown_labels(actions, labels), title, **kw)


def shown_labels(actions: Sequence[str], labels: Mapping[str, str] | None) -> list[str]:
    """What a figure shows for each action: its label (``config.actions.<name>.label``,
    :func:`kvdiverge.config.actions.action_labels`), else its name."""
    return [str((labels or {}).get(a, a)) for a in actions]


def _interval_values(rows: pl.DataFrame) -> np.ndarray:
    return rows.select("value", "ci_low", "ci_high").to_numpy().ravel()
