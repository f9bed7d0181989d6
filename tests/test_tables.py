"""Tables 1–4 (SPEC §5) built from a synthetic study's real estimands and prediction tables."""

from __future__ import annotations

import re

import numpy as np
import polars as pl
import pytest
from study_helpers import CONTROL, LAMBDAS, PAIR, STRATA, build_study

from kvdiverge.tables import (
    StudyTableError,
    latex_escape,
    read_estimands,
    read_prediction,
    render_latex,
    render_markdown,
    table1_timing,
    table2_decomposition,
    table3_strata,
    table4_uncalibrated,
    write_study_tables,
)

COMPARED = [a for a in LAMBDAS if a != CONTROL]
MAIN = f"{PAIR[0]} - {PAIR[1]}"
NUMBER = r"-?\d+\.\d+"
CELL = re.compile(rf"^({NUMBER})(?: \[({NUMBER}), ({NUMBER})\])?")


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("study")
    est, pred = build_study(root)
    return est, pred, read_estimands(est), read_prediction(pred)


def _row(est, *, model, estimand, action="", contrast="", stratum="pooled"):
    r = est.filter(
        (pl.col("model") == model)
        & (pl.col("action") == action)
        & (pl.col("contrast") == contrast)
        & (pl.col("stratum") == stratum)
        & (pl.col("estimand") == estimand)
    )
    assert r.height == 1, (model, estimand, action, contrast, stratum)
    return r.row(0, named=True)


def _check_cell(cell: str, row: dict, scale: float = 100.0) -> None:
    """The rendered cell shows value [lo, hi] of the CSV row ×scale, rounded to 2 decimals."""
    m = CELL.match(cell)
    assert m, cell
    shown = [float(g) for g in m.groups() if g is not None]
    expected = [row["value"], row["ci_low"], row["ci_high"]][: len(shown)]
    np.testing.assert_allclose(shown, np.array(expected) * scale, atol=0.005 + 1e-9)
    assert len(shown) == 3


def test_table1_values_are_the_estimands_in_percent(study):
    _, _, est, _ = study
    table = table1_timing(est, COMPARED, "estimands.csv")
    models = est["model"].unique(maintain_order=True).to_list()
    assert table.data.height == len(models) * len(COMPARED)
    assert table.data.select("model", "action").rows() == [(m, a) for m in models for a in COMPARED]
    assert table.header[:2] == ["Model", "Action"]
    assert len(table.header) == 11
    estimands = ["R_smc", "O_H", "E_H", "C_H", "Pi_H", "mean_entry_time", "S_99"]
    for record, rendered in zip(table.data.iter_rows(named=True), table.rows, strict=True):
        assert rendered[:2] == [record["model"], record["action"]]
        for k, name in enumerate(estimands):
            src = _row(est, model=record["model"], action=record["action"], estimand=name)
            assert record[name] == src["value"]  # the CSV keeps the fractions exactly
            assert (record[f"{name}_low"], record[f"{name}_high"]) == (
                src["ci_low"],
                src["ci_high"],
            )
            _check_cell(rendered[2 + k], src, 1.0 if name == "mean_entry_time" else 100.0)
        docs = _row(
            est, model=record["model"], action=record["action"], estimand="branch_cohort_docs"
        )
        assert rendered[9] == f"{int(round(docs['value'])):,}"
    assert "95% CI" in table.header[2] and "%" in table.header[2]
    assert "steps" in table.header[7]


def test_table2_decomposition_adds_up_and_matches(study):
    _, _, est, _ = study
    table = table2_decomposition(est, None, "estimands.csv")
    contrasts = [c for c in est["contrast"].unique(maintain_order=True).to_list() if c]
    assert len(contrasts) == 3
    assert table.data.height == 2 * len(contrasts)
    d = table.data
    terms = d["gap_occurrence"] + d["gap_exposure"] + d["gap_rate"]
    np.testing.assert_allclose(terms, d["R_smc"], rtol=0, atol=1e-12)
    shares = d["occurrence_share"] + d["exposure_share"] + d["rate_share"]
    np.testing.assert_allclose(shares, 1.0, rtol=0, atol=1e-9)
    names = ["R_smc", "gap_occurrence", "gap_exposure", "gap_rate"]
    names += ["occurrence_share", "exposure_share", "rate_share"]
    for record, rendered in zip(d.iter_rows(named=True), table.rows, strict=True):
        for k, name in enumerate(names):
            src = _row(est, model=record["model"], contrast=record["contrast"], estimand=name)
            assert record[name] == src["value"]
            _check_cell(rendered[2 + k], src)
    assert "pp" in table.header[2] and "%" in table.header[6]


def test_table3_rows_are_strata_of_the_main_contrast(study):
    _, _, est, _ = study
    table = table3_strata(est, MAIN, "estimands.csv")
    models = est["model"].unique(maintain_order=True).to_list()
    expected = [(m, s) for m in models for s in [*sorted(STRATA), "pooled"]]
    assert table.data.select("model", "stratum").rows() == expected
    assert table.header[-2:] == [
        f"B: {PAIR[0]}, pp [95% CI]",
        f"B: {PAIR[1]}, pp [95% CI]",
    ]
    for record, rendered in zip(table.data.iter_rows(named=True), table.rows, strict=True):
        m, s = record["model"], record["stratum"]
        for k, name in enumerate(
            ["R_smc", "gap_exposure", "exposure_share", "block_tv_change", "R_minus_F"]
        ):
            src = _row(est, model=m, contrast=MAIN, stratum=s, estimand=name)
            assert record[name] == src["value"]
            _check_cell(rendered[2 + k], src)
        for k, action in enumerate(PAIR):
            src = _row(est, model=m, action=action, stratum=s, estimand="branch_contrast_B")
            _check_cell(rendered[7 + k], src)


def test_table4_uncalibrated_agrees_with_the_prediction_table(study):
    """Two independent computations of the same contrasts: estimands vs prediction rows."""
    _, _, est, pred = study
    table = table4_uncalibrated(est, pred, MAIN, "estimands.csv")
    d = table.data
    unc = d.filter(pl.col("section") == "uncalibrated")
    assert unc.height == 2 * 5
    names = {
        "R": "full_rollout_tv_gap",
        "F": "fixed_history_gap",
        "flat_extrapolation": "flat_extrapolation_gap",
        "R_minus_F": "full_minus_fixed",
        "R_minus_flat": "full_minus_flat",
    }
    for r in unc.iter_rows(named=True):
        src = _row(est, model=r["model"], contrast=MAIN, estimand=r["quantity"])
        assert r["value"] == src["value"]
        other = pred.filter(
            (pl.col("model") == r["model"])
            & (pl.col("observation") == "uncalibrated")
            & (pl.col("quantity") == names[r["quantity"]])
        )
        assert abs(other["value"][0] - r["value"]) < 1e-12
    predicted = d.filter(pl.col("section") == "prediction")
    assert predicted.height == 2 * 2 * 3  # models × observations × (error, mae, rmse)
    errors = predicted.filter(pl.col("quantity").str.ends_with(":error"))
    assert set(errors["decision"]) <= {"Equivalent", "Unresolved", "Not equivalent"}
    assert (errors["ci_level"] == 1 - 0.05 / 4).all()
    # rows: quantities; columns: the label and one per model
    assert table.header == ["Quantity, pp", "tiny-llama", "tiny-qwen"]
    assert len(table.rows) == 5 + 2 * 3
    first = table.rows[0]
    assert first[0].startswith("Full-H rollout-TV gap")
    _check_cell(first[1], _row(est, model="tiny-llama", contrast=MAIN, estimand="R"))
    error_row = next(r for r in table.rows if r[0].startswith("Prediction error"))
    assert "[98.75% CI]" in error_row[0]
    assert error_row[1].split()[-1] in {"Equivalent", "Unresolved", "equivalent"}


def test_table4_without_prediction_has_only_the_uncalibrated_rows(study):
    _, _, est, _ = study
    table = table4_uncalibrated(est, None, MAIN, "estimands.csv")
    assert set(table.data["section"]) == {"uncalibrated"}
    assert len(table.rows) == 5


def _unescaped(text: str, ch: str) -> int:
    return len(re.findall(rf"(?<!\\){re.escape(ch)}", text))


def test_latex_is_booktabs_and_balanced(study):
    _, _, est, pred = study
    for table in (
        table1_timing(est, COMPARED),
        table2_decomposition(est),
        table3_strata(est, MAIN),
        table4_uncalibrated(est, pred, MAIN),
    ):
        tex = render_latex(table)
        assert _unescaped(tex, "{") == _unescaped(tex, "}")
        begins = re.findall(r"\\begin\{(\w+)\}", tex)
        ends = re.findall(r"\\end\{(\w+)\}", tex)
        assert begins == ["table", "tabular"] and ends == ["tabular", "table"]
        lines = tex.splitlines()
        top, bottom = lines.index(r"\toprule"), lines.index(r"\bottomrule")
        assert top < lines.index(r"\midrule") < bottom
        assert tex.count(r"\toprule") == 1 and tex.count(r"\bottomrule") == 1
        align = re.search(r"\\begin\{tabular\}\{([lr]+)\}", tex).group(1)
        assert len(align) == len(table.header)
        body = [ln for ln in lines[top + 1 : bottom] if ln != r"\midrule"]
        assert len(body) == 1 + len(table.rows)
        for line in body:
            assert line.endswith(r" \\")
            assert _unescaped(line, "&") == len(table.header) - 1, line
            assert _unescaped(line, "$") % 2 == 0, line
        assert "%" not in tex.replace(r"\%", "")  # every percent sign escaped
        assert not re.search(r"(?<![\w$])-\d", "\n".join(body))  # numbers carry a true minus
    assert "$-$" in render_latex(table2_decomposition(est))  # snapkv-half − recent-half < 0


def test_markdown_rows_have_one_cell_per_column(study):
    _, _, est, _ = study
    table = table2_decomposition(est)
    md = render_markdown(table).splitlines()
    assert md[0].startswith("**Table 2.**")
    rows = [ln for ln in md if ln.startswith("|")]
    assert len(rows) == 2 + len(table.rows)
    for line in rows:
        assert _unescaped(line, "|") == len(table.header) + 1
    # groups: a model is named on its first row only
    assert rows[2].split("|")[1].strip() == "tiny-llama"
    assert rows[3].split("|")[1].strip() == ""


def test_latex_escape_specials_and_symbols():
    assert latex_escape("a_b & 5% #1") == r"a\_b \& 5\% \#1"
    assert latex_escape("ΔR_SMC") == r"$\Delta$$R_{\mathrm{SMC}}$"
    assert latex_escape("E[τ | τ ≤ H]") == r"$E[\tau \mid \tau \leq H]$"


def _outputs(folder):
    return {
        f"table{i}": tuple(folder / f"table{i}.{e}" for e in ("csv", "md", "tex"))
        for i in range(1, 5)
    }


def test_write_study_tables_writes_every_rendering(study, tmp_path):
    est_path, pred_path, est, _ = study
    outputs = _outputs(tmp_path)
    built = write_study_tables(est_path, pred_path, outputs, COMPARED, MAIN)
    for name, paths in outputs.items():
        csv, md, tex = paths
        assert pl.read_csv(csv).equals(built[name].data)
        assert md.read_text() == render_markdown(built[name])
        assert tex.read_text() == render_latex(built[name])
    # the CSV keeps fractions: R_smc in table 1 equals the estimands value, not percent
    t1 = pl.read_csv(outputs["table1"][0])
    src = _row(est, model="tiny-llama", action=COMPARED[0], estimand="R_smc")
    assert t1["R_smc"][0] == src["value"] and 0 < src["value"] < 1
    # default main contrast: the first contrast of the table
    again = write_study_tables(est_path, None, _outputs(tmp_path / "b"), None, None)
    assert again["table3"].data.equals(built["table3"].data)
    assert set(again["table1"].data["action"]) == set(LAMBDAS)


def test_missing_estimand_is_one_clear_line_and_writes_nothing(study, tmp_path):
    est_path, _, est, _ = study
    broken = tmp_path / "estimands.csv"
    est.filter(pl.col("estimand") != "S_99").write_csv(broken)
    out = _outputs(tmp_path / "out")
    with pytest.raises(StudyTableError) as err:
        write_study_tables(broken, None, out, COMPARED, MAIN)
    message = str(err.value)
    assert "\n" not in message
    assert str(broken) in message and "'S_99' missing" in message and "table 1" in message
    assert not (tmp_path / "out").exists()


def test_bad_inputs_are_named(study, tmp_path):
    est_path, _, est, _ = study
    with pytest.raises(StudyTableError, match="not found"):
        read_estimands(tmp_path / "absent.csv")
    no_column = tmp_path / "no_column.csv"
    est.drop("ci_level").write_csv(no_column)
    with pytest.raises(StudyTableError, match=r"no_column.csv: missing column\(s\) ci_level"):
        read_estimands(no_column)
    with pytest.raises(StudyTableError, match="no rows for contrast 'a - b'"):
        table3_strata(est, "a - b", "estimands.csv")
    with pytest.raises(StudyTableError, match="no rows for action 'absent'"):
        write_study_tables(est_path, None, _outputs(tmp_path), ["absent"], None)
    one_stratum = est.filter(
        ~((pl.col("estimand") == "gap_exposure") & (pl.col("stratum") == STRATA[0]))
    )
    with pytest.raises(StudyTableError, match=rf"'gap_exposure' missing .*stratum '{STRATA[0]}'"):
        table3_strata(one_stratum, MAIN, "e.csv")
