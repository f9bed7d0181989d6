"""The coupled rollout engine (``docs/architecture.md``, "The engine").

* :mod:`kvdiverge.engine.attention`: shared-prefix attention — many decoding rows attend to
  prompt caches held once per row group, merged exactly with each row's own generated entries;
* :mod:`kvdiverge.engine.settings`: :class:`RolloutSettings` and :class:`ActionPaths`;
* :mod:`kvdiverge.engine.rows`: the coupled decode loop's row machinery — one model call per
  step for every row of a batch, the stepwise maximal coupling on common random numbers;
* :mod:`kvdiverge.engine.document`: one document's rollouts under several actions;
* :mod:`kvdiverge.engine.decoding_compression`: compression during decoding — each row's kept
  entries, re-compressed from its own history after each model call;
* :mod:`kvdiverge.engine.generated_quantization`: each row's own generated entries quantized as
  they age (KIVI's streaming part), in place after each model call;
* :mod:`kvdiverge.engine.batch_plan`: the plan of a job's model calls before any model loads
  (numpy only): :func:`plan_batches` and the masked layout's threshold;
* :mod:`kvdiverge.engine.batches`: many documents' rollouts with the rows of several documents
  in each model call (:func:`batched_paths`, batches packed by :func:`plan_batches`);
* :mod:`kvdiverge.engine.swrb_rollout`: SWRB replicates of one document;
* :mod:`kvdiverge.engine.preflight`: the checks a rollout job runs before any model work;
* :mod:`kvdiverge.engine.rollout_job` and :mod:`kvdiverge.engine.swrb_job`: the rollout jobs —
  a stratum's documents → trajectory or SWRB record files.

This module gathers their public names, so that ``from kvdiverge.engine import …`` reads as
one API. The rollout jobs' names load on first use (they need polars; the engine itself needs
only torch, transformers and numpy, as ``benchmarks/device_check.py`` on a bare GPU machine does).

Beside them: :mod:`kvdiverge.engine.kernels` (the attention kernels and their dispatch),
:mod:`kvdiverge.engine.families` (the attention the engine computes exactly, and the refusal of
the rest), :mod:`kvdiverge.engine.job_records` (what a job's files record per action besides
their rows), :mod:`kvdiverge.engine.memory` (the allocator setting), and
:mod:`kvdiverge.engine.memory_plan` and :mod:`kvdiverge.engine.roofline` (a job's memory plan
and least time, before any weight is loaded), and :mod:`kvdiverge.engine.device_memory` (that
plan against the job's device: ``max_batch_rows: auto`` sized to it).
"""

import importlib
from typing import Any

# name -> the module that defines it. Imported on first use, so that a check that needs no
# torch (the Snakefile's parse-time checks through kvdiverge.engine.preflight) loads none.
_HOMES = {
    "ATTENTION_NAME": "attention",
    "RowCache": "attention",
    "SharedPrefix": "attention",
    "shared_prefix_attention": "attention",
    "plan_batches": "batches",
    "batched_paths": "batches",
    "reference_groups": "document",
    "paths_under_action": "document",
    "paths_under_actions": "document",
    "COUPLING_MODES": "settings",
    "ActionPaths": "settings",
    "RolloutSettings": "settings",
    "TIMING_KEYS": "rollout_job",
    "batched_prompt_paths": "rollout_job",
    "trajectory_tables": "rollout_job",
    "run_stratum_rollout_job": "rollout_job",
    "select_documents": "rollout_job",
    "select_job_documents": "rollout_job",
    "trajectory_frame": "rollout_job",
}

__all__ = [
    "ATTENTION_NAME",
    "COUPLING_MODES",
    "ActionPaths",
    "RolloutSettings",
    "RowCache",
    "SharedPrefix",
    "TIMING_KEYS",
    "batched_prompt_paths",
    "plan_batches",
    "reference_groups",
    "paths_under_action",
    "paths_under_actions",
    "batched_paths",
    "trajectory_tables",
    "run_stratum_rollout_job",
    "select_documents",
    "select_job_documents",
    "shared_prefix_attention",
    "trajectory_frame",
]


def __getattr__(name: str) -> Any:
    """A public name of the engine, imported from its module (``_HOMES``) on first use."""
    if name in _HOMES:
        return getattr(importlib.import_module(f"kvdiverge.engine.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'kvdiverge.engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
