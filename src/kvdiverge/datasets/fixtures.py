"""Synthetic fixtures for the embedded default (issue "Dataset materialization", item 3).

Small files in the exact formats of HELMET (KILT JSONL, ALCE JSON, prompt JSON), SQuAD v2 dev,
HotpotQA dev-distractor and a ``custom`` prompts file (JSONL), all written for this project by a
deterministic generator from an invented world (fictional towns, rivers, people and books).
Every file says it is synthetic (ids prefixed ``synthetic-``, a ``_note`` field, SQuAD's
``version``) and each of their folders holds a ``SYNTHETIC`` marker, so ``source`` in the
documents table says so too. They are read by the same loaders as the real files. The essay
folder beside them (``essays/``) is real public-domain prose, written by
``workflow/scripts/write_essays.py``, and carries no marker.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from kvdiverge.datasets.text import SYNTHETIC_MARKER
from kvdiverge.io import atomic_write_text

__all__ = ["DEFAULT_KILT_PASSAGES", "SYNTHETIC_FOLDERS", "write_fixtures"]

DEFAULT_KILT_PASSAGES: tuple[int, ...] = (4, 10, 16)
"""The K values (passages per question) of the KILT fixture files: the default's rag_passages."""

SYNTHETIC_FOLDERS: tuple[str, ...] = ("squad", "hotpotqa", "helmet", "custom")
"""The fixture folders with a ``SYNTHETIC`` marker (all of ``data/fixtures`` but ``essays``)."""

NOTE = "SYNTHETIC fixture written for kvdiverge (invented facts); not the original dataset."

_ONSETS = ["b", "br", "c", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "r", "s"]
_ONSETS += ["st", "t", "th", "v", "w", "z"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ei", "ou"]
_CODAS = ["", "n", "r", "l", "s", "th", "nd", "rk", "m", "x"]
_SUFFIXES = ["holt", "bury", "mere", "wick", "ford", "stead", "ham", "dale", "ton", "moor"]


def _word(rng: random.Random, syllables: int) -> str:
    parts = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)]
    parts += [rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(syllables - 1)]
    return "".join(parts).capitalize()


class _World:
    """An invented world: towns with founders, years, rivers and regions; authors and books."""

    def __init__(self, seed: int, n: int) -> None:
        rng = random.Random(seed)
        used: set[str] = set()

        def unique(make) -> str:
            while True:
                w = make()
                if w not in used:
                    used.add(w)
                    return w

        self.towns = []
        for _ in range(n):
            self.towns.append(
                {
                    "town": unique(lambda: _word(rng, 1) + rng.choice(_SUFFIXES)),
                    "founder": f"{unique(lambda: _word(rng, 2))} {unique(lambda: _word(rng, 2))}",
                    "year": str(rng.randint(1150, 1890)),
                    "river": unique(lambda: "the " + _word(rng, 2)),
                    "region": unique(lambda: _word(rng, 2)),
                    "book": "The "
                    + unique(lambda: _word(rng, 2))
                    + " "
                    + rng.choice(
                        ["Letters", "Chronicle", "Garden", "Voyage", "Harvest", "Lantern"]
                    ),
                    "pop": rng.choice([40, 120, 300, 650, 900, 2500, 8000]),
                }
            )

    def passage(self, t: dict, kind: int) -> tuple[str, str]:
        """(title, text) of a short encyclopedic passage about town record ``t``."""
        if kind == 0:
            return t["town"], (
                f"{t['town']} is a small town in the {t['region']} valley. It was founded in "
                f"{t['year']} by {t['founder']}, and {t['river']} flows through its centre."
            )
        if kind == 1:
            return t["founder"], (
                f"{t['founder']} was a surveyor and writer who founded {t['town']}. "
                f"{t['founder']} also wrote the book {t['book']}."
            )
        return t["river"].removeprefix("the ").strip(), (
            f"The river {t['river'].removeprefix('the ')} rises in the {t['region']} hills "
            f"and passes {t['town']} before it reaches the sea."
        )


def _dump(path: Path, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def _dump_jsonl(path: Path, rows: Iterable[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _squad(world: _World) -> dict:
    articles = []
    for a in range(8):
        paragraphs = []
        for t in world.towns[a * 4 : a * 4 + 4]:
            _, text = world.passage(t, 0)
            qas = []
            for j, (question, answer) in enumerate(
                [
                    (f"Who founded {t['town']}?", t["founder"]),
                    (f"In what year was {t['town']} founded?", t["year"]),
                ]
            ):
                qas.append(
                    {
                        "question": question,
                        "id": f"synthetic-squad-{t['town'].lower()}-{j}",
                        "answers": [{"text": answer, "answer_start": text.index(answer)}],
                        "is_impossible": False,
                    }
                )
            qas.append(
                {
                    "question": f"Who closed the harbour of {t['town']}?",
                    "id": f"synthetic-squad-{t['town'].lower()}-x",
                    "answers": [],
                    "plausible_answers": [],
                    "is_impossible": True,
                }
            )
            paragraphs.append({"context": text, "qas": qas})
        articles.append({"title": f"Synthetic_region_{a}", "paragraphs": paragraphs})
    return {"version": "v2.0 (SYNTHETIC kvdiverge fixture)", "_note": NOTE, "data": articles}


def _hotpot_sentences(text: str) -> list[str]:
    """HotpotQA's sentence list: later sentences keep their leading space, so ``"".join``
    restores the passage."""
    parts = text.split(". ")
    sents = [p + "." for p in parts[:-1]] + [parts[-1]]
    return [s if i == 0 else " " + s for i, s in enumerate(sents)]


def _hotpotqa(world: _World, rng: random.Random) -> list[dict]:
    out = []
    towns = world.towns
    for i in range(10):
        t = towns[i]
        gold = [world.passage(t, 1), world.passage(t, 0)]
        pool = [world.passage(o, k) for o in towns if o is not t for k in (0, 2)]
        distractors = rng.sample(pool, 8)
        context = gold + distractors
        rng.shuffle(context)
        out.append(
            {
                "_id": f"synthetic-hotpot-{i:03d}",
                "_note": NOTE,
                "question": f"In what year was the town founded by the author of {t['book']} "
                "founded?",
                "answer": t["year"],
                "type": "bridge",
                "level": "medium",
                "supporting_facts": [[gold[0][0], 1], [gold[1][0], 1]],
                "context": [[title, _hotpot_sentences(text)] for title, text in context],
            }
        )
    return out


def _ctx(title: str, text: str, pid: str, has_answer: bool) -> dict:
    return {"title": title, "text": text, "id": pid, "has_answer": has_answer}


def _kilt_rows(world, rng, dataset, towns, k, depths, split) -> list[dict]:
    rows = []
    for qi, t in enumerate(towns):
        if dataset == "hotpotqa":
            question = f"Which river flows through the town founded by the author of {t['book']}?"
            answers, golds = [t["river"].removeprefix("the ")], [(1, True), (0, True)]
        elif dataset == "triviaqa":
            question = f"Which book did the founder of {t['town']} write?"
            answers, golds = [t["book"]], [(1, True)]
        elif dataset == "popqa":
            question = f"Who founded {t['town']}?"
            answers, golds = [t["founder"]], [(0, True)]
        else:
            question = f"who founded the town of {t['town'].lower()}"
            answers, golds = [t["founder"]], [(0, True)]
        gold_ctxs = [
            _ctx(*world.passage(t, kind), f"synthetic-psg-{t['town']}-{kind}", True)
            for kind, _ in golds
        ][: max(1, k)]
        others = [o for o in world.towns if o is not t]
        for d in range(depths):
            negatives = []
            for o in rng.sample(others, len(others)):
                title, text = world.passage(o, 2 if (d + len(negatives)) % 2 else 0)
                if not any(a in text for a in answers):
                    negatives.append(_ctx(title, text, f"synthetic-psg-{o['town']}", False))
                if len(negatives) == k - len(gold_ctxs):
                    break
            ctxs = list(negatives)
            for g, gold in enumerate(gold_ctxs):
                pos = round((d / max(1, depths - 1)) * (len(ctxs))) if depths > 1 else 0
                ctxs.insert(min(len(ctxs), pos + g), gold)
            row = {
                "question": question,
                "answers": answers,
                "ctxs": ctxs[:k],
                "positive_ctxs": gold_ctxs,
                "hard_negative_ctxs": [],
                "depth": d,
            }
            if dataset != "nq":
                row["id"] = f"synthetic-{dataset}-{split}-{qi:03d}"
            if dataset == "popqa":
                row["s_pop"] = t["pop"]
            rows.append(row)
    return rows


def _alce_rows(world: _World, towns: list[dict], dataset: str, n_docs: int) -> list[dict]:
    rows = []
    for i, t in enumerate(towns):
        docs = [_ctx(*world.passage(t, k), f"synthetic-{t['town']}-{k}", True) for k in (0, 1)]
        for o in world.towns:
            if o is not t and len(docs) < n_docs:
                title, text = world.passage(o, len(docs) % 3)
                docs.append({"title": title, "text": text, "id": f"synthetic-{o['town']}"})
        if dataset == "asqa":
            rows.append(
                {
                    "sample_id": f"synthetic-asqa-{i:03d}",
                    "_note": NOTE,
                    "question": f"Who founded {t['town']} and when?",
                    "answer": f"{t['town']} was founded by {t['founder']} in {t['year']}.",
                    "qa_pairs": [
                        {"question": "Who founded it?", "short_answers": [t["founder"]]},
                        {"question": "When was it founded?", "short_answers": [t["year"]]},
                    ],
                    "annotations": [{"long_answer": f"{t['founder']} founded it in {t['year']}."}],
                    "docs": docs,
                }
            )
        else:
            rows.append(
                {
                    "id": f"synthetic-qampari-{i:03d}",
                    "_note": NOTE,
                    "question": f"What do we know about the founding of {t['town']}?",
                    "answers": [[t["founder"]], [t["year"]], [t["river"].removeprefix("the ")]],
                    "docs": docs,
                }
            )
    return rows


def _alce_prompts(world: _World, towns: list[dict], dataset: str) -> dict:
    if dataset == "asqa":
        instruction = (
            "Instruction: Write an accurate, engaging, and concise answer for the given question "
            "using only the provided search results and cite them properly. Cite with [x]."
        )
        demo_prompt = "{instruction}\n\nQuestion: {question}\n\n{context}\n\nAnswer: {answer}"
    else:
        instruction = (
            "Instruction: Provide a list of accurate answers for the given question using only "
            "the provided search results, citing one document per answer as [x]."
        )
        demo_prompt = "{instruction}\n\nQuestion: {question}\n\n{context}\nAnswer: {answer}"
    demos = []
    for t in towns:
        docs = [
            {"title": t["town"], "text": f"Founded in {t['year']} by {t['founder']}."},
            {"title": t["founder"], "text": f"Author of {t['book']}."},
            {"title": t["river"], "text": f"A river through {t['town']}."},
            {"title": t["region"], "text": f"A valley around {t['town']}."},
            {"title": towns[0]["town"], "text": f"A town on {towns[0]['river']}."},
        ]
        answer = (
            f"{t['town']} was founded by {t['founder']} in {t['year']} [1]."
            if dataset == "asqa"
            else f"{t['founder']} [1], {t['year']} [1], {t['river'].removeprefix('the ')} [3]."
        )
        demos.append({"question": f"Who founded {t['town']}?", "answer": answer, "docs": docs})
    return {
        "_note": NOTE,
        "instruction": instruction,
        "demo_sep": "\n\n\n",
        "demo_prompt": demo_prompt,
        "doc_prompt": "Document [{ID}](Title: {title}): {text}",
        "demos": demos,
    }


def _custom_rows(world: _World, rng: random.Random, n: int = 12) -> list[dict]:
    """Records of the ``custom`` environment's format (:mod:`kvdiverge.datasets.custom`): a
    question about one town, its passages among others' in ``context``, ``{context}`` in the
    prompt, the founder or the founding year as the answer."""
    rows = []
    for i, t in enumerate(world.towns[:n]):
        others = rng.sample([o for o in world.towns if o is not t], 5)
        passages = [world.passage(o, rng.randrange(3))[1] for o in others]
        passages.insert(rng.randrange(len(passages) + 1), world.passage(t, 0)[1])
        task, question, answer = (
            ("founder", f"Who founded {t['town']}?", t["founder"])
            if i % 2 == 0
            else ("year", f"In what year was {t['town']} founded?", t["year"])
        )
        rows.append(
            {
                "id": f"synthetic-custom-{i:02d}",
                "task": task,
                "prompt": "Answer the question from the passages, in a few words.\n\n"
                "{context}\n\nQuestion: " + question,
                "context": "\n\n".join(passages),
                "answers": [answer],
                "_note": NOTE,
            }
        )
    return rows


def write_fixtures(root: str | Path, seed: int = 20261129) -> list[Path]:
    """Write every fixture file below ``root`` (``data/fixtures`` in the repository).

    Deterministic in ``seed``: rerunning reproduces the committed files byte for byte.
    Returns the written paths.
    """
    root = Path(root)
    rng = random.Random(seed)
    world = _World(seed, 40)
    written: list[Path] = []

    def put(path: Path, obj, jsonl: bool = False) -> None:
        (_dump_jsonl if jsonl else _dump)(path, obj)
        written.append(path)

    for folder in SYNTHETIC_FOLDERS:
        marker = root / folder / SYNTHETIC_MARKER
        atomic_write_text(marker, NOTE + " Every file below this folder is synthetic.\n")
        written.append(marker)
    put(root / "squad" / "dev-v2.0.json", _squad(world))
    put(root / "hotpotqa" / "hotpot_dev_distractor_v1.json", _hotpotqa(world, rng))
    towns = world.towns
    groups = {"nq": towns[0:10], "triviaqa": towns[10:20], "hotpotqa": towns[20:30]}
    groups["popqa"] = towns[30:40]
    for dataset, members in groups.items():
        dep = 3 if dataset == "hotpotqa" else 6
        if dataset == "popqa":
            name, demo = "popqa_test_1000_k{k}_dep6.jsonl", "popqa_test_1000_k3_dep6.jsonl"
        else:
            split = f"_1000_k{{k}}_dep{dep}.jsonl"
            name, demo = f"{dataset}-dev-multikilt{split}", f"{dataset}-train-multikilt{split}"
        test, train = (members[:6], members[6:]) if dataset != "popqa" else (members, members)
        for k in DEFAULT_KILT_PASSAGES:
            rows = _kilt_rows(world, random.Random(seed + k), dataset, test, k, dep, "dev")
            put(root / "helmet" / "data" / "kilt" / name.format(k=k), rows, jsonl=True)
        if dataset != "popqa":
            rows = _kilt_rows(world, random.Random(seed + 3), dataset, train, 3, dep, "train")
            put(root / "helmet" / "data" / "kilt" / demo.format(k=3), rows, jsonl=True)
        else:
            rows = _kilt_rows(world, random.Random(seed + 3), dataset, test, 3, dep, "dev")
            put(root / "helmet" / "data" / "kilt" / demo, rows, jsonl=True)
    for dataset, members in (("asqa", towns[0:8]), ("qampari", towns[8:16])):
        path = root / "helmet" / "data" / "alce" / f"{dataset}_eval_gtr_top2000.json"
        put(path, _alce_rows(world, members, dataset, 30))
        prompts = _alce_prompts(world, towns[16:20], dataset)
        put(root / "helmet" / "prompts" / f"{dataset}_revised.json", prompts)
    put(root / "custom" / "prompts.jsonl", _custom_rows(world, random.Random(seed + 17)), True)
    return written
