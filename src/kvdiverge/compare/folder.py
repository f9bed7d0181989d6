"""The output folder of ``kvdiverge compare``: a fresh default name per run, no silent reuse, and a
manifest of what compare wrote so that ``--force`` removes exactly that.

:func:`check_out` runs before the model loads: ``--out`` naming a file or a dangling symbolic
link, a non-empty folder without ``--force``, a file of someone else's where compare would
write, a folder that cannot be created or written, a broken manifest, and a path in the
manifest or among compare's files that a symbolic link leads outside ``--out`` are each one
:class:`CompareError` line, and nothing is written: every path ``--force`` removes is resolved
inside ``--out`` (checked again just before the removal). :func:`claim_out` runs once every
result is computed: it records the new files in the manifest (:data:`MANIFEST`, JSON) *before*
removing the files the earlier compare listed there and writing the new ones, so an interrupted
run still leaves every file it wrote listed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from kvdiverge.compare.actions import CompareError
from kvdiverge.io import atomic_write_text

__all__ = ["DEFAULT_OUT", "MANIFEST", "check_out", "claim_out", "default_out", "finish_out"]

DEFAULT_OUT = "kvdiverge-compare"
MANIFEST = ".kvdiverge-compare.json"
"""The manifest of the files an earlier ``kvdiverge compare`` wrote into its folder."""


def default_out(
    parent: str | os.PathLike = ".", now: float | None = None, prefix: str = DEFAULT_OUT
) -> Path:
    """A fresh folder name for one run: ``kvdiverge-compare-YYYYMMDD-HHMMSS`` (UTC; ``prefix``
    instead of ``kvdiverge-compare``) under ``parent``, with ``-2``, ``-3``, … when that name
    is taken."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    base = Path(parent) / f"{prefix}-{stamp}"
    path, k = base, 1
    while path.exists() or path.is_symlink():
        k += 1
        path = base.with_name(f"{base.name}-{k}")
    return path


def _read_manifest(root: Path) -> list[str]:
    path = root / MANIFEST
    try:
        data = json.loads(path.read_text())
        files = data["files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise CompareError(
            f"--out: {path} is not a kvdiverge compare manifest (JSON with a list 'files'); "
            "remove it or name another folder"
        ) from None
    for name in files:
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise CompareError(
                f"--out: {path} lists {name!r}, not a file inside the folder; remove the "
                "manifest or name another folder"
            )
    return files


def _outside(root: Path, name: str) -> Path | None:
    """Where ``root/name`` leads when a symbolic link on its way (the folders above the file)
    leads outside ``root``, else None. The file itself may be a link: removing a link removes
    only the link."""
    base = root.resolve()
    parent = (root / name).parent.resolve()
    return None if parent == base or parent.is_relative_to(base) else parent / Path(name).name


def _check_inside(root: Path, names: Iterable[str], what: str) -> None:
    for name in names:
        if (place := _outside(root, name)) is not None:
            raise CompareError(
                f"--out: {root / name} ({what}) leads outside {root} through a symbolic link, "
                f"to {place}; expected every file compare writes or --force removes inside "
                "--out: remove the link or name another folder"
            )


def _nearest_existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def check_out(root: str | os.PathLike, planned: Iterable[str], force: bool) -> Path:
    """Check ``root`` before any work (module docstring); returns it as a :class:`Path`.
    ``planned``: the files compare will write, relative to ``root``."""
    root = Path(root)
    if root.is_symlink() and not root.exists():
        raise CompareError(
            f"--out: {root} is a symbolic link to {os.readlink(root)}, which does not exist; "
            "expected a folder (new or from compare): remove the link or name another folder"
        )
    if root.exists() and not root.is_dir():
        raise CompareError(f"--out: {root} is a file; expected a folder (new or from compare)")
    if not root.exists():
        base = _nearest_existing(root.absolute().parent)
        if not base.is_dir():
            raise CompareError(f"--out: cannot create {root}: {base} is not a folder")
        if not os.access(base, os.W_OK | os.X_OK):
            raise CompareError(f"--out: cannot create {root}: {base} is not writable")
        return root
    if not os.access(root, os.W_OK | os.X_OK):
        raise CompareError(f"--out: {root} is not writable")
    present = [p for p in root.iterdir()]
    if not present:
        return root
    if not force:
        raise CompareError(
            f"--out: {root} is not empty; pass --force to replace what an earlier kvdiverge "
            "compare wrote there (nothing else is removed), or name a new folder"
        )
    listed = _read_manifest(root) if (root / MANIFEST).exists() else []
    _check_inside(root, listed, f"listed in {MANIFEST}")
    planned = list(planned)
    _check_inside(root, planned, "a file compare writes")
    ours = set(listed)
    for name in planned:
        target = root / name
        if (target.exists() or target.is_symlink()) and name not in ours:
            raise CompareError(
                f"--out: {target} was not written by kvdiverge compare (not in {MANIFEST}); "
                "--force replaces only compare's own files: move it or name another folder"
            )
        if target.is_dir() and not target.is_symlink():
            raise CompareError(f"--out: {target} is a folder; expected a file or nothing")
    return root


def claim_out(root: Path, planned: Iterable[str]) -> None:
    """Make ``root``, list ``planned`` beside the earlier run's files in the manifest, then
    remove the earlier run's files (only those; folders they leave empty too)."""
    planned = list(planned)
    root.mkdir(parents=True, exist_ok=True)
    earlier = _read_manifest(root) if (root / MANIFEST).exists() else []
    _check_inside(root, [*planned, *earlier], f"listed in {MANIFEST} or to be written")
    atomic_write_text(root / MANIFEST, _manifest([*planned, *earlier]))
    for name in earlier:
        target = root / name
        if target.is_file() or target.is_symlink():
            target.unlink()
    for folder in sorted({str(PurePosixPath(n).parent) for n in earlier} - {"."}, reverse=True):
        path = root / folder
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()


def finish_out(root: Path, written: Iterable[str]) -> None:
    """The manifest of a finished run: exactly the files it wrote."""
    atomic_write_text(root / MANIFEST, _manifest(written))


def _manifest(files: Iterable[str]) -> str:
    listed = sorted(dict.fromkeys(files))
    return json.dumps({"written_by": "kvdiverge compare", "files": listed}, indent=1) + "\n"
