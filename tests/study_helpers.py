"""A small synthetic language-model study (finite-state kernel pairs) run through the real
analysis code, for the figure and table tests: estimands.csv and prediction.csv as the
`estimands` and `prediction` rules write them (`docs/architecture.md`, "File contracts")."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.analysis.prediction import prediction_table
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study

MODELS = {"tiny-llama": 100, "tiny-qwen": 200}
LAMBDAS = {"full": 0.0, "snapkv-512": 0.6, "snapkv-half": 0.2, "recent-half": 0.5}
STUDY2_LAMBDAS = {"full": 0.0, "snapkv-90": 0.15, "recent-90": 0.45}
CONTROL = "full"
STRATA = ["helmet-1024", "ruler-1024", "ruler-2048"]
PAIR = ("snapkv-512", "snapkv-half")
H = 32


def build_study(
    root: Path,
    lambdas: dict[str, float] = LAMBDAS,
    family_size: int = 1,
    pair: tuple[str, str] | None = PAIR,
    draws: int = 60,
) -> tuple[Path, Path | None]:
    """Write ``root/estimands.csv`` (and ``root/prediction.csv`` for ``pair``) for a two-model
    synthetic study with actions ``lambdas`` (Q = (1 − λ)P + λA; the control has λ = 0).

    With ``family_size`` > 1, S_99 and branch_contrast_B get the family-adjusted level (study 2).
    """
    actions = list(lambdas)
    est_frames, pred_frames = [], []
    for model, seed in MODELS.items():
        pairs = {s: stratum_pairs(seed + i, lambdas) for i, s in enumerate(STRATA)}
        files = write_synthetic_study(
            root / model,
            "study1",
            model,
            pairs,
            {"dev": (6, 4), "study1": (8, 4)},
            H=H,
            seed=seed,
            control=CONTROL,
        )
        stats, clock = document_stats(
            {a: list(files[a].values()) for a in actions},
            list(files["documents"].values()),
            control=CONTROL,
        )
        est_frames.append(
            estimands_table(
                stats,
                clock,
                model=model,
                actions=actions,
                control=CONTROL,
                cohort="study1",
                draws=draws,
                seed=seed,
                family_estimands=("S_99", "branch_contrast_B"),
                family_size=family_size,
            )
        )
        if pair is not None:
            pred_frames.append(
                prediction_table(
                    stats, clock, model=model, pair=pair, eval_cohort="study1", draws=draws, folds=3
                )
            )
    est = root / "estimands.csv"
    pl.concat(est_frames).write_csv(est)
    if pair is None:
        return est, None
    pred = root / "prediction.csv"
    pl.concat(pred_frames).write_csv(pred)
    return est, pred
