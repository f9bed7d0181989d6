"""The summary's sentences on a table of edge cases (kvdiverge.tables.contrasts): an interval
that includes 0 claims no direction, no "-0", a difference that rounds to 0 keeps its digits,
shares outside [0, 100%] are explained, and greedy decoding's identities are stated once."""

from __future__ import annotations

import math

import polars as pl
import pytest

from kvdiverge.tables.contrasts import (
    GREEDY_NOTE,
    action_sentences,
    contrast_sentences,
    decomposition_sentence,
)

NAN = float("nan")


def _rows(**over) -> pl.DataFrame:
    """A contrast table of one action against ``base`` (values as fractions)."""
    rows = {
        "div_prob": (0.25, 0.10, 0.40, 0.75, 0.50),
        "mean_entry_time": (-3.0, -5.0, -1.0, 4.0, 7.0),
        "R_smc": (0.10, 0.05, 0.15, 0.30, 0.20),
        "occurrence_share": (0.2, NAN, NAN, NAN, NAN),
        "exposure_share": (0.5, NAN, NAN, NAN, NAN),
        "rate_share": (0.3, NAN, NAN, NAN, NAN),
        "accuracy": (0.0, 0.0, 0.0, 0.5, 0.5),
    } | over
    return pl.DataFrame(
        [
            {"action": "mine", "baseline": "base", "estimand": e, "value": v, "ci_low": lo,
             "ci_high": hi, "ci_level": 0.95, "action_value": a, "baseline_value": b,
             "n_docs": 12}
            for e, (v, lo, hi, a, b) in rows.items()
        ]
    )  # fmt: skip


CASES = [
    # (estimand row, sentence index, expected text in that sentence, text it must not hold)
    (
        {"div_prob": (0.0, -0.25, 0.25, 0.75, 0.75)},
        0,
        "on 75% of paths, not clearly more or fewer than base (75%): 0 points [-25.0, 25.0], "
        "an interval that includes 0.",
        "points more",
    ),
    (
        {"div_prob": (0.0, 0.0, 0.0, 0.25, 0.25)},
        0,
        "the same as base (25%) (a difference of 0 in every bootstrap resample)",
        "[0, 0]",
    ),
    (
        {"div_prob": (0.333, 0.083, 0.583, 1.0, 0.667)},
        0,
        "33.3 points more than base (67%) [8.3, 58.3].",
        "includes 0",
    ),
    (
        {"div_prob": (-0.125, -0.347, 0.0, 0.375, 0.5)},
        0,
        "not clearly more or fewer than base (50%): -12.5 points [-34.7, 0], an interval that "
        "includes 0",
        "fewer than base (50%) [",
    ),
    (
        {"mean_entry_time": (0.8, -0.7, 2.3, 5.0, 4.2)},
        1,
        "By the mean first divergence step τ of the paths that diverge, mine diverges not "
        "clearly later or earlier than base: +0.8 steps [-0.7, 2.3], an interval that includes 0.",
        "0.8 steps later",
    ),
    (
        {"mean_entry_time": (-5.8, -10.1, -3.1, 3.0, 8.8)},
        1,
        "mine diverges 5.8 steps earlier than base [3.1, 10.1].",
        "-",
    ),
    (
        {"R_smc": (0.00031, 0.0001, 0.0005, 0.26031, 0.26)},
        2,
        "is 0.260, 0.0003 higher than base's (0.260) [0.0001, 0.0005].",
        "0.000 higher",
    ),
    (
        {"R_smc": (-0.0, -0.0, 0.0, 0.26, 0.26)},
        2,
        "the same as base's (0.260) (a difference of 0 in every bootstrap resample)",
        "-0",
    ),
    (
        {"accuracy": (0.0, -0.25, 0.25, 0.5, 0.5)},
        4,
        "is 50%, not clearly higher or lower than base's (50%): 0 points [-25.0, 25.0]",
        "points higher than",
    ),
]


@pytest.mark.parametrize("over,index,expected,absent", CASES)
def test_each_edge_case_reads_as_a_reviewer_would_sign(over, index, expected, absent):
    sentences = action_sentences(_rows(**over), "mine", "base", 32, "substring_match")
    assert expected in sentences[index]
    assert absent not in sentences[index]
    assert all("-0%" not in s and "-0.0 " not in s for s in sentences)


@pytest.mark.parametrize(
    "shares,text,note",
    [
        ((20.0, 50.0, 30.0), "accounts for 20%, exposure (how long after divergence) 50%", False),
        ((-0.4, 100.4, 0.0), "accounts for 0%, exposure (how long after divergence) 100% and "
         "rate (how often tokens differ after divergence) 0%", False),
        ((215.0, -132.0, 17.0), "accounts for 215%, exposure (how long after divergence) -132%",
         True),
    ],
)  # fmt: skip
def test_the_decomposition_never_says_minus_zero_and_explains_shares_beyond_the_whole(
    shares, text, note
):
    sentence = decomposition_sentence(shares)
    assert text in sentence and "-0%" not in sentence
    assert ("opposite signs" in sentence) is note


def test_the_decomposition_is_given_only_when_the_gap_excludes_zero():
    covering = action_sentences(
        _rows(R_smc=(0.05, -0.01, 0.12, 0.3, 0.25)), "mine", "base", 32, "m"
    )
    assert "split into occurrence, exposure and rate is not given" in covering[3]
    clear = action_sentences(_rows(), "mine", "base", 32, "m")
    assert clear[3].startswith(
        "Of that gap, occurrence (paths that diverge at all) accounts for 20%"
    )


def test_greedy_identities_are_stated_once():
    table = pl.concat([_rows(), _rows().with_columns(action=pl.lit("other"))])
    greedy = contrast_sentences(table, 32, "m", 0.0)
    assert greedy.count(GREEDY_NOTE) == 1 and "S_.99 and R then equal R_SMC" in GREEDY_NOTE
    assert GREEDY_NOTE not in contrast_sentences(table, 32, "m", 1.0)


def test_an_undefined_interval_is_said_so():
    out = action_sentences(_rows(div_prob=(0.25, NAN, NAN, 0.5, 0.25)), "mine", "base", 8, "m")
    assert "25.0 points more than base (25%) [interval undefined]" in out[0]
    assert not math.isnan(0.0)
