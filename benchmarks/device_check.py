"""Device check: the rollout engine at the paper's shapes on an accelerator, one prepared script.

For a session that is lent a GPU (none has been yet). With no downloads, it builds randomly
initialised models of the real shapes on the device — Llama-3.1-8B-Instruct and
Qwen2.5-7B-Instruct from their published ``config.json`` values
(``kvdiverge.engine.memory_plan.KNOWN_CONFIGS``), full depth in bfloat16 unless ``--layers`` —
and prints:

1. torch, CUDA and the device; the roofline's figures: the device's published peak bf16 rate
   and memory bandwidth (assumptions, ``kvdiverge.engine.roofline.DEVICES``) beside a bf16 GEMM
   and a device-to-device copy measured in this process;
2. per model, on 2 layers of the real widths in float32 and bfloat16: the engine's next-token
   laws (P on X's history, Q on Y's, Q on X's) against a plain transformers forward over an
   explicitly gathered cache (``tests/engine_reference.py``), SnapKV at half the prompt, K = 2,
   H = 8, and the kernel each attention layout chose (``kernel_choices``);
3. per model and prompt length (``--lengths``, default 3,968 and 32,640: the 4K and 32K strata's
   length bounds): study 1 (SnapKV-512,
   SnapKV-half, recent-half and the full-retention control) at K = 64, K_control = 2, on
   ``--docs`` documents of random tokens, ``--steps`` decoding steps: the prefill seconds per
   document, milliseconds per decoding step, the peak device memory
   (``torch.cuda.max_memory_allocated``) beside the memory plan's estimate, the roofline's
   times at the published and at the measured rates, the control's largest δ and f and whether
   X ≡ Y, and the kernels chosen.

It imports torch, transformers, numpy and kvdiverge's engine, eviction, models and theory
modules only (no polars, Snakemake or kvpress), so it runs where just these are installed:
the wheels ``torch`` (a CUDA build), ``transformers`` 5.2 and its dependencies
(``huggingface_hub``, ``tokenizers``, ``safetensors``, ``pyyaml``, ``regex``, ``tqdm``,
``filelock``, ``packaging``, ``requests``), ``numpy``, with ``src`` on ``PYTHONPATH``.

Usage (about 5 minutes on one H200 by the roofline; the first call compiles nothing)::

    PYTHONPATH=src python benchmarks/device_check.py                      # the full check
    PYTHONPATH=src python benchmarks/device_check.py --smoke --device cpu # toy sizes on a CPU

``--smoke`` runs every part at toy sizes (2 layers of 256 wide, a 4,096-token vocabulary,
prompts of 256 and 512 tokens, K = 4, 4 steps), the dry run that keeps the script working
where no GPU is at hand. ``--benchmark`` also runs ``benchmarks/rollout.py`` on the device,
and ``--throughput`` ``benchmarks/throughput.py`` (its table against the device's GEMM rate,
then the decode rate per row budget, ``--budgets`` on ``--sweep-docs`` documents;
``--throughput-args`` passes more options); these two need the project's full environment.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from engine_reference import law_differences  # noqa: E402

from kvdiverge.engine import RolloutSettings, kernels  # noqa: E402
from kvdiverge.engine.batches import batched_paths  # noqa: E402
from kvdiverge.engine.document import paths_under_action  # noqa: E402
from kvdiverge.engine.memory_plan import KNOWN_CONFIGS, ModelShape, job_kept, plan_job  # noqa: E402
from kvdiverge.engine.roofline import (  # noqa: E402
    DEVICES,
    Device,
    decode_step_seconds,
    prefill_seconds,
)
from kvdiverge.eviction import kept_positions, parse_action  # noqa: E402

transformers.utils.logging.disable_progress_bar()

MODELS = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
}
STUDY1 = {
    "snapkv-512": {"selector": "snapkv", "budget": 512},
    "snapkv-half": {"selector": "snapkv", "budget": 0.5},
    "recent-half": {"selector": "recent", "budget": 0.5},
    "full": {"selector": "full"},
}
SMOKE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "vocab_size": 4096}
EOS = [0]


def model_config(name: str, layers: int | None, smoke: bool) -> dict:
    """The published config of ``name``, cut to ``layers`` (and to toy widths with ``smoke``:
    the real head size, heads 4, KV heads 2 for Llama and Qwen2 alike)."""
    config = dict(KNOWN_CONFIGS[MODELS[name]])
    if smoke:
        config.update(SMOKE, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def build(config: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised model of ``config`` built on ``device`` (no weights read)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(**config), dtype=dtype, attn_implementation="sdpa"
        )
    return model.eval()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measured_rates(device: str, smoke: bool) -> tuple[float, float]:
    """A bf16 GEMM's FLOP/s (n × n × n, the best of 5) and a device-to-device copy's B/s (read
    and write counted, the best of 5), measured here."""
    n = 1024 if smoke else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - start)
    flops = 2 * n**3 / best
    size = (64 if smoke else 2048) << 20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = float("inf")
    for _ in range(6):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        copy = min(copy, time.perf_counter() - start)
    return flops, 2 * size / copy


def published(device: str) -> Device | None:
    """The roofline's assumed figures for this device (by its name), or None."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name().lower()
    return next((d for key, d in DEVICES.items() if key.split("-")[0] in name), None)


def law_check(name: str, device: str, dtype: torch.dtype, smoke: bool) -> dict:
    """Item 2: the largest |engine − plain| law per stream, 2 layers of the real widths."""
    config = model_config(name, 2, smoke)
    model = build(config, device, dtype)
    gen = torch.Generator().manual_seed(2)
    n = 160 if smoke else 512
    ids = torch.randint(1, config["vocab_size"], (n,), generator=gen).tolist()
    action = parse_action({"selector": "snapkv", "budget": 0.5, "window": 32}, name="snapkv-half")
    full = parse_action({"selector": "full"}, name="full")
    settings = RolloutSettings(8, 5, keep_logits=True)
    r = paths_under_action(model, ids, action, "check", 2, EOS, settings)
    kept, everything = kept_positions(model, ids, action), kept_positions(model, ids, full)
    worst = dict.fromkeys(("p", "q", "q_fixed"), 0.0)
    for k in range(2):
        for stream, difference in law_differences(model, ids, kept, everything, r, k).items():
            worst[stream] = max(worst[stream], difference)
    del model
    return worst


def study1_check(
    name: str,
    n: int,
    device: str,
    args: argparse.Namespace,
    rates: tuple[float, float],
) -> dict:
    """Item 3: study 1 on ``args.docs`` documents of n random tokens; times, peak memory, the
    plan's estimate, the roofline and the control."""
    config = model_config(name, args.layers, args.smoke)
    model = build(config, device, torch.bfloat16 if not args.smoke else torch.float32)
    shape = ModelShape.from_config(config, "bfloat16" if not args.smoke else "float32")
    actions = [parse_action(a, name=a_name) for a_name, a in STUDY1.items()]
    K = 4 if args.smoke else 64
    counts = {a.name: 2 if a.name == "full" else K for a in actions}
    gen = torch.Generator().manual_seed(3)
    docs = [
        (f"d{i}", torch.randint(1, config["vocab_size"], (n,), generator=gen).tolist(), counts)
        for i in range(args.docs)
    ]
    rows = args.rows or (K * 7 + 6) * 2
    H = args.steps + 1
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    reset = getattr(getattr(kernels, "registry", None), "reset", None)
    if reset is not None:  # this run's kernel choices alone
        reset()
    settings = RolloutSettings(H, 1, max_batch_rows=rows)
    sync(device)
    start = time.perf_counter()
    results = list(batched_paths(model, docs, actions, EOS, settings))
    sync(device)
    total = time.perf_counter() - start
    prefill = np.mean([next(iter(r.values())).prefill_seconds for _, r in results])
    selection = sum(sum(x.selection_seconds for x in r.values()) for _, r in results)
    decode = total - prefill * len(results) - selection
    control = [r["full"] for _, r in results]
    delta = max(max(float(c.tv_rollout.max()), float(c.tv_fixed.max())) for c in control)
    same = all(np.array_equal(c.x_token, c.y_token) for c in control)
    kept = [job_kept(actions, n) for _ in docs]
    names = [a.name for a in actions]
    cuda = device.startswith("cuda")  # the CUDA masked pass's bias, the CPU's packed keys
    args = (shape, [n] * len(docs), kept, names, K, 2, "full", H, rows, 32)
    plan = plan_job(*args, packed=not cuda, bias=cuda)
    measured = Device("measured", *rates)
    assumed = published(device)
    steps = max(H - 1, 1)
    out = {
        "model": name,
        "n": n,
        "layers": config["num_hidden_layers"],
        "rows": rows,
        "batches": plan.batches,
        "prefill_s": prefill,
        "step_ms": 1e3 * decode / (steps * plan.batches),
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device.startswith("cuda") else None,
        "plan_gb": plan.peak / 1e9,
        "control": f"{delta:.1e}, X≡Y" if same else f"{delta:.1e}, X≠Y",
        "kernels": "; ".join(f"{k}: {v}" for k, v in kernels.kernel_choices().items()),
    }
    for label, dev in (("measured", measured), ("published", assumed)):
        if dev is None:
            out[f"roof_{label}"] = "-"
            continue
        doc_index = plan.documents[0]
        step = decode_step_seconds(
            shape, [n] * len(doc_index), [kept[d] for d in doc_index], plan.rows[0], H // 2, dev
        )
        out[f"roof_{label}"] = f"{prefill_seconds(shape, n, dev):.2f} s, {1e3 * step:.1f} ms"
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="toy sizes (a CPU dry run)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument("--layers", type=int, default=None, help="default: full depth")
    parser.add_argument("--docs", type=int, default=2, help="study-1 documents per length")
    parser.add_argument("--steps", type=int, default=None, help="decoding steps timed")
    parser.add_argument("--rows", type=int, default=None, help="max_batch_rows (2 documents)")
    parser.add_argument("--skip-laws", action="store_true")
    parser.add_argument("--benchmark", action="store_true", help="also benchmarks/rollout.py")
    parser.add_argument("--throughput", action="store_true", help="also benchmarks/throughput.py")
    parser.add_argument("--budgets", type=int, nargs="+", default=[192, 384, 768, 1536])
    parser.add_argument("--sweep-docs", type=int, default=48)
    parser.add_argument("--throughput-args", default="", help="more throughput.py options")
    args = parser.parse_args()
    # 4K and 32K: the strata's length bounds, target_tokens − generation_reserve (Qwen2.5's
    # window is 32,768 positions: a prompt of 32,640 leaves H = 128)
    args.lengths = args.lengths or ([256, 512] if args.smoke else [3968, 32640])
    args.steps = args.steps or (4 if args.smoke else 16)
    device = args.device
    name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, CUDA "
        f"{torch.version.cuda}, device {device}: {name}"
    )
    flops, bandwidth = measured_rates(device, args.smoke)
    assumed = published(device)
    print(f"measured: bf16 GEMM {flops / 1e12:.1f} TFLOP/s, copy {bandwidth / 1e9:.0f} GB/s")
    print(f"published (assumed): {assumed.name if assumed else 'no figures for this device'}")
    if not args.skip_laws:
        print("\n| model (2 layers, real widths) | dtype | max ΔP | max ΔQ | max ΔQ_fixed |")
        print("|---|---|---:|---:|---:|")
        for model_name in args.models:
            for dtype in (torch.float32, torch.bfloat16):
                w = law_check(model_name, device, dtype, args.smoke)
                print(
                    f"| {model_name} | {str(dtype).removeprefix('torch.')} | {w['p']:.2e} | "
                    f"{w['q']:.2e} | {w['q_fixed']:.2e} |",
                    flush=True,
                )
        print(f"kernels chosen: {kernels.kernel_choices()}")
    print(
        "\n| model | n | layers | rows/call | batches | prefill s | ms/step | peak GB | "
        "plan GB | roofline measured (prefill, step) | roofline published | control δ, f | "
        "kernels |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---|")
    for model_name in args.models:
        for n in args.lengths:
            c = study1_check(model_name, n, device, args, (flops, bandwidth))
            peak = "-" if c["peak_gb"] is None else f"{c['peak_gb']:.1f}"
            print(
                f"| {c['model']} | {c['n']} | {c['layers']} | {c['rows']} | {c['batches']} | "
                f"{c['prefill_s']:.2f} | {c['step_ms']:.1f} | {peak} | {c['plan_gb']:.2f} | "
                f"{c['roof_measured']} | {c['roof_published']} | {c['control']} | "
                f"{c['kernels']} |",
                flush=True,
            )
    if args.benchmark:
        cmd = [sys.executable, str(Path(__file__).with_name("rollout.py")), "--device", device]
        print(flush=True)
        subprocess.run(cmd, check=True)
    if args.throughput:  # the throughput table, then the decode rate per row budget
        script = str(Path(__file__).with_name("throughput.py"))
        extra = shlex.split(args.throughput_args)
        for options in ([], ["--sweep", *map(str, args.budgets)]):
            cmd = [sys.executable, script, "--device", device, *options, *extra]
            if options:
                cmd += ["--sweep-docs", str(args.sweep_docs)]
            print(flush=True)
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
