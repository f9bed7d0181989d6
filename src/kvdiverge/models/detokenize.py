"""Token ids → text, as the model's tokenizer decodes them, without transformers where it may.

The accuracy rule decodes every generation of a study. Loading a tokenizer through transformers
imports transformers and torch (seconds of CPU per job); a tokenizer whose class is a generic
fast one (:data:`GENERIC_FAST_TOKENIZERS`) decodes with its ``tokenizer.json`` alone, so the
tokenizers library does it (:class:`TokenizerFileDecoder`), with transformers' standard
clean-up of spaces where the tokenizer's config asks for it. Any other tokenizer loads through
:func:`kvdiverge.models.load_tokenizer`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["GENERIC_FAST_TOKENIZERS", "TokenizerFileDecoder", "clean_up_spaces", "load_decoder"]


GENERIC_FAST_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""Tokenizer classes whose decoding is the ``tokenizer.json`` decoder plus transformers'
standard clean-up (no decoding code of their own)."""


def clean_up_spaces(text: str) -> str:
    """transformers' standard ``clean_up_tokenization``: no space before . ? ! , and English
    contractions."""
    for old, new in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(old, new)
    return text


class TokenizerFileDecoder:
    """``decode`` of a ``tokenizer.json`` by the tokenizers library, as transformers decodes
    with a generic fast tokenizer (:data:`GENERIC_FAST_TOKENIZERS`), without importing
    transformers (and torch): seconds per job."""

    def __init__(self, path: str | os.PathLike, clean_up: bool) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        self.clean_up = clean_up

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens dropped when asked), cleaned up like
        transformers' ``decode`` when the tokenizer's config asks for it."""
        text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_spaces(text) if self.clean_up else text


def load_decoder(
    path: str | os.PathLike, revision: str | None = None, trust_remote_code: bool = False
) -> Any:
    """An object whose ``decode(ids, skip_special_tokens=True)`` equals the model tokenizer's:
    a :class:`TokenizerFileDecoder` for a local folder whose tokenizer is a generic fast one,
    else the tokenizer itself (:func:`kvdiverge.models.load_tokenizer`)."""
    folder = Path(path)
    config = folder / "tokenizer_config.json"
    if revision is None and (folder / "tokenizer.json").is_file() and config.is_file():
        settings = json.loads(config.read_text(encoding="utf-8"))
        if settings.get("tokenizer_class") in GENERIC_FAST_TOKENIZERS:
            clean_up = bool(settings.get("clean_up_tokenization_spaces", False))
            return TokenizerFileDecoder(folder / "tokenizer.json", clean_up)
    from kvdiverge.models import load_tokenizer

    return load_tokenizer(str(path), trust_remote_code=trust_remote_code, revision=revision)
