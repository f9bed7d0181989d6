"""Checks of a loaded tokenizer against its model folder, before any rollout: each failure one
line (:class:`ModelFolderError`) naming the folder and the file.

* The chat template renders a one-message user prompt (a template that raises is named, with
  its error), and it writes the user's text: two different prompts must render differently (a
  template that drops the message would make every document's prompt the same).
* The tokenizer has no more ids (``len(tokenizer)``) than the model's embedding has rows
  (``config.json``'s ``vocab_size``): a prompt or an EOS holding an id beyond it fails inside
  the model.
* Every EOS id (the tokenizer's, ``generation_config.json``'s and ``config.json``'s
  ``eos_token_id``, an integer or a list) is an integer in [0, vocab_size).

A hub id (no local folder) gets the template checks alone; its config is checked after loading.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "ModelFolderError",
    "check_chat_template",
    "check_tokenizer",
    "folder_vocab_size",
    "model_vocab_size",
    "render_chat",
]

PROBES = ("The first probe asks about a river.", "A second, different probe: 4812 mills?")
"""Two user prompts that any template that writes the user's text renders differently."""


class ModelFolderError(ValueError):
    """A model folder's tokenizer, template or EOS would fail (or mislead) later; one line."""


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def render_chat(tokenizer: Any, prompt: str, where: str) -> str:
    """The chat template's text for ``prompt`` as the one user message, with the generation
    prompt; a template that raises is one :class:`ModelFolderError` line naming ``where``."""
    try:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # a Jinja TemplateError, or any error of the template's own code
        raise ModelFolderError(
            f"{where}: the tokenizer's chat template raised {_reason(exc)} on a one-message "
            "user prompt; expected a template that renders [{role: user, content: ...}] with "
            "add_generation_prompt"
        ) from exc


def check_chat_template(tokenizer: Any, where: str) -> None:
    """The template renders (:func:`render_chat`) and writes the user's text: the two
    :data:`PROBES` must render differently."""
    first, second = (render_chat(tokenizer, p, where) for p in PROBES)
    if first == second:
        shown = first if len(first) <= 60 else first[:57] + "..."
        raise ModelFolderError(
            f"{where}: the tokenizer's chat template drops the user's text (two different "
            f"prompts both render as {shown!r}); expected a template that writes the user "
            "message's content, or every prompt would be the same"
        )


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def folder_vocab_size(folder: str | os.PathLike) -> int | None:
    """``vocab_size`` of a model folder's ``config.json`` (or of its ``text_config``): the
    embedding's rows; None when the folder gives none."""
    config = _json(Path(folder) / "config.json")
    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), dict):
        vocab = config["text_config"].get("vocab_size")
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _eos_entries(tokenizer: Any, folder: Path) -> list[tuple[str, Any]]:
    """(where it is written, value) of every EOS id the folder and tokenizer name."""
    out: list[tuple[str, Any]] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        out.append(("the tokenizer's eos_token_id", tokenizer.eos_token_id))
    for name in ("generation_config.json", "config.json"):
        raw = _json(folder / name).get("eos_token_id")
        for value in raw if isinstance(raw, list) else [] if raw is None else [raw]:
            out.append((f"{folder / name} eos_token_id", value))
    return out


def check_tokenizer(tokenizer: Any, path: str | os.PathLike, where: str | None = None) -> None:
    """Every check of the module docstring for the tokenizer loaded from ``path`` (a local model
    folder or a hub id); ``where`` names it in the refusal (default: the path)."""
    where = str(path) if where is None else where
    check_chat_template(tokenizer, where)
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return
    vocab = folder_vocab_size(folder)
    if vocab is None:
        return
    size = len(tokenizer)
    if size > vocab:
        raise ModelFolderError(
            f"{where}: the tokenizer has {size} ids (len(tokenizer)), more than the "
            f"{vocab} embedding rows of {folder / 'config.json'} (vocab_size); expected at most "
            f"{vocab}: the tokenizer does not belong to these weights"
        )
    for source, value in _eos_entries(tokenizer, folder):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
            raise ModelFolderError(
                f"{where}: {source} is {value!r}; expected a token id in [0, {vocab}) (the "
                f"vocab_size of {folder / 'config.json'})"
            )


def model_vocab_size(model: Any) -> int | None:
    """The token ids a loaded model scores: the rows of its output layer (the logits' width),
    else its config's ``vocab_size``; None when neither is known. Recorded in every trajectory
    file, whose token ids must lie below it (:mod:`kvdiverge.io.roles`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.ndim == 2:
        return int(weight.shape[0])
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None
