"""A rollout job's memory plan against its device, before the model loads
(``docs/running.md``, "Memory and time per job"): a configured ``max_batch_rows`` checked
against a CUDA device's whole memory, and ``max_batch_rows: auto`` sized to the memory the
device has free (:func:`available_bytes`: a CUDA device's free memory, a CPU's available
memory) by the plan of :mod:`kvdiverge.engine.memory_plan`.

``auto`` moves no path: the engine's results do not depend on which documents share a model
call (``tests/engine/test_multidoc_batch.py``, ``tests/engine/test_auto_batch_rows.py``), so
the files record the configured value (``max_batch_rows``, what a lock registers) and the rows
the job ran with (``batch_rows``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvdiverge.engine.memory_plan import (
    GB,
    JobPlan,
    auto_batch_rows,
    check_job_memory,
    job_plan_args,
)
from kvdiverge.engine.preflight import PreflightError

__all__ = ["auto_job_rows", "available_bytes", "check_device_memory"]

log = logging.getLogger(__name__)


def available_bytes(device: str) -> tuple[float, str]:
    """The memory ``max_batch_rows: auto`` is sized to, and where it was read: on CUDA the
    device's free memory (``torch.cuda.mem_get_info``); on a CPU the memory available to new
    allocations, the smaller of ``/proc/meminfo``'s MemAvailable (else the free pages of
    ``os.sysconf``) and a cgroup v2 limit less its usage (a SLURM job's memory)."""
    import torch

    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        return float(torch.cuda.mem_get_info(index)[0]), f"cuda:{index} free memory"
    meminfo = Path("/proc/meminfo")
    text = meminfo.read_text() if meminfo.is_file() else ""
    found = [line.split()[1] for line in text.splitlines() if line.startswith("MemAvailable:")]
    if found:
        free, where = int(found[0]) * 1024.0, "MemAvailable"
    else:
        free = float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        where = "free pages"
    group = Path("/sys/fs/cgroup")
    limit = (group / "memory.max").read_text().strip() if (group / "memory.max").is_file() else ""
    if limit.isdigit() and (group / "memory.current").is_file():
        left = int(limit) - int((group / "memory.current").read_text())
        if left < free:
            free, where = left, "cgroup memory.max less memory.current"
    return float(free), f"CPU {where}"


def auto_job_rows(
    model: Mapping[str, Any],
    specs: Mapping[str, Any],
    cohorts: Mapping[str, Mapping[str, int]],
    lengths: Sequence[int],
    H: int,
    device: str,
) -> JobPlan | None:
    """``max_batch_rows: auto`` for a rollout job on ``device`` (``cpu`` or ``cuda[:i]``): the
    plan of :func:`auto_batch_rows` sized to :func:`available_bytes` (on CUDA the masked
    pass's bias counted, on a CPU the native kernel's packed keys), logged. None when the job
    has no documents; :class:`PreflightError` in one line when the model's shape is unknown or
    one replicate per call does not fit."""
    where = str(model.get("name") or model["path"])
    if not lengths:
        return None
    found = job_plan_args(model, specs, cohorts, lengths, H)
    if found is None:
        raise PreflightError(
            f"rollout.max_batch_rows: auto: the memory plan cannot read the shape of model "
            f"{where} ({model['path']}/config.json); set an integer max_batch_rows"
        )
    (args, window), cuda = found, device.startswith("cuda")
    free, source = available_bytes(device)
    try:
        plan = auto_batch_rows(*args, free, window, packed=not cuda, bias=cuda)
    except PreflightError as exc:
        raise PreflightError(f"{exc} ({source}, model {where})") from None
    log.info(
        "max_batch_rows auto: %d rows a call (%d batches, peak %.1f GB) for %.1f GB of %s",
        plan.max_batch_rows, plan.batches, plan.peak_gb, free / GB, source,
    )  # fmt: skip
    return plan


def check_device_memory(
    model: Mapping[str, Any],
    specs: Mapping[str, Any],
    cohorts: Mapping[str, Mapping[str, int]],
    lengths: Sequence[int],
    H: int,
    max_batch_rows: int | str | None,
    device: str,
) -> JobPlan | None:
    """:func:`check_job_memory` against the job's CUDA device's whole memory, logged; nothing
    on a CPU (``device`` ``cpu``, or no CUDA) or without ``max_batch_rows``. ``auto``: the
    job's rows sized to the device, CPU or CUDA (:func:`auto_job_rows`); anything else than an
    integer >= 1 or ``auto`` refused in one line."""
    import torch

    rows = max_batch_rows
    if rows != "auto" and rows is not None and (not isinstance(rows, int) or rows < 1):
        raise PreflightError(f"max_batch_rows: expected an integer >= 1 or 'auto', got {rows!r}")
    cuda = device != "cpu" and torch.cuda.is_available()
    if max_batch_rows == "auto":
        resolved = (device if device.startswith("cuda") else "cuda") if cuda else "cpu"
        return auto_job_rows(model, specs, cohorts, lengths, H, resolved)
    if max_batch_rows is None or not cuda:
        return None
    index = torch.device(device if device.startswith("cuda") else "cuda").index
    total = torch.cuda.get_device_properties(index or 0).total_memory
    where = str(model.get("name") or model["path"])
    plan = check_job_memory(model, specs, cohorts, lengths, H, int(max_batch_rows), total, where)
    if plan is not None:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in plan.parts.items() if v)
        log.info(
            "memory plan: %.1f GB at %d rows a call (%d batches; %s GB), device %.1f GB",
            plan.peak_gb, max_batch_rows, plan.batches, parts, total / GB,
        )  # fmt: skip
    return plan
