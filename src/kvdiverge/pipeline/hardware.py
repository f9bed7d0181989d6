"""What the machine offers a rollout job, found without importing torch (which costs seconds
at every workflow parse): whether ``device: auto`` will find a GPU (``docs/architecture.md``,
"Rollout jobs"). The job itself decides with torch (:func:`kvdiverge.models.resolve_device`);
this answer only sizes the scheduler's ``gpu`` resource."""

from __future__ import annotations

import glob
import importlib.metadata

__all__ = ["gpu_expected"]

_GPU_DEVICE_NODES = ("/dev/nvidia[0-9]*", "/dev/kfd")  # NVIDIA devices; AMD's ROCm driver


def gpu_expected(device: str) -> bool:
    """True when a rollout with ``rollout.device = device`` will run on a GPU: ``cuda[:i]``;
    for ``auto``, a GPU device node exists and the installed torch is not a CPU-only build
    (its version carries no ``+cpu`` tag). ``cpu``: False."""
    if device != "auto":
        return device.startswith("cuda")
    try:
        cpu_only = importlib.metadata.version("torch").endswith("+cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return not cpu_only and any(glob.glob(pattern) for pattern in _GPU_DEVICE_NODES)
