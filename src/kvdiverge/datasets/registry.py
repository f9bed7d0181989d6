"""The registry of dataset environments: the ``env`` of a stratum names one of them.

An environment is a :class:`DatasetEnvironment` subclass registered with
:func:`register_environment`, like the eviction selectors (:data:`kvdiverge.eviction.SELECTORS`):
it checks its own stratum entries, names its tasks and the files a stratum reads, builds a
stratum's documents and says which task metric scores them (:mod:`kvdiverge.datasets.scoring`). The
built-in ones are ``ruler`` (:mod:`kvdiverge.datasets.ruler_env`), ``helmet``
(:mod:`kvdiverge.datasets.helmet_env`) and ``custom`` (:mod:`kvdiverge.datasets.custom`); a new
source is one such module plus its fixture, imported by the package's ``__init__``.

Namesake: :mod:`kvdiverge.engine.kernels.registry` registers attention kernels, not datasets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvdiverge.datasets.fitting import DatasetError, LengthFn
from kvdiverge.datasets.strata import ENVIRONMENTS, environment

if TYPE_CHECKING:
    from kvdiverge.datasets.strata import DatasetsConfig, DocumentSlot, Stratum

__all__ = [
    "ENVIRONMENTS",
    "DatasetEnvironment",
    "document_row",
    "environment",
    "register_environment",
]


class DatasetEnvironment:
    """One source of documents. Subclasses set :attr:`name` and implement the methods below."""

    name: ClassVar[str] = ""
    shared_plan: ClassVar[bool] = True
    """True: the task mix and source items continue across the env's strata (one source feeds
    them all, so no item is used twice); False: each stratum starts afresh (its own file)."""
    stratum_keys: ClassVar[tuple[str, ...]] = ()
    """Keys a stratum entry of this env may carry beyond env, label and target_tokens."""

    def stratum_options(self, spec: Mapping[str, Any], target: int, where: str) -> dict[str, Any]:
        """Keyword arguments of :class:`~kvdiverge.datasets.strata.Stratum` beyond env, label
        and target_tokens, from the stratum's config entry (keys set to None are absent); one-line
        :class:`DatasetError`."""
        known = {"env", "label", "target_tokens", *self.stratum_keys}
        extra = sorted(k for k, v in spec.items() if k not in known and v not in (None, ()))
        if extra:
            raise DatasetError(
                f"{where}: key(s) {', '.join(extra)} do not apply to env {self.name}"
                + (f" (it takes {', '.join(self.stratum_keys)})" if self.stratum_keys else "")
            )
        return {}

    def check_config(self, cfg: DatasetsConfig) -> None:
        """Cross-checks of the whole ``datasets`` section that concern this env (default none)."""

    def tasks(self, cfg: DatasetsConfig, stratum: Stratum) -> tuple[str, ...]:
        """The tasks a stratum's documents take round-robin."""
        raise NotImplementedError

    def documents(
        self,
        slots: list[DocumentSlot],
        cfg: DatasetsConfig,
        length_fn: LengthFn,
        progress: Callable[[], None],
    ) -> list[dict[str, Any]]:
        """One documents-table row per slot (:func:`document_row`), all of one stratum; every
        check that needs no tokenizer runs before the first ``length_fn`` call."""
        raise NotImplementedError

    def source_paths(self, cfg: DatasetsConfig, stratum: Stratum, tasks: set[str]) -> list[Path]:
        """The files and folders a stratum of these tasks reads, existing or not."""
        raise NotImplementedError

    def metric(self, stratum: Stratum, task: str) -> str:
        """Name of the :data:`kvdiverge.datasets.scoring.METRICS` entry that scores a document of
        ``task`` (the ``task`` column of the documents table)."""
        raise NotImplementedError


def register_environment(cls: type[DatasetEnvironment]) -> type[DatasetEnvironment]:
    """Class decorator: register one instance of ``cls`` under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__}: a dataset environment needs a name")
    ENVIRONMENTS[cls.name] = cls()
    return cls


def document_row(
    slot: DocumentSlot,
    prompt: str,
    answers: Any,
    source: str,
    seed: int,
    n_tokens: int,
    task: str | None = None,
) -> dict[str, Any]:
    """A documents-table row (:data:`kvdiverge.datasets.materialize.DOCUMENTS_SCHEMA`) of one
    planned slot; ``task`` replaces the slot's task name when given."""
    return {
        "doc_id": slot.doc_id,
        "stratum": slot.stratum.name,
        "env": slot.stratum.env,
        "length_label": slot.stratum.label,
        "target_tokens": slot.stratum.target_tokens,
        "task": slot.task if task is None else task,
        "cohort": slot.cohort,
        "prompt": prompt,
        "answers": list(answers),
        "source": source,
        "seed": seed,
        "n_tokens": n_tokens,
    }
