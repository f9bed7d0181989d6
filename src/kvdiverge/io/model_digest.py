"""The digests of a model folder that a lock registers (``docs/prespecification.md``, "Fixed by
the lock"): one SHA-256 of the weights and one of the tokenizer.

``weights``: the model's configuration and weight files (``config.json``,
``generation_config.json``, ``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``);
``tokenizer``: its tokenizer and chat-template files (``tokenizer*``, ``special_tokens_map.json``,
``added_tokens.json``, ``vocab.*``, ``merges.txt``, ``chat_template.*``, ``*.tiktoken``,
``*.model``). Each digest is the SHA-256 of the sorted list of (relative path, the file's own
SHA-256): renaming, adding, removing or editing one of those files changes it; the folder's
other files (a materialization's ``provenance.json``, a demo model's ``training.json``) do not.
A file's SHA-256 is kept in the user's cache folder keyed by its path, size, modification time
and inode, so a job that finds the files as they were hashes nothing again.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from pathlib import Path

from kvdiverge.io.files import atomic_write_text, sha256_file

__all__ = ["TOKENIZER_PATTERNS", "WEIGHT_PATTERNS", "model_digests"]

WEIGHT_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.gguf",
)
TOKENIZER_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
    "*.tiktoken",
    "*.model",
)


def _cache_file() -> Path:
    root = os.environ.get("KVDIVERGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "kvdiverge",
    )
    return Path(root) / "file-digests-v1.json"


def _file_digest(path: Path, cache: dict[str, str]) -> str:
    stat = path.stat()
    key = f"{path.resolve()}\x1f{stat.st_size}\x1f{stat.st_mtime_ns}\x1f{stat.st_ino}"
    if key not in cache:
        cache[key] = sha256_file(path)
    return cache[key]


def model_digests(folder: str | os.PathLike) -> dict[str, str] | None:
    """``{"weights": hex, "tokenizer": hex}`` of a local model folder (module docstring), or
    ``None`` when ``folder`` is no local folder (a hub id: its revision stands for it). A
    folder without weight files is one line naming it."""
    root = Path(folder)
    if not root.is_dir():
        return None
    try:
        cache = json.loads(_cache_file().read_text(encoding="utf-8"))
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    before = len(cache)
    files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    out = {}
    for part, patterns in (("weights", WEIGHT_PATTERNS), ("tokenizer", TOKENIZER_PATTERNS)):
        chosen = [p for p in files if any(fnmatch.fnmatch(p.name, pat) for pat in patterns)]
        if part == "tokenizer":
            chosen = [p for p in chosen if p.name not in {"config.json"}]
        if not chosen:
            raise FileNotFoundError(f"{root}: no {part} files to digest ({', '.join(patterns)})")
        listing = [[str(p.relative_to(root)), _file_digest(p, cache)] for p in chosen]
        out[part] = hashlib.sha256(json.dumps(listing).encode()).hexdigest()
    if len(cache) != before:
        try:
            atomic_write_text(_cache_file(), json.dumps(dict(list(cache.items())[-2000:])))
        except OSError:
            pass  # an unwritable cache costs only the time
    return out
