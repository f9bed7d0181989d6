"""``kvdiverge compare --budgets`` (issue 31, item 5): each method expanded over the budgets, its
estimands against the budget in ``budget_sweep.csv`` and a figure that draws exactly them."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest
from figure_helpers import texts_outside

from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.cli import main
from kvdiverge.compare import CompareError, parse_actions
from kvdiverge.compare.actions import (
    baseline_method,
    contrast_pairs,
    parse_budgets,
    sweep_budgets,
    with_baseline,
)
from kvdiverge.compare.sweep import SWEEP_ESTIMANDS, plot_sweep, sweep_table
from kvdiverge.plots.sweep import dodge

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
EXPECTED = "--budgets: expected comma-separated budgets (fractions in (0, 1] or token counts >= 1)"
NO_SWEEP = "--budgets: no action to sweep (every action keeps everything or is the baseline)"
PROMPT = (
    "The owl named Pim keeps the number 42 under its wing, says the old book of owls. "
    "Which number does Pim keep?"
)


def test_each_method_is_expanded_over_the_budgets():
    actions, base = with_baseline(
        parse_actions("r=recent@0.5+sinks=2,snapkv@0.5+window=8,full"), "s=snapkv@0.5+window=8"
    )
    swept, sweep = sweep_budgets(actions, parse_budgets("0.25,0.5"), base)
    # the baseline is swept too (a paired grid); full keeps everything and stays as it is
    assert [(a.label, a.spec) for a in swept] == [
        ("s@0.25", "snapkv@0.25+window=8"),
        ("s@0.5", "snapkv@0.5+window=8"),
        ("r@0.25", "recent@0.25+sinks=2"),
        ("r@0.5", "recent@0.5+sinks=2"),
        ("snapkv@0.25+window=8", "snapkv@0.25+window=8"),
        ("snapkv@0.5+window=8", "snapkv@0.5+window=8"),
        ("full", "full"),
    ]
    assert swept[2].action.budget == 0.25 and swept[2].action.sinks == 2
    assert sweep["r@0.25"] == ("r", 0.25) and sweep["snapkv@0.5+window=8"] == (
        "snapkv+window=8",
        0.5,
    )
    assert sweep["s@0.5"] == ("s", 0.5) and "full" not in sweep
    tokens, _ = sweep_budgets(actions, parse_budgets("64,128"), base)
    assert [a.action.budget for a in tokens if a.label.startswith("r@")] == [64, 128]


def test_every_action_is_contrasted_with_the_baseline_at_its_own_budget():
    before, base = with_baseline(parse_actions("mine=recent@0.5,full"), "s=snapkv@0.5+window=8")
    swept, sweep = sweep_budgets(before, parse_budgets("0.25,0.75"), base)
    pairs = contrast_pairs(swept, base, sweep, baseline_method(before, base))
    assert pairs == {"mine@0.25": "s@0.25", "mine@0.75": "s@0.75"}
    # a baseline that keeps everything is not swept: every action against it
    before, base = with_baseline(parse_actions("mine=recent@0.5"), "full")
    swept, sweep = sweep_budgets(before, parse_budgets("0.25,0.75"), base)
    pairs = contrast_pairs(swept, base, sweep, baseline_method(before, base))
    assert pairs == {"mine@0.25": "full", "mine@0.75": "full"}


@pytest.mark.parametrize(
    "text,message",
    [
        ("0", f"{EXPECTED}, got 0"),
        ("1.5", f"{EXPECTED}, got 1.5"),
        ("half", f"{EXPECTED}, got 'half'"),
        ("true", f"{EXPECTED}, got 'true'"),
        ("0.5,0.5", "--budgets: budget 0.5 given twice"),
        ("0.5,5e-1", "--budgets: budget 0.5 given twice"),
        ("64,64", "--budgets: budget 64 given twice"),
        (
            "1,1.0",
            "--budgets: 1.0 is a fraction of the prompt and 1 a token count; expected one kind "
            "on one axis (all fractions in (0, 1], or all token counts)",
        ),
        (
            "0.25,512",
            "--budgets: 0.25 is a fraction of the prompt and 512 a token count; expected one "
            "kind on one axis (all fractions in (0, 1], or all token counts)",
        ),
    ],
)
def test_bad_budgets_are_one_line(text, message):
    """Each refused --budgets text is one exact line."""
    with pytest.raises(CompareError) as err:
        parse_budgets(text)
    assert str(err.value) == message


def test_budgets_in_any_float_notation_are_fractions():
    assert parse_budgets("1e-1,2.5E-1,0.5") == [0.1, 0.25, 0.5]
    assert parse_budgets("1") == [1] and isinstance(parse_budgets("1")[0], int)
    assert parse_budgets("1.0") == [1.0] and isinstance(parse_budgets("1.0")[0], float)


@pytest.fixture(scope="module")
def swept_study(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    labels = [f"{m}@{b}" for m in ("mine", "recent") for b in (0.25, 0.5, 0.75)]
    lambdas = {
        a: (0.9 if a.startswith("mine") else 0.6) * (1.0 - float(a.split("@")[1])) for a in labels
    }
    lambdas["snapkv"] = 0.3
    files = write_synthetic_study(
        root,
        "s",
        "tiny",
        {"custom-prompts": stratum_pairs(5, lambdas)},
        {"study1": (8, 2)},
        H=8,
        seed=2,
    )
    actions = ["snapkv", *labels]
    stats, clock = document_stats(
        {a: list(files[a].values()) for a in actions}, list(files["documents"].values())
    )
    table = estimands_table(
        stats, clock, model="tiny", actions=actions, contrasts=[], draws=40, seed=0
    )
    sweep = {a: (a.split("@")[0], float(a.split("@")[1])) for a in labels}
    return table, sweep


def test_the_sweep_table_and_figure_show_the_estimands(swept_study):
    table, sweep = swept_study
    swept = sweep_table(table, sweep)
    assert swept.height == len(sweep) * len(SWEEP_ESTIMANDS)
    assert swept["method"].unique(maintain_order=True).to_list() == ["mine", "recent"]
    for r in swept.iter_rows(named=True):
        own = table.filter(
            (pl.col("action") == r["action"])
            & (pl.col("estimand") == r["estimand"])
            & (pl.col("stratum") == "pooled")
        )
        assert (r["value"], r["ci_low"], r["ci_high"]) == own.select(
            "value", "ci_low", "ci_high"
        ).row(0)
        assert sweep[r["action"]] == (r["method"], r["budget"])
    fig = plot_sweep(swept, table, "snapkv")
    try:
        assert texts_outside(fig) == []
        for ax, (estimand, (_, scale, _)) in zip(fig.axes, SWEEP_ESTIMANDS.items(), strict=True):
            lines = [line for line in ax.lines if (line.get_gid() or "").startswith("method:")]
            assert len(lines) == 2  # one per method
            for j, (line, method) in enumerate(zip(lines, ["mine", "recent"], strict=True)):
                rows = swept.filter(
                    (pl.col("method") == method) & (pl.col("estimand") == estimand)
                ).sort("budget")
                x = np.array([25, 50, 75]) + dodge(j, 2, 50)  # dodged a little along x
                np.testing.assert_allclose(line.get_xdata(), x)
                np.testing.assert_allclose(line.get_ydata(), scale * rows["value"].to_numpy())
            base = table.filter(
                (pl.col("action") == "snapkv")
                & (pl.col("estimand") == estimand)
                & (pl.col("stratum") == "pooled")
            )["value"][0]
            dashed = [line for line in ax.lines if line.get_gid() == "baseline"]
            assert len(dashed) == 1 and dashed[0].get_ydata()[0] == pytest.approx(scale * base)
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["mine", "recent", "baseline snapkv"]
    finally:
        plt.close(fig)


def test_compare_sweeps_the_budgets(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps(
            {
                "id": "q",
                "prompt": PROMPT,
                "answers": ["42"],
            }
        )
        + "\n"
    )
    out = tmp_path / "out"
    argv = [
        "compare",
        "--model",
        str(MODEL),
        "--prompts",
        str(prompts),
        "--actions",
        "recent@0.5",
        "--budgets",
        "0.25,0.75",
        "--K",
        "1",
        "--H",
        "4",
        "--draws",
        "10",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    swept = pl.read_csv(out / "budget_sweep.csv")
    assert swept["action"].unique(maintain_order=True).to_list() == ["recent@0.25", "recent@0.75"]
    assert set(swept["method"]) == {"recent"} and swept.height == 2 * 3
    assert (out / "budget_sweep.png").stat().st_size > 10_000
    assert str(out / "budget_sweep.png") in capsys.readouterr().out.split()
    bad = [
        "compare",
        "--model",
        str(MODEL),
        "--prompts",
        str(prompts),
        "--actions",
        "full",
        "--budgets",
        "0.5",
        "--out",
        str(tmp_path / "o2"),
    ]
    assert main(bad) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"kvdiverge compare: {NO_SWEEP}"
    assert not (tmp_path / "o2").exists()
