"""Tables 1–4 built from a synthetic study's real estimands and prediction tables: values,
precision, hidden shares, and the Markdown, LaTeX and HTML renderings."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import numpy as np
import polars as pl
import pytest
from study_helpers import CONTROL, LAMBDAS, PAIR, STRATA, build_study

from kvdiverge.tables import (
    HIDDEN,
    MAX_LATEX_COLUMNS,
    SHARE_NOTE,
    StudyTableError,
    covers_zero,
    decimals_for,
    estimands_summary,
    format_value,
    latex_escape,
    read_estimands,
    read_prediction,
    render_html,
    render_latex,
    render_markdown,
    table1_timing,
    table2_decomposition,
    table3_strata,
    table4_uncalibrated,
    tidy_estimands,
    write_estimands_summary,
    write_study_tables,
)

COMPARED = [a for a in LAMBDAS if a != CONTROL]
MAIN = f"{PAIR[0]} - {PAIR[1]}"
NUMBER = r"-?\d+(?:\.\d+)?"
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


def _decimals(cell: str) -> int:
    number = re.match(NUMBER, cell).group()
    return len(number.partition(".")[2])


def _check_cell(cell: str, row: dict, scale: float = 100.0) -> None:
    """The rendered cell shows value [lo, hi] of the CSV row ×scale, rounded to the cell's
    decimals (the same for all three numbers)."""
    m = CELL.match(cell)
    assert m, cell
    shown = [float(g) for g in m.groups() if g is not None]
    expected = [row["value"], row["ci_low"], row["ci_high"]][: len(shown)]
    digits = _decimals(cell)
    assert all(len(g.partition(".")[2]) == digits for g in m.groups() if g is not None), cell
    np.testing.assert_allclose(shown, np.array(expected) * scale, atol=0.5 * 10**-digits + 1e-9)
    assert len(shown) == 3


def _check_share(cell: str, row: dict, total: dict) -> None:
    """A share cell: hidden ("—") exactly where the interval of ΔR_SMC covers 0."""
    if total["ci_low"] <= 0 <= total["ci_high"]:
        assert cell == HIDDEN
    else:
        _check_cell(cell, row)


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
        total = _row(est, model=record["model"], contrast=record["contrast"], estimand="R_smc")
        for k, name in enumerate(names):
            src = _row(est, model=record["model"], contrast=record["contrast"], estimand=name)
            assert record[name] == src["value"]
            if name.endswith("_share"):
                _check_share(rendered[2 + k], src, total)
            else:
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
        total = _row(est, model=m, contrast=MAIN, stratum=s, estimand="R_smc")
        assert rendered[2] == str(total["n_docs"]) == str(record["n_docs"])  # its documents
        for k, name in enumerate(
            ["R_smc", "gap_exposure", "exposure_share", "block_tv_change", "R_minus_F"]
        ):
            src = _row(est, model=m, contrast=MAIN, stratum=s, estimand=name)
            assert record[name] == src["value"]
            if name == "exposure_share":
                _check_share(rendered[3 + k], src, total)
            else:
                _check_cell(rendered[3 + k], src)
        for k, action in enumerate(PAIR):
            src = _row(est, model=m, action=action, stratum=s, estimand="branch_contrast_B")
            _check_cell(rendered[8 + k], src)
    assert table.header[2] == "Documents"
    assert any(
        n.startswith("Documents: the evaluation documents each row rests on") for n in table.notes
    )


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


def test_latex_is_booktabs_balanced_and_fits_a_page(study):
    _, _, est, pred = study
    for table in (
        table1_timing(est, COMPARED),
        table2_decomposition(est),
        table3_strata(est, MAIN),
        table4_uncalibrated(est, pred, MAIN),
    ):
        tex = render_latex(table)
        assert _unescaped(tex, "{") == _unescaped(tex, "}")
        begins = re.findall(r"\\begin\{(\w+\*?)\}", tex)
        n_values = len(table.header) - table.key_columns
        panels = -(-n_values // MAX_LATEX_COLUMNS)
        assert begins == ["table*"] + ["tabular"] * panels
        assert tex.rstrip().endswith(r"\end{table*}")
        assert tex.count(r"\toprule") == tex.count(r"\bottomrule") == panels
        shown = 0
        aligns = [
            re.sub(r"p\{[^}]*\}", "l", a)
            for a in re.findall(r"\\begin\{tabular\}\{((?:[lr]|p\{[^}]*\})+)\}", tex)
        ]
        assert len(aligns) == panels
        for align in aligns:
            keys = align.count("l")
            assert keys == table.key_columns - table.group_columns  # a model is a heading row
            assert 1 <= align.count("r") <= MAX_LATEX_COLUMNS
            shown += align.count("r")
        assert shown == n_values
        for line in tex.splitlines():
            if line.endswith(r" \\") and not line.startswith(r"\multicolumn"):
                assert _unescaped(line, "&") in {len(a) - 1 for a in aligns}, line
                assert _unescaped(line, "$") % 2 == 0, line
        assert "%" not in tex.replace(r"\%", "")  # every percent sign escaped
        body = tex.split(r"\midrule", 1)[1]
        assert not re.search(r"(?<![\w$])-\d", body)  # numbers carry a true minus
    table1 = render_latex(table1_timing(est, COMPARED))
    assert "(a) Action" in table1 and "(b) Action" in table1  # 9 value columns: 5 + 4
    assert r"\multicolumn{6}{@{}l}{\textit{tiny-llama}}" in table1
    assert "$-$" in render_latex(table2_decomposition(est))  # snapkv-half − recent-half < 0
    assert r"\begin{tabular}{p{5cm}rr}" in render_latex(table4_uncalibrated(est, pred, MAIN))


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
        f"table{i}": tuple(folder / f"table{i}.{e}" for e in ("csv", "md", "tex", "html"))
        for i in range(1, 5)
    }


def test_write_study_tables_writes_every_rendering(study, tmp_path):
    est_path, pred_path, est, _ = study
    outputs = _outputs(tmp_path)
    built = write_study_tables(est_path, pred_path, outputs, COMPARED, MAIN)
    for name, paths in outputs.items():
        csv, md, tex, html = paths
        assert pl.read_csv(csv).equals(built[name].data)
        assert md.read_text() == render_markdown(built[name])
        assert tex.read_text() == render_latex(built[name])
        assert html.read_text() == render_html(built[name])
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


# ---- precision, signs and hidden shares -------------------------------------------------------


def test_decimals_follow_the_interval_width():
    assert decimals_for([0.032], "pp") == 1  # ±3.2 points: one decimal
    assert decimals_for([0.087], "pp") == 0  # ±8.7 points (18 documents, say): none
    assert decimals_for([0.12, 0.15], "percent") == 0  # ±12 points: none
    assert decimals_for([0.0021], "pp") == 2  # ±0.21 points: two
    assert decimals_for([0.004], "pp") == 1  # ±0.4 points: one
    assert decimals_for([2.5], "steps") == 1
    assert decimals_for([None, float("nan"), 0.0], "pp") == 1  # no width: the default
    assert decimals_for([1e-9], "pp") == 3  # at most three


def test_no_negative_zero_anywhere(study):
    _, _, est, pred = study
    assert format_value(-0.00001, "pp", 2) == "0.00"
    assert format_value(-0.004, "pp", 0) == "0"
    assert format_value(-0.006, "pp", 0) == "-1"
    for table in (
        table1_timing(est, COMPARED),
        table2_decomposition(est),
        table3_strata(est, MAIN),
        table4_uncalibrated(est, pred, MAIN),
    ):
        for row in table.rows:
            for cell in row:
                assert not re.search(r"(?<![\w.])-0(?:\.0+)?(?![\d.])", cell), cell


def _covering(est: pl.DataFrame) -> pl.DataFrame:
    """``est`` with every contrast's ΔR_SMC interval widened to cover 0."""
    is_total = (pl.col("contrast") != "") & (pl.col("estimand") == "R_smc")
    return est.with_columns(
        ci_low=pl.when(is_total).then(-0.5).otherwise(pl.col("ci_low")),
        ci_high=pl.when(is_total).then(0.5).otherwise(pl.col("ci_high")),
    )


def test_shares_are_hidden_where_the_gap_interval_covers_zero(study):
    _, _, est, _ = study
    shown = table2_decomposition(est)
    assert shown.data["share_shown"].all() and not shown.notes
    table = table2_decomposition(_covering(est))
    assert not table.data["share_shown"].any()
    assert all(row[-3:] == [HIDDEN] * 3 for row in table.rows)
    assert table.notes == (SHARE_NOTE,)
    # the CSV keeps the values; every rendering marks and explains them
    assert table.data["exposure_share"].equals(shown.data["exposure_share"])
    assert SHARE_NOTE in render_markdown(table)
    assert "---" in render_latex(table) and "share not shown" in render_latex(table)
    assert SHARE_NOTE.split(":")[1].strip()[:20] in render_html(table)
    t3 = table3_strata(_covering(est), MAIN)
    assert {row[5] for row in t3.rows} == {HIDDEN}


# ---- HTML --------------------------------------------------------------------------------------


class _Cells(HTMLParser):
    """The cells of an HTML table: header cells, group rows and body rows (text only)."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.rows, self.groups, self.captions = [], [], [], 0
        self._row, self._cell, self._in_head, self._group = None, None, False, False
        self.stack = []

    def handle_starttag(self, tag, attrs):
        self.stack.append(tag)
        if tag == "caption":
            self.captions += 1
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr":
            self._row, self._group = [], ("class", "group") in attrs
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        assert self.stack.pop() == tag, tag  # well nested
        if tag == "thead":
            self._in_head = False
        elif tag in ("td", "th"):
            self._row.append(self._cell.strip())
            self._cell = None
        elif tag == "tr":
            target = self.head if self._in_head else self.groups if self._group else self.rows
            target.append(self._row)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def test_html_is_a_page_with_the_table(study):
    _, _, est, pred = study
    for table in (table1_timing(est, COMPARED), table4_uncalibrated(est, pred, MAIN)):
        page = render_html(table)
        assert page.startswith("<!DOCTYPE html>") and "<style>" in page
        assert "<script" not in page
        parser = _Cells()
        parser.feed(page.split("<body>", 1)[1].split("</body>", 1)[0])
        assert parser.captions == 1 and not parser.stack
        columns = len(table.header) - table.group_columns
        assert len(parser.head) == 1 and len(parser.head[0]) == columns
        assert len(parser.rows) == len(table.rows)
        assert all(len(r) == columns for r in parser.rows)
        if table.group_columns:
            assert [g[0] for g in parser.groups] == ["tiny-llama", "tiny-qwen"]
        # a value and its interval, both shown
        first = table.rows[0][table.key_columns]
        assert parser.rows[0][1].replace(" ", "").replace("−", "-") == str(first).replace(" ", "")


# ---- the estimands: tidy copy and summary --------------------------------------------------------


def test_tidy_estimands_keep_every_row_typed(study):
    _, _, est, _ = study
    tidy = tidy_estimands(est)
    assert tidy.height == est.height
    assert set(tidy["kind"]) == {"action", "contrast"}
    assert (
        tidy.filter(pl.col("kind") == "action")["contrast"].null_count()
        == tidy.filter(pl.col("kind") == "action").height
    )
    cdf = tidy.filter(pl.col("estimand") == "div_cdf")
    assert cdf["index"].dtype == pl.Int64 and cdf["index"].min() == 1
    blocks = tidy.filter(pl.col("estimand") == "block_tv")
    assert blocks["index"].null_count() == blocks.height and ":" in blocks["at"][0]
    assert tidy.filter(pl.col("at").is_null())["estimand"].is_in(["R_smc"]).any()
    assert "draws_dropped" in tidy.columns


def test_estimands_summary_is_short_and_complete(study, tmp_path):
    est_path, _, est, _ = study
    files = [tmp_path / n for n in ("estimands.parquet", "summary.md", "summary.html")]
    summary = write_estimands_summary(est_path, *files, study="study1")
    assert pl.read_parquet(files[0]).equals(tidy_estimands(est))
    text = files[1].read_text()
    assert len(text.splitlines()) < 150 < est.height
    assert text.startswith("# Estimands of study1")
    assert "## Pooled estimates per action" in text and "## Pooled contrasts" in text
    scalars = {n for n in est["estimand"].unique().to_list() if "@" not in n}
    assert scalars <= {name for name, _ in summary.glossary}
    assert all(meaning for _, meaning in summary.glossary)  # every name explained
    assert f"{est.height:,} rows" in summary.facts[0]
    page = files[2].read_text()
    parser = _Cells()
    parser.feed(page.split("<body>", 1)[1].split("</body>", 1)[0])
    assert not parser.stack and len(parser.rows) > 20
    assert estimands_summary(est).title == "Estimands"


def _ending_at(est: pl.DataFrame, low: float, high: float) -> pl.DataFrame:
    """``est`` with every contrast's ΔR_SMC interval set to [low, high]."""
    is_total = (pl.col("contrast") != "") & (pl.col("estimand") == "R_smc")
    return est.with_columns(
        ci_low=pl.when(is_total).then(low).otherwise(pl.col("ci_low")),
        ci_high=pl.when(is_total).then(high).otherwise(pl.col("ci_high")),
    )


def test_an_interval_end_at_the_rounding_of_zero_covers_zero(study):
    # a bootstrap end of -1.1e-16 is floating-point rounding of 0: the shares stay hidden,
    # while an end a millionth below 0 excludes it
    _, _, est, _ = study
    rounded = table2_decomposition(_ending_at(est, -0.05, -1.1e-16))
    assert not rounded.data["share_shown"].any()
    assert rounded.notes == (SHARE_NOTE,)
    clear = table2_decomposition(_ending_at(est, -0.05, -1e-6))
    assert clear.data["share_shown"].all()
    assert covers_zero(1.1e-16, 0.05) and not covers_zero(1e-6, 0.05)
    assert not covers_zero(float("nan"), 0.05)
