"""What the machine offers a rollout job, and what the job was promised, found without importing
torch (which costs seconds at every workflow parse): whether ``device: auto`` will find a GPU
(``docs/architecture.md``, "Rollout jobs"), which sizes the scheduler's ``gpu`` resource, and
whether the running job was given a GPU (:func:`gpu_requested`), so that ``device: auto``
refuses to fall back to the CPU there (:func:`kvdiverge.models.resolve_device`;
``docs/running.md``, "The device")."""

from __future__ import annotations

import glob
import importlib.metadata
import os
from collections.abc import Mapping

__all__ = ["SLURM_GPU_VARIABLES", "gpus_hidden", "gpu_expected", "gpu_requested"]

_GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")  # NVIDIA devices; AMD's ROCm driver

SLURM_GPU_VARIABLES = (
    "SLURM_JOB_GPUS",
    "SLURM_STEP_GPUS",
    "SLURM_GPUS_ON_NODE",
    "SLURM_GPUS",
    "SLURM_GPUS_PER_NODE",
    "SLURM_GPUS_PER_TASK",
)
"""Variables SLURM sets in a job (or step) that was allocated GPUs (``--gpus``, ``--gres=gpu``):
the first two list the GPUs' indices (``0``, ``0,1``), the others count them (``0``: none) or
name ``<model>:<count>``."""

_SLURM_GPU_INDICES = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS")


def gpus_hidden(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``CUDA_VISIBLE_DEVICES`` is set to hide every GPU (empty or ``-1``): the user
    (or the scheduler) asked for no GPU."""
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    return value is not None and value.strip() in ("", "-1")


def gpu_expected(device: str, environ: Mapping[str, str] | None = None) -> bool:
    """True when a rollout with ``rollout.device = device`` will run on a GPU: ``cuda[:i]``;
    for ``auto``, a GPU device node exists, the installed torch is not a CPU-only build (its
    version carries no ``+cpu`` tag) and ``CUDA_VISIBLE_DEVICES`` does not hide every GPU.
    ``cpu``: False."""
    if device != "auto":
        return device.startswith("cuda")
    try:
        cpu_only = importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    if cpu_only or gpus_hidden(environ):
        return False
    return any(glob.glob(pattern) for pattern in _GPU_DEVICE_NODES)


def gpu_requested(environ: Mapping[str, str] | None = None) -> str | None:
    """Why the running job should have a GPU, in words, or None when nothing says so.

    Either SLURM allocated it GPUs (one of :data:`SLURM_GPU_VARIABLES` is set, not empty and
    not ``0``; the cluster executor asks for them for every rollout job under ``device:
    auto``), or this machine looks like a GPU host (:func:`gpu_expected` for ``auto``: a device
    node and a CUDA build of torch), on which the workflow asked for the local ``gpu``
    resource."""
    env = os.environ if environ is None else environ
    for name in SLURM_GPU_VARIABLES:
        value = env.get(name, "").strip()
        if not value or value == "(null)":
            continue
        if name in _SLURM_GPU_INDICES or value.rpartition(":")[2] not in ("0", ""):
            return f"SLURM allocated this job a GPU ({name}={value})"
    if gpu_expected("auto", env):
        nodes = sorted(p for pattern in _GPU_DEVICE_NODES for p in glob.glob(pattern))
        return f"this machine has a GPU ({nodes[0]}) and a CUDA build of torch"
    return None
