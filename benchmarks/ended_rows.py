"""Benchmark: ended rows leaving the decoding batch, on the trained demo models.

A row whose stream has emitted EOS (X, Y, or Z once X has) has a point-mass kernel from then
on; the engine drops such rows from the batch once they are a quarter of it
(``kvdiverge.engine``). This script runs study 1's four actions (SnapKV-512, SnapKV-half,
recent-half, full) on held-out RULER needle prompts with the committed trained models, once
with ended rows dropped and once with every row kept (``RolloutSettings.drop_ended``), interleaved,
and prints decoding seconds side by side with the share of paths whose X has ended by H and
whether both runs give the same tokens. The gain grows with the share of row-steps after EOS,
so with H and with how briefly the model answers.

Usage::

    OMP_NUM_THREADS=2 python benchmarks/ended_rows.py --H 32 64 --K 16
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import kvdiverge.engine as engine
from kvdiverge.engine import RolloutSettings
from kvdiverge.eviction import parse_action
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer
from kvdiverge.models.training import heldout_samples

ROOT = Path(__file__).resolve().parents[1]
ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 512}, name="snapkv-512"),
    parse_action({"selector": "snapkv", "budget": 0.5}, name="snapkv-half"),
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({"selector": "full"}, name="full"),
]


def _run(model, prompts, K: int, H: int, eos: list[int], drop: bool) -> tuple[float, list]:
    seconds, results = 0.0, []
    for j, ids in enumerate(prompts):
        start = time.perf_counter()
        out = engine.paths_under_actions(
            model, ids, ACTIONS, f"doc-{j}", K, eos, RolloutSettings(H, 1, drop_ended=drop)
        )
        seconds += time.perf_counter() - start
        results.append(out)
    return seconds, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-llama", "tiny-qwen"])
    parser.add_argument("--H", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--K", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--per-task", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name in args.models:
        path = ROOT / "data" / "models" / name
        model, tokenizer = load_model(str(path), device="cpu"), load_tokenizer(str(path))
        eos = eos_token_ids(model, tokenizer)
        samples = heldout_samples(
            tokenizer, 7, ("niah_single_1", "niah_single_2"), args.lengths, args.per_task
        )
        prompts = [chat_prompt_ids(tokenizer, sample.prompt) for _, sample in samples]
        for H in args.H:
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for drop in (True, False):
                    seconds, results = _run(model, prompts, args.K, H, eos, drop)
                    times[drop].append(seconds)
                    tokens = [[(r.x_token, r.y_token) for r in out.values()] for out in results]
                    if drop:
                        dropped = tokens
                        ended = np.mean([out["full"].x_eos[:, -1].mean() for out in results])
                    else:
                        same = all(
                            np.array_equal(a, b)
                            for d, k in zip(dropped, tokens, strict=True)
                            for pa, pb in zip(d, k, strict=True)
                            for a, b in zip(pa, pb, strict=True)
                        )
            drop_s, keep_s = np.median(times[True]), np.median(times[False])
            rows.append((name, H, len(prompts), ended, drop_s, keep_s, same))
    print(
        f"torch threads {torch.get_num_threads()}, K = {args.K}, study 1's four actions, "
        f"{len(prompts)} held-out needle prompts per model ({', '.join(map(str, args.lengths))} "
        f"tokens), median of {args.rounds} interleaved rounds, seconds over all prompts:\n"
    )
    print(
        "| model | H | prompts | X ended by H | rows dropped s | rows kept s | speed-up "
        "| same tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, H, n, ended, drop_s, keep_s, same in rows:
        print(
            f"| {name} | {H} | {n} | {ended:.0%} | {drop_s:.2f} | {keep_s:.2f} | "
            f"{keep_s / drop_s:.2f}× | {'yes' if same else 'no'} |"
        )


if __name__ == "__main__":
    main()
