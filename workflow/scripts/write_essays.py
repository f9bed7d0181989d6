"""Write the committed essay haystack, data/fixtures/essays/, from the public-domain source
(deterministic; `data/fixtures/essays/README.md` and `docs/datasets.md`, "RULER").

Usage: python workflow/scripts/write_essays.py [SOURCE] [OUT]

SOURCE defaults to macdowell-critical-and-historical-essays.txt in the folder data/essays/ of the
project's shared data (a folder "shared" beside the checkout, outside the repository), OUT to
data/fixtures/essays/macdowell-critical-and-historical-essays.txt. The cleaning, :func:`clean`,
keeps the book's prose and drops what is not prose:

1. the transcriber's notes and the title page: every line before the first ``PREFACE`` line;
2. the table of contents: the lines from ``CONTENTS`` up to (not including) the second
   ``CRITICAL AND HISTORICAL ESSAYS`` line, where the first lecture starts;
3. the index: the line ``INDEX`` and everything after it;
4. the transcriber's bracketed renderings of the musical examples and signs (``[Illustration]``,
   ``[Figure 07]``, pitch lists such as ``[G: f' g' c'' d'' f'']``, rhythms, lyrics lines,
   diagrams; nested and multi-line brackets included), each with the whitespace before it,
   except: footnote markers ``[01]``-``[15]`` are kept as they are; the accidentals ``[flat]``,
   ``[sharp]``, ``[#]``, ``[natural]``, ``[double-flat]``, ``[double-sharp]`` become their word
   (joined by a hyphen to a note letter before them: ``B[flat]`` -> ``B-flat``); time signatures
   such as ``[3/4]`` lose their brackets; an ``=`` between two removed spans goes with them;
5. in a line that step 4 changed: parentheses left empty are removed with the whitespace
   before them; a ``,`` or ``;`` right after another ``,``, ``;`` or ``.`` is removed; leading
   whitespace the source line did not have is stripped; a ``,``, ``;`` or ``.`` that now opens
   the line moves to the end of the line before (where that one already ends in punctuation,
   a ``.`` replaces its ``,`` or ``;`` and is otherwise dropped); a line left with no letter or
   digit is dropped.

Lines are right-stripped and the file ends in one newline. Only the standard library is used.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT.parent / "shared" / "data" / "essays" / "macdowell-critical-and-historical-essays.txt"
OUT = ROOT / "data" / "fixtures" / "essays" / "macdowell-critical-and-historical-essays.txt"

TITLE = "CRITICAL AND HISTORICAL ESSAYS"
ACCIDENTALS = {
    "flat": "flat",
    "sharp": "sharp",
    "#": "sharp",
    "natural": "natural",
    "double-flat": "double-flat",
    "double-sharp": "double-sharp",
}
_FOOTNOTE = re.compile(r"\d\d")
_TIME = re.compile(r"\d+/\d+")
_JOINED = re.compile(r"[ \t]*=[ \t]*(?=\[)")
_EMPTY_PARENS = re.compile(r"[ \t]*\([ \t]*\)")
_REPEATED = re.compile(r"([,;.])[ \t]*[,;]")
_LEADING = re.compile(r"[ \t]*([,;.])[ \t]*")


def _line_index(lines: list[str], text: str, start: int = 0) -> int:
    for i in range(start, len(lines)):
        if lines[i].strip() == text:
            return i
    raise ValueError(f"essay source: no line {text!r} after line {start + 1}")


def _body(lines: list[str]) -> list[str]:
    """Steps 1-3: the preface and the lectures (no notes, title page, contents or index)."""
    preface = _line_index(lines, "PREFACE")
    contents = _line_index(lines, "CONTENTS", preface)
    lectures = _line_index(lines, TITLE, contents)
    index = _line_index(lines, "INDEX", lectures)
    return lines[preface:contents] + lines[lectures:index]


def _replacement(inner: str, before: str) -> str | None:
    """What a top-level bracket span becomes (None: removed with the whitespace before it)."""
    if _FOOTNOTE.fullmatch(inner):
        return f"[{inner}]"
    if inner in ACCIDENTALS:
        word = ACCIDENTALS[inner]
        return f"-{word}" if before[-1:].isalpha() else word
    if _TIME.fullmatch(inner):
        return inner
    return None


def _strip_brackets(text: str) -> str:
    """Step 4 over the whole body (brackets may nest and span lines)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "[":
            if text[i] == "]":
                raise ValueError(f"essay source: unmatched ']' at character {i}")
            out.append(text[i])
            i += 1
            continue
        depth, j = 0, i
        while j < len(text):
            depth += {"[": 1, "]": -1}.get(text[j], 0)
            if depth == 0:
                break
            j += 1
        if depth:
            raise ValueError(f"essay source: unmatched '[' at character {i}")
        kept = _replacement(text[i + 1 : j], out[-1] if out else "")
        if kept is None:
            while out and out[-1] in " \t":
                out.pop()
            # a removed span keeps its line breaks, so that step 5 sees the emptied lines
            out.append("\n" * text[i:j].count("\n"))
            joined = _JOINED.match(text, j + 1)  # "[4 8] = [- ']": one example
            i = joined.end() if joined else j + 1
            continue
        out.append(kept)
        i = j + 1
    return "".join(out)


def clean(text: str) -> str:
    """The committed haystack text from the source text (steps 1-5 of the module docstring)."""
    body = "\n".join(_body(text.splitlines()))
    stripped = _strip_brackets(body).split("\n")
    originals = body.split("\n")
    if len(stripped) != len(originals):
        raise AssertionError("bracket removal changed the number of lines")
    kept = []
    for new, old in zip(stripped, originals, strict=True):
        if new != old:
            new = _REPEATED.sub(r"\1", _EMPTY_PARENS.sub("", new))
            if not re.search(r"\w", new):
                continue
            new = new.lstrip() if not old[:1].isspace() else new
            lead = _LEADING.match(new)
            if lead and kept and kept[-1]:
                mark, last = lead.group(1), kept[-1][-1]
                if last not in ",;.:":
                    kept[-1] += mark
                elif mark == "." and last in ",;":  # the sentence still ends here
                    kept[-1] = kept[-1][:-1] + mark
                new = new[lead.end() :]
        kept.append(new.rstrip())
    return "\n".join(kept).strip("\n") + "\n"


def main(argv: list[str]) -> None:
    source = Path(argv[1]) if len(argv) > 1 else SOURCE
    out = Path(argv[2]) if len(argv) > 2 else OUT
    if not source.is_file():
        raise SystemExit(f"essay source: no file {source} (expected the MacDowell essays text)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(clean(source.read_text(encoding="utf-8")), encoding="utf-8")
    print(out)


if __name__ == "__main__":
    main(sys.argv)
