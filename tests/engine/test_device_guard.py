"""Fail fast on the wrong device: ``device: auto`` on a job that was given a GPU refuses the CPU,
``device: cuda`` without CUDA stops in one line, both before any model work; the site's GPU model
and partition come from the profile or the command line, not from a shared config."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from kvdiverge.engine.rollout_job import load_checked_job
from kvdiverge.models import DeviceError, loading, resolve_device
from kvdiverge.pipeline import hardware

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine where torch finds no CUDA (as here) and no GPU device node."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: [])


def test_gpu_requested_reads_slurm_and_the_host(monkeypatch):
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: [])
    assert hardware.gpu_requested({}) is None
    assert hardware.gpu_requested({"SLURM_GPUS_ON_NODE": "0", "SLURM_JOB_GPUS": ""}) is None
    assert hardware.gpu_requested({"SLURM_GPUS": "h100:0"}) is None
    assert "SLURM_GPUS_ON_NODE=1" in hardware.gpu_requested({"SLURM_GPUS_ON_NODE": "1"})
    assert hardware.gpu_requested({"SLURM_JOB_GPUS": "3"}) == (
        "SLURM allocated this job a GPU (SLURM_JOB_GPUS=3)"
    )
    assert "SLURM_GPUS=h100:1" in hardware.gpu_requested({"SLURM_GPUS": "h100:1"})
    # a GPU host with a CUDA build of torch: the workflow asked for the local gpu resource
    monkeypatch.setattr(hardware.importlib.metadata, "version", lambda name: "2.13.0")
    nodes = {"/dev/nvidia[0-9]*": ["/dev/nvidia0"]}
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: nodes.get(pattern, []))
    assert hardware.gpu_requested({}) == (
        "this machine has a GPU (/dev/nvidia0) and a CUDA build of torch"
    )
    assert hardware.gpu_expected("auto", {})
    # GPUs hidden on purpose: neither asked for nor promised
    for hidden in ("", "-1"):
        assert hardware.gpu_requested({"CUDA_VISIBLE_DEVICES": hidden}) is None
        assert not hardware.gpu_expected("auto", {"CUDA_VISIBLE_DEVICES": hidden})


def test_auto_without_a_promised_gpu_runs_on_the_cpu(no_cuda):
    assert resolve_device("auto", {}) == torch.device("cpu")
    assert resolve_device("cpu", {"SLURM_JOB_GPUS": "0,1"}) == torch.device("cpu")


def test_auto_on_a_job_given_a_gpu_refuses_the_cpu(no_cuda):
    with pytest.raises(DeviceError) as err:
        resolve_device("auto", {"SLURM_JOB_GPUS": "0"})
    line = str(err.value)
    assert "\n" not in line
    reason = loading.cuda_unavailable_reason({})
    assert line == (
        "device: auto, but SLURM allocated this job a GPU (SLURM_JOB_GPUS=0) and CUDA is not "
        f"available here ({reason}): refusing to run on the CPU; set rollout.device: cpu "
        "(kvdiverge compare: --device cpu) to run there"
    )


def test_the_cpu_fallback_variable_lets_a_stand_in_gpu_job_run_on_the_cpu(no_cuda):
    env = {"SLURM_JOB_GPUS": "0", loading.CPU_FALLBACK_VARIABLE: "1"}
    assert resolve_device("auto", env) == torch.device("cpu")
    with pytest.raises(DeviceError):
        resolve_device("auto", {**env, loading.CPU_FALLBACK_VARIABLE: "yes"})
    with pytest.raises(DeviceError):  # cuda is never given up for the CPU
        resolve_device("cuda", env)


def test_the_reasons_cuda_is_missing(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert loading.cuda_unavailable_reason({}) == (f"torch {torch.__version__} is a CPU-only build")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert loading.cuda_unavailable_reason({"CUDA_VISIBLE_DEVICES": ""}) == (
        "CUDA_VISIBLE_DEVICES='' hides every GPU"
    )
    assert loading.cuda_unavailable_reason({}).endswith(
        "(CUDA 12.8) finds no usable CUDA device; check the node's driver with nvidia-smi"
    )


def test_cuda_without_cuda_and_bad_names_are_one_line(no_cuda, monkeypatch):
    reason = loading.cuda_unavailable_reason({})
    with pytest.raises(DeviceError) as err:
        resolve_device("cuda", {})
    assert str(err.value) == f"device: 'cuda' requested but CUDA is not available here ({reason})"
    with pytest.raises(DeviceError, match=r"expected auto, cpu, cuda or cuda:<index>, got 'gpu'"):
        resolve_device("gpu", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0", {}) == torch.device("cuda:0")
    with pytest.raises(DeviceError, match=r"'cuda:1' requested but only 1 CUDA device\(s\)"):
        resolve_device("cuda:1", {})


def test_a_rollout_job_stops_before_reading_anything(no_cuda, monkeypatch, tmp_path):
    """The device is the rollout job's first check: a job given a GPU without CUDA stops before
    the model folder, the tokenizer and the documents are read (none of them exists here)."""
    monkeypatch.setenv("SLURM_JOB_GPUS", "0")
    for name in hardware.SLURM_GPU_VARIABLES[1:]:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(loading.CPU_FALLBACK_VARIABLE, raising=False)
    missing = {"path": str(tmp_path / "no-model"), "name": "m"}
    with pytest.raises(DeviceError, match=r"^device: auto, but SLURM allocated this job a GPU"):
        load_checked_job(tmp_path / "no-documents.parquet", missing, {}, {}, 4, device="auto")
    with pytest.raises(DeviceError, match=r"^device: 'cuda' requested but CUDA is not"):
        load_checked_job(tmp_path / "no-documents.parquet", missing, {}, {}, 4, device="cuda")


def test_site_resources_are_not_in_the_paper_config():
    """configs/paper.yaml asks for what a job needs (a GPU of any model, CPUs, memory, time);
    the GPU model and the partition come from the profile (its `config:` entry) or the command
    line, and the schema gives neither a default."""
    paper = yaml.safe_load((ROOT / "configs/paper.yaml").read_text())
    resources = paper["rollout"]["resources"]
    assert set(resources) == {"gpus", "cpus_per_gpu", "mem_mb", "runtime"}
    schema = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
    props = schema["properties"]["rollout"]["properties"]["resources"]["properties"]
    assert props["gpu_model"]["default"] is None and props["partition"]["default"] is None
    profile = yaml.safe_load((ROOT / "profiles/slurm/config.v8+.yaml").read_text())
    (entry,) = profile["config"]
    key, value = entry.split("=", 1)
    assert key == "rollout" and yaml.safe_load(value) == {"resources": {"partition": "gpu"}}
