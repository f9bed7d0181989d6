"""Every estimand of ``estimands_table`` against values computed independently of the package.

The fixture is a hand-built trajectory study (several strata of different sizes, documents
with different replicate counts, a control, a rarely diverging action and a development
cohort), written with :func:`kvdiverge.io.trajectories.write_trajectories` and run through the real
pipeline (:func:`document_stats` then :func:`estimands_table`). The expected values come from
plain Python loops over the written paths, following the definitions:

* a document's value of a per-path quantity is the mean over its replicates;
* an estimand averages documents with equal weight (pooled: all documents of all strata);
* a ratio estimand is the ratio of the document-averaged numerator and denominator.

The fixture is built so that the tempting alternatives (a mean of per-document ratios,
path-weighted pooling, equal stratum weights) give different numbers, and the tests assert
that they do, so an aggregation error cannot pass. A second study replays every coupled path of
tiny finite-state kernel pairs with multiplicity proportional to its probability, so the sample
means *are* the exact expectations of ``tests/exact_small.py``'s brute-force evaluator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import polars as pl
import pytest
from exact_small import enumerate_coupled_paths, exact_summary

from kvdiverge.analysis.bootstrap import stratified_bootstrap_weights
from kvdiverge.analysis.document_stats import Clock, document_stats
from kvdiverge.analysis.estimands import (
    ESTIMAND_COLUMNS,
    INTERVAL_COLUMNS,
    bootstrap_estimands,
    estimands_table,
    render_markdown,
    write_estimands,
)
from kvdiverge.io.trajectories import write_trajectories
from kvdiverge.tables import read_estimands, table1_timing, table2_decomposition
from kvdiverge.tables import render_markdown as study_markdown

H = 16
CLOCK = Clock.for_horizon(H)  # d = 8, window 2, blocks 1:4, 5:8, 9:16, prefix 4, run 2
STRATA = {"helmet-4k": 2, "ruler-4k": 3, "ruler-16k": 4}  # evaluation documents per stratum
CONTROL = "full"
ACTIONS = [CONTROL, "snap", "recent", "rare"]
COMPARED = ACTIONS[1:]
DRAWS = 60
SEED = 5
RARE_DOC = "helmet-4k/study1/000"  # the only document where action "rare" diverges


# the wrong aggregations differ from the right one by far more than the comparison tolerance
SEPARATION = 1e-4


def close(x: float) -> object:
    return pytest.approx(x, rel=1e-12, abs=1e-14, nan_ok=True)


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Path:
    """One coupled path: I_t, δ_t, f_t and the EOS flags ("has emitted EOS at or before t")."""

    mismatch: tuple[int, ...]
    delta: tuple[float, ...]
    fixed: tuple[float, ...]
    x_eos: tuple[int, ...] = (0,) * H
    y_eos: tuple[int, ...] = (0,) * H


def _eos(at: int | None) -> tuple[int, ...]:
    return tuple(int(at is not None and t >= at) for t in range(1, H + 1))


def _sixty_fourths(values) -> tuple[float, ...]:
    return tuple(float(v) / 64 for v in values)  # exact in float32 (the file's dtype)


# Hand-written edge cases (H = 16, d = 8): the branch-cohort boundary, divergence at the last
# step, EOS inside the branch window, long agreement runs and re-entries.
EDGE_PATHS = {
    # τ = d = 8: in the cohort, lags reach t = 16; Y emits EOS at 12 (e = 12)
    "tau_at_depth": Path(
        mismatch=(0,) * 7 + (1, 0, 0, 1, 1, 0, 0, 0, 0),
        delta=_sixty_fourths([0, 3, 5, 8, 9, 13, 21, 40, 33, 30, 50, 64, 20, 18, 16, 64]),
        fixed=_sixty_fourths([0, 3, 5, 7, 9, 9, 10, 11, 12, 12, 13, 14, 15, 15, 16, 16]),
        y_eos=_eos(12),
    ),
    # τ = d + 1 = 9: diverged, outside the cohort
    "tau_after_depth": Path(
        mismatch=(0,) * 8 + (1, 1, 0, 1, 0, 0, 1, 1),
        delta=_sixty_fourths([0, 1, 2, 4, 8, 8, 8, 8, 32, 48, 64, 64, 40, 30, 50, 60]),
        fixed=_sixty_fourths([0, 1, 2, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6]),
    ),
    # τ = H: diverged with zero exposure
    "tau_at_horizon": Path(
        mismatch=(0,) * 15 + (1,),
        delta=_sixty_fourths([0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 7]),
        fixed=_sixty_fourths([0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]),
    ),
    # τ = 2; agreements 3, 4 (run 2), mismatch 5 (re-entry); X ends at 9, Y at 13
    "early_with_eos": Path(
        mismatch=(0, 1, 0, 0, 1, 0, 1, 1, 1, 0, 1, 1, 0, 0, 0, 0),
        delta=_sixty_fourths([0, 16, 8, 8, 24, 4, 32, 40, 64, 30, 60, 64, 64, 0, 0, 0]),
        fixed=_sixty_fourths([0, 6, 6, 6, 8, 8, 9, 9, 10, 0, 0, 0, 0, 0, 0, 0]),
        x_eos=_eos(9),
        y_eos=_eos(13),
    ),
    # τ = 3; mismatch every other step: no run of 2 agreements, re-entry
    "alternating": Path(
        mismatch=(0, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0),
        delta=_sixty_fourths([0, 8, 12, 20, 28, 28, 36, 36, 44, 44, 52, 52, 60, 60, 64, 64]),
        fixed=_sixty_fourths([0, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]),
    ),
    # X ends at 5, Y at 7 (e = 5, e' = 7), τ = 4; δ and f stay nonzero after both have
    # ended (a real kernel pair would give 0 there) so that segment S3 is not empty
    "gap_after_both_ended": Path(
        mismatch=(0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        delta=_sixty_fourths([0, 4, 6, 32, 48, 24, 40, 8, 8, 12, 12, 16, 16, 4, 4, 2]),
        fixed=_sixty_fourths([0, 2, 2, 4, 4, 1, 1, 1, 2, 2, 3, 3, 1, 1, 1, 1]),
        x_eos=_eos(5),
        y_eos=_eos(7),
    ),
}
# (action, document, replicate) → edge path, overriding the generated one
EDGE_PLACES = {
    ("snap", "ruler-4k/study1/001", 0): "tau_at_depth",
    ("snap", "ruler-16k/study1/002", 1): "tau_after_depth",
    ("recent", "ruler-16k/study1/000", 0): "tau_at_horizon",
    ("recent", "ruler-4k/study1/000", 1): "early_with_eos",
    ("snap", "helmet-4k/study1/001", 0): "alternating",
    ("rare", RARE_DOC, 0): "early_with_eos",
    ("snap", "ruler-16k/study1/001", 2): "gap_after_both_ended",
    ("recent", "helmet-4k/study1/001", 3): "gap_after_both_ended",
}


def _random_path(rng: np.random.Generator, p_div: float, post_rate: float) -> Path:
    """A generated path on the 1/64 grid: τ ≤ H with probability p_div, then I_t ~
    Bernoulli(post_rate); δ_1 = 0; EOS sometimes; after both have ended I_t = δ_t = 0."""
    last = H if rng.random() < 0.25 else CLOCK.branch_depth  # a well-filled branch cohort
    tau = int(rng.integers(2, last + 1)) if rng.random() < p_div else None
    mism = [0] * H
    if tau is not None:
        mism[tau - 1] = 1
        for t in range(tau + 1, H + 1):
            mism[t - 1] = int(rng.random() < post_rate)
    delta = [0] + [int(v) for v in rng.integers(0, 65, H - 1)]
    fixed = [0] + [int(v) for v in rng.integers(0, 40, H - 1)]
    e_x = int(rng.integers(3, H + 1)) if rng.random() < 0.3 else None
    e_y = int(rng.integers(3, H + 1)) if rng.random() < 0.3 else None
    for t in range(1, H + 1):
        if mism[t - 1]:
            delta[t - 1] = max(delta[t - 1], 1)
        if e_x is not None and e_y is not None and t > max(e_x, e_y):
            mism[t - 1], delta[t - 1] = 0, 0
        if e_x is not None and t > e_x:
            fixed[t - 1] = 0
    return Path(tuple(mism), _sixty_fourths(delta), _sixty_fourths(fixed), _eos(e_x), _eos(e_y))


def _documents() -> pl.DataFrame:
    rows = []
    for stratum, n in STRATA.items():
        rows += [(f"{stratum}/study1/{i:03d}", stratum, "study1") for i in range(n)]
        rows.append((f"{stratum}/dev/000", stratum, "dev"))
    return pl.DataFrame(rows, schema=["doc_id", "stratum", "cohort"], orient="row")


def _study_paths() -> dict[str, dict[str, list[Path]]]:
    """paths[action][doc_id]: replicate counts differ across documents (1..6)."""
    rng = np.random.default_rng(20240607)
    docs = _documents()
    zero = Path((0,) * H, (0.0,) * H, (0.0,) * H)
    out: dict[str, dict[str, list[Path]]] = {a: {} for a in ACTIONS}
    for i, doc in enumerate(docs["doc_id"]):
        k = [1, 4, 2, 6, 3][i % 5]
        p_div = float(rng.uniform(0.3, 0.95))
        post = float(rng.choice([0.03, 0.3, 0.97]))
        out[CONTROL][doc] = [zero, zero]
        out["snap"][doc] = [_random_path(rng, p_div, post) for _ in range(k)]
        out["recent"][doc] = [
            _random_path(rng, 0.5 * p_div, min(1.0, 1.5 * post)) for _ in range(k)
        ]
        quiet = [
            Path((0,) * H, _sixty_fourths([0, *rng.integers(0, 9, H - 1)]), (0.0,) * H)
            for _ in range(k)
        ]
        out["rare"][doc] = quiet
    for (action, doc, rep), name in EDGE_PLACES.items():
        out[action][doc][rep] = EDGE_PATHS[name]
    return out


def _frame(paths: dict[str, list[Path]]) -> pl.DataFrame:
    cols: dict[str, list] = {c: [] for c in ("doc_id", "replicate", "t", "x_token", "y_token")}
    cols |= {c: [] for c in ("mismatch", "tv_rollout", "tv_fixed", "x_eos", "y_eos")}
    for doc, reps in paths.items():
        for r, p in enumerate(reps):
            for t in range(len(p.mismatch)):
                cols["doc_id"].append(doc)
                cols["replicate"].append(r)
                cols["t"].append(t + 1)
                cols["x_token"].append(0)
                cols["y_token"].append(p.mismatch[t])
                cols["mismatch"].append(bool(p.mismatch[t]))
                cols["tv_rollout"].append(p.delta[t])
                cols["tv_fixed"].append(p.fixed[t])
                cols["x_eos"].append(bool(p.x_eos[t]))
                cols["y_eos"].append(bool(p.y_eos[t]))
    n = len(cols["t"])
    return pl.DataFrame(cols).with_columns(
        n_prompt=pl.repeat(100, n, dtype=pl.Int32), n_kept=pl.repeat(50, n, dtype=pl.Int32)
    )


def _write_study(root, paths: dict[str, dict[str, list[Path]]], h: int = H) -> dict:
    files: dict[str, list] = {}
    for action, by_doc in paths.items():
        for stratum in sorted({d.split("/")[0] for d in by_doc}):
            part = {d: reps for d, reps in by_doc.items() if d.startswith(stratum + "/")}
            path = root / f"{action}-{stratum}.parquet"
            meta = {
                "model": "m",
                "revision": "r",
                "action": {"name": action},
                "H": h,
                "K": max(len(r) for r in part.values()),
                "seed": 0,
                "coupling": "shared-reference",
                "dtype": "float32",
                "device": "cpu",
            }
            write_trajectories(_frame(part), path, meta)
            files.setdefault(action, []).append(path)
    return files


# ---------------------------------------------------------------------------------------------
# The independent oracle: definitions written as loops over paths
# ---------------------------------------------------------------------------------------------


def _first(flags) -> float:
    for t, v in enumerate(flags, start=1):
        if v:
            return t
    return math.inf


def path_facts(p: Path, clock: Clock) -> dict:
    """The per-path random variables whose expectations define the estimands."""
    h, d, m, run = clock.H, clock.branch_depth, clock.prefix, clock.agreement_run
    tau = _first(p.mismatch)
    e_x, e_y = _first(p.x_eos), _first(p.y_eos)
    e, e2 = min(e_x, e_y), max(e_x, e_y)
    in_cohort = tau <= d
    out = {
        "D": sum(p.mismatch) / h,
        "diverged": float(tau <= h),
        "tau_if_diverged": float(tau) if tau <= h else 0.0,
        "exposure_steps": float(max(h - tau, 0)) if tau <= h else 0.0,
        "post_mismatches": float(sum(p.mismatch[t - 1] for t in range(1, h + 1) if t > tau)),
        "rollout": sum(p.delta) / h,
        "fixed": sum(p.fixed) / h,
        "saturated_steps": float(sum(1 for x in p.delta if x > clock.saturation)),
        "cohort": float(in_cohort),
        "flat": sum(p.mismatch[:m]) / m,
    }
    for t in range(1, h + 1):
        out[("cdf", t)] = float(tau <= t)
        out[("delta", t)] = p.delta[t - 1]
    for j in range(1, d + 1):
        out[("branch", j)] = p.delta[tau + j - 1] if in_cohort else 0.0
        pre = in_cohort and tau + j < e
        out[("pre_num", j)] = p.delta[tau + j - 1] if pre else 0.0
        out[("pre_den", j)] = float(pre)
    segments = (
        lambda t: t < e,
        lambda t: t == e,
        lambda t: e < t <= e2,
        lambda t: t > e2,
    )
    for k, inside in enumerate(segments):
        out[("seg", k)] = sum(p.delta[t - 1] - p.fixed[t - 1] for t in range(1, h + 1) if inside(t))
        out[("seg", k)] /= h
    longest = current = 0
    agreed = reentered = False
    if in_cohort:
        for t in range(tau + 1, min(e, h + 1)):
            if p.mismatch[t - 1]:
                current = 0
                reentered = reentered or agreed
            else:
                current += 1
                agreed = True
                longest = max(longest, current)
    out["long_run"] = float(in_cohort and longest >= run)
    out["reentry"] = float(in_cohort and reentered)
    return out


class Oracle:
    """Document means of the path facts, and estimands under any document weights."""

    def __init__(self, paths: dict[str, list[Path]], strata: dict[str, str], clock: Clock):
        self.clock = clock
        self.docs = sorted(paths, key=lambda doc: (strata[doc], doc))  # the bootstrap order
        self.strata = [strata[doc] for doc in self.docs]
        self.n_paths = [len(paths[doc]) for doc in self.docs]
        self.means = []
        self.cohort_paths = []
        for doc in self.docs:
            facts = [path_facts(p, clock) for p in paths[doc]]
            self.means.append({k: sum(f[k] for f in facts) / len(facts) for k in facts[0]})
            self.cohort_paths.append(sum(f["cohort"] for f in facts))

    def estimands(self, weights) -> dict[str, float]:
        """Every per-action estimand with document weights ``weights`` (zero: left out)."""
        c = self.clock
        h, d, w = c.H, c.branch_depth, c.window
        total = sum(weights)

        def E(key) -> float:
            return sum(wt * m[key] for wt, m in zip(weights, self.means, strict=True)) / total

        def ratio(num: float, den: float) -> float:
            return num / den if den != 0 else math.nan

        out = {
            "R_smc": E("D"),
            "O_H": E("diverged") / h,
            "E_H": E("exposure_steps") / h,
            "C_H": ratio(E("post_mismatches"), E("exposure_steps")),
            "Pi_H": E("post_mismatches") / h,
            "div_prob": E("diverged"),
            "mean_entry_time": ratio(E("tau_if_diverged"), E("diverged")),
            "R": E("rollout"),
            "F": E("fixed"),
            "R_minus_F": E("rollout") - E("fixed"),
            "S_99": E("saturated_steps") / h,
            "branch_cohort_fraction": E("cohort"),
            "branch_cohort_docs": sum(
                wt * (n > 0) for wt, n in zip(weights, self.cohort_paths, strict=True)
            ),
            "branch_cohort_paths": sum(
                wt * n for wt, n in zip(weights, self.cohort_paths, strict=True)
            ),
            "flat_extrapolation": E("flat"),
            "R_minus_flat": E("rollout") - E("flat"),
            "local_agreement_run": ratio(E("long_run"), E("cohort")),
            "local_reentry": ratio(E("reentry"), E("cohort")),
        }
        for t in range(1, h + 1):
            out[f"div_cdf@{t}"] = E(("cdf", t))
            out[f"tv@{t}"] = E(("delta", t))
        blocks = [
            sum(E(("delta", t)) for t in range(lo, hi + 1)) / (hi - lo + 1) for lo, hi in c.blocks
        ]
        for (lo, hi), value in zip(c.blocks, blocks, strict=True):
            out[f"block_tv@{lo}:{hi}"] = value
        out["block_tv_change"] = blocks[-1] - blocks[0]
        early, late = range(1, w + 1), range(d - w + 1, d + 1)
        for j in range(1, d + 1):
            out[f"branch_tv@{j}"] = ratio(E(("branch", j)), E("cohort"))
            out[f"branch_pre_tv@{j}"] = ratio(E(("pre_num", j)), E(("pre_den", j)))
        # b_J: the mean of b_j over the window; b^pre_J: pre-EOS δ over all (path, lag) pairs
        out["branch_early"] = sum(out[f"branch_tv@{j}"] for j in early) / w
        out["branch_late"] = sum(out[f"branch_tv@{j}"] for j in late) / w
        out["branch_contrast_B"] = out["branch_late"] - out["branch_early"]
        for name, lags in (("early", early), ("late", late)):
            out[f"branch_pre_{name}"] = ratio(
                sum(E(("pre_num", j)) for j in lags), sum(E(("pre_den", j)) for j in lags)
            )
        out["branch_pre_contrast_B"] = out["branch_pre_late"] - out["branch_pre_early"]
        for k in range(4):
            out[f"rf_S{k}"] = E(("seg", k))
        out["pre_eos_share"] = ratio(out["rf_S0"], out["R_minus_F"])
        out["eos_share"] = 1 - out["pre_eos_share"]
        return out


def contrast(b: dict[str, float], a: dict[str, float]) -> dict[str, float]:
    """b − a of every estimand, shares recomputed, and the gap decomposition from its formula."""
    out = {k: b[k] - a[k] for k in b}
    out["pre_eos_share"] = out["rf_S0"] / out["R_minus_F"] if out["R_minus_F"] != 0 else math.nan
    out["eos_share"] = 1 - out["pre_eos_share"]
    # an undefined rate (E_H = 0, so Π_H = 0) takes the other action's rate, 0 if both are
    # undefined: any finite stand-in keeps the identity, and this one puts ΔΠ_H on exposure
    c_a = a["C_H"] if a["E_H"] > 0 else (b["C_H"] if b["E_H"] > 0 else 0.0)
    c_b = b["C_H"] if b["E_H"] > 0 else c_a
    c_bar = (c_a + c_b) / 2
    e_bar = (a["E_H"] + b["E_H"]) / 2
    terms = {
        "occurrence": b["O_H"] - a["O_H"],
        "exposure": (b["E_H"] - a["E_H"]) * c_bar,
        "rate": (c_b - c_a) * e_bar,
    }
    for name, value in terms.items():
        out[f"gap_{name}"] = value
        out[f"{name}_share"] = value / out["R_smc"] if out["R_smc"] != 0 else math.nan
    return out


# ---------------------------------------------------------------------------------------------
# Fixture
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    root = tmp_path_factory.mktemp("independent")
    paths = _study_paths()
    docs = _documents()
    files = _write_study(root, paths)
    stats, clock = document_stats(files, docs, control=CONTROL)
    assert clock == CLOCK
    table = estimands_table(
        stats,
        clock,
        model="m",
        actions=ACTIONS,
        cohort="study1",
        draws=DRAWS,
        seed=SEED,
        control=CONTROL,
    )
    strata = dict(zip(docs["doc_id"], docs["stratum"], strict=True))
    evaluation = {d for d in docs.filter(cohort="study1")["doc_id"]}
    oracles = {
        a: Oracle({d: r for d, r in paths[a].items() if d in evaluation}, strata, clock)
        for a in ACTIONS
    }
    return stats, table, oracles


def _rows(table: pl.DataFrame) -> dict[tuple[str, str, str], dict]:
    return {
        (r["action"] or r["contrast"], r["stratum"], r["estimand"]): r
        for r in table.iter_rows(named=True)
    }


def _selection(oracle: Oracle, stratum: str) -> list[float]:
    return [1.0 if stratum in ("pooled", s) else 0.0 for s in oracle.strata]


def _expected(oracles, weights) -> dict[str, dict[str, float]]:
    """{unit: estimands} for every action and every default contrast, under ``weights``."""
    per = {a: oracles[a].estimands(weights) for a in ACTIONS}
    out = dict(per)
    for i, b in enumerate(COMPARED):
        for a in COMPARED[i + 1 :]:
            out[f"{b} - {a}"] = contrast(per[b], per[a])
    return out


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_fixture_separates_the_aggregation_rules(study):
    """Mean of ratios ≠ ratio of means, path-weighted ≠ document-weighted, equal stratum weights
    ≠ equal document weights: each tempting error would change the numbers checked below."""
    _, table, oracles = study
    o = oracles["snap"]
    value = lambda name: _rows(table)[("snap", "pooled", name)]["value"]  # noqa: E731
    ones = [1.0] * len(o.docs)
    right = o.estimands(ones)
    for name, num, den in (
        ("C_H", "post_mismatches", "exposure_steps"),
        ("mean_entry_time", "tau_if_diverged", "diverged"),
        ("branch_tv@1", ("branch", 1), "cohort"),
        ("local_reentry", "reentry", "cohort"),
    ):
        per_doc = [m[num] / m[den] for m in o.means if m[den] > 0]
        mean_of_ratios = sum(per_doc) / len(per_doc)
        path_weighted = sum(m[num] * k for m, k in zip(o.means, o.n_paths, strict=True)) / sum(
            m[den] * k for m, k in zip(o.means, o.n_paths, strict=True)
        )
        by_stratum = {}
        for s in STRATA:
            by_stratum[s] = o.estimands(_selection(o, s))[name]
        stratum_weighted = sum(by_stratum.values()) / len(by_stratum)
        for wrong in (mean_of_ratios, path_weighted, stratum_weighted):
            assert abs(wrong - right[name]) > SEPARATION, (name, wrong)
        assert value(name) == close(right[name]), name
    # a plain mean: path weighting and stratum weighting would differ too
    flat = sum(m["D"] * k for m, k in zip(o.means, o.n_paths, strict=True)) / sum(o.n_paths)
    by_stratum = [o.estimands(_selection(o, s))["R_smc"] for s in STRATA]
    for wrong in (flat, sum(by_stratum) / len(by_stratum)):
        assert abs(wrong - right["R_smc"]) > SEPARATION
    assert value("R_smc") == close(right["R_smc"])
    # the fixture has unequal strata and replicate counts
    assert len(set(STRATA.values())) == len(STRATA) and len(set(o.n_paths)) > 2


def test_every_point_estimate_matches_the_definitions(study):
    """Every (unit, stratum, estimand) of the table, pooled and per stratum."""
    _, table, oracles = study
    rows = _rows(table)
    checked = set()
    for stratum in ["pooled", *STRATA]:
        weights = _selection(oracles["snap"], stratum)
        expected = _expected(oracles, weights)
        for unit, values in expected.items():
            for name, target in values.items():
                row = rows[(unit, stratum, name)]
                assert row["value"] == close(target), (unit, stratum, name)
                checked.add((unit, stratum, name))
    assert checked == set(rows), sorted(set(rows) - checked)[:5]  # nothing left unchecked
    # counts: documents and paths of each unit
    for stratum in ["pooled", *STRATA]:
        sel = _selection(oracles["snap"], stratum)
        for a in ACTIONS:
            n_paths = sum(k for k, s in zip(oracles[a].n_paths, sel, strict=True) if s)
            r = rows[(a, stratum, "R_smc")]
            assert (r["n_docs"], r["n_paths"]) == (int(sum(sel)), n_paths)
        r = rows[("snap - recent", stratum, "R_smc")]
        assert (
            r["n_paths"]
            == rows[("snap", stratum, "R_smc")]["n_paths"]
            + rows[("recent", stratum, "R_smc")]["n_paths"]
        )


def test_decomposition_and_identities_hold_on_the_fixture(study):
    _, table, oracles = study
    rows = _rows(table)
    for stratum in ["pooled", *STRATA]:
        for b, a in (("snap", "recent"), ("snap", "rare"), ("recent", "rare")):
            unit = f"{b} - {a}"
            terms = [
                rows[(unit, stratum, f"gap_{k}")]["value"]
                for k in ("occurrence", "exposure", "rate")
            ]
            assert math.fsum(terms) == close(rows[(unit, stratum, "R_smc")]["value"])
        for a in COMPARED:
            r = {k: rows[(a, stratum, k)]["value"] for k in ("R_smc", "O_H", "Pi_H", "E_H", "C_H")}
            assert r["O_H"] + r["Pi_H"] == close(r["R_smc"])
            if not math.isnan(r["C_H"]):
                assert r["E_H"] * r["C_H"] == close(r["Pi_H"])


def test_bootstrap_draws_are_ratios_of_resampled_document_means(study):
    """A hand-written resampling (within strata) through ``bootstrap_estimands``."""
    stats, _, oracles = study
    o = oracles["snap"]
    # docs in (stratum, doc_id) order: helmet-4k ×2, ruler-16k ×4, ruler-4k ×3
    assert o.strata == ["helmet-4k"] * 2 + ["ruler-16k"] * 4 + ["ruler-4k"] * 3
    draws = np.array(
        [
            [1, 1, 1, 1, 1, 1, 1, 1, 1],
            [2, 0, 0, 3, 1, 0, 1, 1, 1],
            [0, 2, 1, 1, 1, 1, 3, 0, 0],
        ],
        dtype=float,
    )
    contrasts = [("snap", "recent"), ("recent", "rare")]
    per_action, per_contrast, n_docs, _ = bootstrap_estimands(
        stats.filter(cohort="study1"), CLOCK, ACTIONS, contrasts, draws
    )
    assert n_docs == 9
    for r, weights in enumerate(draws):
        expected = {a: oracles[a].estimands(list(weights)) for a in ACTIONS}
        for i, a in enumerate(ACTIONS):
            for name, target in expected[a].items():
                assert per_action[name][i, r] == close(target), (a, r, name)
        for i, (b, a) in enumerate(contrasts):
            for name, target in contrast(expected[b], expected[a]).items():
                assert per_contrast[name][i, r] == close(target), (b, a, r, name)


def test_intervals_and_dropped_draws_match_the_resampled_definitions(study):
    """Percentile intervals and ``draws_dropped`` from the oracle on the same resamples (the
    paired, within-stratum document bootstrap over documents ordered by stratum, doc_id)."""
    _, table, oracles = study
    rows = _rows(table)
    labels = np.array(oracles["snap"].strata)
    boot = stratified_bootstrap_weights(labels, DRAWS, np.random.SeedSequence(SEED))
    for stratum in ["pooled", *STRATA]:
        sel = np.array(_selection(oracles["snap"], stratum))
        per_draw = [_expected(oracles, list(w * sel)) for w in boot]
        for unit in per_draw[0]:
            for name in per_draw[0][unit]:
                values = np.array([d[unit][name] for d in per_draw])
                finite = values[np.isfinite(values)]
                row = rows[(unit, stratum, name)]
                assert row["draws_dropped"] == DRAWS - finite.size, (unit, stratum, name)
                if finite.size == 0 or row["denominator_docs"] < 2:  # no interval
                    assert math.isnan(row["ci_low"]) and math.isnan(row["ci_high"])
                    continue
                low, high = np.quantile(finite, [(1 - 0.95) / 2, (1 + 0.95) / 2])
                assert row["ci_low"] == close(low), (unit, stratum, name)
                assert row["ci_high"] == close(high), (unit, stratum, name)


def test_undefined_draws_are_counted_and_the_outputs_still_render(study, tmp_path):
    """Action "rare" diverges in one document of helmet-4k only: its ratio estimands are
    undefined in the draws that miss that document, and everywhere outside helmet-4k."""
    _, table, oracles = study
    assert list(table.columns) == [*ESTIMAND_COLUMNS, *INTERVAL_COLUMNS]
    assert table["draws_dropped"].dtype == pl.Int64 and table["draws_dropped"].min() == 0
    rows = _rows(table)
    labels = np.array(oracles["rare"].strata)
    boot = stratified_bootstrap_weights(labels, DRAWS, np.random.SeedSequence(SEED))
    rare = oracles["rare"].docs.index(RARE_DOC)
    missed = int((boot[:, rare] == 0).sum())
    assert 0 < missed < DRAWS  # some, not all, draws are undefined
    for stratum in ("pooled", "helmet-4k"):
        for name in ("C_H", "mean_entry_time", "branch_tv@1", "local_reentry"):
            assert rows[("rare", stratum, name)]["draws_dropped"] == missed, (stratum, name)
    # the value itself is defined, but one document carries its denominator: no interval
    row = rows[("rare", "pooled", "C_H")]
    assert math.isfinite(row["value"]) and row["denominator_docs"] == 1
    assert math.isnan(row["ci_low"]) and math.isnan(row["ci_high"])
    # no divergence at all in ruler strata: undefined value, every draw dropped, NaN interval
    row = rows[("rare", "ruler-4k", "C_H")]
    assert math.isnan(row["value"]) and row["draws_dropped"] == DRAWS
    assert math.isnan(row["ci_low"])
    # the control never diverges either; defined estimands drop nothing
    assert rows[(CONTROL, "pooled", "mean_entry_time")]["draws_dropped"] == DRAWS
    assert rows[("rare", "pooled", "R_smc")]["draws_dropped"] == 0
    assert rows[("snap", "pooled", "C_H")]["draws_dropped"] == 0

    md = render_markdown(table)
    assert md.splitlines()[0].startswith(
        f"Intervals: percentile bootstrap over documents, {DRAWS:,} draws"
    )
    assert any("| dropped draws |" in x for x in md.splitlines())
    line = next(x for x in md.splitlines() if x.startswith("| m | rare |  | pooled | C_H |"))
    assert line.endswith(f"| {missed} |")
    nan_line = next(x for x in md.splitlines() if x.startswith("| m | rare |  | ruler-4k | C_H |"))
    assert "| NA | not available (0 of 3 documents carry the denominator) |" in nan_line
    assert nan_line.endswith(f"| {DRAWS} |")

    csv, md_path = tmp_path / "estimands.csv", tmp_path / "estimands.md"
    write_estimands(table, str(csv), str(md_path))
    back = read_estimands(csv)
    assert back["draws_dropped"].to_list() == table["draws_dropped"].to_list()
    nan_back = back.filter(action="rare", stratum="ruler-4k", estimand="C_H").row(0, named=True)
    assert math.isnan(nan_back["value"]) and nan_back["draws_dropped"] == DRAWS
    # study tables render with undefined cells; an older CSV without the column still reads
    t1 = table1_timing(back, COMPARED, str(csv))
    assert len(t1.rows) == len(COMPARED) and study_markdown(t1).count("\n") > len(COMPARED)
    t2 = table2_decomposition(back, None, str(csv))
    assert study_markdown(t2)
    old = tmp_path / "old.csv"
    table.drop("draws_dropped").write_csv(old)
    assert read_estimands(old)["draws_dropped"].null_count() == table.height


# ---------------------------------------------------------------------------------------------
# Exact answers: every coupled path of tiny finite-state pairs, replayed by its probability
# ---------------------------------------------------------------------------------------------

EXACT_H = 5
GRID = 4**EXACT_H  # path probabilities are multiples of 4^-H: kernels use quarters


def _quarter_kernel(table: dict) -> object:
    """A history-dependent kernel on {0, 1} with probabilities in quarters, keyed by
    (number of ones so far mod 2, last token or None)."""

    def kernel(history: tuple[int, ...]) -> np.ndarray:
        key = (sum(history) % 2, history[-1] if history else None)
        p1 = table.get(key, table["default"])
        return np.array([1 - p1 / 4, p1 / 4])

    return kernel


REFERENCES = {
    "exact-a/study1/000": _quarter_kernel({(0, None): 1, (1, 1): 3, (0, 1): 2, "default": 1}),
    "exact-a/study1/001": _quarter_kernel({(0, None): 2, (1, 1): 1, (0, 0): 3, "default": 2}),
    "exact-b/study1/000": _quarter_kernel({(0, None): 0, (1, 1): 4, "default": 1}),
}
INTERVENTIONS = {
    "mild": _quarter_kernel({(0, None): 1, (1, 1): 2, (0, 1): 2, "default": 2}),
    "strong": _quarter_kernel({(0, None): 1, (1, 1): 0, (0, 0): 4, "default": 3}),
}


def _replayed_paths(reference, intervention) -> list[Path]:
    """Every coupled path of positive probability, repeated prob × 4^H times (exact counts)."""
    out = []
    for c in enumerate_coupled_paths(reference, intervention, EXACT_H):
        copies = c.prob * GRID
        assert copies == round(copies) and copies >= 1
        fixed = tuple(
            0.5 * float(np.abs(reference(c.x[:t]) - intervention(c.x[:t])).sum())
            for t in range(EXACT_H)
        )
        path = Path(
            tuple(int(m) for m in c.mismatches),
            tuple(c.deltas),
            fixed,
            (0,) * EXACT_H,
            (0,) * EXACT_H,
        )
        out += [path] * int(round(copies))
    return out


def test_estimands_equal_exact_expectations_of_finite_state_pairs(tmp_path):
    """One document per kernel pair, whose replicates are exactly the law of the coupled pair:
    document means are the exact expectations of the brute-force evaluator. Pooled ratio
    estimands are ratios of averaged exact moments, which differ from averaged exact ratios."""
    paths = {
        a: {doc: _replayed_paths(ref, q) for doc, ref in REFERENCES.items()}
        for a, q in INTERVENTIONS.items()
    }
    docs = pl.DataFrame(
        {
            "doc_id": list(REFERENCES),
            "stratum": [d.split("/")[0] for d in REFERENCES],
            "cohort": "study1",
        }
    )
    files = _write_study(tmp_path, paths, EXACT_H)
    stats, clock = document_stats(files, docs)
    table = estimands_table(stats, clock, model="m", actions=list(INTERVENTIONS), draws=10, seed=0)
    rows = _rows(table)
    exact = {
        a: {doc: exact_summary(ref, q, EXACT_H) for doc, ref in REFERENCES.items()}
        for a, q in INTERVENTIONS.items()
    }
    d = clock.branch_depth

    def pooled(a: str, doc_ids: list[str]) -> dict[str, float]:
        ex = [exact[a][doc] for doc in doc_ids]
        n = len(ex)
        mean = lambda key: sum(e[key] for e in ex) / n  # noqa: E731
        div = sum(e["p"].sum() for e in ex) / n
        tau_mass = sum((np.arange(1, EXACT_H + 1) * e["p"]).sum() for e in ex) / n
        cohort = sum(e["p"][:d].sum() for e in ex) / n
        out = {
            "R_smc": mean("R_SMC"),
            "R": mean("R"),
            "F": mean("F"),
            "O_H": mean("O_H"),
            "E_H": mean("E_H"),
            "Pi_H": mean("Pi_H"),
            "C_H": mean("Pi_H") / mean("E_H"),
            "div_prob": div,
            "mean_entry_time": tau_mass / div,
            "branch_cohort_fraction": cohort,
        }
        for t in range(1, EXACT_H + 1):
            out[f"div_cdf@{t}"] = sum(e["div_cdf"][t - 1] for e in ex) / n
        # b_j = E[δ_{τ+j} 1{τ ≤ d}] / P(τ ≤ d) = Σ_s p_s ρ_{s,j} / Σ_s p_s (tower property)
        for j in range(1, d + 1):
            num = sum(
                e["p"][s - 1] * e["rho"][s - 1, j]
                for e in ex
                for s in range(1, d + 1)
                if e["p"][s - 1] > 0
            )
            out[f"branch_tv@{j}"] = num / n / cohort
        return out

    groups = {
        "pooled": list(REFERENCES),
        "exact-a": list(REFERENCES)[:2],
        "exact-b": list(REFERENCES)[2:],
    }
    for stratum, doc_ids in groups.items():
        for a in INTERVENTIONS:
            for name, target in pooled(a, doc_ids).items():
                assert rows[(a, stratum, name)]["value"] == pytest.approx(target, rel=1e-12), (
                    a,
                    stratum,
                    name,
                )
    # the two documents of stratum exact-a have different C_H: the pooled ratio is not their mean
    c = [exact["strong"][doc]["C_H"] for doc in groups["exact-a"]]
    assert abs(c[0] - c[1]) > 0.05
    assert abs(rows[("strong", "exact-a", "C_H")]["value"] - sum(c) / 2) > 1e-3
    # the contrast's gap decomposition from the exact moments (ΔO + ΔE·C̄ + ΔC·Ē)
    for stratum, doc_ids in groups.items():
        m, s = pooled("mild", doc_ids), pooled("strong", doc_ids)
        unit = "mild - strong"
        exposure = (m["E_H"] - s["E_H"]) * (m["C_H"] + s["C_H"]) / 2
        rate = (m["C_H"] - s["C_H"]) * (m["E_H"] + s["E_H"]) / 2
        assert rows[(unit, stratum, "gap_exposure")]["value"] == pytest.approx(exposure, rel=1e-12)
        assert rows[(unit, stratum, "gap_rate")]["value"] == pytest.approx(rate, rel=1e-12)
        assert rows[(unit, stratum, "gap_occurrence")]["value"] == pytest.approx(
            m["O_H"] - s["O_H"], rel=1e-12
        )
