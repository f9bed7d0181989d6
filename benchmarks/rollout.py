"""Benchmark: the coupled rollout engine against the per-replicate baseline a user would write.

Both run the same coupled sampler (SPEC §1, §6: stepwise maximal coupling with common random
numbers, δ_t and f_t every step) on the same tiny demo model and prompt, after one shared
prefill and the same SnapKV-half eviction:

* engine (``kvdiverge.engine.rollout_document``, DESIGN §4): all K replicates' streams in one
  batch per step over a shared prompt cache (X and Y rows, and a Z row once a replicate's
  histories split);
* baseline: per replicate, its own copy of the full cache (X) and of the evicted cache (Y, Z)
  in transformers ``DynamicCache``s, a step-by-step batch-1 forward per stream.

Reports coupled token pairs per second (K·H / decoding wall time after a shared prefill and
the selection, both timed apart; best of ``--repeats`` runs, each cell in a fresh
subprocess), side by side with the speed-up; the KV memory each approach holds (exact
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
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvdiverge.coupling import Stream, crn_uniforms, document_key, maximal_coupling_step, tv
from kvdiverge.engine import rollout_document
from kvdiverge.eviction import parse_action, run_prefill, select_positions
from kvdiverge.models import build_demo_model, eos_token_ids, load_model, load_tokenizer

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


def _one(method: str, model_dir: str, n: int, K: int, H: int, device: str, repeats: int) -> dict:
    model = load_model(model_dir, device=device)
    tokenizer = load_tokenizer(model_dir)
    eos = eos_token_ids(model, tokenizer)
    ids = _prompt_ids(tokenizer, n)
    dev = next(model.parameters()).device

    start = time.perf_counter()
    prefill = run_prefill(model, ids, ACTION.window)  # shared by both methods, timed apart
    prefill_seconds = time.perf_counter() - start

    def run() -> tuple[np.ndarray, float]:
        if method == "engine":  # decode seconds as the engine measures them (after selection)
            r = rollout_document(
                model, ids, ACTION, DOC, K, H, SEED, eos, max_batch_rows=3 * K, prefill=prefill
            )
            return np.stack([r.x_token, r.y_token], axis=-1), r.decode_seconds
        return baseline_rollout(model, prefill, K, H, eos)

    def usage() -> int:
        if dev.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = usage() if dev.type != "cuda" else torch.cuda.memory_allocated()
    tokens, _ = run()  # first run: peak memory (and one-time initialisation)
    peak = usage() - base
    times = []
    for _ in range(repeats):  # best of `repeats`: the machine may be shared
        again, decode_seconds = run()
        times.append(decode_seconds)
        assert np.array_equal(tokens, again)
    seconds = min(times)
    start = _clock(dev)
    select_positions(prefill, ACTION)  # the same code for both methods: reported apart
    selection_seconds = _clock(dev) - start
    entry = 2 * len(prefill.keys) * prefill.keys[0].shape[0] * prefill.head_dim
    entry *= prefill.keys[0].element_size()
    n_keep = ACTION.n_keep(prefill.n)
    shared_kv = entry * (prefill.n + n_keep + 3 * K * (H - 1))  # engine: one copy of each part
    copies_kv = entry * (prefill.n + K * (prefill.n + 2 * n_keep + 3 * (H - 1)))  # K copies
    return {
        "method": method,
        "n": n,
        "K": K,
        "H": H,
        "seconds": seconds,
        "prefill_seconds": prefill_seconds,
        "selection_seconds": selection_seconds,
        "pairs_per_s": K * H / seconds,
        "peak_mb": peak / 2**20,
        "shared_kv_mb": shared_kv / 2**20,
        "copies_kv_mb": copies_kv / 2**20,
        "tokens": tokens.tolist(),
        "device": str(dev),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--K", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per cell (best kept)")
    parser.add_argument("--one", nargs=3, metavar=("METHOD", "N", "K"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        method, n, k = args.one[0], int(args.one[1]), int(args.one[2])
        print(json.dumps(_one(method, args.model_dir, n, k, args.H, args.device, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_demo_model("llama", Path(tmp) / "tiny-llama", seed=0))
        rows = []
        for n in args.lengths:
            for k in args.K:
                cell = {}
                for method in ("engine", "baseline"):
                    cmd = [sys.executable, __file__, "--one", method, str(n), str(k)]
                    cmd += ["--H", str(args.H), "--device", args.device, "--model-dir", model_dir]
                    cmd += ["--repeats", str(args.repeats)]
                    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
                    cell[method] = json.loads(out.stdout.strip().splitlines()[-1])
                e, b = cell["engine"], cell["baseline"]
                same = np.mean(np.array(e["tokens"]) == np.array(b["tokens"]))
                rows.append((n, k, e, b, same))
                print(f"done n={n} K={k}", file=sys.stderr, flush=True)
    e0 = rows[0][2]
    print(
        f"device {e0['device']}, torch threads {e0['threads']}, H = {args.H}, "
        f"action {ACTION.name}, tiny Llama demo model (2 layers, hidden 64, GQA 4/2). "
        "Throughput: decoding only (after one shared prefill and the SnapKV selection, the "
        "same code for both methods, timed apart: "
        + ", ".join(
            f"n={n}: prefill {e['prefill_seconds']:.2f} s, selection {e['selection_seconds']:.3f} s"
            for n, k, e, _, _ in rows
            if k == args.K[0]
        )
        + "); peak: CUDA memory added by the rollout (not measured on CPU, where a few MB of "
        "peak-RSS growth is allocator noise); KV held (exact): the engine's prompt cache, "
        "evicted copy and generated entries, against K per-replicate copies (a batched "
        "baseline).\n"
    )
    print(
        "| prompt n | K | engine pairs/s | baseline pairs/s | speed-up | "
        "engine peak MB | baseline peak MB | KV held: shared MB | KV if K copies MB | same tokens |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def peak(cell: dict) -> str:  # CPU peak-RSS growth of a few MB is allocator noise
        return f"{cell['peak_mb']:.1f}" if cell["device"].startswith("cuda") else "—"

    for n, k, e, b, same in rows:
        print(
            f"| {n} | {k} | {e['pairs_per_s']:.0f} | {b['pairs_per_s']:.1f} | "
            f"{e['pairs_per_s'] / b['pairs_per_s']:.1f}× | {peak(e)} | {peak(b)} | "
            f"{e['shared_kv_mb']:.2f} | {e['copies_kv_mb']:.2f} | "
            f"{same:.1%} |"
        )


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
