"""Documents for the language-model study (`docs/method.md`, "The language-model study").

Six strata {HELMET, RULER} × nominal lengths, each with ``dev``/``study1``/``study2`` cohorts:
RULER's 13 synthetic tasks (:mod:`kvdiverge.datasets.ruler`) and HELMET's six RAG/Cite datasets
(:mod:`kvdiverge.datasets.helmet`), fitted to a token budget under a length tokenizer's chat
template (:mod:`kvdiverge.datasets.fitting`), planned by :mod:`kvdiverge.datasets.strata` and
written by :mod:`kvdiverge.datasets.materialize`. Synthetic fixtures for the embedded default:
:mod:`kvdiverge.datasets.fixtures`. Each ``env`` of a stratum is a registered dataset
environment (:mod:`kvdiverge.datasets.registry`): ``ruler``, ``helmet`` and ``custom`` (the
user's own JSONL or Parquet prompts, :mod:`kvdiverge.datasets.custom`), imported here so that
they are registered whenever the package is.

The environments' own modules are :mod:`kvdiverge.datasets.ruler_env` and
:mod:`kvdiverge.datasets.helmet_env`; the task metrics :mod:`kvdiverge.datasets.scoring`;
sentence splitting and haystack prose :mod:`kvdiverge.datasets.text`.
"""

from kvdiverge.datasets import custom, helmet_env, ruler_env  # noqa: F401  (registration)
from kvdiverge.datasets.fitting import (
    DatasetError,
    LengthFitError,
    LengthFn,
    LongestLength,
    MissingSourceError,
    ModelLength,
)
from kvdiverge.datasets.helmet import HELMET_DATASETS
from kvdiverge.datasets.materialize import (
    materialize_for_models,
    materialize_stratum,
    stratum_source_paths,
)
from kvdiverge.datasets.registry import ENVIRONMENTS, DatasetEnvironment, register_environment
from kvdiverge.datasets.ruler import RULER_TASKS
from kvdiverge.datasets.strata import (
    COHORTS,
    DatasetsConfig,
    DocumentSlot,
    Stratum,
    plan_documents,
)
from kvdiverge.io.documents import (
    DOCUMENTS_SCHEMA,
    DocumentsFormatError,
    read_documents,
    write_documents,
)

__all__ = [
    "COHORTS",
    "DOCUMENTS_SCHEMA",
    "ENVIRONMENTS",
    "HELMET_DATASETS",
    "RULER_TASKS",
    "DatasetEnvironment",
    "DatasetError",
    "DatasetsConfig",
    "DocumentSlot",
    "DocumentsFormatError",
    "LengthFitError",
    "LengthFn",
    "LongestLength",
    "MissingSourceError",
    "ModelLength",
    "Stratum",
    "materialize_for_models",
    "materialize_stratum",
    "plan_documents",
    "read_documents",
    "register_environment",
    "stratum_source_paths",
    "write_documents",
]
