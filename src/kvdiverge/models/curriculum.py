"""The demo models' curriculum (:mod:`kvdiverge.models.training`): its stages and settings, and
the training data — RULER prompts with their answers, needle drills, batches and the loss on
answer tokens."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from kvdiverge.datasets import ruler as R
from kvdiverge.datasets.fitting import derive_seed

TRAINING_TASKS: tuple[str, ...] = tuple(t for t in R.RULER_TASKS if not t.startswith("qa"))
"""RULER tasks the demo models train on (qa needs its QA source files: left out)."""


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: ``steps`` optimizer steps on sequences of at most ``max_tokens``.

    With ``drill_needles`` > 0 the stage trains on needle drills (:func:`drill_ids`) with up to
    that many needles instead of full RULER prompts: short sequences with many answers, where
    the copying mechanism forms quickly before the long prompts.
    """

    max_tokens: int
    steps: int
    drill_needles: int = 0


@dataclass(frozen=True)
class TrainSettings:
    """Training settings of a demo model (config ``models.<name>.train``;
    docs/models.md, "Training").

    ``stages``: the curriculum; ``batch_tokens``: tokens per optimizer step (batch size is
    ``batch_tokens // max_tokens``); ``lr``/``warmup_steps``/``weight_decay``: AdamW with linear
    warm-up and cosine decay to ``lr / 10``; ``context_weight``: weight of the non-answer
    tokens' loss; ``plain_fraction``: share of plain continuation sequences;
    ``drill_fraction``: share of needle drills (up to ``drill_mix_needles`` needles) mixed into
    the RULER stages, so that the copying learnt in the drill stages is kept; ``tasks``: RULER
    tasks and their sampling weights; ``eval_per_task``: held-out documents per task and length
    for the accuracy recorded in ``training.json``; ``eval_lengths``: their prompt lengths.
    """

    stages: tuple[Stage, ...]
    batch_tokens: int = 2048
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    context_weight: float = 0.2
    plain_fraction: float = 0.1
    drill_fraction: float = 0.25
    drill_mix_needles: int = 4
    tasks: Mapping[str, float] = field(default_factory=lambda: dict.fromkeys(TRAINING_TASKS, 1.0))
    eval_per_task: int = 4
    eval_lengths: tuple[int, ...] = (992, 1504, 2016)

    @classmethod
    def from_config(cls, raw: Mapping[str, Any], where: str = "train") -> TrainSettings:
        """Settings from a config mapping; one-line ``ValueError`` naming the bad field."""
        known = {f for f in cls.__dataclass_fields__}
        extra = sorted(set(raw) - known)
        if extra:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}")
        stages = raw.get("stages")
        if not stages:
            raise ValueError(f"{where}.stages: expected a non-empty list of {{max_tokens, steps}}")
        parsed = []
        for i, s in enumerate(stages):
            keys = set(s) if isinstance(s, Mapping) else set()
            if not {"max_tokens", "steps"} <= keys <= {"max_tokens", "steps", "drill_needles"}:
                raise ValueError(
                    f"{where}.stages[{i}]: expected {{max_tokens, steps[, drill_needles]}}, "
                    f"got {s!r}"
                )
            if int(s["max_tokens"]) < 64 or int(s["steps"]) < 1:
                raise ValueError(f"{where}.stages[{i}]: expected max_tokens >= 64 and steps >= 1")
            needles = int(s.get("drill_needles", 0))
            if needles < 0:
                raise ValueError(f"{where}.stages[{i}].drill_needles: expected a value >= 0")
            parsed.append(Stage(int(s["max_tokens"]), int(s["steps"]), needles))
        tasks = dict(raw.get("tasks", dict.fromkeys(TRAINING_TASKS, 1.0)))
        bad = sorted(set(tasks) - set(TRAINING_TASKS))
        if bad or not tasks or min(tasks.values()) < 0 or sum(tasks.values()) <= 0:
            raise ValueError(
                f"{where}.tasks: expected non-negative weights of {', '.join(TRAINING_TASKS)}"
                f"{f' (unknown: {bad})' if bad else ''}"
            )
        values = {k: raw[k] for k in known - {"stages", "tasks"} if k in raw}
        if "eval_lengths" in values:
            values["eval_lengths"] = tuple(int(n) for n in values["eval_lengths"])
        settings = cls(stages=tuple(parsed), tasks=tasks, **values)
        if settings.batch_tokens < max(s.max_tokens for s in parsed):
            raise ValueError(f"{where}.batch_tokens: expected at least the largest max_tokens")
        for name in ("plain_fraction", "drill_fraction"):
            if not 0 <= getattr(settings, name) < 1:
                raise ValueError(f"{where}.{name}: expected a value in [0, 1)")
        if settings.drill_mix_needles < 1:
            raise ValueError(f"{where}.drill_mix_needles: expected a value >= 1")
        return settings

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (the fingerprint's settings part)."""
        out = asdict(self)
        out["stages"] = [asdict(s) for s in self.stages]
        out["tasks"] = dict(sorted(self.tasks.items()))
        out["eval_lengths"] = list(self.eval_lengths)
        return out

    @property
    def total_steps(self) -> int:
        """Optimizer steps over all stages."""
        return sum(s.steps for s in self.stages)


_DRILL_TYPES = (("words", "numbers"), ("words", "numbers"), ("words", "uuids"), ("uuids", "uuids"))
_ANSWER_RESERVE = 72  # tokens kept free after the prompt for the answer and EOS


@dataclass(frozen=True)
class TrainingSample:
    """One generated RULER prompt (the user message), its task and gold answers."""

    task: str
    prompt: str
    answers: tuple[str, ...]


def answer_text(task: str, answers: Sequence[str]) -> str:
    """The assistant reply the model is trained to give: the answers in the format of the
    task's answer prefix (numbered words for cwe, as its one-shot example; space-separated
    names/words for vt and fwe; comma-separated values for needle tasks)."""
    if task == "cwe":
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(answers))
    if task in ("vt", "fwe"):
        return " ".join(answers)
    return ", ".join(answers) + "."


@dataclass
class _Generator:
    """Builds RULER prompts near a token target (linear tokens-per-unit fit per task)."""

    tokenizer: Any
    essays: R.EssayHaystack
    vocab_seed: int
    fits: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)

    def n_tokens(self, prompt: str) -> int:
        from kvdiverge.models import chat_prompt_ids

        return len(chat_prompt_ids(self.tokenizer, prompt))

    def build(self, task: str, units: int, rng: random.Random, budget: int) -> R.RulerSample:
        return R.build_ruler_prompt(
            task,
            units,
            rng,
            target_tokens=budget,
            budget=budget,
            vocab_seed=self.vocab_seed,
            essays=self.essays,
            example_units=1 + rng.randrange(4),
        )

    def fit(self, task: str, budget: int) -> tuple[float, float]:
        key = (task, budget)
        if key not in self.fits:
            lo = R.min_units(task)
            hi = lo + (200 if R.task_needs_essays(task) or task == "fwe" else 20)
            probe = random.Random(derive_seed("fit", task, budget))
            a = self.n_tokens(self.build(task, lo, probe, budget).prompt)
            b = self.n_tokens(self.build(task, hi, probe, budget).prompt)
            self.fits[key] = (float(a), max(1e-3, (b - a) / (hi - lo)))
        return self.fits[key]


def sample_task_prompt(
    gen: _Generator, task: str, target: int, rng: random.Random
) -> TrainingSample | None:
    """A prompt of ``task`` whose chat-wrapped length is at most ``target`` tokens (about
    ``target``), or None when even the shortest prompt of the task is longer."""
    budget = max(256, target)
    base, slope = gen.fit(task, budget)
    lo = R.min_units(task)
    if task == "cwe":
        lo = max(lo, 11)
    units = max(lo, int((target - base) / slope) + lo)
    for _ in range(8):
        state = rng.getstate()
        sample = gen.build(task, units, rng, budget)
        n = gen.n_tokens(sample.prompt)
        if n <= target:
            return TrainingSample(task, sample.prompt, tuple(sample.answers))
        if units == lo:
            return None
        rng.setstate(state)
        units = max(lo, int(units * target / n) - 1)
    return None


def _plain_ids(tokenizer: Any, words: Sequence[str], n: int, rng: random.Random) -> list[int]:
    start = rng.randrange(max(1, len(words) - 4 * n))
    ids = tokenizer(" ".join(words[start : start + 2 * n]), add_special_tokens=False)["input_ids"]
    return [int(i) for i in ids[:n]]


def drill_ids(
    tokenizer: Any, max_tokens: int, max_needles: int, rng: random.Random
) -> tuple[list[int], list[bool]]:
    """A needle drill of about ``max_tokens`` tokens: RULER needle lines (``NIAH_NEEDLE``; keys
    and values of RULER's needle tasks: word keys with 7-digit or UUID values, or UUID keys and
    values) among noise-haystack lines, then up to three queries, each RULER's single-needle
    answer prefix followed by the value. Needles are dropped (unqueried ones first; an answer is
    never truncated) until they fit; returns token ids and the answer-token mask."""

    def encode(text: str) -> list[int]:
        return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]

    # UUIDs take ~40 tokens each: UUID drills only where a needle and its answer fit
    key_type, value_type = rng.choice(_DRILL_TYPES if max_tokens >= 240 else _DRILL_TYPES[:2])
    n = rng.randint(1, max_needles)
    keys = [R._random_item(key_type, rng) for _ in range(n)]
    values = [R._random_item(value_type, rng) for _ in range(n)]
    lines = [
        encode(R.NIAH_NEEDLE.format(type_needle_v=value_type, key=k, value=v) + "\n")
        for k, v in zip(keys, values, strict=True)
    ]
    queries = [
        (
            encode(f"The special magic {value_type[:-1]} for {k} mentioned in the text is"),
            encode(f" {v}.\n"),
        )
        for k, v in zip(keys, values, strict=True)
    ]
    asked = rng.sample(range(n), min(3, n))  # queried needles, in query order
    present = list(range(n))  # needle lines kept, in text order

    def size() -> int:
        return sum(len(lines[i]) for i in present) + sum(sum(map(len, queries[i])) for i in asked)

    while size() > max_tokens and len(present) > 1:
        unasked = [i for i in present if i not in asked]
        drop = unasked[-1] if unasked else asked.pop()
        present.remove(drop)
    noise = encode(R.NOISE_HAYSTACK + "\n")
    body = [lines[i] for i in present]
    for _ in range(rng.randint(0, max(0, (max_tokens - size()) // len(noise)))):
        body.insert(rng.randrange(len(body) + 1), noise)
    ids = [t for line in body for t in line]
    mask = [False] * len(ids)
    for i in asked:
        question, answer = queries[i]
        ids += question + answer
        mask += [False] * len(question) + [True] * len(answer)
    return ids, mask


def make_batch(
    gen: _Generator,
    settings: TrainSettings,
    stage: Stage,
    plain_words: Sequence[str],
    rng: random.Random,
) -> dict[str, torch.Tensor]:
    """One training batch: ``input_ids`` (B, L) right-padded, ``answer_mask`` and
    ``context_mask`` (B, L) marking the tokens whose prediction is scored (answer tokens and
    EOS; other non-padding tokens after the first)."""
    from kvdiverge.models import chat_prompt_ids

    tok = gen.tokenizer
    eos = int(tok.eos_token_id)
    tasks = sorted(settings.tasks)
    weights = [settings.tasks[t] for t in tasks]
    max_tokens = stage.max_tokens
    rows: list[tuple[list[int], list[bool]]] = []  # ids, answer mask
    for _ in range(max(1, settings.batch_tokens // max_tokens)):
        target = rng.randint(max(64, max_tokens // 3), max_tokens)
        if stage.drill_needles:
            rows.append(drill_ids(tok, target, stage.drill_needles, rng))
            continue
        if rng.random() < settings.drill_fraction:
            rows.append(drill_ids(tok, target, settings.drill_mix_needles, rng))
            continue
        if rng.random() < settings.plain_fraction:
            ids = _plain_ids(tok, plain_words, target, rng)
            rows.append((ids, [False] * len(ids)))
            continue
        sample = None
        while sample is None:
            task = rng.choices(tasks, weights)[0]
            sample = sample_task_prompt(gen, task, target - _ANSWER_RESERVE, rng)
            if sample is None and target < max_tokens:
                target = min(max_tokens, target * 2)
        prompt = chat_prompt_ids(tok, sample.prompt)
        answer = tok(answer_text(sample.task, sample.answers), add_special_tokens=False)
        reply = [int(i) for i in answer["input_ids"]] + [eos]
        ids = (prompt + reply)[:max_tokens]
        rows.append((ids, ([False] * len(prompt) + [True] * len(reply))[:max_tokens]))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), int(tok.pad_token_id), dtype=torch.long)
    answer_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    context_mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        answer_mask[i, : len(ids)] = torch.tensor(mask, dtype=torch.bool)
        context_mask[i, 1 : len(ids)] = ~answer_mask[i, 1 : len(ids)]
    return {"input_ids": input_ids, "answer_mask": answer_mask, "context_mask": context_mask}


def batch_loss(model: torch.nn.Module, batch: Mapping[str, torch.Tensor], context_weight: float):
    """(loss, answer loss, context loss): mean cross-entropy on the answer tokens plus
    ``context_weight`` times the mean cross-entropy on the context tokens."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids).logits[:, :-1].float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.shape[0], -1)
    parts = []
    for name in ("answer_mask", "context_mask"):
        mask = batch[name][:, 1:].float()
        parts.append((ce * mask).sum() / mask.sum().clamp(min=1.0))
    return parts[0] + context_weight * parts[1], parts[0], parts[1]
