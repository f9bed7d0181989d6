"""The output folder checked before any job: a run that cannot write its results stops at once.

Snakemake creates each job's output and log folders only when the job starts, so a read-only
``output_dir`` (an archived results folder, a read-only mount) used to end in a long traceback
from the first job. :func:`check_writable_folder` is called while the workflow parses (not for
a dry run, which writes nothing there): it finds the folder, or the nearest of its parents that
exists, and creates and removes a temporary folder in it, so that permissions, read-only file
systems and immutable folders all count, as they do for the jobs.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["OutputFolderError", "check_writable_folder"]


class OutputFolderError(ValueError):
    """The output folder cannot be written; one line naming the config field and the folder."""


def check_writable_folder(path: str | os.PathLike, field: str) -> None:
    """Check that ``path`` is, or can be created as, a folder this process can write; leaves
    nothing behind. One :class:`OutputFolderError` naming ``field`` and the folder otherwise."""
    folder = Path(path).expanduser().absolute()
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    at = "" if probe == folder else f" (its nearest existing parent {probe})"
    if not probe.is_dir():
        raise OutputFolderError(
            f"{field}: {path}: {probe} is a file, expected a folder to write the results in"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvdiverge-write-check-", dir=probe))
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise OutputFolderError(
            f"{field}: {path}{at} is not writable ({reason}); make it writable or choose "
            "another output_dir"
        ) from None
