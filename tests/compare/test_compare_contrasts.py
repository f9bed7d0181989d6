"""``kvdiverge compare --baseline``: the contrasts against the baseline agree with an independent
computation from the trajectory files of a small synthetic study (per-path statistics by hand,
documents weighted equally, the paired document bootstrap redone with numpy), and the summary
sentences carry those numbers."""

from __future__ import annotations

import math
import re

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.bootstrap import stratified_bootstrap_weights
from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.compare.contrasts import CONTRAST_ESTIMANDS, baseline_contrasts, render_contrasts

H, K, N_DOCS, DRAWS, SEED, LEVEL = 8, 3, 10, 400, 7, 0.9
ACTIONS = ["snapkv", "mine", "recent"]
BASE = "snapkv"


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("contrasts")
    pairs = stratum_pairs(11, {"snapkv": 0.3, "mine": 0.6, "recent": 0.15})
    files = write_synthetic_study(
        root, "study1", "tiny", {"custom-prompts": pairs}, {"study1": (N_DOCS, K)}, H=H, seed=3
    )
    trajectories = {a: list(files[a].values()) for a in ACTIONS}
    stats, clock = document_stats(trajectories, list(files["documents"].values()))
    contrasts = [(a, BASE) for a in ACTIONS if a != BASE]
    estimands = estimands_table(
        stats, clock, model="tiny", actions=ACTIONS, contrasts=contrasts, draws=DRAWS,
        seed=SEED, level=LEVEL,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    acc = stats.select("doc_id", "action", "stratum").with_columns(
        acc_y=pl.Series(rng.integers(0, 2, stats.height).astype(float))
    )
    table, summary = baseline_contrasts(
        estimands, stats, acc, ACTIONS, BASE, H=H, metric="substring_match", draws=DRAWS,
        seed=SEED, level=LEVEL, temperature=0.5,
    )  # fmt: skip
    return files, acc, table, summary


def _by_hand(files, acc):
    """Per-document statistics straight from the trajectory files, and the bootstrap weights
    (documents in doc_id order, one stratum), as numpy arrays per action."""
    out = {}
    for action in ACTIONS:
        (path,) = files[action].values()
        frame = pl.read_parquet(path).sort("doc_id", "replicate", "t")
        paths = frame.group_by("doc_id", "replicate", maintain_order=True).agg(
            mism=pl.col("mismatch").cast(pl.Float64).mean(),
            tau=pl.col("t").filter(pl.col("mismatch")).min(),
            flags=pl.col("mismatch"),
        )
        rows = []
        for doc_id, _, mism, tau, flags in paths.rows():
            diverged = tau is not None
            post = sum(flags[tau:]) if diverged else 0  # mismatches at steps after τ
            rows.append(
                {
                    "doc_id": doc_id,
                    "R": mism,
                    "D": float(diverged),
                    "tauD": float(tau) if diverged else 0.0,
                    "E": (H - tau) / H if diverged else 0.0,
                    "Pi": post / H,
                }
            )
        docs = pl.DataFrame(rows).group_by("doc_id").mean().sort("doc_id")
        a = acc.filter(pl.col("action") == action).sort("doc_id")
        assert a["doc_id"].to_list() == docs["doc_id"].to_list()
        out[action] = {k: docs[k].to_numpy() for k in ("R", "D", "tauD", "E", "Pi")}
        out[action]["acc"] = a["acc_y"].to_numpy()
    strata = np.array(["custom-prompts"] * N_DOCS)
    boot = stratified_bootstrap_weights(strata, DRAWS, np.random.SeedSequence(SEED))
    return out, np.vstack([np.ones((1, N_DOCS)), boot])


def _independent(files, acc, action):
    per, w = _by_hand(files, acc)

    def mean(action, key):
        return w @ per[action][key] / w.sum(1)

    def moments(action):
        o, e, pi = mean(action, "D") / H, mean(action, "E"), mean(action, "Pi")
        with np.errstate(invalid="ignore", divide="ignore"):
            c = np.where(e > 0, pi / np.where(e > 0, e, 1), np.nan)
        return o, e, c

    (o_a, e_a, c_a), (o_b, e_b, c_b) = moments(BASE), moments(action)
    c_a, c_b = np.where(np.isnan(c_a), c_b, c_a), np.where(np.isnan(c_b), c_a, c_b)
    delta_r = mean(action, "R") - mean(BASE, "R")
    with np.errstate(invalid="ignore", divide="ignore"):
        entry = mean(action, "tauD") / mean(action, "D") - mean(BASE, "tauD") / mean(BASE, "D")
    return {
        "R_smc": delta_r,
        "div_prob": mean(action, "D") - mean(BASE, "D"),
        "mean_entry_time": entry,
        "gap_occurrence": o_b - o_a,
        "gap_exposure": (e_b - e_a) * (c_a + c_b) / 2,
        "gap_rate": (c_b - c_a) * (e_a + e_b) / 2,
        "accuracy": mean(action, "acc") - mean(BASE, "acc"),
    }


@pytest.mark.parametrize("action", ["mine", "recent"])
def test_contrasts_equal_an_independent_computation(study, action):
    files, acc, table, _ = study
    expected = _independent(files, acc, action)
    rows = {
        r["estimand"]: r for r in table.filter(pl.col("action") == action).iter_rows(named=True)
    }
    assert list(rows) == list(CONTRAST_ESTIMANDS)
    for estimand, draws in expected.items():
        r = rows[estimand]
        assert r["baseline"] == BASE and r["n_docs"] == N_DOCS and r["ci_level"] == LEVEL
        assert r["value"] == pytest.approx(draws[0], abs=1e-12), estimand
        finite = draws[1:][np.isfinite(draws[1:])]
        low, high = np.quantile(finite, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
        assert (r["ci_low"], r["ci_high"]) == pytest.approx((low, high), abs=1e-12), estimand
        assert r["draws_dropped"] == DRAWS - finite.size
    # the decomposition adds up, and its shares are of ΔR_SMC
    terms = [rows[f"gap_{t}"]["value"] for t in ("occurrence", "exposure", "rate")]
    assert sum(terms) == pytest.approx(rows["R_smc"]["value"], abs=1e-12)
    for term, value in zip(("occurrence", "exposure", "rate"), terms, strict=True):
        assert rows[f"{term}_share"]["value"] == pytest.approx(value / sum(terms), abs=1e-9)
    # the two sides of the headline differences
    per, _ = _by_hand(files, acc)
    assert rows["R_smc"]["action_value"] == pytest.approx(per[action]["R"].mean(), abs=1e-12)
    assert rows["R_smc"]["baseline_value"] == pytest.approx(per[BASE]["R"].mean(), abs=1e-12)


def _interval(low, high, value, digits, scale=1.0):
    if value < 0:
        low, high = -high, -low
    return f"[{scale * low:.{digits}f}, {scale * high:.{digits}f}]".replace("-0.0,", "0.0,")


def test_summary_sentences_carry_the_numbers(study):
    _, _, table, summary = study
    assert summary.startswith("# Against the baseline\n")
    assert f"{N_DOCS} prompts, H = {H} generated tokens, temperature 0.5" in summary
    assert "paired 90% document-bootstrap intervals" in summary
    for action in ("mine", "recent"):
        rows = {
            r["estimand"]: r for r in table.filter(pl.col("action") == action).iter_rows(named=True)
        }
        assert f"## {action} against {BASE}" in summary
        e = rows["mean_entry_time"]
        word = "earlier" if e["value"] < 0 else "later"
        text = (
            f"{action} diverges {abs(e['value']):.1f} steps {word} than {BASE} "
            f"{_interval(e['ci_low'], e['ci_high'], e['value'], 1)}"
        )
        assert text in summary, (text, summary)
        p = rows["div_prob"]
        word = "more" if p["value"] > 0 else "fewer"
        base = f"{BASE} ({100 * p['baseline_value']:.0f}%)"
        text = f"{100 * abs(p['value']):.1f} points {word} than {base}"
        assert text in summary
        r = rows["R_smc"]
        word = "higher" if r["value"] > 0 else "lower"
        assert f"is {r['action_value']:.3f}, {abs(r['value']):.3f} {word} than {BASE}'s" in summary
    # every number printed is a finite number
    assert not re.search(r"\bnan\b", summary, re.IGNORECASE)


def test_contrasts_markdown_one_row_per_action_and_estimand(study):
    _, _, table, _ = study
    md = render_contrasts(table).splitlines()
    assert len(md) == 2 + 2 * len(CONTRAST_ESTIMANDS)
    assert md[2].startswith("| mine | snapkv | ΔR_SMC")
    value = table.filter((pl.col("action") == "mine") & (pl.col("estimand") == "R_smc"))["value"]
    assert f"{value[0]:.4f}" in md[2]
    assert not any(math.isnan(v) for v in table.filter(pl.col("estimand") == "R_smc")["value"])


def _rows(r_low: float, r_high: float) -> pl.DataFrame:
    """Contrast rows of one action against a baseline, with the R_SMC gap's interval given."""

    def row(estimand, value, low, high, action_value=0.5, baseline_value=0.4):
        return {
            "estimand": estimand,
            "value": value,
            "ci_low": low,
            "ci_high": high,
            "action_value": action_value,
            "baseline_value": baseline_value,
        }

    return pl.DataFrame(
        [
            row("div_prob", 0.1, 0.0, 0.2),
            row("mean_entry_time", -1.0, -2.0, 0.5, 10.0, 11.0),
            row("R_smc", 0.008, r_low, r_high),
            row("occurrence_share", -0.67, -5.0, 5.0),
            row("exposure_share", -8.14, -50.0, 50.0),
            row("rate_share", 9.81, -50.0, 50.0),
        ]
    )


def test_the_summary_splits_a_gap_only_when_its_interval_excludes_zero():
    """A gap whose interval includes 0 may be 0: its shares are unbounded (e.g. -814%), so the
    sentence says why it gives none; a gap away from 0 is split."""
    from kvdiverge.tables.contrasts import action_sentences

    near_zero = " ".join(action_sentences(_rows(-0.036, 0.052), "mine", "snapkv", 32, "m"))
    assert "Of that gap" not in near_zero and "-814%" not in near_zero
    assert "The gap's interval includes 0, so its split" in near_zero
    away = " ".join(action_sentences(_rows(0.004, 0.012), "mine", "snapkv", 32, "m"))
    assert "Of that gap, occurrence (paths that diverge at all) accounts for -67%" in away
