"""Benchmark: the coupled rollout engine against the per-replicate baseline a user would write.

Both run the same coupled sampler (`docs/method.md`, "The coupled pair" and "Common random
numbers": stepwise maximal coupling with common random numbers, δ_t and f_t every step) on the
same tiny demo model and prompt, after one shared prefill and the same SnapKV-half eviction:

* engine (``kvdiverge.engine.paths_under_action``; `docs/architecture.md`, "Coupled decoding"):
  all K replicates' streams in one batch per step over a shared prompt cache (X and Y rows, and
  a Z row once a replicate's histories split);
* baseline: per replicate, its own copy of the full cache (X) and of the evicted cache (Y, Z)
  in transformers ``DynamicCache``s, a step-by-step batch-1 forward per stream.

Reports coupled token pairs per second (K·H / decoding wall time after a shared prefill and
the selection, both timed apart; median over runs, each (n, K) cell in a fresh subprocess,
engine and baseline interleaved in rounds so that both see the same machine), side by side
with the speed-up (median and range over rounds); the KV memory each approach holds (exact
accounting: the engine's one prompt cache, one evicted copy and at most 3K·H generated
entries, against K per-replicate copies); on CUDA also the peak memory the rollout adds
(``max_memory_allocated``); and checks that both produce the same tokens.
Usage::

    OMP_NUM_THREADS=2 python benchmarks/rollout.py --lengths 1024 4096 --K 8 32 --H 32
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvdiverge.engine import RolloutSettings, paths_under_action, paths_under_actions
from kvdiverge.eviction import parse_action, run_prefill, select_positions
from kvdiverge.models import build_demo_model, eos_token_ids, load_model, load_tokenizer
from kvdiverge.theory.coupling import Stream, crn_uniforms, document_key, maximal_coupling_step, tv

ACTION = parse_action({"selector": "snapkv", "budget": 0.5}, name="snapkv-half")
SEED = 1
DOC = "benchmark/doc"


def _prompt_ids(tokenizer, n: int) -> list[int]:
    text = "The river flows north through the valley, past the old mill and the stone bridge. "
    ids: list[int] = []
    while len(ids) < n:
        ids += tokenizer(text * 50, add_special_tokens=False)["input_ids"]
    return ids[:n]


def _gathered_cache(prefill, kept):
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer, (keys, values) in enumerate(zip(prefill.keys, prefill.values, strict=True)):
        index = kept[layer][..., None].expand(-1, -1, keys.shape[-1])
        cache.update(
            keys.gather(1, index)[None].clone(), values.gather(1, index)[None].clone(), layer
        )
    return cache


@torch.no_grad()
def baseline_rollout(model, prefill, K: int, H: int, eos: list[int]) -> tuple[np.ndarray, float]:
    """Per replicate: own cache copies, batch-1 forwards per stream, the same coupling.

    Returns the (K, H, 2) X/Y tokens and the decoding seconds (after the selection, which is
    the engine's own code and is timed apart, as in the engine).
    """
    device = next(model.parameters()).device
    kept = select_positions(prefill, ACTION)
    start = _clock(device)
    everything = torch.arange(prefill.n, device=device).expand_as(
        kept[..., :1].expand(-1, -1, prefill.n)
    )
    n = prefill.n
    eos_t = torch.tensor(eos, device=device)
    point = torch.zeros(prefill.last_logits.shape[-1], dtype=torch.float64, device=device)
    point[eos[0]] = 1.0
    tokens = np.zeros((K, H, 2), dtype=np.int64)
    for rep in range(K):
        caches = [
            _gathered_cache(prefill, everything),
            _gathered_cache(prefill, kept),
            _gathered_cache(prefill, kept),
        ]
        logits = [prefill.last_logits.float()] * 3
        x_done = y_done = False
        for t in range(1, H + 1):
            p, q, qz = (lg.double().softmax(-1)[None] for lg in logits)
            p = point[None] if x_done else p
            q = point[None] if y_done else q
            qz = point[None] if x_done else qz
            u = np.stack(
                [
                    crn_uniforms(SEED, document_key(DOC), [rep], t, s)
                    for s in (Stream.REFERENCE, Stream.ACCEPT, Stream.RESIDUAL)
                ],
                axis=-1,
            )
            x, y = maximal_coupling_step(p, q, torch.from_numpy(u).to(device))
            tv(p, q), tv(p, qz)  # δ_t and f_t, as the engine computes them
            x_done = x_done or bool(torch.isin(x, eos_t))
            y_done = y_done or bool(torch.isin(y, eos_t))
            tokens[rep, t - 1] = (int(x), int(y))
            if t == H:
                break
            position = torch.tensor([[n + t - 1]], device=device)
            logits = [
                model(
                    input_ids=tok.view(1, 1),
                    position_ids=position,
                    past_key_values=c,
                    use_cache=True,
                ).logits[0, -1]
                for tok, c in zip((x, y, x), caches, strict=True)
            ]
    return tokens, _clock(device) - start


def _clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


STUDY_ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 512}, name="snapkv-512"),
    ACTION,
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({"selector": "full"}, name="full"),
]


def _study(model_dir: str, n: int, K: int, H: int, device: str, rounds: int) -> dict:
    """Study 1's four actions on one document: one job (all rows in one model call per step)
    against one run per action, in the same process, interleaved, best of ``rounds``;
    seconds after the shared prefill (selections included on both sides)."""
    model = load_model(model_dir, device=device)
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model, tokenizer)
    ids = _prompt_ids(tokenizer, n)
    dev = next(model.parameters()).device
    prefill = run_prefill(model, ids, ACTION.window)
    rows = 7 * K  # X, and Y and Z for each of the three evicting actions

    def job() -> dict:
        return paths_under_actions(
            model,
            ids,
            STUDY_ACTIONS,
            DOC,
            K,
            eos,
            RolloutSettings(H, SEED, max_batch_rows=rows),
            prefill=prefill,
        )

    def separate() -> dict:
        return {
            a.name: paths_under_action(
                model,
                ids,
                a,
                DOC,
                K,
                eos,
                RolloutSettings(H, SEED, max_batch_rows=rows),
                prefill=prefill,
            )
            for a in STUDY_ACTIONS
        }

    times: dict[str, list[float]] = {"job": [], "separate": []}
    results = {}
    for _ in range(rounds + 1):  # the first round initialises
        for name, run in (("job", job), ("separate", separate)):
            start = _clock(dev)
            results[name] = run()
            times[name].append(_clock(dev) - start)
    same = np.mean(
        [
            np.array_equal(results["job"][a.name].y_token, results["separate"][a.name].y_token)
            for a in STUDY_ACTIONS
        ]
    )
    return {
        "n": n,
        "K": K,
        "job_seconds": min(times["job"][1:]),
        "separate_seconds": min(times["separate"][1:]),
        "same_tokens": float(same),
    }


def _cell(model_dir: str, n: int, K: int, H: int, device: str, rounds: int) -> dict:
    """Engine against baseline on one (n, K) cell, interleaved in one process.

    After one untimed run of each (initialisation; on CUDA the peak memory each adds), every
    round times three engine runs and one baseline run back to back, so that both see the
    same machine; the round's speed-up is the baseline's seconds over the engine's median.
    Reported: median seconds of each method over all its runs and the median, minimum and
    maximum of the per-round speed-ups.
    """
    model = load_model(model_dir, device=device)
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model, tokenizer)
    ids = _prompt_ids(tokenizer, n)
    dev = next(model.parameters()).device

    start = _clock(dev)
    prefill = run_prefill(model, ids, ACTION.window)  # shared by both methods, timed apart
    prefill_seconds = _clock(dev) - start
    start = _clock(dev)
    select_positions(prefill, ACTION)  # the same code for both methods: timed apart
    selection_seconds = _clock(dev) - start

    def engine() -> tuple[np.ndarray, float]:  # decode seconds as the engine measures them
        r = paths_under_action(
            model,
            ids,
            ACTION,
            DOC,
            K,
            eos,
            RolloutSettings(H, SEED, max_batch_rows=3 * K),
            prefill=prefill,
        )
        return np.stack([r.x_token, r.y_token], axis=-1), r.decode_seconds

    def baseline() -> tuple[np.ndarray, float]:
        return baseline_rollout(model, prefill, K, H, eos)

    tokens, peaks = {}, {}
    for name, run in (("engine", engine), ("baseline", baseline)):
        if dev.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        tokens[name], _ = run()
        if dev.type == "cuda":
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    times: dict[str, list[float]] = {"engine": [], "baseline": []}
    ratios = []
    for _ in range(rounds):
        round_engine = []
        for _ in range(3):
            again, seconds = engine()
            assert np.array_equal(again, tokens["engine"])  # reruns are bit-identical
            round_engine.append(seconds)
        again, seconds = baseline()
        assert np.array_equal(again, tokens["baseline"])
        times["engine"] += round_engine
        times["baseline"].append(seconds)
        ratios.append(seconds / float(np.median(round_engine)))
    entry = 2 * len(prefill.keys) * prefill.keys[0].shape[0] * prefill.head_dim
    entry *= prefill.keys[0].element_size()
    n_keep = ACTION.n_keep(prefill.n)
    shared_kv = entry * (prefill.n + n_keep + 3 * K * (H - 1))  # engine: one copy of each part
    copies_kv = entry * (prefill.n + K * (prefill.n + 2 * n_keep + 3 * (H - 1)))  # K copies
    return {
        "n": n,
        "K": K,
        "prefill_seconds": prefill_seconds,
        "selection_seconds": selection_seconds,
        "engine_pairs_per_s": K * H / float(np.median(times["engine"])),
        "baseline_pairs_per_s": K * H / float(np.median(times["baseline"])),
        "speedup": float(np.median(ratios)),
        "speedup_min": min(ratios),
        "speedup_max": max(ratios),
        "peak_mb": peaks,
        "shared_kv_mb": shared_kv / 2**20,
        "copies_kv_mb": copies_kv / 2**20,
        "same_tokens": float(np.mean(tokens["engine"] == tokens["baseline"])),
        "device": str(dev),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--K", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per cell")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "N", "K"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        method, n, k = args.one[0], int(args.one[1]), int(args.one[2])
        run = _study if method == "study" else _cell
        print(json.dumps(run(args.model_dir, n, k, args.H, args.device, args.rounds)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_demo_model("llama", Path(tmp) / "tiny-llama", seed=0))
        cells, studies = [], []
        for n in args.lengths:
            for k in args.K:
                for method, out in (("cell", cells), ("study", studies)):
                    cmd = [sys.executable, __file__, "--one", method, str(n), str(k)]
                    cmd += ["--H", str(args.H), "--device", args.device, "--model-dir", model_dir]
                    cmd += ["--rounds", str(args.rounds)]
                    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    out.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"done n={n} K={k}", file=sys.stderr, flush=True)
    c0 = cells[0]
    print(
        f"device {c0['device']}, torch threads {c0['threads']}, H = {args.H}, "
        f"action {ACTION.name}, tiny Llama demo model (2 layers, hidden 64, GQA 4/2), "
        f"{args.rounds} rounds per cell (each: 3 engine runs, 1 baseline run, back to back). "
        "Throughput: decoding only, median over runs (after one shared prefill and the SnapKV "
        "selection, the same code for both methods, timed apart: "
        + ", ".join(
            f"n={c['n']}: prefill {c['prefill_seconds']:.2f} s, "
            f"selection {c['selection_seconds']:.3f} s"
            for c in cells
            if c["K"] == args.K[0]
        )
        + "); speed-up: median [min–max] over rounds of baseline seconds / engine seconds; "
        "peak: CUDA memory added by the rollout (not measured on CPU); KV held (exact): the "
        "engine's prompt cache, evicted copy and at most 3K·H generated entries, against K "
        "per-replicate copies.\n"
    )
    print(
        "| prompt n | K | engine pairs/s | baseline pairs/s | speed-up | "
        "engine peak MB | baseline peak MB | KV held: shared MB | KV if K copies MB | same tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in cells:
        peak = {
            m: f"{c['peak_mb'][m]:.1f}" if m in c["peak_mb"] else "—"
            for m in ("engine", "baseline")
        }
        print(
            f"| {c['n']} | {c['K']} | {c['engine_pairs_per_s']:.0f} | "
            f"{c['baseline_pairs_per_s']:.1f} | {c['speedup']:.1f}× "
            f"[{c['speedup_min']:.1f}–{c['speedup_max']:.1f}] | {peak['engine']} | "
            f"{peak['baseline']} | {c['shared_kv_mb']:.2f} | {c['copies_kv_mb']:.2f} | "
            f"{c['same_tokens']:.1%} |"
        )
    print(
        "\nA study's job: study 1's four actions (SnapKV-512, SnapKV-half, recent-half, full) on "
        "one document, one job (X shared; X, Y and Z rows of every action in one model call "
        "per step) against one run per action (each with its own X rows), seconds after the "
        "shared prefill, selections included, interleaved in one process, best of "
        f"{args.rounds}:\n"
    )
    print("| prompt n | K | one job s | one run per action s | speed-up | same tokens |")
    print("|---:|---:|---:|---:|---:|---:|")
    for st in studies:
        print(
            f"| {st['n']} | {st['K']} | {st['job_seconds']:.3f} | {st['separate_seconds']:.3f} | "
            f"{st['separate_seconds'] / st['job_seconds']:.1f}× | {st['same_tokens']:.0%} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
