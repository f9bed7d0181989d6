"""The memory plan (kvdiverge.engine.memory_plan): exact parameter counts, the batches it
plans, sizing ``max_batch_rows: auto``, the refusal line, the paper config on an 80 GB card,
and the estimate against a real rollout's measured peak memory on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoConfig, AutoModelForCausalLM

from kvdiverge.engine.memory_plan import (
    GB,
    KNOWN_CONFIGS,
    ModelShape,
    auto_batch_rows,
    check_fits,
    format_plan,
    job_kept,
    plan_config,
    plan_job,
    usable_bytes,
)
from kvdiverge.engine.preflight import PreflightError
from kvdiverge.engine.roofline import Device, decode_step_seconds, prefill_seconds
from kvdiverge.eviction import parse_action

ROOT = Path(__file__).resolve().parents[2]
STUDY1 = {
    "snapkv-512": {"selector": "snapkv", "budget": 512},
    "snapkv-half": {"selector": "snapkv", "budget": 0.5},
    "recent-half": {"selector": "recent", "budget": 0.5},
    "full": {"selector": "full"},
}
STUDY2 = {
    "snapkv-90": {"selector": "snapkv", "budget": 0.9},
    "recent-90": {"selector": "recent", "budget": 0.9},
    "full": {"selector": "full"},
}


def _small(config: dict) -> dict:
    """A known config cut to 2 layers and a small vocabulary (the count's formula is per layer)."""
    return {**config, "num_hidden_layers": 2, "vocab_size": 1000}


@pytest.mark.parametrize("hub_id", sorted(KNOWN_CONFIGS))
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_equals_the_transformers_model(hub_id, tied):
    """Every parameter of the real architecture (Llama: no biases; Qwen2: q/k/v biases),
    counted from the shapes, equals the built model's own count, tied head or not."""
    config = {**_small(KNOWN_CONFIGS[hub_id]), "tie_word_embeddings": tied}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    assert ModelShape.from_config(config).parameters() == sum(p.numel() for p in model.parameters())


def test_known_models_weigh_what_their_names_say():
    llama = ModelShape.from_config(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"])
    qwen = ModelShape.from_config(KNOWN_CONFIGS["Qwen/Qwen2.5-7B-Instruct"])
    assert llama.parameters() == 8_030_261_248  # Llama-3.1-8B's published count
    assert qwen.parameters() == 7_615_616_512  # Qwen2.5-7B's published count
    assert llama.dtype_bytes == qwen.dtype_bytes == 2
    assert (
        ModelShape.from_config(KNOWN_CONFIGS["Qwen/Qwen2.5-7B-Instruct"], "float32").dtype_bytes
        == 4
    )


def _job(shape, n_docs=48, n=4096, K=64, K_control=2, budget=448):
    actions = [parse_action(a, name=name) for name, a in STUDY1.items()]
    lengths = [n] * n_docs
    kept = [job_kept(actions, n)] * n_docs
    return shape, lengths, kept, list(STUDY1), K, K_control, "full", 128, budget


def test_448_rows_run_the_control_apart_and_auto_packs_it():
    """At 448 = 7 × 64 rows study 1's control (2 × 3 rows) gets a batch of its own per
    document (96 batches for 48); ``auto`` budgets whole documents' rows, control included."""
    shape = ModelShape.from_config(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"])
    fixed = plan_job(*_job(shape))
    assert fixed.batches == 96 and sorted(set(fixed.rows)) == [6, 448]
    auto = auto_batch_rows(*_job(shape)[:-1], 80 * GB)
    assert auto.max_batch_rows % 454 == 0 and set(auto.rows) <= {
        auto.max_batch_rows,
        454 * (48 % (auto.max_batch_rows // 454)),
    }
    assert auto.batches == -(-48 // (auto.max_batch_rows // 454))
    assert (
        auto.peak
        <= usable_bytes(80 * GB)
        < plan_job(*_job(shape)[:-1], auto.max_batch_rows + 454).peak
    )


def test_auto_below_one_document_and_the_refusal_line():
    """A device too small for a whole document gets whole replicates; one that cannot hold
    even one replicate per call is refused in one line with the numbers."""
    shape = ModelShape.from_config(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"])
    small = auto_batch_rows(*_job(shape, n=32640)[:-1], 32 * GB)
    assert 7 <= small.max_batch_rows < 454 and small.peak <= usable_bytes(32 * GB)
    with pytest.raises(PreflightError) as info:
        auto_batch_rows(*_job(shape, n=32640)[:-1], 16 * GB)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith("rollout.max_batch_rows: auto: job the job needs ")
    assert "weights 16.1" in line and "but the device holds 16.0 GB" in line
    with pytest.raises(PreflightError, match="max_batch_rows: 4096: job study1/x needs"):
        check_fits(plan_job(*_job(shape, budget=4096)), 80 * GB, 4096, "study1/x")


@pytest.mark.parametrize("budget", [None, "auto"])
def test_paper_config_fits_an_80_gb_card(budget):
    """Every rollout job of configs/paper.yaml (both models' published shapes, every stratum at
    its length bound, both stages) fits 80 GB, as configured (two study-1 documents with their
    controls per call: 24 batches for 48 documents) and with ``auto``."""
    config = yaml.safe_load((ROOT / "configs" / "paper.yaml").read_text())
    if budget is not None:
        config["rollout"]["max_batch_rows"] = budget
    rows = plan_config(config, 80)
    assert len(rows) == 2 * 2 * 2 * 6  # models × studies × stages × strata
    assert all(r["plan"].peak <= usable_bytes(80 * GB) for r in rows)
    table = format_plan(rows, 80)
    assert table.count("| yes |") == len(rows) and "| NO |" not in table
    if budget is None:
        study1 = [r["plan"] for r in rows if r["job"].startswith("study1/eval/")]
        assert {p.batches for p in study1} == {24} and {max(p.rows) for p in study1} == {908}


def test_roofline_step_and_prefill_by_hand():
    """The roofline's step: max(bytes / bandwidth, operations / rate), written out."""
    shape = ModelShape.from_config(_small(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B-Instruct"]))
    device = Device("test", 1e12, 1e11)
    P, L, Hq, d, Hkv, b = shape.parameters(), 2, 32, 128, 8, 2
    n, keep, rows, t = 4000, 400, 10, 5  # one gathered part (10% kept), one masked action
    moved = P * b + 2 * L * Hkv * d * b * (n + keep + rows * t)
    flops = 2 * P * rows + 4 * L * Hq * d * rows * (n + t)
    step = decode_step_seconds(shape, [n], [[keep, n // 2, n]], rows, t, device)
    assert step == pytest.approx(max(moved / 1e11, flops / 1e12), rel=1e-12)
    assert prefill_seconds(shape, n, device) == pytest.approx(
        (2 * P * n + 2 * L * Hq * d * n * n) / 1e12, rel=1e-12
    )


MEASURE = r"""
import json, resource, sys
import torch, transformers
transformers.utils.logging.disable_progress_bar()
torch.set_num_threads(1)
from transformers import AutoConfig, AutoModelForCausalLM
from kvdiverge.engine import RolloutSettings
from kvdiverge.engine.batches import batched_paths
from kvdiverge.engine.memory import keep_freed_memory
from kvdiverge.eviction import parse_action

args = json.loads(sys.argv[1])
keep_freed_memory()
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**args["config"])).eval()
actions = [parse_action(a, name=n) for n, a in args["actions"].items()]
gen = torch.Generator().manual_seed(1)
V = args["config"]["vocab_size"]
def docs(lengths):
    return [(f"d{i}", torch.randint(5, V, (n,), generator=gen).tolist(), args["K"])
            for i, n in enumerate(lengths)]
warm = RolloutSettings(4, 1, max_batch_rows=args["rows"])
for _ in batched_paths(model, docs([300]), actions, [0], warm):
    pass  # the kernels built and validated, the lazy state made
import threading

def status():  # resident memory (VmRSS), its peak (VmHWM) and its anonymous part (RssAnon)
    with open("/proc/self/status") as f:
        return {l.split(":")[0]: int(l.split()[1]) * 1024 for l in f
                if l.startswith(("VmRSS:", "VmHWM:", "RssAnon:"))}

with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the kernel's peak of resident memory, VmHWM, restarts from here
base = status()
peak, done = [base["RssAnon"]], threading.Event()
def watch():
    while not done.is_set():
        peak[0] = max(peak[0], status()["RssAnon"])
        done.wait(0.001)
watcher = threading.Thread(target=watch)
watcher.start()
settings = RolloutSettings(args["H"], 1, max_batch_rows=args["rows"])
for _ in batched_paths(model, docs(args["lengths"]), actions, [0], settings):
    pass
done.set()
watcher.join()
end = status()
peak[0] = max(peak[0], end["RssAnon"])
# the kernel's peak misses nothing, but counts file pages too: less what they grew by
files = (end["VmRSS"] - end["RssAnon"]) - (base["VmRSS"] - base["RssAnon"])
kernel = end["VmHWM"] - base["VmRSS"] - max(files, 0)
sampled = peak[0] - base["RssAnon"]  # a watcher starved on a loaded machine misses the peak
from kvdiverge.engine.kernels import kernel_choices
print(json.dumps({"job": max(kernel, sampled), "kernel": kernel, "sampled": sampled,
                  "files": files, "kernels": kernel_choices()}))
"""

LLAMA = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=32000,
    max_position_embeddings=8192,
)
QWEN = dict(
    model_type="qwen2",
    hidden_size=256,
    intermediate_size=1536,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=16000,
    max_position_embeddings=16384,
)


@pytest.mark.slow  # real rollouts of mid-size models, measured
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status, clear_refs")
@pytest.mark.parametrize(
    "config, actions, K, H, rows, lengths",
    [
        # decoding dominates: 248 rows' logits and float64 laws
        (LLAMA, STUDY1, 8, 16, 248, [3000, 2800, 2900, 3100]),
        # the prefill dominates: 6K-token documents, three batches of two
        (QWEN, STUDY2, 4, 24, 64, [6000, 5500, 6100, 5800]),
    ],
)
def test_estimate_within_15_percent_of_the_measured_peak(
    config, actions, K, H, rows, lengths, tmp_path
):
    """A real rollout of randomly initialised mid-size models (float32, one thread, the native
    prompt kernel's packed keys counted) in a fresh process: the growth of its resident
    anonymous memory from before the rollout to its peak (the weights already held; file pages,
    which another process's load can evict, not counted) is within 15% of the plan's peak less
    the weights.

    The peak is the kernel's own (``VmHWM``, restarted through ``/proc/self/clear_refs`` after
    the warm-up), so a sampling thread that a loaded machine starves cannot miss it; it counts
    every resident page, so the growth of the file pages (resident less anonymous memory, end
    against start) is taken off it. Where the file pages shrank instead (evicted under another
    process's load), the watcher's densest sample of the anonymous memory is the floor: the
    measured growth is the larger of the two, never above the true peak while file pages
    only grow."""
    counts = {name: 2 if a["selector"] == "full" else K for name, a in actions.items()}
    args = {"config": config, "actions": actions, "K": counts, "H": H, "rows": rows}
    args["lengths"] = lengths
    # one thread and one malloc arena: the resident memory then grows by what is allocated,
    # not by how thread arenas happen to split it (measured: ±25% between runs without)
    # and no variable a caller (another test in this worker) left behind: only what it needs
    keep = ("PATH", "HOME", "LANG", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"})
    # a kernel cache of its own: built in the warm-up, whatever other tests do to the shared one
    env["KVDIVERGE_CACHE"] = str(tmp_path / "cache")
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(args)],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "PYTHONHASHSEED": "0"},
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    measured = result["job"]
    shape = ModelShape.from_config({**config, "torch_dtype": "float32"})
    specs = [parse_action(a, name=name) for name, a in actions.items()]
    kept = [job_kept(specs, n) for n in lengths]
    plan = plan_job(shape, lengths, kept, list(actions), K, 2, "full", H, rows, 64, packed=True)
    estimate = plan.peak - plan.parts["weights"]
    assert abs(estimate / measured - 1) <= 0.15, (
        estimate / 1e6,
        measured / 1e6,
        result,
        plan.parts,
    )


def test_job_check_before_the_model_loads():
    """A job's own documents, actions and replicates: refused in one line when the plan's peak
    exceeds the device's whole memory; planned (not refused) when it fits; no plan for a model
    whose shape is unknown, and none on a CPU."""
    from kvdiverge.engine.device_memory import check_device_memory
    from kvdiverge.engine.memory_plan import check_job_memory

    model = {"name": "llama", "path": "meta-llama/Llama-3.1-8B-Instruct"}
    specs = {name: parse_action(a, name=name) for name, a in STUDY1.items()}
    cohorts = {name: {"study1": 2 if name == "full" else 64} for name in STUDY1}
    lengths = [32000, 31000, 30500]
    plan = check_job_memory(model, specs, cohorts, lengths, 128, 908, 80 * GB, "llama")
    assert plan.batches == 2 and plan.rows == [908, 454]
    with pytest.raises(PreflightError) as info:
        check_job_memory(model, specs, cohorts, lengths, 128, 908, 40 * GB, "llama/ruler-32k")
    line = str(info.value)
    assert "\n" not in line and line.startswith("rollout.max_batch_rows: 908: job llama/ruler-32k")
    assert "but the device holds 40.0 GB" in line
    unknown = {"name": "x", "path": "org/unknown-model"}
    assert check_job_memory(unknown, specs, cohorts, lengths, 128, 908, 1.0) is None
    if not torch.cuda.is_available():
        assert check_device_memory(model, specs, cohorts, lengths, 128, 908, "auto") is None


BARE = r"""
import runpy, sys
for name in ("polars", "snakemake", "kvpress", "seaborn", "jsonschema"):
    sys.modules[name] = None  # any import of them fails, as on the bare device machine
sys.argv = ["device_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/device_check.py", run_name="__main__")
"""


def test_device_check_smoke_runs_without_the_pipeline_libraries():
    """``benchmarks/device_check.py --smoke`` runs end to end on CPU with polars, Snakemake,
    kvpress, seaborn and jsonschema unimportable (the device machine has only torch,
    transformers and numpy), and prints a study-1 row with an exact control."""
    out = subprocess.run(
        [sys.executable, "-c", BARE, "--smoke", "--device", "cpu", "--skip-laws"]
        + ["--models", "qwen2.5-7b", "--lengths", "256"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    row = [line for line in out.stdout.splitlines() if line.startswith("| qwen2.5-7b | 256 |")]
    assert len(row) == 1 and "| 0.0e+00, X≡Y |" in row[0]
    assert "measured: bf16 GEMM" in out.stdout


def test_the_parse_time_plan_at_auto_shows_a_job_that_cannot_fit():
    """At ``auto`` a config whose job cannot hold one replicate per call on the planned card is
    shown as not fitting (the plan at one replicate per call), not a parse-time failure: the
    card is an assumption, and the job refuses on its own device."""
    config = yaml.safe_load((ROOT / "configs" / "paper.yaml").read_text())
    config["rollout"]["max_batch_rows"] = "auto"
    rows = plan_config(config, 16)  # the weights alone (16.1 GB for Llama) exceed it
    llama = [r for r in rows if "llama" in r["job"]]
    assert llama and all(r["plan"].peak > usable_bytes(16 * GB) for r in llama)
    assert {r["plan"].max_batch_rows for r in llama if r["job"].startswith("study1/")} == {7}
    table = format_plan(rows, 16)
    assert table.count("| NO |") >= len(llama)
