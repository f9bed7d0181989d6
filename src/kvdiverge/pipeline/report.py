"""The HTML report built after a complete run of the workflow (docs/running.md, "The report").

Snakemake builds a report only from a finished run, in a second invocation
(``snakemake --report``). The workflow's ``onsuccess`` handler calls :func:`build_report` after
a real run of the default target, so that one command gives the results and the report. The
report run sees the same configuration as the run: the effective config (the config files,
``--config`` values and the schema's defaults) is written to a temporary file and passed with
``--configfile`` and ``--replace-workflow-config``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


def wants_report(
    *, dryrun: bool, touch: bool, remote: bool, targets: set[str], target_jobs: object
) -> bool:
    """Whether a successful run builds the report: a real run (no dry run, no ``--touch``, not a
    job run for a cluster) of the default target (no targets, or only ``all``)."""
    if dryrun or touch or remote or target_jobs:
        return False
    return set(targets) <= {"all"}


def report_command(
    report: str | os.PathLike, snakefile: str | os.PathLike, configfile: str
) -> list[str]:
    """``python -m snakemake --report`` of ``snakefile`` with ``configfile`` as the whole
    config, and no workflow profile (the report runs no job)."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--report",
        str(report),
        "--snakefile",
        str(snakefile),
        "--configfile",
        configfile,
        "--replace-workflow-config",
        "--workflow-profile",
        "none",
    ]


def build_report(
    report: str | os.PathLike,
    snakefile: str | os.PathLike,
    config: Mapping[str, Any],
    log: str | os.PathLike,
) -> None:
    """Build ``report`` with ``snakemake --report`` under ``config`` (the run's effective
    config), writing its output to ``log``. Raises :class:`RuntimeError` in one line, naming
    the log and the command to rerun, when the report fails."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvdiverge-report-") as folder:
        configfile = os.path.join(folder, "config.yaml")
        with open(configfile, "w") as f:
            yaml.safe_dump(dict(config), f, sort_keys=False)
        command = report_command(report, snakefile, configfile)
        with open(log, "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"the report {report} failed (exit {done.returncode}; see {log}); the results are "
            f"complete: build it with `snakemake --report {report}` and the same config options"
        )
