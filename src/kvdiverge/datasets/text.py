"""Text utilities for the document generators: sentence splitting without NLTK data, whitespace
handling, a synthetic prose haystack, and the synthetic-data marker.

RULER splits its essay haystack into sentences with NLTK's punkt model
(docs/datasets.md, "RULER"), whose data cannot be downloaded here; :func:`split_sentences` is a
rule-based splitter with the same contract (a list of sentences whose ``" ".join`` restores the
whitespace-collapsed text).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

__all__ = [
    "SYNTHETIC_MARKER",
    "collapse_whitespace",
    "is_synthetic",
    "split_sentences",
    "synthetic_prose",
]

SYNTHETIC_MARKER = "SYNTHETIC"
"""Name of the file that marks a data folder (and everything below it) as synthetic."""

# Lower-cased tokens that end with a period without ending a sentence.
_ABBREVIATIONS = frozenset(
    """mr mrs ms dr prof sr jr st mt vs etc e.g i.e u.s u.k a.m p.m inc ltd co corp no nos
    fig figs al approx dept est jan feb mar apr jun jul aug sep sept oct nov dec gen gov
    col lt sgt capt rev hon op cf ed eds vol vols pp""".split()
)
_BOUNDARY = re.compile(r"[.!?]+[\"')\]]*\s+")
_NEXT_STARTS_SENTENCE = re.compile(r"[\"'(\[]*[A-Z0-9]")


def collapse_whitespace(text: str) -> str:
    """Replace every whitespace run by one space and strip the ends (RULER A4 step 1)."""
    return re.sub(r"\s+", " ", text).strip()


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into sentences (the role of NLTK ``sent_tokenize`` in RULER A4 step 2).

    A boundary is terminal punctuation (``.``, ``!``, ``?``, possibly followed by closing quotes
    or brackets) followed by whitespace and a token that starts with a capital letter, a digit
    or an opening quote; a period after a known abbreviation (``Mr.``, ``e.g.``, ``U.S.``) or a
    single-letter initial (``J.``) is not a boundary. The text is whitespace-collapsed first, so
    ``" ".join(split_sentences(t)) == collapse_whitespace(t)``.
    """
    text = collapse_whitespace(text)
    if not text:
        return []
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        end = match.end()
        if end >= len(text) or not _NEXT_STARTS_SENTENCE.match(text, end):
            continue
        head = text[start : match.start()]
        last_word = head.rsplit(" ", 1)[-1].lower().lstrip("\"'([")
        punct = text[match.start()]
        if punct == "." and (last_word in _ABBREVIATIONS or re.fullmatch(r"[a-z]", last_word)):
            continue
        sentences.append(text[start:end].rstrip())
        start = end
    sentences.append(text[start:])
    return sentences


def is_synthetic(path: str | Path) -> bool:
    """Whether ``path`` lies in a folder marked synthetic (a ``SYNTHETIC`` file in it or above)."""
    p = Path(path).resolve()
    folders = [p] if p.is_dir() else []
    folders += list(p.parents)
    return any((f / SYNTHETIC_MARKER).is_file() for f in folders)


_SUBJECTS = [
    "the {adj} {noun}",
    "a {adj} {noun}",
    "every {noun}",
    "the old {noun}",
    "our {noun}",
]
_PATTERNS = [
    "{Subj} {verb}s the {adj} {noun} near the {noun2}.",
    "{Subj} was never as {adj} as the {noun} of the {noun2}.",
    "When {subj} {verb}s, the {noun2} becomes {adj}.",
    "Nobody expected {subj} to {verb} the {noun2} before the {adj} {noun} arrived.",
    "It is said that {subj} can {verb} any {noun2} in a {adj} way.",
    "Then {subj} {verb}ed, and the {adj} {noun2} followed.",
    "Why would {subj} {verb} a {noun2}?",
    "{Subj} and the {noun2} kept talking about the {adj} {noun} until late.",
]


def synthetic_prose(n_sentences: int, seed: int, words: dict[str, list[str]]) -> str:
    """Deterministic synthetic English-like prose of ``n_sentences`` sentences.

    The essay haystack of RULER's essay tasks when no essay folder is configured
    (docs/datasets.md, "RULER"). ``words`` holds ``adjectives``, ``nouns`` and ``verbs`` (e.g.
    wonderwords' lists); sentences follow a few fixed patterns, grouped into paragraphs of
    about six sentences separated by blank lines.
    """
    rng = random.Random(seed)
    adjs, nouns, verbs = words["adjectives"], words["nouns"], words["verbs"]
    verbs = [v for v in verbs if v.isalpha() and not v.endswith(("e", "s", "y", "h", "x"))]
    out: list[str] = []
    for i in range(n_sentences):
        subj = rng.choice(_SUBJECTS).format(adj=rng.choice(adjs), noun=rng.choice(nouns))
        sentence = rng.choice(_PATTERNS).format(
            Subj=subj[0].upper() + subj[1:],
            subj=subj,
            verb=rng.choice(verbs),
            adj=rng.choice(adjs),
            noun=rng.choice(nouns),
            noun2=rng.choice(nouns),
        )
        sentence = sentence[0].upper() + sentence[1:]
        out.append(sentence + ("\n\n" if i % 6 == 5 else " "))
    return "".join(out).strip() + "\n"
