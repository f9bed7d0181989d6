"""Checks of models and documents before expensive work, each failure one line.

Pure functions over a config, a model folder or a documents table: they return what they
learnt or raise :class:`PreflightError` with one line that names the config field, the file and,
for a document, its ``doc_id`` and stratum. Nothing here loads weights; the cheap ones run at
parse time (``workflow/rules/common.smk``: :func:`check_configured_models`), the others at the
start of a rollout job, before the model loads (:func:`check_model_source`) and before its first
rollout (:func:`check_documents`).

* A model folder holds ``config.json`` (valid JSON), safetensors weights whose headers are whole
  (a truncated or corrupt file is named), a tokenizer with a chat template, a context window
  (``max_position_embeddings`` or its synonyms) that covers the longest prompt plus H, and an
  attention the engine computes exactly (no logit soft cap, no sliding window shorter than the
  longest prompt plus H: :mod:`kvdiverge.engine.families`).
* A document's prompt is a non-empty string whose chat-wrapped length n leaves room for H
  generated tokens in the context window, and every action of the job can act on an n-token
  prompt (its budget keeps at least one entry; SnapKV's observation window and the recent
  selector's sinks fit inside the prompt and the budget).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # polars loads in check_documents only (the engine needs no polars)
    import polars as pl

__all__ = [
    "CONTEXT_KEYS",
    "EMBEDDING_SUFFIXES",
    "PreflightError",
    "check_attention_family",
    "check_configured_models",
    "check_documents",
    "check_loaded_model",
    "check_model_folder",
    "check_model_source",
    "check_safetensors",
    "check_vocab_size",
    "is_local_path",
    "model_context_window",
    "required_positions",
    "resolve_cached_folder",
    "window_fix",
]

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""config.json keys that give a model's context window, in order of preference."""

DOCUMENT_COLUMNS = ("doc_id", "stratum", "cohort", "prompt")


class PreflightError(ValueError):
    """A model or document would fail (or silently mislead) later; the message is one line."""


# ---- models -------------------------------------------------------------------------------------
def is_local_path(path: str | os.PathLike) -> bool:
    """Whether a model's ``path`` names a local folder rather than a hub id ``org/name``.

    Local: it exists, is absolute, starts with ``.`` or ``~``, or has more than one ``/`` (a hub
    id has at most one). A one-slash name that does not exist is taken as a hub id.
    """
    text = str(path)
    return (
        Path(text).expanduser().exists()
        or os.path.isabs(text)
        or text.startswith((".", "~"))
        or text.strip("/").count("/") > 1
        or "\\" in text
    )


def model_context_window(config: Mapping[str, Any]) -> int | None:
    """The context window of a model config (``config.json`` as a dict): the first of
    :data:`CONTEXT_KEYS` present, looking into ``text_config`` too; None when absent."""
    for section in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_safetensors(path: str | os.PathLike, where: str) -> dict[str, Any]:
    """The header of a safetensors file is whole and its tensors lie inside the file; returns
    the header (tensor name → dtype, shape, offsets).

    Reads the 8-byte header length and the JSON header only (no tensor data).
    """
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) < 8:
                raise ValueError(f"{size} bytes, shorter than a header")
            (length,) = struct.unpack("<Q", raw)
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size} bytes")
            header = json.loads(fh.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = max(
            (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
            default=0,
        )
        if 8 + length + end > size:
            raise ValueError(f"tensors need {8 + length + end} bytes, the file has {size}")
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise PreflightError(f"{where}: {path} is not a whole safetensors file ({reason})") from exc
    return header


EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "lm_head.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "embed_out.weight",
)
"""Names (their ends) of the tensors with one row per token: their first dimension is the
config's ``vocab_size``."""


def check_vocab_size(
    config: Mapping[str, Any],
    config_file: Path,
    headers: Mapping[Path, Mapping[str, Any]],
    where: str,
) -> None:
    """The config's ``vocab_size`` (or its ``text_config``'s) equals the rows of every token
    embedding and output matrix in the weights (:data:`EMBEDDING_SUFFIXES`): transformers
    refuses the pair only after reading every weight, in a many-line report."""
    vocab = config.get("vocab_size")
    if vocab is None and isinstance(config.get("text_config"), Mapping):
        vocab = config["text_config"].get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool):
        return
    for file, header in headers.items():
        for name, entry in header.items():
            if name == "__metadata__" or not name.endswith(EMBEDDING_SUFFIXES):
                continue
            shape = entry.get("shape") if isinstance(entry, Mapping) else None
            if isinstance(shape, list) and len(shape) == 2 and shape[0] != vocab:
                raise PreflightError(
                    f"{where}: {config_file} says vocab_size = {vocab}, but {file} holds "
                    f"{name} with {shape[0]} rows (one per token): the config does not "
                    "belong to these weights"
                )


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    config = folder / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except (ValueError, AttributeError):
            return False
    return False


def check_model_folder(
    path: str | os.PathLike,
    where: str,
    min_positions: int | None = None,
    need: str = "the longest prompt plus H",
) -> dict[str, Any]:
    """Check a local model folder without loading it; return ``{"max_positions": int | None}``.

    Errors (one line, ``where`` first, then the file): the folder is missing or not a folder;
    ``config.json`` is missing or not a JSON object; no safetensors weights (only ``.bin``
    weights are named as such), a shard of the index missing, a weights file truncated or
    corrupt (:func:`check_safetensors`); a ``vocab_size`` that disagrees with the weights
    (:func:`check_vocab_size`); no tokenizer, or one without a chat template; a context
    window below ``min_positions`` (``need`` says what it must hold).
    """
    folder = Path(path).expanduser()
    if not folder.exists():
        raise PreflightError(
            f"{where}: {path} does not exist (expected a model folder holding config.json, "
            "or a hub id 'org/name')"
        )
    if not folder.is_dir():
        raise PreflightError(f"{where}: {path} is a file, expected a model folder")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise PreflightError(f"{where}: {config_file} not found: {path} is not a model folder")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise PreflightError(f"{where}: {config_file} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise PreflightError(f"{where}: {config_file} is not a JSON object")
    weights = sorted(folder.glob("*.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PreflightError(f"{where}: {index} is not a safetensors index ({exc})") from exc
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise PreflightError(f"{where}: {folder / missing[0]} (listed in {index}) not found")
    if not weights:
        bins = sorted(folder.glob("*.bin"))
        extra = f" (only {bins[0].name}: PyTorch pickles are not loaded)" if bins else ""
        raise PreflightError(f"{where}: no *.safetensors weights in {path}{extra}")
    headers = {file: check_safetensors(file, where) for file in weights}
    check_vocab_size(config, config_file, headers, where)
    check_attention_family(config, f"{where}: {config_file}", min_positions)
    if not any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise PreflightError(f"{where}: no tokenizer (tokenizer.json) in {path}")
    if not _has_chat_template(folder):
        raise PreflightError(
            f"{where}: the tokenizer in {path} has no chat template (tokenizer_config.json "
            "chat_template or chat_template.jinja); every prompt is chat-wrapped"
        )
    positions = model_context_window(config)
    if min_positions is not None and positions is not None and positions < min_positions:
        raise PreflightError(
            f"{where}: {config_file} gives a context window of {positions} positions, below "
            f"{need} ({min_positions} tokens)"
        )
    return {"max_positions": positions}


def check_attention_family(config: Mapping[str, Any], where: str, positions: int | None) -> None:
    """The model's attention is one the engine computes exactly
    (:func:`kvdiverge.engine.families.attention_config_problem`: no logit soft cap, chunked
    attention or ALiBi; no sliding window shorter than ``positions``); one line otherwise."""
    from kvdiverge.engine.families import attention_config_problem

    problem = attention_config_problem(config, positions)
    if problem is not None:
        raise PreflightError(
            f"{where}: the model's attention uses {problem}, which the shared-prefix attention "
            'does not compute (docs/models.md, "Model families")'
        )


def resolve_cached_folder(path: str, revision: str | None = None) -> Path | None:
    """The local snapshot folder of hub id ``path`` when its config.json is in the Hugging Face
    cache (no download), else None."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    try:
        found = try_to_load_from_cache(path, "config.json", revision=revision)
    except (ValueError, OSError):
        return None
    return Path(found).parent if isinstance(found, str) else None


def check_model_source(
    spec: Mapping[str, Any],
    where: str,
    min_positions: int | None = None,
    need: str = "the longest prompt plus H",
) -> dict[str, Any] | None:
    """Check a rollout job's model before it loads: ``spec`` holds ``path`` (a local folder or
    a hub id) and optionally ``revision``; ``where`` names its config field (e.g.
    ``config.models.<name>.path``). A local folder gets :func:`check_model_folder`; a hub id is
    checked the same way when the cache holds it, else returns None (check the loaded model
    with :func:`check_loaded_model`)."""
    path = str(spec["path"])
    if is_local_path(path):
        return check_model_folder(path, where, min_positions, need)
    cached = resolve_cached_folder(path, spec.get("revision"))
    if cached is None:
        return None
    return check_model_folder(cached, f"{where} ({path})", min_positions, need)


def check_loaded_model(
    model: Any,
    tokenizer: Any,
    where: str,
    min_positions: int | None = None,
    need: str = "the longest prompt plus H",
) -> int | None:
    """After loading (a hub model not in the cache): the tokenizer's chat template and the
    model config's context window; returns the window (None when the config gives none)."""
    if not getattr(tokenizer, "chat_template", None):
        raise PreflightError(f"{where}: the tokenizer has no chat template")
    config = getattr(model, "config", None)
    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    positions = model_context_window(raw)
    check_attention_family(raw, f"{where}: the model's config", min_positions)
    if min_positions is not None and positions is not None and positions < min_positions:
        raise PreflightError(
            f"{where}: the model's context window of {positions} positions is below {need} "
            f"({min_positions} tokens)"
        )
    return positions


def required_positions(config: Mapping[str, Any]) -> int | None:
    """Positions every model must hold: the longest stratum's prompt bound
    (target_tokens − generation_reserve) plus ``rollout.H``; None without strata."""
    datasets = config.get("datasets", {})
    strata = datasets.get("strata") or []
    if not strata:
        return None
    reserve = datasets.get("generation_reserve", 128)
    horizon = config.get("rollout", {}).get("H", 128)
    return max(s["target_tokens"] for s in strata) - reserve + horizon


def check_configured_models(config: Mapping[str, Any]) -> None:
    """Parse-time check of every configured model loaded from a local ``path`` (hub ids and the
    folders this workflow builds, data/models/<name> of a ``demo`` or ``source`` model, are
    left to the rollout job): :func:`check_model_folder` naming ``config.models.<name>.path``,
    with the context window against :func:`required_positions`."""
    need = required_positions(config) if config.get("studies") else None
    for name, spec in config.get("models", {}).items():
        if spec.get("demo") or spec.get("source") or not spec.get("path"):
            continue
        if is_local_path(spec["path"]):
            check_model_folder(
                spec["path"],
                f"config.models.{name}.path",
                need,
                "the longest prompt plus H (the strata's target_tokens - generation_reserve "
                "+ rollout.H)",
            )


# ---- documents ----------------------------------------------------------------------------------
def _actions(actions: Mapping[str, Any] | Iterable[Any]) -> list[Any]:
    from kvdiverge.eviction import ActionSpec, parse_action

    if isinstance(actions, Mapping):
        items = actions.items()
    else:
        items = ((a.name if isinstance(a, ActionSpec) else a["name"], a) for a in actions)
    return [a if isinstance(a, ActionSpec) else parse_action(a, name=n) for n, a in items]


def window_fix(action: Any, lengths: Iterable[int], field: str) -> str:
    """The fix for prompts too short for an action's ``window`` (SnapKV's observation window),
    as the end of its refusal: the most tokens a window may hold to fit every prompt of
    ``lengths`` and what the budget keeps of each (n - 1 and ``n_keep(n)``), and the largest
    power of two up to it as the value to write (``field``: the config mapping that holds the
    action, e.g. ``config.actions``); "" when the selector has no window or none fits."""
    window = getattr(action.method, "window", None)
    ns = [n for n in lengths if isinstance(n, int) and n >= 1]
    if not isinstance(window, int) or not ns:
        return ""
    fits = min(min(n - 1, action.n_keep(n)) for n in ns)
    if fits < 1:
        return ""
    w = 1 << (fits.bit_length() - 1)
    return (
        f"; a window of at most {fits} tokens fits every prompt of the job: e.g. window: {w} "
        f"in {field}.{action.name}"
    )


def check_documents(
    frame: pl.DataFrame,
    actions: Mapping[str, Any] | Iterable[Any],
    max_positions: int | None,
    H: int,
    where: str,
    length_fn: Callable[[str], int] | None = None,
    cohorts: Iterable[str] | None = None,
    actions_field: str | None = "config.actions",
) -> pl.DataFrame:
    """Check every document of a rollout job against every action and the model, before the
    first rollout; return the checked rows with ``n_tokens`` (the prompt's length).

    ``frame``: the documents table (columns doc_id, stratum, cohort, prompt, and n_tokens when
    no ``length_fn``); ``actions``: action specs (dicts or ``ActionSpec``) by name;
    ``max_positions``: the model's context window (None: unchecked); ``H``: the horizon;
    ``where``: the documents file; ``length_fn``: the job model's chat-wrapped length of a
    prompt (else the table's ``n_tokens``, measured with the length tokenizer); ``cohorts``:
    the cohorts the job runs (others are neither checked nor returned; none present is an
    error); ``actions_field``: the config mapping that holds the actions, named in the fix a
    too-short-window refusal ends with (:func:`window_fix`; None: no fix, the caller gives its
    own).

    Errors, one line ``<where>: doc_id '<id>' (stratum <s>)[, action '<a>']: <what>``: a missing
    column, a missing or duplicate doc_id, a prompt that is null, not text or blank, a length
    below 1, n + H beyond the context window, a budget that keeps nothing of n, a prompt or
    budget too small for what the selector always keeps.
    """
    import polars as pl

    from kvdiverge.eviction import ActionError, check_action, keeps_everything

    needed = [*DOCUMENT_COLUMNS, *([] if length_fn else ["n_tokens"])]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise PreflightError(f"{where}: documents table lacks column(s) {', '.join(missing)}")
    if cohorts is not None:
        wanted = list(cohorts)
        frame = frame.filter(pl.col("cohort").is_in(wanted))
        if frame.height == 0:
            raise PreflightError(f"{where}: no documents of the job's cohort(s) {wanted}")
    if frame["doc_id"].null_count():
        raise PreflightError(f"{where}: a row has no doc_id")
    dup = frame.filter(pl.col("doc_id").is_duplicated())
    if dup.height:
        raise PreflightError(f"{where}: doc_id {dup['doc_id'][0]!r} appears more than once")
    specs = _actions(actions)
    lengths = []
    given = frame["n_tokens"].to_list() if "n_tokens" in frame.columns else [None] * frame.height
    rows = list(zip(frame["doc_id"], frame["stratum"], frame["prompt"], given, strict=True))
    for i, (doc_id, stratum, prompt, n) in enumerate(rows):
        doc = f"{where}: doc_id {doc_id!r} (stratum {stratum})"
        if prompt is None:
            raise PreflightError(f"{doc}: prompt is missing (null)")
        if not isinstance(prompt, str):
            raise PreflightError(f"{doc}: prompt is a {type(prompt).__name__}, expected text")
        if not prompt.strip():
            raise PreflightError(f"{doc}: prompt is empty")
        if length_fn is not None:
            n = length_fn(prompt)
        if n is None or n < 1:
            raise PreflightError(f"{doc}: prompt length n = {n}, expected at least 1 token")
        n = int(n)
        if max_positions is not None and n + H > max_positions:
            raise PreflightError(
                f"{doc}: prompt of {n} tokens plus H = {H} generated tokens exceeds the "
                f"model's context window of {max_positions} positions"
            )
        for action in specs:
            if keeps_everything(action):
                continue
            try:
                keep = action.n_keep(n)
                if keep < n:
                    check_action(action, n, keep)
            except ActionError as exc:
                reason = str(exc).split(": ", 1)[-1]
                if actions_field and "observation window" in reason:
                    rest = [length_fn(p) if length_fn else g for _, _, p, g in rows[i + 1 :]
                            if isinstance(p, str) and p.strip()]  # fmt: skip
                    reason += window_fix(action, [*lengths, n, *rest], actions_field)
                raise PreflightError(f"{doc}, action {action.name!r}: {reason}") from exc
        lengths.append(n)
    return frame.with_columns(n_tokens=pl.Series("n_tokens", lengths, dtype=pl.Int64))
