"""Renderings of a study table: Markdown (one wide table), LaTeX (a booktabs ``table*`` whose
wide tables are split into stacked panels) and a self-contained HTML page for the report; and
the writer of all formats."""

from __future__ import annotations

import math
import os
import re
from html import escape

from kvdiverge.io import atomic_path, atomic_write_text
from kvdiverge.tables.study_table import StudyTable


def _grouped(table: StudyTable) -> list[list[str]]:
    """Rows with repeated leading group values blanked (the paper's layout)."""
    out, previous = [], None
    for row in table.rows:
        key = tuple(row[: table.group_columns])
        shown = list(row)
        if table.group_columns and key == previous:
            shown[: table.group_columns] = [""] * table.group_columns
        previous = key
        out.append(shown)
    return out


def _groups(table: StudyTable) -> list[tuple[str, list[list[str]]]]:
    """Rows split into their groups (the first column's value), in order; one unnamed group
    for a table without group columns."""
    if not table.group_columns:
        return [("", [list(r) for r in table.rows])]
    out: list[tuple[str, list[list[str]]]] = []
    for row in table.rows:
        if not out or out[-1][0] != row[0]:
            out.append((str(row[0]), []))
        out[-1][1].append(list(row))
    return out


def _title(name: str) -> str:
    """``table3`` → ``Table 3``; ``tableA`` (the accuracy table) → ``Table A``."""
    return re.sub(r"^table(\d+|[A-Z])$", r"Table \1", name)


def render_markdown(table: StudyTable) -> str:
    """A study table as GitHub-flavoured Markdown: its caption as a leading paragraph, its
    notes after the table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    lines = [f"**{_title(table.name)}.** {table.caption}", ""]
    lines.append("| " + " | ".join(cell(h) for h in table.header) + " |")
    n_text = table.group_columns + 1 if table.group_columns else 1
    rule = [":---" if i < n_text else "---:" for i in range(len(table.header))]
    lines.append("|" + "|".join(rule) + "|")
    for row in _grouped(table):
        lines.append("| " + " | ".join(cell(c) for c in row) + " |")
    for note in table.notes:
        lines += ["", f"*Note.* {note}"]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}
_LATEX_TOKENS = {
    "E[τ | τ ≤ H]": r"$E[\tau \mid \tau \leq H]$",
    "R_SMC": r"$R_{\mathrm{SMC}}$",
    "S_.99": r"$S_{.99}$",
    "C̄_H": r"$\bar{C}_H$",
    "Ē_H": r"$\bar{E}_H$",
    "O_H": r"$O_H$",
    "E_H": r"$E_H$",
    "C_H": r"$C_H$",
    "Π_H": r"$\Pi_H$",
    "τ": r"$\tau$",
    "Π": r"$\Pi$",
    "Δ": r"$\Delta$",
    "≤": r"$\leq$",
    "−": r"$-$",
    "—": "---",
    "–": "--",
    "·": r"$\cdot$",
}
_LATEX_TOKEN_PATTERN = re.compile(
    "|".join(re.escape(t) for t in sorted(_LATEX_TOKENS, key=len, reverse=True))
)


_NEGATIVE = re.compile(r"(?<![\w$])-(?=\d)")  # the sign of a number, not a hyphen in a name

MAX_LATEX_COLUMNS = 5
"""The most value columns of one LaTeX panel: a wider table is split into stacked panels."""


def latex_escape(text: str) -> str:
    """Escape LaTeX specials; typeset the estimand symbols of captions and headers as math."""
    parts, last = [], 0
    for match in _LATEX_TOKEN_PATTERN.finditer(text):
        parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last : match.start()]))
        parts.append(_LATEX_TOKENS[match.group()])
        last = match.end()
    parts.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in text[last:]))
    return "".join(parts)


def _latex_number(text: str) -> str:
    return _NEGATIVE.sub("$-$", latex_escape(text))


def latex_panels(n_values: int, most: int = MAX_LATEX_COLUMNS) -> list[range]:
    """Split ``n_values`` value columns into the fewest panels of at most ``most`` columns,
    as even as possible (9 → 5 + 4, 7 → 4 + 3)."""
    count = max(1, math.ceil(n_values / most))
    size, extra = divmod(n_values, count)
    panels, start = [], 0
    for k in range(count):
        stop = start + size + (1 if k < extra else 0)
        panels.append(range(start, stop))
        start = stop
    return panels


LATEX_WRAP_AT = 36
"""Row labels longer than this many characters wrap in a column of :data:`LATEX_WRAP_WIDTH`."""
LATEX_WRAP_WIDTH = "5cm"


def _latex_key_spec(table: StudyTable, k: int) -> str:
    """``l`` for a label column, or a wrapping ``p{…}`` where its labels are long."""
    longest = max((len(str(row[k])) for row in table.rows), default=0)
    return f"p{{{LATEX_WRAP_WIDTH}}}" if longest > LATEX_WRAP_AT else "l"


def render_latex(
    table: StudyTable, label: str | None = None, max_columns: int = MAX_LATEX_COLUMNS
) -> str:
    """A study table as a booktabs ``table*`` (``\\toprule``, ``\\midrule``, ``\\bottomrule``;
    needs ``\\usepackage{booktabs}``) that fits the text width.

    Each value sits over its interval (a second, smaller line), so that columns stay narrow;
    long row labels wrap (:data:`LATEX_WRAP_AT`); a table with more than ``max_columns`` value
    columns is split into stacked panels (a), (b),
    … that repeat the row labels; a group (a model) is a heading row instead of a column;
    interval levels go under the column labels; numbers carry a true minus sign; the notes
    follow the panels.
    """
    columns = table.described_columns()
    n_keys, n_groups = table.key_columns, table.group_columns
    values = list(range(n_keys, len(columns)))
    panels = latex_panels(len(values), max_columns)
    lines = [
        r"\begin{table*}[t]",
        r"\centering",
        r"\small",
        r"\setlength{\tabcolsep}{4pt}",
        rf"\caption{{{latex_escape(table.caption)}}}",
        rf"\label{{{label or 'tab:' + table.name}}}",
    ]
    for p, panel in enumerate(panels):
        shown = [values[i] for i in panel]
        keys = list(range(n_groups, n_keys))
        width = len(keys) + len(shown)
        if p:
            lines.append(r"\medskip")
        spec = "".join(_latex_key_spec(table, k) for k in keys) + "r" * len(shown)
        lines += [rf"\begin{{tabular}}{{{spec}}}", r"\toprule"]
        titles = [latex_escape(columns[k].title) for k in keys + shown]
        if len(panels) > 1:
            titles[0] = f"({chr(ord('a') + p)}) {titles[0]}"
        lines.append(" & ".join(titles) + r" \\")
        levels = [columns[k].level for k in shown]
        if any(levels):
            cells = [""] * len(keys) + [
                rf"{{\footnotesize {latex_escape(v)}}}" if v else "" for v in levels
            ]
            lines.append(" & ".join(cells) + r" \\")
        lines.append(r"\midrule")
        for g, (group, rows) in enumerate(_groups(table)):
            if group:
                if g:
                    lines.append(r"\addlinespace")
                lines.append(
                    rf"\multicolumn{{{width}}}{{@{{}}l}}{{\textit{{{latex_escape(group)}}}}} \\"
                )
            for row in rows:
                cells = [latex_escape(str(row[k])) for k in keys]
                cells += [_latex_number(getattr(row[k], "value", str(row[k]))) for k in shown]
                lines.append(" & ".join(cells) + r" \\")
                intervals = [getattr(row[k], "interval", "") for k in shown]
                if any(intervals):
                    cells = [""] * len(keys) + [
                        rf"{{\footnotesize {_latex_number(v)}}}" if v else "" for v in intervals
                    ]
                    lines.append(" & ".join(cells) + r" \\")
        lines += [r"\bottomrule", r"\end{tabular}"]
    for note in table.notes:
        lines.append(rf"\par\smallskip{{\footnotesize {latex_escape(note)}\par}}")
    lines.append(r"\end{table*}")
    return "\n".join(lines) + "\n"


HTML_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif;
       font-size: 14px; color: #1a1a1a; margin: 16px; }
h1 { font-size: 18px; } h2 { font-size: 15px; margin-top: 20px; }
table.study { border-collapse: collapse; border-top: 2px solid #333;
              border-bottom: 2px solid #333; font-variant-numeric: tabular-nums;
              margin: 8px 0 4px; }
table.study caption { caption-side: top; text-align: left; max-width: 75em;
                      line-height: 1.45; padding-bottom: 8px; }
table.study th, table.study td { padding: 3px 10px; vertical-align: top; }
table.study thead th { border-bottom: 1px solid #333; text-align: right; font-weight: 600; }
table.study th.key, table.study td.key { text-align: left; }
table.study td.num { text-align: right; white-space: nowrap; }
table.study td.key { white-space: nowrap; }
table.study .ci, table.study .level { display: block; color: #666; font-size: 12px;
                                       font-weight: normal; }
table.study tr.group td { font-style: italic; font-weight: 600; padding-top: 9px;
                          border-top: 1px solid #ccc; }
table.study tr.group:first-child td { border-top: none; }
p.note { font-size: 12px; color: #444; max-width: 75em; }
"""


_HTML_TOKENS = {
    "R_SMC": "R<sub>SMC</sub>",
    "S_.99": "S<sub>.99</sub>",
    "C̄_H": "C̄<sub>H</sub>",
    "Ē_H": "Ē<sub>H</sub>",
    "O_H": "O<sub>H</sub>",
    "E_H": "E<sub>H</sub>",
    "C_H": "C<sub>H</sub>",
    "Π_H": "Π<sub>H</sub>",
}
_HTML_TOKEN_PATTERN = re.compile("|".join(re.escape(t) for t in _HTML_TOKENS))


def html_text(text: str) -> str:
    """Escaped, with the estimand symbols' subscripts set as subscripts."""
    return _HTML_TOKEN_PATTERN.sub(lambda m: _HTML_TOKENS[m.group()], escape(text))


def _html_number(text: str) -> str:
    """Escaped, with a true minus sign on negative numbers."""
    return _NEGATIVE.sub("\N{MINUS SIGN}", escape(text))


def html_table(table: StudyTable, caption: bool = True) -> str:
    """The ``<table>`` element of a study table (and its notes)."""
    columns = table.described_columns()
    n_keys, n_groups = table.key_columns, table.group_columns
    keys = list(range(n_groups, n_keys))
    shown = list(range(n_keys, len(columns)))
    out = ['<table class="study">']
    if caption:
        out.append(
            f"<caption><b>{escape(_title(table.name))}.</b> {html_text(table.caption)}</caption>"
        )
    out.append("<thead><tr>")
    for k in keys:
        out.append(f'<th class="key">{html_text(columns[k].title)}</th>')
    for k in shown:
        level = columns[k].level
        extra = f'<span class="level">{escape(level)}</span>' if level else ""
        out.append(f"<th>{html_text(columns[k].title)}{extra}</th>")
    out.append("</tr></thead><tbody>")
    for group, rows in _groups(table):
        if group:
            span = len(keys) + len(shown)
            out.append(f'<tr class="group"><td colspan="{span}">{escape(group)}</td></tr>')
        for row in rows:
            out.append("<tr>")
            out += [f'<td class="key">{html_text(str(row[k]))}</td>' for k in keys]
            for k in shown:
                cell = row[k]
                value = _html_number(getattr(cell, "value", str(cell)))
                interval = getattr(cell, "interval", "")
                extra = f'<span class="ci">{_html_number(interval)}</span>' if interval else ""
                out.append(f'<td class="num">{value}{extra}</td>')
            out.append("</tr>")
    out.append("</tbody></table>")
    out += [f'<p class="note">{html_text(note)}</p>' for note in table.notes]
    return "\n".join(out)


def html_document(title: str, body: str) -> str:
    """A self-contained HTML page (inline style, no scripts) around ``body``."""
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>\n'
        f"<style>{HTML_STYLE}</style></head>\n<body>\n{body}\n</body></html>\n"
    )


def render_html(table: StudyTable) -> str:
    """A study table as a self-contained HTML page (the report shows it inline): caption,
    the model groups as heading rows, each interval on a line under its value, notes."""
    return html_document(_title(table.name), html_table(table))


def write_table(
    table: StudyTable,
    csv: str | os.PathLike,
    markdown: str | os.PathLike,
    latex: str | os.PathLike,
    html: str | os.PathLike | None = None,
) -> None:
    """Write a study table: CSV (fractions), Markdown, LaTeX and, given a path, HTML, each
    atomically."""
    with atomic_path(csv, suffix=".csv") as tmp:
        table.data.write_csv(tmp)
    atomic_write_text(markdown, render_markdown(table))
    atomic_write_text(latex, render_latex(table))
    if html is not None:
        atomic_write_text(html, render_html(table))
