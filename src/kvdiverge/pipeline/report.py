"""The HTML report built after a complete run of the workflow (docs/running.md, "The report").

Snakemake builds a report only from a finished run, in a second invocation
(``snakemake --report``). The workflow's ``onsuccess`` handler calls :func:`build_report` after
a real run of the whole default target, so that one command gives the results and the report;
a partial run (:func:`partial_run`) ends with a line saying how to build it
(:func:`skipped_report`) and exits as its jobs did. The report run sees the same configuration
as the run: the effective config (the config files, ``--config`` values and the schema's
defaults) is written to a temporary file and passed with ``--configfile`` and
``--replace-workflow-config``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml


def partial_run(
    *,
    targets: Iterable[str] = (),
    target_jobs: object = (),
    until: Iterable[str] = (),
    omit_from: Iterable[str] = (),
    allowed_rules: Iterable[str] = (),
    batch: object = None,
) -> str | None:
    """What makes a run partial, as the options that did (``"--until materialize_documents"``),
    or None for a run of the whole default target: targets other than ``all``, ``--until``,
    ``--omit-from``, ``--allowed-rules``, ``--batch``, or the jobs of a cluster job."""
    reasons = []
    others = sorted(set(targets) - {"all"})
    if others:
        reasons.append("the targets " + " ".join(others))
    for option, names in (
        ("--until", until),
        ("--omit-from", omit_from),
        ("--allowed-rules", allowed_rules),
    ):
        if names:
            reasons.append(f"{option} " + " ".join(sorted(names)))
    if batch is not None:
        reasons.append(f"--batch {batch}")
    if target_jobs:
        reasons.append("--target-jobs")
    return ", ".join(reasons) or None


def wants_report(
    *,
    dryrun: bool,
    touch: bool,
    remote: bool,
    targets: Iterable[str],
    target_jobs: object,
    until: Iterable[str] = (),
    omit_from: Iterable[str] = (),
    allowed_rules: Iterable[str] = (),
    batch: object = None,
) -> bool:
    """Whether a successful run builds the report: a real run (no dry run, no ``--touch``, not a
    job run for a cluster) of the whole default target (:func:`partial_run` is None)."""
    if dryrun or touch or remote:
        return False
    partial = partial_run(
        targets=targets,
        target_jobs=target_jobs,
        until=until,
        omit_from=omit_from,
        allowed_rules=allowed_rules,
        batch=batch,
    )
    return partial is None


def skipped_report(
    report: str | os.PathLike,
    partial: str,
    configfiles: Iterable[str | os.PathLike] = (),
    replace: bool = False,
    config_values: bool = False,
) -> str:
    """The line a partial run ends with: the report was skipped, and the command that builds it
    once the whole workflow has run (with the run's config files; ``config_values``: the run
    had ``--config`` values, to pass again)."""
    command = f"snakemake --report {shlex.quote(str(report))}"  # a path with spaces runs as is
    files = [shlex.quote(os.path.relpath(f)) for f in configfiles]
    if files:
        command += " --configfile " + " ".join(files)
    if files and replace:
        command += " --replace-workflow-config"
    if config_values:
        command += " --config <the same values>"
    return (
        f"Report skipped: a partial run ({partial}) builds no report. Once every job of the "
        f"default target has run, build {report} with `{command}`."
    )


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
