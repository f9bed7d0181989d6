"""Sentence splitting without NLTK data, and the synthetic prose haystack."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvdiverge.datasets.ruler import wonderwords_lists
from kvdiverge.datasets.text import collapse_whitespace, split_sentences, synthetic_prose


def test_splits_on_terminal_punctuation_before_a_capital():
    text = 'It rained. Did it stop? Yes! "Then we go," she said. (Later.) 42 people came.'
    assert split_sentences(text) == [
        "It rained.",
        "Did it stop?",
        "Yes!",
        '"Then we go," she said.',
        "(Later.)",
        "42 people came.",
    ]


def test_abbreviations_initials_and_lowercase_continuations_do_not_split():
    text = (
        "Mr. Smith met Dr. Jones in the U.S. last year. J. R. R. Tolkien wrote e.g. this. "
        "Prices rose to 3.5 percent. it was late... and then it ended."
    )
    assert split_sentences(text) == [
        "Mr. Smith met Dr. Jones in the U.S. last year.",
        "J. R. R. Tolkien wrote e.g. this.",
        "Prices rose to 3.5 percent. it was late... and then it ended.",
    ]


def test_empty_and_unterminated_text():
    assert split_sentences("   \n ") == []
    assert split_sentences("no terminal punctuation here") == ["no terminal punctuation here"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.text(alphabet="abcAB. !?\"')(\n\t", min_size=0, max_size=30), min_size=0, max_size=8
    )
)
def test_joining_sentences_restores_the_collapsed_text(pieces):
    text = " ".join(pieces)
    sentences = split_sentences(text)
    assert " ".join(sentences) == collapse_whitespace(text)
    assert all(s and s == s.strip() for s in sentences)


def test_synthetic_prose_is_deterministic_and_splits_into_its_sentences():
    words = wonderwords_lists()
    a, b = synthetic_prose(50, 7, words), synthetic_prose(50, 7, words)
    assert a == b and a != synthetic_prose(50, 8, words)
    assert len(split_sentences(a)) == 50
