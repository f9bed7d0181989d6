"""The HTML report built after a complete run of the workflow (docs/running.md, "The report").

Snakemake builds a report only from a finished run, in a second invocation
(``snakemake --report``). The workflow's ``onsuccess`` handler calls :func:`build_report` after
a real run of the whole default target, so that one command gives the results and the report;
a partial run (:func:`partial_run`) ends with a line saying how to build it
(:func:`skipped_report`) and exits as its jobs did. The report is built into a hidden sibling
and renamed into place when complete (:func:`build_report`), and a report that does not show
the current results (older than a result, or its last build interrupted) is named at parse
time in one line (:func:`stale_report`). The report run sees the same configuration
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
    """``snakemake --report`` of ``snakefile`` with ``configfile`` as the whole config, and no
    workflow profile (the report runs no job), through :mod:`kvdiverge.pipeline.report_graph`
    (its rule graph has one node per rule)."""
    return [
        sys.executable,
        "-m",
        "kvdiverge.pipeline.report_graph",
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


def building_path(report: str | os.PathLike) -> Path:
    """Where :func:`build_report` builds ``report`` before moving it into place: a hidden
    sibling ``.<name>.building.html`` (Snakemake writes a report only to a ``.html`` name), so a
    build killed part-way leaves the earlier report whole and this file as its trace."""
    report = Path(report)
    return report.with_name(f".{report.stem}.building{report.suffix}")


def stale_report(report: str | os.PathLike, outputs: Iterable[str | os.PathLike]) -> str | None:
    """One line when ``report`` does not show the current results, else None: its last build
    was interrupted (:func:`building_path` is left), or one of ``outputs`` (the default
    target's files) is newer than it. A run that leaves nothing to be done runs no
    ``onsuccess`` handler, so this line (printed at parse time) is what says so."""
    report = Path(report)
    rebuild = (
        f"build it with `snakemake --report {shlex.quote(str(report))}` (the same config options)"
    )
    if building_path(report).exists():
        return (
            f"{report}: its last build was interrupted ({building_path(report)} is left); the "
            f"report may not show the current results: a run of the default target with jobs "
            f"to do rebuilds it, else {rebuild}"
        )
    if not report.is_file():
        return None
    built = report.stat().st_mtime
    newer = []
    for path in outputs:
        try:
            if os.stat(path).st_mtime > built:
                newer.append(str(path))
        except OSError:
            continue
    if not newer:
        return None
    more = f" and {len(newer) - 1} more" if len(newer) > 1 else ""
    return (
        f"{report} is older than {newer[0]}{more}: it does not show the current results; a "
        f"run of the default target with jobs to do rebuilds it, else {rebuild}"
    )


def build_report(
    report: str | os.PathLike,
    snakefile: str | os.PathLike,
    config: Mapping[str, Any],
    log: str | os.PathLike,
) -> None:
    """Build ``report`` with ``snakemake --report`` under ``config`` (the run's effective
    config), writing its output to ``log``, atomically: into :func:`building_path` first, then
    renamed onto ``report`` once complete (a killed build leaves the earlier report and the
    partial file, which :func:`stale_report` names). Raises :class:`RuntimeError` in one line,
    naming the log and the command to rerun, when the report fails."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    partial = building_path(report)
    with tempfile.TemporaryDirectory(prefix="kvdiverge-report-") as folder:
        configfile = os.path.join(folder, "config.yaml")
        with open(configfile, "w") as f:
            yaml.safe_dump(dict(config), f, sort_keys=False)
        command = report_command(partial, snakefile, configfile)
        with open(log, "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not partial.is_file():
        raise RuntimeError(
            f"the report {report} failed (exit {done.returncode}; see {log}); the results are "
            f"complete: build it with `snakemake --report {report}` and the same config options"
        )
    os.replace(partial, report)
