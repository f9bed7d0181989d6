"""Benchmark: SWRB against naive coupled rollouts on language models, at equal cost.

For each model (SmolLM2-135M-Instruct in float32, the tiny Llama demo model) and each action
(study 1's ``snapkv-512`` and ``recent-512`` on ~768-token prompts, study 2's ``snapkv-90`` and
``recent-90``), every document runs K naive coupled rollouts
(:func:`kvdiverge.engine.document.paths_under_actions`) and K SWRB replicates
(:func:`kvdiverge.engine.swrb_rollout.swrb_rollout_document`) on one shared prefill. Per estimand
(R_SMC, O_H, Π_H, the divergence CDF at t = 8, 32 and H) it reports:

* both estimators' means (they estimate the same number; ± the standard error over replicates);
* the variance ratio naive/SWRB: per-replicate variances within each document, averaged over
  documents, then the ratio;
* the cost of each in model row-steps per replicate: naive, the X and Y rows of the action alone
  until their EOS over steps 2..H (the engine's fixed-history rows Z are needed by neither
  estimator and are not counted); SWRB, the scan's two rows per evaluated step after the first
  plus the continuation's running sides (``docs/method.md``, "Survival-weighted residual
  branching");
* the variance–cost advantage (naive variance × naive cost) / (SWRB variance × SWRB cost): above 1,
  SWRB reaches a given precision for less compute;
* the gain where the reported intervals live, the document bootstrap: its variance is
  (σ_b² + σ_w²/K)/n and SWRB shrinks only σ_w², so the document-level variance ratio at K
  replicates is (σ_b² + σ_w,naive²/K) / (σ_b² + σ_w,SWRB²/K), with σ_b² the variance of the
  documents' means between documents (the naive means' sample variance minus σ_w,naive²/K,
  clipped at 0; rough with few documents), at ``--doc-K`` (the default's evaluation K, 3).

Wall seconds of each run are reported too (naive: the engine's one batch for all actions, the X
rows shared; SWRB: its scan and continuation batches for all actions). The machine is shared,
so seconds are indicative; row-steps are the cost measure.

Usage::

    python benchmarks/swrb_lm.py                        # both models, defaults below
    python benchmarks/swrb_lm.py --models tiny --docs 4 --K 32 --H 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import document_prompts  # noqa: E402

from kvdiverge.analysis.swrb import naive_replicate_values, swrb_replicate_values  # noqa: E402
from kvdiverge.engine import RolloutSettings, paths_under_actions  # noqa: E402
from kvdiverge.engine.swrb_rollout import swrb_rollout_document  # noqa: E402
from kvdiverge.eviction import parse_action, run_prefill  # noqa: E402
from kvdiverge.models import eos_token_ids, load_model, load_tokenizer  # noqa: E402

MODELS = {"smollm2": ROOT / "data/models/smollm2", "tiny": ROOT / "data/models/tiny-llama"}
ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 512}, name="snapkv-512"),
    parse_action({"selector": "recent", "budget": 512}, name="recent-512"),
    parse_action({"selector": "snapkv", "budget": 0.9}, name="snapkv-90"),
    parse_action({"selector": "recent", "budget": 0.9}, name="recent-90"),
]


def naive_cost(x_eos: np.ndarray, y_eos: np.ndarray) -> np.ndarray:
    """Row-steps of one action's naive rollout alone: X and Y rows over steps 2..H while they
    have not emitted EOS (the flags read "at or before t")."""
    return (~x_eos[:, :-1]).sum(1) + (~y_eos[:, :-1]).sum(1)


def estimand_names(H: int) -> list[str]:
    cdf = sorted({t for t in (8, 32, H) if t <= H})
    return ["R_smc", "O_H", "Pi_H", *(f"div_cdf@{t}" for t in cdf)]


def run_model(
    name: str, n_docs: int, K: int, H: int, n: int, seed: int, doc_K: int = 3
) -> list[dict]:
    model = load_model(str(MODELS[name]), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(MODELS[name]))
    eos = eos_token_ids(model, tokenizer)
    prompts = document_prompts(tokenizer, n - H, n_docs)
    per: dict[str, dict[str, list]] = {a.name: {} for a in ACTIONS}
    seconds = {"naive": 0.0, "swrb": 0.0}
    for d, ids in enumerate(prompts):
        doc_id = f"bench/{name}/{d}"
        prefill = run_prefill(model, ids, actions=ACTIONS)
        start = time.perf_counter()
        naive = paths_under_actions(
            model,
            ids,
            ACTIONS,
            doc_id,
            K,
            eos,
            RolloutSettings(H, seed, max_batch_rows=100_000),
            prefill,
        )
        seconds["naive"] += time.perf_counter() - start
        start = time.perf_counter()
        swrb = swrb_rollout_document(model, ids, ACTIONS, doc_id, K, eos, H, seed, prefill=prefill)
        seconds["swrb"] += time.perf_counter() - start
        for a in ACTIONS:
            nv, sw = naive[a.name], swrb[a.name]
            values = {
                "naive": naive_replicate_values(nv.x_token != nv.y_token),
                "swrb": swrb_replicate_values(sw.e, sw.entry, sw.mismatch),
            }
            costs = {"naive": naive_cost(nv.x_eos, nv.y_eos), "swrb": sw.cost}
            for kind in ("naive", "swrb"):
                per[a.name].setdefault(f"cost_{kind}", []).append(costs[kind].mean())
                for est in estimand_names(H):
                    v = values[kind][est]
                    per[a.name].setdefault(f"{est}_{kind}_mean", []).append(v.mean())
                    per[a.name].setdefault(f"{est}_{kind}_var", []).append(v.var(ddof=1))
            per[a.name].setdefault("mean_M", []).append(sw.weight.mean())
        print(f"  {name} document {d}: n = {len(ids)}, {seconds}", flush=True)
    rows = []
    for a in ACTIONS:
        p = {k: np.asarray(v) for k, v in per[a.name].items()}
        cn, cs = p["cost_naive"].mean(), p["cost_swrb"].mean()
        for est in estimand_names(H):
            vn, vs = p[f"{est}_naive_var"].mean(), p[f"{est}_swrb_var"].mean()
            ratio = vn / vs if vs > 0 else float("inf") if vn > 0 else float("nan")
            means = p[f"{est}_naive_mean"]
            between = max(float(means.var(ddof=1)) - vn / K, 0.0) if means.size > 1 else np.nan
            doc_naive, doc_swrb = between + vn / doc_K, between + vs / doc_K
            doc_ratio = doc_naive / doc_swrb if doc_swrb > 0 else float("nan")
            rows.append(
                {
                    "model": name,
                    "action": a.name,
                    "estimand": est,
                    "naive": p[f"{est}_naive_mean"].mean(),
                    "naive_se": np.sqrt(vn / (K * n_docs)),
                    "swrb": p[f"{est}_swrb_mean"].mean(),
                    "swrb_se": np.sqrt(vs / (K * n_docs)),
                    "var_ratio": ratio,
                    "cost_naive": cn,
                    "cost_swrb": cs,
                    "advantage": ratio * cn / cs,
                    "P_div": p["mean_M"].mean(),
                    "sigma_b2": between,
                    "doc_ratio": doc_ratio,
                    "doc_K": doc_K,
                }
            )
    print(f"  {name}: seconds {seconds}", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | action | P(τ≤H) | estimand | naive | SWRB | var naive/SWRB "
        "| row-steps naive | row-steps SWRB | advantage | σ_b² | document-level var ratio "
        "(K) |\n" + "|---" * 12 + "|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['action']} | {r['P_div']:.3f} | {r['estimand']} "
            f"| {r['naive']:.4f} ± {r['naive_se']:.4f} | {r['swrb']:.4f} ± {r['swrb_se']:.4f} "
            f"| {r['var_ratio']:.2f} | {r['cost_naive']:.1f} | {r['cost_swrb']:.1f} "
            f"| {r['advantage']:.2f} | {r['sigma_b2']:.2e} | {r['doc_ratio']:.2f} ({r['doc_K']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=list(MODELS))
    parser.add_argument("--docs", type=int, default=2, help="documents per model")
    parser.add_argument("--K", type=int, default=16, help="replicates per document and action")
    parser.add_argument("--H", type=int, default=32, help="horizon")
    parser.add_argument("--n", type=int, default=768, help="prompt + H tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--doc-K", type=int, default=3, help="K of the document-level ratio")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    rows = []
    for name in args.models:
        print(f"{name}: {args.docs} documents, K = {args.K}, H = {args.H}", flush=True)
        rows += run_model(name, args.docs, args.K, args.H, args.n, args.seed, args.doc_K)
    print(markdown(rows))


if __name__ == "__main__":
    main()
