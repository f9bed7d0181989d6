"""Task metrics: how well one generated text answers a document's gold answers, in [0, 1].

Each dataset environment names its metric per task (:mod:`kvdiverge.datasets.registry`), the
metric its benchmark reports:

* ``string_match_all`` — RULER's recall of every needle: the fraction of gold strings found in
  the output as case-insensitive substrings (control characters replaced by line breaks and the
  output stripped first, as RULER post-processes predictions);
* ``string_match_part`` — RULER's QA metric: 1 when any gold string is found that way;
* ``substring_exact_match`` — HELMET's RAG metric: 1 when any normalized gold answer is a
  substring of the normalized output (normalization: lower case, no punctuation, no articles
  *a*, *an*, *the*, single spaces). HELMET also scores the text after "Answer:"; a substring of
  that part is a substring of the whole, so the maximum is the whole output's score;
* ``str_em`` — ASQA's string exact match: the fraction of gold short answers whose normalized
  form occurs in the normalized output (the documents table keeps ASQA's short answers as one
  flat list, so each counts once rather than once per question pair);
* ``qampari_rec_top5`` — QAMPARI's top-5 recall: the output split at commas (trailing period
  and comma removed) into normalized predictions; min(5, gold answers predicted exactly) /
  min(5, gold answers);
* ``substring_match`` — the ``custom`` default: 1 when any gold answer occurs in the output,
  case-insensitive.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Sequence

__all__ = ["METRICS", "normalize_answer", "score"]

_CONTROL = re.compile(r"[\x00-\x1f]")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's answer normalization: lower case, punctuation removed, articles removed,
    whitespace collapsed to single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _ruler_prediction(output: str) -> str:
    return _CONTROL.sub("\n", output).strip().lower()


def string_match_all(output: str, answers: Sequence[str]) -> float:
    """RULER: fraction of gold strings found (case-insensitive substrings)."""
    pred = _ruler_prediction(output)
    return sum(a.lower() in pred for a in answers) / len(answers)


def string_match_part(output: str, answers: Sequence[str]) -> float:
    """RULER's QA metric: 1 if any gold string is found (case-insensitive substring)."""
    pred = _ruler_prediction(output)
    return float(any(a.lower() in pred for a in answers))


def substring_exact_match(output: str, answers: Sequence[str]) -> float:
    """HELMET's RAG metric: 1 if any normalized answer occurs in the normalized output."""
    pred = normalize_answer(output)
    return float(any(normalize_answer(a) in pred for a in answers if normalize_answer(a)))


def str_em(output: str, answers: Sequence[str]) -> float:
    """ASQA: fraction of gold short answers found after normalization."""
    pred = normalize_answer(output)
    gold = [g for g in map(normalize_answer, answers) if g]
    return sum(g in pred for g in gold) / len(gold) if gold else 0.0


def qampari_rec_top5(output: str, answers: Sequence[str]) -> float:
    """QAMPARI: min(5, gold answers among the comma-separated predictions) / min(5, gold)."""
    items = output.rstrip().rstrip(".").rstrip(",").split(",")
    preds = {p for p in (normalize_answer(x.strip()) for x in items) if p}
    hits = sum(normalize_answer(a) in preds for a in answers)
    return min(5, hits) / min(5, len(answers))


def substring_match(output: str, answers: Sequence[str]) -> float:
    """The custom default: 1 if any gold answer occurs in the output (case-insensitive)."""
    pred = output.lower()
    return float(any(a.lower() in pred for a in answers))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
    "substring_exact_match": substring_exact_match,
    "str_em": str_em,
    "qampari_rec_top5": qampari_rec_top5,
    "substring_match": substring_match,
}
"""Every metric by name (the module docstring defines each)."""


def score(metric: str, output: str, answers: Sequence[str]) -> float:
    """``metric``'s score of ``output`` against ``answers`` (at least one); one-line errors."""
    if metric not in METRICS:
        raise ValueError(f"metric: expected one of {', '.join(METRICS)}, got {metric!r}")
    if not answers:
        raise ValueError("answers: expected at least one gold answer to score against")
    return float(METRICS[metric](output, answers))
