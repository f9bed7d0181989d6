"""HELMET's RAG and Cite datasets (docs/datasets.md, "HELMET").

Reads HELMET's own files (princeton-nlp/HELMET data.py ``load_qa`` and ``load_alce``): the KILT
JSONL files (question, answers, ctxs; K passages per length) with their k3 demo files, and the
ALCE ``*_gtr_top2000`` JSON with the ``prompts/*_revised.json`` demo files. Templates, the two
demonstrations, the demo selection, PopQA's popularity filter and the context truncation to
the budget follow HELMET. HELMET runs RAG as completion and Cite through the chat template
(``use_chat_template``); here every prompt is chat-wrapped at rollout time (`docs/method.md`,
"The language-model study"), so a RAG prompt is HELMET's completion text (user template +
"\\nAnswer:") and a Cite prompt is HELMET's user message (no "Answer:"), which is exactly the
text HELMET gives the model in each mode.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvdiverge.datasets.fitting import DatasetError, LengthFn, MissingSourceError, truncate_context
from kvdiverge.datasets.text import is_synthetic

__all__ = [
    "CITE_DOCUMENTS",
    "HELMET_DATASETS",
    "HELMET_TASK_NAMES",
    "RAG_PASSAGES",
    "USES_CHAT_TEMPLATE",
    "HelmetPrompt",
    "HelmetSource",
    "build_helmet_prompt",
    "helmet_file_paths",
    "load_helmet_source",
]

HELMET_DATASETS: tuple[str, ...] = (
    "kilt_nq",
    "kilt_triviaqa",
    "kilt_hotpotqa",
    "kilt_popqa",
    "alce_asqa",
    "alce_qampari",
)
HELMET_TASK_NAMES: dict[str, str] = {d: d.split("_", 1)[1] for d in HELMET_DATASETS}
"""The ``task`` column value per dataset (e.g. ``kilt_nq`` -> ``nq``)."""

USES_CHAT_TEMPLATE: dict[str, bool] = {d: d.startswith("alce") for d in HELMET_DATASETS}
"""HELMET's ``use_chat_template`` per task: RAG False, Cite True."""

# HELMET's generate_configs.py: input_max_length -> passages (RAG) / first-N documents (Cite)
RAG_PASSAGES: dict[int, int] = {4096: 20, 8192: 50, 16384: 105, 32768: 220, 65536: 440}
RAG_PASSAGES[131072] = 1000
CITE_DOCUMENTS: dict[int, int] = {4096: 8, 8192: 30, 16384: 75, 32768: 165, 65536: 345}
CITE_DOCUMENTS[131072] = 700

# HELMET's data.py load_qa
RAG_USER_TEMPLATE = (
    "Use the given documents to write a concise and short answer to the question. Write your "
    "answer in the following format:\nAnswer: [answer]\n\n{demos}{context}\n\nQuestion: {question}"
)
RAG_ANSWER_PREFIX = "Answer:"
RAG_DEMO_TEMPLATE = "{documents}\n\nQuestion: {question}\nAnswer: {answer}"
RAG_PASSAGE_TEMPLATE = "Document (Title: {title}): {text}"
# HELMET's data.py load_alce
CITE_USER_TEMPLATE = "{demo_text}{instruction}\n\nQuestion: {question}\n\n{context}"

_KILT_FILES: dict[str, tuple[str, str]] = {
    "kilt_nq": (
        "kilt/nq-dev-multikilt_1000_k{k}_dep6.jsonl",
        "kilt/nq-train-multikilt_1000_k3_dep6.jsonl",
    ),
    "kilt_triviaqa": (
        "kilt/triviaqa-dev-multikilt_1000_k{k}_dep6.jsonl",
        "kilt/triviaqa-train-multikilt_1000_k3_dep6.jsonl",
    ),
    "kilt_hotpotqa": (
        "kilt/hotpotqa-dev-multikilt_1000_k{k}_dep3.jsonl",
        "kilt/hotpotqa-train-multikilt_1000_k3_dep3.jsonl",
    ),
    "kilt_popqa": (
        "kilt/popqa_test_1000_k{k}_dep6.jsonl",
        "kilt/popqa_test_1000_k3_dep6.jsonl",
    ),
}
_ALCE_FILES: dict[str, tuple[str, str]] = {
    "alce_asqa": ("alce/asqa_eval_gtr_top2000.json", "asqa_revised.json"),
    "alce_qampari": ("alce/qampari_eval_gtr_top2000.json", "qampari_revised.json"),
}
_ORIGIN = (
    "HELMET's data archive: scripts/download_data.sh, data.tar.gz of the HF dataset "
    "princeton-nlp/HELMET"
)


@dataclass(frozen=True)
class HelmetSource:
    """One HELMET dataset at one length: test rows grouped by question key (every depth copy),
    the keys in a seeded order, and the demonstrations."""

    dataset: str
    groups: dict[str, tuple[dict, ...]]
    key_order: tuple[str, ...]
    demos: tuple[dict, ...]
    prompt_file: dict | None
    source: str


@dataclass(frozen=True)
class HelmetPrompt:
    """A HELMET prompt (the user message), its gold answers and how much context survived."""

    prompt: str
    answers: tuple[str, ...]
    context_kept: float


def helmet_file_paths(
    dataset: str, data_dir: str | Path, prompts_dir: str | Path, count: int
) -> tuple[Path, Path]:
    """(test file, demo file) of ``dataset`` with ``count`` passages."""
    if dataset in _KILT_FILES:
        test, demo = _KILT_FILES[dataset]
        return Path(data_dir) / test.format(k=count), Path(data_dir) / demo
    if dataset in _ALCE_FILES:
        test, prompt = _ALCE_FILES[dataset]
        return Path(data_dir) / test, Path(prompts_dir) / prompt
    raise DatasetError(
        f"unknown HELMET dataset {dataset!r}; expected one of {', '.join(HELMET_DATASETS)}"
    )


def _read_rows(path: Path, field: str) -> list[dict]:
    if not path.is_file():
        raise MissingSourceError(f"{field}: HELMET file not found: {path} (expected {_ORIGIN})")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        # HF datasets' json loader (HELMET's) also accepts JSON lines in a .json file
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, dict) and "data" in data:
        data = data["data"]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of rows")
    return data


def _require(rows: Sequence[dict], fields: Sequence[str], path: Path, what: str) -> None:
    for i, row in enumerate(rows):
        missing = [f for f in fields if f not in row]
        if missing:
            raise DatasetError(
                f"{path}: row {i} lacks {', '.join(missing)} (expected HELMET's {what} format)"
            )


def _popular_enough(row: dict, max_log10_pop: float) -> bool:
    return row["s_pop"] > 0 and math.log10(row["s_pop"]) < max_log10_pop


def load_helmet_source(
    dataset: str,
    data_dir: str | Path,
    prompts_dir: str | Path,
    count: int,
    seed: int,
    popqa_max_log10_pop: float = 3.0,
) -> HelmetSource:
    """Read one HELMET dataset's test and demo files for ``count`` passages/documents.

    Rows are grouped by question key (``id`` when every row has one, else ``question``, as
    HELMET); keys are sorted and shuffled with ``seed``, so the k-th document of a dataset takes
    the k-th key. PopQA keeps rows with log10(s_pop) below ``popqa_max_log10_pop``.
    """
    test_path, demo_path = helmet_file_paths(dataset, data_dir, prompts_dir, count)
    rows = _read_rows(test_path, "datasets.helmet.data_dir")
    prompt_file = None
    if dataset in _KILT_FILES:
        _require(rows, ("question", "answers", "ctxs"), test_path, "KILT")
        demos = _read_rows(demo_path, "datasets.helmet.data_dir")
        _require(demos, ("question", "answers", "ctxs"), demo_path, "KILT demo")
        if dataset == "kilt_popqa":
            _require(rows, ("s_pop",), test_path, "PopQA")
            rows = [r for r in rows if _popular_enough(r, popqa_max_log10_pop)]
            demos = [d for d in demos if _popular_enough(d, popqa_max_log10_pop)]
        key = "id" if rows and all("id" in r for r in rows) else "question"
    else:
        _require(rows, ("question", "docs"), test_path, "ALCE")
        if not demo_path.is_file():
            raise MissingSourceError(
                f"datasets.helmet.prompts_dir: HELMET prompt file not found: {demo_path} "
                "(expected HELMET's prompts/ folder)"
            )
        prompt_file = json.loads(demo_path.read_text(encoding="utf-8"))
        missing = [
            f for f in ("instruction", "demo_prompt", "doc_prompt", "demos") if f not in prompt_file
        ]
        if missing:
            raise DatasetError(f"{demo_path}: lacks {', '.join(missing)} (HELMET prompt file)")
        demos = prompt_file["demos"]
        key = "question"
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(str(row[key]), []).append(row | {"_key": str(row[key])})
    for d in demos:
        d["_key"] = str(d.get(key, d["question"]))
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    tag = " (synthetic)" if is_synthetic(test_path) else ""
    return HelmetSource(
        dataset=dataset,
        groups={k: tuple(v) for k, v in groups.items()},
        key_order=tuple(order),
        demos=tuple(demos),
        prompt_file=prompt_file,
        source=f"{test_path}{tag}",
    )


def _kilt_demo_text(sample_key: str, demos: Sequence[dict], dataset: str, shots: int) -> str:
    if shots == 0:
        return ""
    pool = [d for d in demos if d["_key"] != sample_key] if dataset == "kilt_popqa" else demos
    h = int(hashlib.sha256(sample_key.encode("utf-8")).hexdigest(), 16) % 2**31
    # HF datasets' Dataset.shuffle(seed=h) permutes with np.random.default_rng(h)
    shuffled = [pool[i] for i in np.random.default_rng(h).permutation(len(pool))]
    chosen, seen = [], set()
    for d in shuffled:
        if d["_key"] not in seen:
            seen.add(d["_key"])
            chosen.append(d)
    if len(chosen) < shots:
        raise DatasetError(f"{dataset}: {len(chosen)} demonstrations available, {shots} needed")
    blocks = [
        RAG_DEMO_TEMPLATE.format(
            documents="\n\n".join(RAG_PASSAGE_TEMPLATE.format(**c) for c in d["ctxs"]),
            question=d["question"],
            answer=d["answers"][0],
        )
        for d in chosen[:shots]
    ]
    return "\n\n".join(blocks) + "\n\n"


def _cite_answers(dataset: str, row: dict) -> tuple[str, ...]:
    if dataset == "alce_asqa":
        shorts = [a for pair in row.get("qa_pairs", []) for a in pair.get("short_answers", [])]
        return tuple(dict.fromkeys(shorts)) or ((row["answer"],) if "answer" in row else ())
    answers = row.get("answers", [])
    return tuple(a[0] if isinstance(a, list) else a for a in answers if a)


def build_helmet_prompt(
    source: HelmetSource,
    key: str,
    count: int,
    rng: random.Random,
    length_fn: LengthFn,
    budget: int,
    shots: int = 2,
) -> HelmetPrompt:
    """Build the prompt for question ``key`` of ``source`` and truncate its context so that the
    chat-wrapped length is at most ``budget`` tokens.

    RAG: one depth copy of the question (drawn with ``rng``), all its K passages, ``shots``
    demonstrations chosen as HELMET does; the prompt is HELMET's completion text. Cite: the
    first ``count`` documents, ``shots`` of the prompt file's demos drawn with ``rng``, and
    HELMET's chat-mode user message.
    """
    rows = source.groups[key]
    row = rows[rng.randrange(len(rows))]
    dataset = source.dataset
    if dataset in _KILT_FILES:
        demos = _kilt_demo_text(key, source.demos, dataset, shots)
        context = "\n\n".join(RAG_PASSAGE_TEMPLATE.format(**c) for c in row["ctxs"])

        def render(ctx: str) -> str:
            user = RAG_USER_TEMPLATE.format(demos=demos, context=ctx, question=row["question"])
            return user + "\n" + RAG_ANSWER_PREFIX

        answers = tuple(row["answers"])
    else:
        pf = source.prompt_file
        assert pf is not None
        doc_prompt, instruction = pf["doc_prompt"], pf["instruction"]
        chosen = rng.sample(list(pf["demos"]), shots) if shots else []
        demo_text = "\n\n\n".join(
            pf["demo_prompt"].format(
                **{k: v for k, v in demo.items() if k not in ("instruction", "context")},
                instruction=instruction,
                context="\n\n".join(
                    doc_prompt.format(**d, ID=i + 1) for i, d in enumerate(demo["docs"])
                ),
            )
            for demo in chosen
        )
        if shots:
            demo_text += "\n\n\n"
        context = "\n\n".join(
            doc_prompt.format(**d, ID=i + 1) for i, d in enumerate(row["docs"][:count])
        )

        def render(ctx: str) -> str:
            return CITE_USER_TEMPLATE.format(
                demo_text=demo_text, instruction=instruction, question=row["question"], context=ctx
            )

        answers = _cite_answers(dataset, row)
    prompt, kept = truncate_context(render, context, length_fn, budget)
    return HelmetPrompt(prompt, answers, kept / len(context) if context else 1.0)
