"""Speed of the Section 5 analysis on a paper-sized synthetic study (issue #5).

288 documents (6 strata × 48) × 3 actions × K = 64 replicates × H = 128 steps: 7.1M trajectory
rows, written in the trajectory schema from finite-state kernel pairs
(:mod:`kvdiverge.analysis.synthetic`). Timed:

* ``document_stats``: trajectory files → one row per (document, action);
* ``estimands_table`` with 2,000 and 10,000 bootstrap draws: every estimand and contrast, pooled
  and per stratum (weights matrix × statistics);
* naive baselines, per draw: (a) resample documents within strata with polars and recompute
  every estimand from polars group-by means of the document statistics; (b) resample
  trajectories and recompute R_SMC, O_H, E_H, Π_H with polars group-bys over the 7.1M rows.
  Both are timed on a few draws and extrapolated linearly to 2,000 and 10,000 draws.

Run: ``OMP_NUM_THREADS=2 python benchmarks/analysis.py [--docs-per-stratum 48] [--K 64]``.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import numpy as np
import polars as pl

from kvdiverge.analysis.document_stats import document_stats, stat_columns
from kvdiverge.analysis.estimands import action_estimands, estimands_table
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study

ACTIONS = {"snapkv-512": 0.6, "snapkv-half": 0.2, "recent-half": 0.7}
STRATA = [f"{env}-{n}k" for env in ("helmet", "ruler") for n in (4, 16, 32)]


def naive_stats_draw(stats: pl.DataFrame, rng: np.random.Generator, clock, actions) -> dict:
    """One naive draw: polars resampling within strata, group-by means, every estimand."""
    docs = stats.filter(pl.col("action") == actions[0]).select("doc_id", "stratum")
    picks = []
    for (_stratum,), group in docs.group_by("stratum"):
        ids = group["doc_id"].to_numpy()
        picks.append(pl.DataFrame({"doc_id": rng.choice(ids, size=ids.size, replace=True)}))
    sample = pl.concat(picks).join(stats, on="doc_id", how="inner")
    sample = sample.with_columns(cohort_any=(pl.col("cohort_paths") > 0).cast(pl.Float64))
    names = [*stat_columns(clock), "n_paths", "cohort_paths", "cohort_any"]
    out = {}
    for keys in (["action"], ["action", "stratum"]):
        means = sample.group_by(keys).agg(pl.col(names).mean()).sort(keys)
        arrays = {n: means[n].to_numpy() for n in names}
        out[tuple(keys)] = action_estimands(arrays, clock, docs.height)
    return out


def naive_trajectory_draw(traj: pl.LazyFrame, docs: pl.DataFrame, rng, H: int) -> pl.DataFrame:
    """One naive draw from trajectories: R_SMC, O_H, E_H, Π_H by polars group-bys."""
    picks = []
    for (_stratum,), group in docs.group_by("stratum"):
        ids = group["doc_id"].to_numpy()
        picks.append(pl.DataFrame({"doc_id": rng.choice(ids, size=ids.size, replace=True)}))
    weights = pl.concat(picks).group_by("doc_id").len("w").lazy()
    per_path = (
        traj.join(weights, on="doc_id")
        .group_by("action", "doc_id", "replicate")
        .agg(
            pl.col("w").first(),
            d=pl.col("mismatch").mean(),
            tau=pl.when(pl.col("mismatch").any())
            .then(pl.col("mismatch").arg_max() + 1)
            .otherwise(H + 1),
        )
        .with_columns(
            exposure=(H - pl.col("tau")).clip(lower_bound=0) / H,
            occurred=(pl.col("tau") <= H).cast(pl.Float64),
        )
    )
    per_doc = per_path.group_by("action", "doc_id").agg(
        pl.col("w").first(), pl.col("d", "exposure", "occurred").mean()
    )
    return (
        per_doc.group_by("action")
        .agg(
            R_smc=(pl.col("d") * pl.col("w")).sum() / pl.col("w").sum(),
            O_H=(pl.col("occurred") * pl.col("w")).sum() / pl.col("w").sum() / H,
            E_H=(pl.col("exposure") * pl.col("w")).sum() / pl.col("w").sum(),
        )
        .with_columns(Pi_H=pl.col("R_smc") - pl.col("O_H"))
        .collect()
    )


def main() -> None:
    """Build the synthetic study, time every stage, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs-per-stratum", type=int, default=48)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--H", type=int, default=128)
    parser.add_argument("--naive-draws", type=int, default=5)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        pairs = {s: stratum_pairs(10 + i, ACTIONS, n_states=12) for i, s in enumerate(STRATA)}
        files = write_synthetic_study(
            tmp, "study1", "m", pairs, {"study1": (args.docs_per_stratum, args.K)}, args.H, seed=1
        )
        n_rows = sum(
            pl.scan_parquet(p).select(pl.len()).collect().item()
            for a in ACTIONS
            for p in files[a].values()
        )
        rows.append(("synthetic study written (not timed as analysis)", time.perf_counter() - t0))

        t0 = time.perf_counter()
        stats, clock = document_stats(
            {a: list(files[a].values()) for a in ACTIONS}, list(files["documents"].values())
        )
        rows.append(("document_stats (7.1M rows → document table)", time.perf_counter() - t0))

        for draws in (2000, 10_000):
            t0 = time.perf_counter()
            table = estimands_table(
                stats, clock, model="m", actions=list(ACTIONS), draws=draws, seed=0
            )
            rows.append(
                (
                    f"estimands_table, {draws:,} draws ({table.height:,} rows)",
                    time.perf_counter() - t0,
                )
            )

        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for _ in range(args.naive_draws):
            naive_stats_draw(stats, rng, clock, list(ACTIONS))
        per_draw = (time.perf_counter() - t0) / args.naive_draws
        for draws in (2000, 10_000):
            rows.append(
                (
                    f"naive (a) per-draw polars group-by of doc stats, {draws:,} draws*",
                    per_draw * draws,
                )
            )

        traj = pl.concat(
            [
                pl.scan_parquet(list(map(str, files[a].values()))).with_columns(action=pl.lit(a))
                for a in ACTIONS
            ]
        ).select("action", "doc_id", "replicate", "t", "mismatch")
        docs = stats.filter(pl.col("action") == next(iter(ACTIONS))).select("doc_id", "stratum")
        n_traj = max(1, args.naive_draws // 2)
        t0 = time.perf_counter()
        for _ in range(n_traj):
            naive_trajectory_draw(traj, docs, rng, args.H)
        per_traj = (time.perf_counter() - t0) / n_traj
        for draws in (2000, 10_000):
            rows.append(
                (
                    f"naive (b) per-draw group-by of trajectories (4 estimands), {draws:,}*",
                    per_traj * draws,
                )
            )

    print(
        f"\n{args.docs_per_stratum * len(STRATA)} documents × {len(ACTIONS)} actions × "
        f"K = {args.K} × H = {args.H} = {n_rows:,} trajectory rows; "
        f"{stats.height} document-stat rows × {len(stat_columns(clock))} statistics\n"
    )
    print("| stage | seconds |\n|---|---|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.1f} |")
    print(
        f"\n* extrapolated from {args.naive_draws} (a) and {n_traj} (b) timed draws: "
        f"{per_draw * 1e3:.0f} ms and {per_traj * 1e3:.0f} ms per draw."
    )


if __name__ == "__main__":
    main()
