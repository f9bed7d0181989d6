"""Device check: the rollout engine on an accelerator, as one short prepared script.

For a session that is lent a GPU (none has been yet). Prints, for the tiny demo Llama and
Qwen2 models built here (random weights, the engine tests' seed):

1. torch, CUDA and device names;
2. per architecture and dtype (float32, bfloat16): the fused attention kernel the engine
   validated and chose (``kvdiverge.engine.kernels.registry.choose``), and the largest difference
   between the engine's next-token laws (P on X's history, Q on Y's, Q on X's) and a plain
   transformers forward over an explicitly gathered cache on the same device, over every step
   of K = 4 replicates, H = 24 (`docs/architecture.md`, "Shared-prefix attention"; float32
   should be ≤ 1e-5 as on CPU);
3. optionally ``benchmarks/rollout.py`` on the device (``--benchmark``), for
   ``benchmarks/README.md``;
4. optionally (``--throughput``) the table of ``benchmarks/throughput.py`` on the device —
   decode row-steps/s and model GFLOP/s, prefill tokens/s and GFLOP/s, each against the same
   process's GEMM rate in the model's dtype, the time by part, the speed-up over the
   per-replicate baseline — then the decode rate per row budget (``--budgets``, on
   ``--sweep-docs`` documents), from which ``rollout.max_batch_rows`` for the device is read.
   ``--throughput-args`` passes further options (e.g. ``--models tiny --lengths 1024 --H 8``
   for a dry run on CPU).

Usage (about 1 minute without the benchmarks)::

    python benchmarks/device_check.py --device cuda [--benchmark --lengths 4096 16384 --K 32 64]
    python benchmarks/device_check.py --device cuda --throughput --budgets 192 384 768 1536
    python benchmarks/device_check.py --device cpu --skip-laws --throughput --budgets 24 48 \
        --sweep-docs 6 --throughput-args "--models tiny --lengths 1024 --H 8"   # CPU dry run
    # the replication's shapes, both prompt layouts
    # (benchmarks/README.md, "The replication's shapes")
    python benchmarks/device_check.py --device cuda --throughput --budgets 192 --throughput-args \
        "--shapes study1 study2 --lengths 4096 8192 --H 128 --layouts gathered auto"

The law check (item 2) runs the default prompt layout (``auto``: snapkv-half in the masked pass)
and names the kernel of each part: the gathered groups' and the masked pass's.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine_reference import law_differences  # noqa: E402

import kvdiverge.engine as engine  # noqa: E402
from kvdiverge.engine import RolloutSettings  # noqa: E402
from kvdiverge.engine.kernels import registry  # noqa: E402
from kvdiverge.eviction import kept_positions, parse_action  # noqa: E402
from kvdiverge.models import (  # noqa: E402
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
)

PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 5
ACTION = parse_action({"selector": "snapkv", "budget": 0.5, "window": 32}, name="snapkv-half")
FULL = parse_action({"selector": "full"}, name="full")


def law_check(model_dir: Path, device: str, dtype: str, K: int = 4, H: int = 24) -> dict:
    """Largest |p_engine − p_plain| per stream over K replicates and H steps."""
    model = load_model(str(model_dir), device=device, dtype=dtype)
    tokenizer = load_tokenizer(str(model_dir))
    ids = chat_prompt_ids(tokenizer, PROMPT)
    eos = eos_token_ids(model, tokenizer)
    start = time.perf_counter()
    r = engine.rollout_document(
        model, ids, ACTION, "check", K, eos, RolloutSettings(H, 5, keep_logits=True)
    )
    seconds = time.perf_counter() - start
    kept, everything = kept_positions(model, ids, ACTION), kept_positions(model, ids, FULL)
    worst = dict.fromkeys(("p", "q", "q_fixed"), 0.0)
    for k in range(K):
        for name, difference in law_differences(model, ids, kept, everything, r, k).items():
            worst[name] = max(worst[name], difference)
    d = model.config.hidden_size // model.config.num_attention_heads
    kernel = registry.choose("rows_own", model.device, model.dtype, d).name
    masked = registry.choose("prompt_masked", model.device, model.dtype, d).name
    return {
        "dtype": str(model.dtype).removeprefix("torch."),
        "kernel": kernel,
        "masked_kernel": masked,
        "seconds": seconds,
        "split_paths": int((r.x_token != r.y_token).any(axis=1).sum()),
        **worst,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--benchmark", action="store_true", help="also run benchmarks/rollout.py")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--K", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-laws", action="store_true", help="no law check (item 2)")
    parser.add_argument("--throughput", action="store_true", help="benchmarks/throughput.py")
    parser.add_argument("--budgets", type=int, nargs="+", default=[192, 384, 768, 1536])
    parser.add_argument("--sweep-docs", type=int, default=48)
    parser.add_argument("--throughput-args", default="", help="more throughput.py options")
    args = parser.parse_args()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {args.device}: {name}")
    if not args.skip_laws:
        law_table(args.device)
    if args.benchmark:
        cmd = [sys.executable, str(Path(__file__).with_name("rollout.py")), "--device"]
        cmd += [args.device, "--rounds", str(args.rounds), "--lengths"]
        cmd += [str(n) for n in args.lengths] + ["--K"] + [str(k) for k in args.K]
        print(flush=True)
        subprocess.run(cmd, check=True)
    if args.throughput:
        script = str(Path(__file__).with_name("throughput.py"))
        extra = shlex.split(args.throughput_args)
        for options in ([], ["--sweep", *map(str, args.budgets)]):
            cmd = [sys.executable, script, "--device", args.device, *options, *extra]
            if options:
                cmd += ["--sweep-docs", str(args.sweep_docs)]
            print(flush=True)
            subprocess.run(cmd, check=True)


def law_table(device: str) -> None:
    """Item 2: per architecture and dtype, the kernel chosen and the largest law differences."""
    print(
        "\n| model | dtype | kernel | masked-pass kernel | max abs ΔP | max abs ΔQ | "
        "max abs ΔQ_fixed | paths split | engine s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("llama", "qwen2"):
            model_dir = build_demo_model(kind, Path(tmp) / kind, seed=11)
            for dtype in ("float32", "bfloat16"):
                c = law_check(model_dir, device, dtype)
                print(
                    f"| {kind} | {c['dtype']} | {c['kernel']} | {c['masked_kernel']} | "
                    f"{c['p']:.2e} | {c['q']:.2e} | "
                    f"{c['q_fixed']:.2e} | {c['split_paths']}/4 | {c['seconds']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
