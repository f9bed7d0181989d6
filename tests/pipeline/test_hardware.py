"""kvdiverge.pipeline.hardware: the scheduler's GPU answer without importing torch."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from kvdiverge.pipeline import hardware


def test_explicit_devices_answer_themselves():
    assert hardware.gpu_expected("cuda") and hardware.gpu_expected("cuda:1")
    assert not hardware.gpu_expected("cpu")


def test_auto_needs_a_device_node_and_a_gpu_build(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0")
    nvidia = {"/dev/nvidia[0-9]*": ["/dev/nvidia0"]}
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: nvidia.get(pattern, []))
    assert hardware.gpu_expected("auto")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0+cpu")
    assert not hardware.gpu_expected("auto")  # a CPU-only build on a GPU host
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.13.0")
    monkeypatch.setattr(hardware.glob, "glob", lambda pattern: [])
    assert not hardware.gpu_expected("auto")  # a GPU build without a GPU


def test_auto_agrees_with_torch_here_and_imports_no_torch():
    probe = (
        "import sys; from kvdiverge.pipeline.hardware import gpu_expected; "
        "print(gpu_expected('auto'), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    import torch

    assert out.stdout.split() == [str(torch.cuda.is_available()), "False"]
