"""The paper's Tables 1–4 of one study, built from the long estimands table and, for Table 4,
the prediction table (package docstring), and written in every format."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import polars as pl

from kvdiverge.analysis.bootstrap import distinct_resamples
from kvdiverge.analysis.estimand_registry import ESTIMANDS
from kvdiverge.tables.inputs import (
    StudyTableError,
    actions_in,
    contrast_actions,
    contrasts_in,
    default_main_contrast,
    models_in,
    pooled_support,
    read_estimands,
    read_prediction,
    require_estimands,
    strata_in,
)
from kvdiverge.tables.render import write_table
from kvdiverge.tables.study_table import (
    COUNT,
    PERCENT,
    PP,
    STEPS,
    Cell,
    Column,
    Measure,
    StudyTable,
    decimals_for,
    estimand_row,
    half_width,
    interval_cell,
    level_text,
    measure_table,
)


def registry_measure(
    column: str, unit: str | None = None, contrast: bool = False, label: str | None = None
) -> Measure:
    """A table column for an estimand of the registry
    (:data:`kvdiverge.analysis.estimand_registry.ESTIMANDS`): its symbol (as a contrast: Δ and
    the symbol) unless ``label`` is given, and its unit (steps, a count, else ``unit`` or a
    percentage)."""
    entry = ESTIMANDS[column]
    units = {"steps": STEPS, "count": COUNT}
    shown = label or (entry.shown_contrast if contrast else entry.name)
    return Measure(column, shown, units.get(entry.unit, unit or PERCENT))


TABLE1_MEASURES = tuple(
    registry_measure(e) for e in ("R_smc", "O_H", "E_H", "C_H", "Pi_H", "mean_entry_time", "S_99")
)
TABLE2_MEASURES = (
    registry_measure("R_smc", PP, contrast=True),
    *(registry_measure(e, PP) for e in ("gap_occurrence", "gap_exposure", "gap_rate")),
    *(registry_measure(e) for e in ("occurrence_share", "exposure_share", "rate_share")),
)
TABLE3_CONTRAST_MEASURES = (
    registry_measure("R_smc", PP, contrast=True),
    registry_measure("gap_exposure", PP, label="exposure term"),
    registry_measure("exposure_share"),
    registry_measure("block_tv_change", PP, contrast=True),
    registry_measure("R_minus_F", PP, contrast=True),
)
TABLE4_QUANTITIES = (
    ("R", "Full-H rollout-TV gap"),
    ("F", "Fixed-history gap"),
    ("flat_extrapolation", "Flat-extrapolation gap"),
    ("R_minus_F", "Full minus fixed history"),
    ("R_minus_flat", "Full minus flat extrapolation"),
)
_OBSERVATION_LABELS = {"positions_1_32": "early positions", "fixed_history": "fixed history"}


def shown_action(action: str, labels: Mapping[str, str] | None) -> str:
    """What a table shows for an action: its label (``config.actions.<name>.label``), else its
    name."""
    return str((labels or {}).get(action, action))


def shown_contrast(contrast: str, labels: Mapping[str, str] | None) -> str:
    """A contrast ``b - a`` as a table shows it: each side by its label."""
    return " - ".join(shown_action(part, labels) for part in contrast.split(" - ", 1))


def _shown_keys(built: StudyTable, column: int, shown) -> StudyTable:
    """``built`` with its rendered key column ``column`` passed through ``shown`` (the CSV
    keeps the names, the join keys of ``estimands.csv``)."""
    rows = [[*r[:column], shown(r[column]), *r[column + 1 :]] for r in built.rows]
    return dataclasses.replace(built, rows=rows)


def table1_timing(
    table: pl.DataFrame,
    actions: Sequence[str] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """Table 1: timing and occupation per model × action, pooled.

    ``actions`` (default: every action of the table) fixes rows and order; pass the study's
    compared actions to leave out the full-retention control. ``labels``: what the rendered
    rows show for each action (default its name; the CSV keeps the name).
    """
    needed = "table 1"
    counts = (registry_measure("branch_cohort_docs"), registry_measure("branch_cohort_paths"))
    require_estimands(table, [m.estimand for m in TABLE1_MEASURES + counts], where, needed)
    actions = list(actions) if actions is not None else actions_in(table)
    records = []
    for model in models_in(table):
        for action in actions:
            rec = {"model": model, "action": action}
            rec |= estimand_row(table, where, needed, TABLE1_MEASURES, model=model, action=action)
            got = estimand_row(table, where, needed, counts, model=model, action=action)
            rec |= {m.estimand: got[m.estimand] for m in counts}
            rec["n_docs"], rec["n_paths"] = pooled_support(table, model, action, "R_smc")
            records.append(rec)
    caption = (
        "Timing and occupation per model and action (all strata pooled): token-mismatch risk "
        "R_SMC = O_H + Π_H, occurrence O_H = P(τ ≤ H)/H, post-divergence exposure E_H, "
        "post-divergence mismatch rate C_H, post-divergence component Π_H = E_H·C_H, mean "
        "entry time among diverging paths, saturation S_.99, and the fixed branch cohort's "
        "documents and paths. Percent of the horizon; document-bootstrap intervals."
    )
    measures = TABLE1_MEASURES + counts
    built = measure_table(
        "table1", caption, [("model", "Model"), ("action", "Action")], records, measures
    )
    return _shown_keys(built, 1, lambda a: shown_action(a, labels))


def table2_decomposition(
    table: pl.DataFrame,
    contrasts: Sequence[str] | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """Table 2: ΔR_SMC = occurrence + exposure + rate terms, with shares, pooled (the rendered
    contrasts by their actions' labels)."""
    needed = "table 2"
    require_estimands(table, [m.estimand for m in TABLE2_MEASURES], where, needed)
    contrasts = list(contrasts) if contrasts is not None else contrasts_in(table)
    if not contrasts:
        raise StudyTableError(f"{where}: no contrast rows (needed by {needed})")
    records = []
    for model in models_in(table):
        for contrast in contrasts:
            rec = {"model": model, "contrast": contrast}
            rec |= estimand_row(
                table, where, needed, TABLE2_MEASURES, model=model, contrast=contrast
            )
            records.append(rec)
    caption = (
        "Gap decomposition per contrast b − a (all strata pooled): ΔR_SMC = ΔO_H + ΔE_H·C̄_H "
        "+ ΔC_H·Ē_H (occurrence, exposure and rate terms, in percentage points), exact on the "
        "empirical moments; each share divides its term by ΔR_SMC. Document-bootstrap "
        "intervals, paired across actions."
    )
    built = measure_table(
        "table2",
        caption,
        [("model", "Model"), ("contrast", "Contrast")],
        records,
        TABLE2_MEASURES,
        shares=("occurrence_share", "exposure_share", "rate_share"),
    )
    return _shown_keys(built, 1, lambda c: shown_contrast(c, labels))


def table3_strata(
    table: pl.DataFrame,
    contrast: str | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """Table 3: the main contrast per model × stratum (pooled last), with B(a) of both actions.

    Columns: ΔR_SMC, its exposure term and share, the generation-clock change Δg
    (g_last block − g_first block), Δ(R − F), and the branch contrast B of each action of the
    contrast (the divergence clock).
    """
    needed = "table 3"
    contrast = contrast or default_main_contrast(table, where)
    b, a = contrast_actions(contrast)
    branch = (Measure("branch_contrast_B", "B", PP),)
    require_estimands(
        table, [m.estimand for m in TABLE3_CONTRAST_MEASURES] + ["branch_contrast_B"], where, needed
    )
    if contrast not in contrasts_in(table):
        raise StudyTableError(f"{where}: no rows for contrast {contrast!r} (needed by {needed})")
    strata = [*strata_in(table), "pooled"]
    records = []
    for model in models_in(table):
        for stratum in strata:
            rec = {"model": model, "stratum": stratum}
            rec |= estimand_row(
                table,
                where,
                needed,
                TABLE3_CONTRAST_MEASURES,
                model=model,
                contrast=contrast,
                stratum=stratum,
            )
            rec["n_docs"] = rec[f"{TABLE3_CONTRAST_MEASURES[0].estimand}_docs"]
            for action, key in ((b, "B_minuend"), (a, "B_subtrahend")):
                got = estimand_row(
                    table, where, needed, branch, model=model, action=action, stratum=stratum
                )
                rec |= {
                    key: got["branch_contrast_B"],
                    f"{key}_low": got["branch_contrast_B_low"],
                    f"{key}_high": got["branch_contrast_B_high"],
                    f"{key}_level": got["branch_contrast_B_level"],
                    f"{key}_docs": got["branch_contrast_B_docs"],
                }
            records.append(rec)
    measures = TABLE3_CONTRAST_MEASURES + (
        Measure("B_minuend", f"B: {shown_action(b, labels)}", PP),
        Measure("B_subtrahend", f"B: {shown_action(a, labels)}", PP),
    )
    caption = (
        f"The contrast {shown_contrast(contrast, labels)} per stratum (pooled last): ΔR_SMC, "
        "its exposure term and share, the generation-clock change Δg = g(last block) − "
        "g(first block), Δ(R − F), and each action's branch contrast B = late − early branch "
        "TV within its fixed branch cohort. Percentage points; document-bootstrap intervals."
    )
    built = measure_table(
        "table3",
        caption,
        [("model", "Model"), ("stratum", "Stratum"), ("n_docs", "Documents")],
        records,
        measures,
        shares=("exposure_share",),
    )
    sizes = sorted({int(r["n_docs"]) for r in records if r["stratum"] != "pooled"})
    note = (
        "Documents: the evaluation documents each row rests on; the bootstrap resamples them "
        "within their stratum, so a stratum of n documents has only C(2n − 1, n) distinct "
        "resamples ("
        + ", ".join(f"{n} → {distinct_resamples([n]):,}" for n in sizes)
        + ") and its interval is correspondingly coarse."
    )
    return dataclasses.replace(built, notes=(*built.notes, note))


def table4_uncalibrated(
    table: pl.DataFrame,
    prediction: pl.DataFrame | None = None,
    contrast: str | None = None,
    where: str = "estimands",
    labels: Mapping[str, str] | None = None,
) -> StudyTable:
    """Table 4: uncalibrated contrasts of the main contrast, then its predictions.

    Rows are quantities, columns models. From the estimands (pooled contrast rows): ``R``
    (full-H rollout-TV gap), ``F`` (fixed-history gap), ``flat_extrapolation``, ``R_minus_F``,
    ``R_minus_flat``. From ``prediction`` (rows of the same contrast only): per observation,
    the selected predictor's ``error`` with its interval and decision, ``mae`` and ``rmse``.
    The CSV is long: model, section, quantity, label, value, ci_low, ci_high, ci_level,
    decision, predictor.
    """
    needed = "table 4"
    contrast = contrast or default_main_contrast(table, where)
    require_estimands(table, [q for q, _ in TABLE4_QUANTITIES], where, needed)
    if contrast not in contrasts_in(table):
        raise StudyTableError(f"{where}: no rows for contrast {contrast!r} (needed by {needed})")
    models = models_in(table)
    records = []
    for model in models:
        got = estimand_row(
            table,
            where,
            needed,
            [Measure(q, label) for q, label in TABLE4_QUANTITIES],
            model=model,
            contrast=contrast,
        )
        for q, label in TABLE4_QUANTITIES:
            records.append(
                {
                    "model": model,
                    "section": "uncalibrated",
                    "quantity": q,
                    "label": label,
                    "value": got[q],
                    "ci_low": got[f"{q}_low"],
                    "ci_high": got[f"{q}_high"],
                    "ci_level": got[f"{q}_level"],
                    "decision": "",
                    "predictor": "",
                }
            )
    if prediction is not None:
        chosen = prediction.filter(
            (pl.col("contrast") == contrast)
            & pl.col("quantity").is_in(["error", "mae", "rmse"])
            & pl.col("model").is_in(models)
        )
        for r in chosen.iter_rows(named=True):
            obs = _OBSERVATION_LABELS.get(r["observation"], r["observation"].replace("_", " "))
            what = {"error": "error", "mae": "MAE", "rmse": "RMSE"}[r["quantity"]]
            records.append(
                {
                    "model": r["model"],
                    "section": "prediction",
                    "quantity": f"{r['observation']}:{r['quantity']}",
                    "label": f"Prediction {what}, {obs}",
                    "value": r["value"],
                    "ci_low": r["ci_low"],
                    "ci_high": r["ci_high"],
                    "ci_level": r["ci_level"],
                    "decision": r["decision"],
                    "predictor": r["predictor"],
                }
            )
    data = pl.DataFrame(
        records,
        schema={
            "model": pl.String,
            "section": pl.String,
            "quantity": pl.String,
            "label": pl.String,
            "value": pl.Float64,
            "ci_low": pl.Float64,
            "ci_high": pl.Float64,
            "ci_level": pl.Float64,
            "decision": pl.String,
            "predictor": pl.String,
        },
    )
    quantities = data.select("quantity", "label").unique(maintain_order=True)
    rows = []
    for quantity, label in quantities.iter_rows():
        sub = data.filter(pl.col("quantity") == quantity)
        level = level_text(sub["ci_level"].to_list())
        predictor = next((p for p in sub["predictor"].to_list() if p), "")
        text = label + (f" ({predictor.replace('_', ' ')})" if predictor else "")
        row: list[str] = [text + (f" [{level}]" if level else "")]
        widths = [half_width(lo, hi) for lo, hi in sub.select("ci_low", "ci_high").iter_rows()]
        digits = decimals_for(widths, PP)
        for model in models:
            cell = sub.filter(pl.col("model") == model)
            if cell.height == 0:
                row.append(Cell(""))
                continue
            r = cell.row(0, named=True)
            shown = interval_cell(r["value"], r["ci_low"], r["ci_high"], PP, digits)
            extra = [r["decision"]] if r["decision"] else []
            if r["predictor"] and r["predictor"] != predictor:
                extra.append(f"({r['predictor'].replace('_', ' ')})")
            if extra:
                shown = Cell(shown.value, " ".join([shown.interval, *extra]).strip())
            row.append(shown)
        rows.append(row)
    caption = (
        f"Uncalibrated contrasts for {shown_contrast(contrast, labels)} (pp): full-horizon "
        "rollout-TV gap ΔR, fixed-history gap ΔF, flat extrapolation of the early-position "
        "mismatch, and their differences; then the development-selected aggregate predictions "
        "of the contrast (error of the predicted population-average contrast with its interval "
        "and the equivalence decision, and document-contrast MAE and RMSE)."
    )
    columns = (Column("Quantity, pp"), *(Column(m) for m in models))
    header = [c.header for c in columns]
    return StudyTable("table4", caption, data, header, rows, group_columns=0, columns=columns)


def write_study_tables(
    estimands_csv: str | os.PathLike,
    prediction_csv: str | os.PathLike | None,
    outputs: Mapping[str, Sequence[str | os.PathLike]],
    actions: Sequence[str] | None = None,
    main_contrast: str | None = None,
    registration: str | None = None,
    labels: Mapping[str, str] | None = None,
) -> dict[str, StudyTable]:
    """Build Tables 1–4 of one study and write each as CSV, Markdown, LaTeX (and HTML).

    ``outputs`` maps ``table1``…``table4`` to their paths: (CSV, Markdown, LaTeX) or
    (CSV, Markdown, LaTeX, HTML). ``actions``: Table 1's rows (default: every action);
    ``main_contrast``: Tables 3–4's contrast (default: the first). Every input is read and
    every table built before anything is written. ``registration``: a note under every table
    saying which registration of the study's lock the estimands come from
    (:func:`kvdiverge.analysis.prespecification.registration_line`). ``labels``: what the
    rendered tables show for each action (``config.actions.<name>.label``; default its name).
    """
    unknown = sorted(set(outputs) - {"table1", "table2", "table3", "table4"})
    if unknown:
        raise StudyTableError(f"outputs: unknown table(s) {', '.join(unknown)}")
    where = str(estimands_csv)
    table = read_estimands(estimands_csv)
    prediction = read_prediction(prediction_csv) if prediction_csv is not None else None
    if actions is not None:
        absent = [a for a in actions if a not in set(table["action"].to_list())]
        if absent:
            raise StudyTableError(f"{where}: no rows for action {absent[0]!r}")
    built = {
        "table1": table1_timing(table, actions, where, labels),
        "table2": table2_decomposition(table, None, where, labels),
        "table3": table3_strata(table, main_contrast, where, labels),
        "table4": table4_uncalibrated(table, prediction, main_contrast, where, labels),
    }
    if registration:
        built = {
            k: dataclasses.replace(t, notes=(*t.notes, registration)) for k, t in built.items()
        }
    for name, paths in outputs.items():
        write_table(built[name], *paths)
    return built
