"""The committed essay haystack (data/fixtures/essays, real public-domain prose) and RULER's
de-duplicated word lists (`docs/datasets.md`, "RULER")."""

from __future__ import annotations

import importlib.resources
import importlib.util
import re
from collections import Counter
from pathlib import Path

import pytest
import yaml

from kvdiverge.datasets import ruler as R
from kvdiverge.datasets.fixtures import SYNTHETIC_FOLDERS
from kvdiverge.datasets.text import is_synthetic

ROOT = Path(__file__).resolve().parents[2]
ESSAYS = ROOT / "data" / "fixtures" / "essays"
COMMITTED = ESSAYS / "macdowell-critical-and-historical-essays.txt"


def _script():
    path = ROOT / "workflow" / "scripts" / "write_essays.py"
    spec = importlib.util.spec_from_file_location("write_essays", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


W = _script()


@pytest.mark.skipif(not W.SOURCE.is_file(), reason=f"shared essay source absent: {W.SOURCE}")
def test_committed_essays_are_the_scripts_output_on_the_shared_source():
    source = W.SOURCE.read_text(encoding="utf-8")
    assert "TRANSCRIBER'S NOTES" in source and "[Illustration]" in source  # what is removed
    assert COMMITTED.read_text(encoding="utf-8") == W.clean(source)


def test_no_transcribers_note_or_musical_example_remains():
    text = COMMITTED.read_text(encoding="utf-8")
    for marker in ("[Illustration", "[illustration", "[Figure", "TRANSCRIBER", "[G:", "[W:"):
        assert marker not in text, marker
    assert "Transcriber" not in text and "transcriber" not in text
    spans = re.findall(r"\[[^\]]*\]", text)
    assert spans and all(re.fullmatch(r"\[\d\d\]", s) for s in spans)  # footnote markers only
    assert "]" not in re.sub(r"\[\d\d\]", "", text) and "[" not in re.sub(r"\[\d\d\]", "", text)
    assert text.startswith("PREFACE\n") and text.endswith("\n") and not text.endswith("\n\n")
    assert "\nINDEX\n" not in text and "\nCONTENTS\n" not in text
    assert "Darwin's theory that music had its origin" in text  # lecture I is there


def test_cleaning_rules_on_a_small_example():
    source = "\n".join(
        [
            "TRANSCRIBER'S NOTES",
            "[G:] = Treble clef",
            "CRITICAL AND HISTORICAL ESSAYS",  # the title page
            "PREFACE",
            "Some words.[01] Then A and B[flat], or [natural], in [3/4] time [Figure 01].",
            "viz.: [2 4] = [- '] or ([- -]), the trochee",
            "    [G: c' d'",
            "        e' f']",
            "[W: one [Gamma] two], end.",
            "",
            "CONTENTS",
            " I. ONE  1",
            "CRITICAL AND HISTORICAL ESSAYS",
            "Last line.",
            "INDEX",
            "  Wagner, 14.",
        ]
    )
    assert W.clean(source) == (
        "PREFACE\n"
        "Some words.[01] Then A and B-flat, or natural, in 3/4 time.\n"
        "viz.: or, the trochee,\n"  # the "," that opened the emptied line
        "end.\n"
        "\n"
        "CRITICAL AND HISTORICAL ESSAYS\n"
        "Last line.\n"
    )
    with pytest.raises(ValueError, match="unmatched"):
        W.clean("PREFACE\n[open\nCONTENTS\nCRITICAL AND HISTORICAL ESSAYS\nINDEX\n")


def test_essay_folder_is_real_prose_read_as_ruler_reads_it():
    assert sorted(p.name for p in ESSAYS.glob("*.txt")) == [COMMITTED.name]
    haystack = R.load_essays(ESSAYS)
    assert not is_synthetic(ESSAYS) and "(synthetic)" not in haystack.source
    text = COMMITTED.read_text(encoding="utf-8")
    assert haystack.words == tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    assert len(haystack.words) > 60_000  # RULER's 32K haystack takes about 25K words
    for folder in SYNTHETIC_FOLDERS:  # the other fixtures still say they are synthetic
        assert is_synthetic(ROOT / "data" / "fixtures" / folder)


@pytest.mark.parametrize("config", ["config.yaml", "configs/cpu-study.yaml"])
def test_default_and_cpu_configs_read_the_real_prose(config):
    ruler = yaml.safe_load((ROOT / config).read_text())["datasets"]["ruler"]
    assert ROOT / ruler["essay_dir"] == ESSAYS


@pytest.mark.parametrize(
    "kind,asset", [("nouns", "nounlist"), ("adjectives", "adjectivelist"), ("verbs", "verblist")]
)
def test_word_lists_are_deduplicated_as_ruler_does(kind, asset):
    words = R.wonderwords_lists()[kind]
    text = (importlib.resources.files("wonderwords") / "assets" / f"{asset}.txt").read_text()
    lines = [w.rstrip() for w in text.splitlines()]  # wonderwords' own reading
    assert len(words) == len(set(words)) == len(set(lines)) and words == sorted(words)
    if kind == "adjectives":
        assert len(lines) == 912 and len(words) == 910
        assert {w for w, c in Counter(lines).items() if c > 1} == {"wet", "nasty"}


def test_adjective_noun_pairs_are_distinct_strings():
    """RULER draws uniformly from sorted(set(adj-noun pairs)); drawing the adjective and the
    noun uniformly gives the same law only if no two pairs join to the same string."""
    lists = R.wonderwords_lists()
    adjectives, nouns = set(lists["adjectives"]), set(lists["nouns"])
    clashes = [
        (a, n)
        for a in adjectives
        for i, c in enumerate(a)
        if c == "-" and a[:i] in adjectives
        for n in nouns
        if n.startswith(a[i + 1 :] + "-") and n[len(a) - i :] in nouns
    ]
    assert clashes == []
