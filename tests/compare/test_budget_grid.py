"""Paired budget grids in ``kvdiverge compare --budgets``: the baseline is swept with every
method, each contrast is at equal budget (equal kept entries and KV-cache bytes), the sweep
figure draws the baseline at every budget, and one table holds the contrasts per budget."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
import pytest

from kvdiverge.compare import CompareError, compare
from kvdiverge.compare.sweep import kv_bytes_per_entry, plot_sweep, render_budget_contrasts
from kvdiverge.plots.sweep import dodge

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
PROMPTS = [
    {
        "id": f"owl-{i}",
        "prompt": f"The owl named Pim{i} keeps the number {40 + i} under its wing, says the old "
        f"book of owls, which is kept in the library of the town. Which number does Pim{i} keep?",
        "answers": [str(40 + i)],
    }
    for i in range(3)
]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    root = tmp_path_factory.mktemp("grid")
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    out = root / "out"
    result = compare(
        MODEL, prompts, "mine=recent@0.5", baseline="snap=snapkv@0.5+window=4",
        budgets="0.25,0.75", K=2, H=6, draws=30, out=out, quiet=True,
    )  # fmt: skip
    return result, out


def test_every_contrast_is_at_the_baselines_own_budget(grid):
    result, out = grid
    pairs = result.contrasts.select("action", "baseline").unique(maintain_order=True).rows()
    assert pairs == [("mine@0.25", "snap@0.25"), ("mine@0.75", "snap@0.75")]
    table = pl.read_csv(out / "budget_contrasts.csv")
    assert table.select("method", "budget").unique(maintain_order=True).rows() == [
        ("mine", 0.25),
        ("mine", 0.75),
    ]
    # each cell is the estimands table's own contrast row, exactly
    est = result.estimands.filter(pl.col("stratum") == "pooled")
    for r in table.filter(pl.col("estimand") != "accuracy").iter_rows(named=True):
        own = est.filter(
            (pl.col("contrast") == f"{r['action']} - {r['baseline']}")
            & (pl.col("estimand") == r["estimand"])
        )
        assert own.select("value", "ci_low", "ci_high").row(0) == pytest.approx(
            (r["value"], r["ci_low"], r["ci_high"]), nan_ok=True
        )
    # equal budget: both sides keep the same entries, hence the same KV-cache bytes
    assert table["kept_entries"].to_list() == table["baseline_kept_entries"].to_list()
    assert table["kv_bytes"].to_list() == table["baseline_kv_bytes"].to_list()
    n = result.documents["n_tokens"].to_numpy()
    quarter = np.mean([max(1, int(np.floor(0.25 * k))) for k in n])
    at_quarter = table.filter(pl.col("budget") == 0.25)["kept_entries"][0]
    assert at_quarter == pytest.approx(quarter, abs=1.0)  # exact-integer budgets of each prompt
    text = (out / "budget_contrasts.md").read_text()
    assert "| mine | 25% | snap@0.25 |" in text and "-0.0" not in text


def test_the_sweep_figure_draws_the_baseline_at_every_budget(grid):
    result, _ = grid
    swept = result.budget_sweep
    assert set(swept["method"]) == {"mine", "snap"}
    fig = plot_sweep(swept, result.estimands, "snap", baseline_method="snap")
    try:
        for ax in fig.axes:
            lines = {line.get_gid(): line for line in ax.lines if line.get_gid()}
            assert {"method:mine", "method:snap"} <= set(lines)
            x = np.array([25, 75]) + dodge(0, 2, 50)  # the baseline's line first, dodged
            np.testing.assert_allclose(lines["method:snap"].get_xdata(), x)
            assert "baseline" not in lines  # no flat line: the baseline is a swept line
        legend = [t.get_text() for t in fig.legends[0].get_texts()]
        assert legend == ["snap (baseline)", "mine"]
    finally:
        plt.close(fig)


def test_kv_bytes_per_entry_from_the_model_config():
    class Config:
        num_hidden_layers, num_attention_heads, num_key_value_heads = 30, 9, 3
        hidden_size = 576

    assert kv_bytes_per_entry(Config(), 4) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_entry(object(), 4) is None


def test_an_empty_grid_says_so():
    empty = pl.DataFrame(schema={"ci_level": pl.Float64, "budget": pl.Float64})
    assert render_budget_contrasts(empty) == "No swept action has a baseline at its budget.\n"


def test_a_token_budget_above_a_prompt_is_refused_before_the_model_loads(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS[:1]))
    with pytest.raises(CompareError) as err:
        compare(MODEL, prompts, "recent@8", budgets="8,100000", K=1, H=4, quiet=True)
    message = str(err.value)
    assert message.startswith("--budgets: action 'recent@100000' keeps 100000 tokens, more than ")
    assert "prompt 'owl-0' (line 1) holds" in message and "\n" not in message
    with pytest.raises(CompareError) as err:
        compare(MODEL, prompts, "recent@100000", K=1, H=4, quiet=True)
    assert str(err.value).startswith("--actions: action 'recent@100000' keeps 100000 tokens")


def test_a_bad_prompts_file_is_refused_before_torch_is_imported(tmp_path):
    """The JSONL is read and checked before the model's checks import torch and transformers."""
    import subprocess
    import sys

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[0]) + "\n" + '{"prompt": "x", "answers": ["y"]\n')
    code = (
        "import sys\n"
        "from kvdiverge.compare import CompareError, compare\n"
        "try:\n"
        f"    compare({str(MODEL)!r}, {str(bad)!r}, 'snapkv@0.5', quiet=True)\n"
        "except CompareError as exc:\n"
        "    print(exc)\n"
        "print('torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    message, imported = done.stdout.strip().splitlines()
    assert message.startswith(f"{bad}, line 2") and imported == "False False"


def test_a_prompt_too_short_for_the_window_gets_the_fix(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "s", "prompt": "Hi?", "answers": ["x"]}) + "\n")
    with pytest.raises(CompareError) as err:
        compare(MODEL, prompts, "snapkv@0.5", K=1, H=4, quiet=True)
    message = str(err.value)
    assert "too short for the 64-token observation window" in message
    fix = message.rsplit("e.g. ", 1)[1]
    assert fix.startswith("snapkv@0.5+window=")
    compare(MODEL, prompts, fix, K=1, H=4, draws=5, quiet=True)  # the suggestion runs


def _swept_config():
    import yaml

    from kvdiverge.config import check_config

    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["actions"]["snapkv"] = {"selector": "snapkv", "budgets": [0.25, 0.5]}
    config["actions"]["recent"] = {"selector": "recent", "budgets": [0.25, 0.5]}
    study = config["studies"]["study1"]
    study.update(actions=["snapkv", "recent", "snapkv-512", "full"], baseline="snapkv@0.5")
    config["analysis"]["contrasts"]["study1"] = [["recent@0.5", "snapkv@0.5"]]
    config["analysis"]["prediction"]["pairs"].pop("study1", None)
    config["figures"]["main_contrast"].pop("study1", None)
    check_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    return config


def test_a_config_with_a_swept_baseline_pairs_every_budget():
    from kvdiverge.config.baselines import baseline_contrasts, baseline_pairs

    config = _swept_config()
    assert baseline_pairs(config, "study1") == {
        "recent@0.25": "snapkv@0.25",
        "recent@0.5": "snapkv@0.5",
        "snapkv-512": "snapkv@0.5",  # outside the sweep: the baseline as named
    }
    assert ["recent@0.25", "snapkv@0.25"] in baseline_contrasts(config, "study1")
    # a baseline outside any sweep: every compared action against it
    default = _swept_config()
    default["studies"]["study1"]["baseline"] = "snapkv-512"
    assert set(baseline_pairs(default, "study1").values()) == {"snapkv-512"}
