"""Atomic file output, stale temporaries and file digests.

* :func:`atomic_path`: write to a temporary file beside the target, fsync it, rename it onto
  the target, fsync the folder. A reader sees either the old file or the complete new one, and
  after a power cut the rename is not on disk before the data it names.
* :func:`clean_stale_temporaries`: a run killed with SIGKILL leaves its temporary behind (no
  cleanup handler runs); a job calls this at its start for its outputs.
* :func:`sha256_file`: a file's content digest (checksums of fetched files, scratch keys).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # polars is imported where it runs: the workflow's parse uses this module
    pass

__all__ = [
    "atomic_path",
    "atomic_write_text",
    "clean_stale_temporaries",
    "fsync_directory",
    "sha256_file",
    "temporary_pattern",
]


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 hex digest of the file at ``path`` (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# mkstemp's random part: 8 characters of this alphabet (tempfile._RandomNameSequence)
_RANDOM = r"[a-z0-9_]{8}"


def fsync_directory(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk; a no-op where folders
    cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_pattern(target: str | os.PathLike) -> re.Pattern[str]:
    """Names of the temporaries :func:`atomic_path` creates for ``target``:
    ``.<name>.<8 random characters><suffix>`` in the target's folder."""
    name = Path(target).name
    return re.compile(rf"\.{re.escape(name)}\.{_RANDOM}(\.[A-Za-z0-9]+)?")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; on success fsync it, rename it onto the
    target and fsync the folder. On failure the temporary is removed and the target is kept."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        prefix=f".{target.name}.", suffix=suffix or target.suffix or ".tmp", dir=target.parent
    )
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
    try:
        yield tmp_path
        _fsync_file(tmp_path)
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise
    fsync_directory(target.parent)


def atomic_write_text(target: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``target`` atomically."""
    with atomic_path(target) as tmp:
        tmp.write_text(text)


def clean_stale_temporaries(targets: Iterable[str | os.PathLike]) -> list[Path]:
    """Remove the temporaries that :func:`atomic_path` left for ``targets`` (a run killed
    before its rename); return the removed paths.

    Call it at the start of the job that owns the targets: Snakemake's lock guarantees that no
    other run writes them at the same time. Only names of :func:`temporary_pattern` beside each
    target are touched.
    """
    removed = []
    for target in targets:
        target = Path(target)
        if not target.parent.is_dir():
            continue
        pattern = temporary_pattern(target)
        for entry in target.parent.iterdir():
            if pattern.fullmatch(entry.name) and entry.is_file():
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry)
    return removed
