"""A job's scratch area, where the finished units (documents) of a rollout job survive a kill
(:class:`JobScratch`, written and read verified through :mod:`kvdiverge.io.parquet`)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kvdiverge.io.files import atomic_write_text
from kvdiverge.io.parquet import StoredFileError, read_verified_parquet, write_parquet_with_metadata

if TYPE_CHECKING:  # polars is imported where it runs
    import polars as pl

__all__ = ["UNIT_NAME_MAX", "JobScratch"]

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
