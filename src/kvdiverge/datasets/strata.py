"""Strata, cohorts and the document plan (`docs/method.md`, "The language-model study").

A stratum is (env, nominal length): ``{env}-{label}`` with a target of ``target_tokens``
tokens. Each stratum has the cohorts ``dev``, ``study1``, ``study2`` (paper: 6, 48, 48
documents). The plan is computed from the config alone, so document ids are known at DAG build
time: ``{stratum}/{cohort}/{index:03d}``.

Task mix: within an env, documents take the env's tasks round-robin by a running index that
continues across cohorts (dev, study1, study2) and across the env's strata in config order, so
every stratum is balanced over its tasks (counts differ by at most one) and a few documents per
stratum still cover every task across the env's strata. Source items: the k-th document of an
(env, task) pair over the whole plan takes source item k (question k of a QA file, the k-th key
of a HELMET dataset), so no source question is used twice anywhere, in particular not in two
cohorts. An env whose strata each read their own file (``custom``; ``shared_plan`` false in
:mod:`kvdiverge.datasets.registry`) keeps its running index and items per stratum instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdiverge.datasets.fitting import DatasetError, derive_seed
from kvdiverge.datasets.helmet import HELMET_DATASETS
from kvdiverge.datasets.ruler import RULER_TASKS

__all__ = [
    "COHORTS",
    "DatasetsConfig",
    "DocumentSlot",
    "Stratum",
    "plan_documents",
]

ENVIRONMENTS: dict[str, Any] = {}
"""Registered environments by name: :class:`kvdiverge.datasets.registry.DatasetEnvironment`
instances, added by :func:`kvdiverge.datasets.registry.register_environment`."""


def environment(name: str, where: str = "env") -> Any:
    """The registered environment ``name``; one-line :class:`DatasetError` naming the known ones."""
    try:
        return ENVIRONMENTS[name]
    except KeyError:
        raise DatasetError(
            f"{where}: expected one of {', '.join(sorted(ENVIRONMENTS))}, got {name!r}"
        ) from None


COHORTS: tuple[str, ...] = ("dev", "study1", "study2")


@dataclass(frozen=True)
class Stratum:
    """(env, nominal length): name ``{env}-{label}``, target length in tokens, for HELMET
    the passage count K (RAG) and document count N (Cite) at that length (HELMET's
    generate_configs.py), and the env's other options as sorted (key, value) pairs (e.g. a
    ``custom`` stratum's file; :mod:`kvdiverge.datasets.registry`)."""

    env: str
    label: str
    target_tokens: int
    rag_passages: int | None = None
    cite_documents: int | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        """The value of one of :attr:`options`, else ``default``."""
        return dict(self.options).get(key, default)

    @property
    def name(self) -> str:
        """``{env}-{label}``, the ``stratum`` wildcard and column."""
        return f"{self.env}-{self.label}"


@dataclass(frozen=True)
class DocumentSlot:
    """One planned document: id, stratum, cohort, index, task, source item and seed."""

    doc_id: str
    stratum: Stratum
    cohort: str
    index: int
    task: str
    source_index: int
    seed: int


@dataclass(frozen=True)
class DatasetsConfig:
    """The validated ``datasets:`` config section (docs/datasets.md, "Config")."""

    strata: tuple[Stratum, ...]
    cohorts: dict[str, int]
    seed: int
    generation_reserve: int
    length_tokenizer: str
    ruler_tasks: tuple[str, ...]
    essay_dir: Path | None
    squad: Path
    hotpotqa: Path
    helmet_data_dir: Path
    helmet_prompts_dir: Path
    helmet_datasets: tuple[str, ...]
    helmet_shots: int = 2
    popqa_max_log10_pop: float = 3.0

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> DatasetsConfig:
        """Build from the ``datasets:`` mapping (schema defaults already filled); one-line
        :class:`DatasetError` for unknown tasks or datasets, duplicate strata, missing HELMET
        counts at non-standard lengths, unknown cohorts, or a budget that is not positive."""
        ruler, helmet = section.get("ruler", {}), section.get("helmet", {})
        tasks = tuple(ruler.get("tasks", RULER_TASKS))
        unknown = [t for t in tasks if t not in RULER_TASKS]
        if unknown:
            raise DatasetError(
                f"config.datasets.ruler.tasks: unknown task(s) {', '.join(map(repr, unknown))}; "
                f"expected some of {', '.join(RULER_TASKS)}"
            )
        dsets = tuple(helmet.get("datasets", HELMET_DATASETS))
        unknown = [d for d in dsets if d not in HELMET_DATASETS]
        if unknown:
            raise DatasetError(
                f"config.datasets.helmet.datasets: unknown dataset(s) "
                f"{', '.join(map(repr, unknown))}; expected some of {', '.join(HELMET_DATASETS)}"
            )
        if not tasks or not dsets:
            raise DatasetError("config.datasets: RULER tasks and HELMET datasets need items")
        cohorts = dict(section.get("cohorts", {"dev": 6, "study1": 48, "study2": 48}))
        bad = [c for c in cohorts if c not in COHORTS]
        if bad:
            raise DatasetError(
                f"config.datasets.cohorts: unknown cohort(s) {', '.join(map(repr, bad))}; "
                f"expected {', '.join(COHORTS)}"
            )
        reserve = int(section.get("generation_reserve", 128))
        strata = []
        for i, s in enumerate(section.get("strata", [])):
            where = f"config.datasets.strata[{i}]"
            # a Stratum's own fields round-trip: its options become keys of the entry again
            s = {**dict(s.get("options") or ()), **{k: v for k, v in s.items() if k != "options"}}
            env, target = s["env"], int(s["target_tokens"])
            source = environment(env, f"{where}.env")
            if target <= reserve:
                raise DatasetError(
                    f"{where}.target_tokens: {target} leaves no room for the prompt after the "
                    f"generation reserve of {reserve} tokens"
                )
            options = source.stratum_options(s, target, where)
            strata.append(Stratum(env, str(s["label"]), target, **options))
        if not strata:
            raise DatasetError("config.datasets.strata: expected at least one stratum")
        names = [s.name for s in strata]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise DatasetError(f"config.datasets.strata: duplicate stratum {', '.join(dup)}")
        essay = ruler.get("essay_dir")
        cfg = cls(
            strata=tuple(strata),
            cohorts={c: int(cohorts.get(c, 0)) for c in COHORTS},
            seed=int(section.get("seed", 42)),
            generation_reserve=reserve,
            length_tokenizer=str(section.get("length_tokenizer", "")),
            ruler_tasks=tasks,
            essay_dir=Path(essay) if essay else None,
            squad=Path(ruler.get("squad", "data/fixtures/squad/dev-v2.0.json")),
            hotpotqa=Path(
                ruler.get("hotpotqa", "data/fixtures/hotpotqa/hotpot_dev_distractor_v1.json")
            ),
            helmet_data_dir=Path(helmet.get("data_dir", "data/fixtures/helmet/data")),
            helmet_prompts_dir=Path(helmet.get("prompts_dir", "data/fixtures/helmet/prompts")),
            helmet_datasets=dsets,
            helmet_shots=int(helmet.get("shots", 2)),
            popqa_max_log10_pop=float(helmet.get("popqa_max_log10_pop", 3.0)),
        )
        for env in dict.fromkeys(s.env for s in strata):
            environment(env).check_config(cfg)
        return cfg

    def stratum(self, name: str) -> Stratum:
        """The stratum called ``name``; one-line error naming the configured ones otherwise."""
        for s in self.strata:
            if s.name == name:
                return s
        raise DatasetError(
            f"stratum {name!r} is not configured; expected one of "
            f"{', '.join(s.name for s in self.strata)}"
        )

    def tasks(self, stratum: Stratum | str) -> tuple[str, ...]:
        """The task list of a stratum, or of an env's first stratum (RULER tasks, HELMET
        datasets; a ``custom`` stratum's tasks come from its file, so its plan has one)."""
        if isinstance(stratum, str):
            found = [s for s in self.strata if s.env == stratum]
            if not found:
                raise DatasetError(f"no stratum of env {stratum!r} is configured")
            stratum = found[0]
        return environment(stratum.env).tasks(self, stratum)


def plan_documents(cfg: DatasetsConfig) -> list[DocumentSlot]:
    """Every document of every stratum, in order (module docstring: ids, task mix, sources).

    Deterministic in the config: ``seed`` of a document is derived from the master seed and
    its doc_id.
    """
    slots: list[DocumentSlot] = []
    running: dict[str, int] = {}
    per_task: dict[tuple[str, str], int] = {}
    for stratum in cfg.strata:
        tasks = cfg.tasks(stratum)
        plan = stratum.env if environment(stratum.env).shared_plan else stratum.name
        for cohort in COHORTS:
            for index in range(cfg.cohorts[cohort]):
                task = tasks[running.get(plan, 0) % len(tasks)]
                running[plan] = running.get(plan, 0) + 1
                k = per_task.get((plan, task), 0)
                per_task[(plan, task)] = k + 1
                doc_id = f"{stratum.name}/{cohort}/{index:03d}"
                slots.append(
                    DocumentSlot(
                        doc_id, stratum, cohort, index, task, k, derive_seed(cfg.seed, doc_id)
                    )
                )
    return slots
