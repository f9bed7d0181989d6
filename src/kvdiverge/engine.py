"""The coupled rollout engine, in three modules (``docs/architecture.md``, "The engine").

* :mod:`kvdiverge.attention`: shared-prefix attention — many decoding rows attend to prompt
  caches held once per row group, merged exactly with each row's own generated entries;
* :mod:`kvdiverge.decode`: the coupled decode loop — one document's rollouts under several
  actions, one model call per step for all rows, with :class:`RolloutSettings`; and many
  documents' rollouts with the rows of several documents in each model call
  (:func:`rollout_documents`, batches packed by :func:`plan_batches`);
* :mod:`kvdiverge.rollout_job`: the rollout job — a stratum's documents → trajectory files.

This module gathers their public names, so that ``from kvdiverge.engine import …`` reads as
one API.
"""

from kvdiverge.attention import (
    ATTENTION_NAME,
    RowCache,
    SharedPrefix,
    shared_prefix_attention,
)
from kvdiverge.decode import (
    COUPLING_MODES,
    DocumentRollout,
    RolloutSettings,
    plan_batches,
    reference_groups,
    rollout_document,
    rollout_document_actions,
    rollout_documents,
)
from kvdiverge.rollout_job import (
    TIMING_KEYS,
    document_rollouts,
    rollout_documents_actions,
    run_stratum_rollout_job,
    select_documents,
    select_job_documents,
    trajectory_frame,
)

__all__ = [
    "ATTENTION_NAME",
    "COUPLING_MODES",
    "DocumentRollout",
    "RolloutSettings",
    "RowCache",
    "SharedPrefix",
    "TIMING_KEYS",
    "document_rollouts",
    "plan_batches",
    "reference_groups",
    "rollout_document",
    "rollout_document_actions",
    "rollout_documents",
    "rollout_documents_actions",
    "run_stratum_rollout_job",
    "select_documents",
    "select_job_documents",
    "shared_prefix_attention",
    "trajectory_frame",
]
