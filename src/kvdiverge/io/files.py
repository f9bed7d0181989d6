"""Atomic file output, stale temporaries and a job-scoped scratch area.

* :func:`atomic_path`: write to a temporary file beside the target, fsync it, rename it onto
  the target, fsync the folder. A reader sees either the old file or the complete new one, and
  after a power cut the rename is not on disk before the data it names.
* :func:`clean_stale_temporaries`: a run killed with SIGKILL leaves its temporary behind (no
  cleanup handler runs); a job calls this at its start for its outputs.
* :class:`JobScratch`: finished units of a long job (a rollout job's documents) kept on disk
  until the job's outputs are written, so that a rerun after a kill resumes from them.
* :func:`sha256_file`: a file's content digest (checksums of fetched files, scratch keys).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:  # polars is imported where it runs: the workflow's parse uses this module
    import polars as pl

__all__ = [
    "JobScratch",
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


UNIT_NAME_MAX = 128
"""The longest folder name (bytes, ASCII) a :class:`JobScratch` unit takes from its doc_id."""


class JobScratch:
    """A job-scoped scratch area: finished units (documents) of a job survive a kill.

    The folder sits beside the job's first output, named after all its outputs
    (``.<stem>.scratch-<digest>``), so that a rerun of the same job finds it and no other job
    shares it; Snakemake does not remove it with the outputs of a failed job. ``key`` (any
    JSON-able value: the job's settings) is stored in it: a scratch area written under another
    key (a changed model, action, H, seed...) is cleared on opening, never resumed from.

    Each unit is a folder holding one Parquet file per frame and ``done.json`` (its ``info``),
    written last: a unit without it was interrupted and counts as not done. Call
    :meth:`clear` once the job's outputs are written.
    """

    def __init__(self, out_paths: Mapping[str, str | os.PathLike] | Iterable, key: Any = None):
        paths = list(out_paths.values()) if isinstance(out_paths, Mapping) else list(out_paths)
        if not paths:
            raise ValueError("JobScratch: the job has no outputs")
        names = sorted(str(Path(p)) for p in paths)
        digest = hashlib.sha256("\0".join(names).encode()).hexdigest()[:12]
        first = Path(names[0])
        self.root = first.parent / f".{first.stem}.scratch-{digest}"
        self.key = json.dumps(key, sort_keys=True, default=str)
        manifest = self.root / "key.json"
        if self.root.exists():
            try:
                same = manifest.read_text() == self.key
            except OSError:
                same = False
            if not same:
                self.clear()
        self.root.mkdir(parents=True, exist_ok=True)
        if not manifest.exists():
            atomic_write_text(manifest, self.key)
        # temporaries of a killed save (atomic_path's names all start with a dot)
        for folder in [self.root, *(u for u in self.root.iterdir() if u.is_dir())]:
            for entry in folder.iterdir():
                if entry.name.startswith(".") and entry.is_file():
                    entry.unlink(missing_ok=True)

    def _unit(self, doc_id: str) -> Path:
        """The unit's folder: the doc_id percent-encoded, or for a doc_id whose encoding is
        longer than :data:`UNIT_NAME_MAX` bytes (file names hold at most 255) its first part
        and ``%%`` and a digest of the whole (a percent-encoding never holds ``%%``, so no
        two doc_ids share a folder)."""
        name = quote(str(doc_id), safe="")
        if len(name) > UNIT_NAME_MAX:
            digest = hashlib.sha256(str(doc_id).encode()).hexdigest()[:32]
            name = f"{name[: UNIT_NAME_MAX - 34]}%%{digest}"
        return self.root / name

    @staticmethod
    def _record(unit: Path) -> dict[str, Any] | None:
        """A unit's ``done.json``, or None when it is missing or does not parse (the unit is
        then not done, and is rolled out again)."""
        try:
            record = json.loads((unit / "done.json").read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and "doc_id" in record else None

    def done(self, doc_id: str) -> bool:
        """Whether ``doc_id`` was saved completely."""
        return self._record(self._unit(doc_id)) is not None

    def doc_ids(self) -> list[str]:
        """The saved units, sorted."""
        if not self.root.is_dir():
            return []
        records = (self._record(u) for u in self.root.iterdir() if u.is_dir())
        return sorted(str(r["doc_id"]) for r in records if r is not None)

    def save(
        self,
        doc_id: str,
        frames: Mapping[str, pl.DataFrame],
        info: Mapping[str, Any] | None = None,
    ) -> None:
        """Keep a finished unit: one frame per name (e.g. per action), plus JSON ``info``
        (e.g. its timing), each frame with page checksums and digests
        (:func:`kvdiverge.io.parquet.write_parquet_with_metadata`). Every file is fsynced;
        ``done.json`` comes last."""
        from kvdiverge.io.parquet import write_parquet_with_metadata  # it imports this module

        unit = self._unit(doc_id)
        (unit / "done.json").unlink(missing_ok=True)
        unit.mkdir(parents=True, exist_ok=True)
        for name, frame in frames.items():
            write_parquet_with_metadata(frame, unit / f"{quote(name, safe='')}.parquet", {})
        record = {"doc_id": doc_id, "frames": list(frames), "info": dict(info or {})}
        atomic_write_text(unit / "done.json", json.dumps(record, sort_keys=True, default=str))

    def load(self, doc_id: str) -> tuple[dict[str, pl.DataFrame], dict[str, Any]]:
        """The frames and info of a saved unit (KeyError when it is not done), each frame read
        back verified (:func:`kvdiverge.io.parquet.read_verified_parquet`). A damaged unit is
        discarded (no longer done) and raises one
        :class:`~kvdiverge.io.parquet.StoredFileError` line naming the file: a rerun of the job
        rolls that document out again."""
        from kvdiverge.io.parquet import StoredFileError, read_verified_parquet

        unit = self._unit(doc_id)
        record = self._record(unit)
        if record is None:
            raise KeyError(doc_id)
        frames = {}
        for name in record["frames"]:
            path = unit / f"{quote(name, safe='')}.parquet"
            try:
                frames[name] = read_verified_parquet(path, "job scratch file")[0]
            except StoredFileError as exc:
                (unit / "done.json").unlink(missing_ok=True)
                raise StoredFileError(
                    f"{exc} [the scratch unit of doc_id {doc_id!r} is discarded: rerun the job "
                    "to roll that document out again]"
                ) from exc
        return frames, record["info"]

    def load_all(self) -> dict[str, tuple[dict[str, pl.DataFrame], dict[str, Any]]]:
        """Every saved unit: ``{doc_id: (frames, info)}``."""
        return {doc_id: self.load(doc_id) for doc_id in self.doc_ids()}

    def clear(self) -> None:
        """Remove the scratch area (after the job's outputs are written)."""
        shutil.rmtree(self.root, ignore_errors=True)
