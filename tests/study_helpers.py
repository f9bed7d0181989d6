"""A small synthetic language-model study (finite-state kernel pairs) run through the real
analysis code, for the figure and table tests: estimands.csv and prediction.csv as the
`estimands` and `prediction` rules write them (`docs/architecture.md`, "File contracts")."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import yaml

from kvdiverge.analysis.document_stats import document_stats
from kvdiverge.analysis.estimands import estimands_table
from kvdiverge.analysis.prediction import prediction_table
from kvdiverge.analysis.prespecification import make_lock, prespecified, write_lock
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.config import validate_config
from kvdiverge.eviction import parse_action

MODELS = {"tiny-llama": 100, "tiny-qwen": 200}
LAMBDAS = {"full": 0.0, "snapkv-512": 0.6, "snapkv-half": 0.2, "recent-half": 0.5}
STUDY2_LAMBDAS = {"full": 0.0, "snapkv-90": 0.15, "recent-90": 0.45}
CONTROL = "full"
STRATA = ["helmet-1024", "ruler-1024", "ruler-2048"]
PAIR = ("snapkv-512", "snapkv-half")
H = 32
ROOT = Path(__file__).resolve().parents[1]


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


def build_accuracy(folder: Path, lambdas: dict[str, float] = LAMBDAS, draws: int = 60) -> None:
    """Write the `accuracy` rule's outputs for the study with actions ``lambdas`` into
    ``folder`` (``tables/`` and ``figures/``) from synthetic per-document accuracy statistics:
    paths of an action with larger λ diverge earlier and score lower on Y (the control's
    shares all 'never')."""
    from kvdiverge.analysis.accuracy import ACCURACY_STATS, accuracy_table, write_accuracy
    from kvdiverge.plots.accuracy import write_accuracy_figure
    from kvdiverge.tables import write_accuracy_table

    rng = np.random.default_rng(5)
    actions = [a for a in lambdas if a != CONTROL]
    frames = []
    for model in MODELS:
        rows = []
        for stratum in STRATA:
            for d in range(6):
                acc_x = rng.uniform(0.4, 1.0)
                for action in actions:
                    lam = lambdas[action]
                    share = np.array([lam, (1 - lam) / 2, (1 - lam) / 2])
                    acc_x_at = acc_x * share
                    acc_y_at = acc_x_at * np.array([1 - lam, 1 - lam / 2, 1.0])
                    row = {"doc_id": f"{stratum}-{d}", "action": action, "stratum": stratum}
                    row |= {"cohort": "study1", "n_paths": 4, "acc_x": acc_x}
                    row["acc_y"] = float(acc_y_at.sum())
                    for k, c in enumerate(("early", "late", "never")):
                        row |= {f"share@{c}": share[k], f"acc_x@{c}": acc_x_at[k]}
                        row[f"acc_y@{c}"] = acc_y_at[k]
                    rows.append(row)
        stats = pl.DataFrame(rows).select(
            "doc_id", "action", "stratum", "cohort", "n_paths", *ACCURACY_STATS
        )
        frames.append(accuracy_table(stats, model=model, actions=actions, draws=draws, seed=7))
    tables, figures = folder / "tables", folder / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    figures.mkdir(parents=True, exist_ok=True)
    csv = tables / "accuracy.csv"
    write_accuracy(pl.concat(frames), csv)
    outputs = [tables / f"table_accuracy.{e}" for e in ("csv", "md", "tex", "html")]
    write_accuracy_table(csv, outputs, actions)
    write_accuracy_figure(csv, figures / "accuracy.png", figures / "accuracy.pdf", actions)


def build_lock(folder: Path, study: str) -> Path:
    """``folder/lock.json``: a real lock of the default config's ``study`` (no registration
    record), written as rule prespecify writes one, for rules that name the lock they come from."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    actions = {
        name: parse_action({"name": name, **a}).as_dict() for name, a in config["actions"].items()
    }
    spec = prespecified(config, study, STRATA, actions)
    plan = {"study": study, "K": 2, "K_planned": 2, "K_source": "plan", "notes": [], "plans": []}
    folder.mkdir(parents=True, exist_ok=True)
    write_lock(make_lock(spec, plan), folder / "lock.json")
    return folder / "lock.json"
