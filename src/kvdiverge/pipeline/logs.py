"""One call at the top of every workflow script: its output and tracebacks go into its log.

:func:`job_log` points the process's stderr and stdout (file descriptors 2 and 1, so C
extensions, tqdm, warnings and Python's own traceback printing all follow) at the rule's
``log:`` file, configures :mod:`logging` there, and removes the temporaries a killed earlier run
of the job left beside its outputs (:func:`kvdiverge.io.clean_stale_temporaries`). An uncaught
exception writes its full traceback into the log, and one line — the rule, the error and the
log's path — to the console Snakemake shows, so that its "check log file(s)" pointer is true
and a SLURM job's scheduler file holds a line, not the traceback.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from kvdiverge.io import clean_stale_temporaries

__all__ = ["LOG_FORMAT", "job_log"]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def job_log(snakemake: Any, name: str | None = None) -> logging.Logger:
    """Send this job's stderr, stdout, logging records, warnings and traceback to
    ``snakemake.log[0]`` (truncated first); clean stale temporaries of its outputs; return a
    logger named ``name`` (default: the rule's name).

    Without a ``log:`` file, output stays on the console and only logging is configured.
    """
    outputs = [str(o) for o in getattr(snakemake, "output", [])]
    clean_stale_temporaries(outputs)
    rule = name or getattr(snakemake, "rule", None) or "job"
    logs = list(getattr(snakemake, "log", []))
    if logs:
        path = Path(logs[0])
        path.parent.mkdir(parents=True, exist_ok=True)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        console = os.dup(2)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o666)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

        def report(exc_type, exc, tb) -> None:
            traceback.print_exception(exc_type, exc, tb)
            sys.stderr.flush()
            if not issubclass(exc_type, KeyboardInterrupt):
                line = f"{rule}: {_one_line(exc)} (traceback in {path})\n"
                os.write(console, line.encode(errors="backslashreplace"))

        sys.excepthook = report
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format=LOG_FORMAT, force=True)
    logging.captureWarnings(True)
    faulthandler.enable(file=sys.stderr)
    return logging.getLogger(rule)
