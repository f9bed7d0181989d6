"""Live progress of a rollout: documents finished and decode steps, with rate and ETA.

:class:`RolloutProgress` takes the engine's step hook (``on_step(batch, batches, t, H)`` of
:func:`kvdiverge.engine.batches.batched_paths`, called after every decode step of every
batch) and one call per finished document. On a terminal it draws two tqdm bars (documents,
decode steps) that move while a batch runs. Anywhere else (a job's log file, a pipe, a
notebook's captured stream, a ``log`` callable) it writes plain lines, never carriage
returns: one when decoding starts (with the seconds of prefill and selection), one on the decode
steps at most every ``interval`` seconds and at each batch's last step, with tqdm's own rate and
ETA (``tqdm.format_meter``), and one per finished document with the elapsed time (the documents
of a batch finish together, so their own rate would mislead). :func:`quiet_library_bars`
switches transformers' own bars (the "Loading weights" bar) off while its stream is not a
terminal.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = ["RolloutProgress", "is_terminal", "quiet_library_bars", "step_position", "tqdm_interval"]

_FORMAT = "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"


def tqdm_interval(seconds: float) -> str:
    """Seconds as tqdm writes an elapsed time (``01:05``, ``1:02:03``)."""
    from tqdm import tqdm

    return tqdm.format_interval(seconds)


def is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes and objects
    without ``isatty``)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def step_position(batch: int, t: int, H: int) -> int:
    """Decode steps done once step ``t`` of planned batch ``batch`` (0-based) has run: every
    earlier batch's H steps plus ``t``."""
    return batch * H + t


@contextlib.contextmanager
def quiet_library_bars(stream: Any = None) -> Iterator[None]:
    """Within the block, transformers' progress bars are off unless ``stream`` (default
    stderr) is a terminal; their earlier state is restored after."""
    stream = sys.stderr if stream is None else stream
    if is_terminal(stream):
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class RolloutProgress:
    """Progress of ``documents`` documents (``done`` of them finished already, e.g. resumed).

    ``stream``: where bars or lines go (default stderr); ``write``: a callable taking one line,
    used instead of ``stream`` (always plain lines); ``interval``: seconds between two plain
    lines on the decode steps; ``clock``: seconds (monotonic), replaceable in tests. Use
    :meth:`on_step` as the engine's step hook and call :meth:`document` as each document
    finishes; :meth:`close` (or the ``with`` block's end) finishes the bars.
    """

    def __init__(
        self,
        documents: int,
        *,
        stream: IO[str] | None = None,
        write: Callable[[str], None] | None = None,
        done: int = 0,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        unit: str = "document",
    ) -> None:
        self.documents, self.done, self.unit = documents, done, unit
        self.interval, self.clock = interval, clock
        self.stream = sys.stderr if stream is None and write is None else stream
        self.write = write or self._write_stream
        self.bars = write is None and is_terminal(self.stream)
        self.start = clock()
        self.steps = 0
        self.first_step: tuple[float, int] | None = None  # (time, position) of the first step
        self.total_steps: int | None = None
        self.last_line = -float("inf")
        self._doc_bar = self._step_bar = None
        if self.bars:
            from tqdm import tqdm

            self._doc_bar = tqdm(
                total=documents, initial=done, desc=f"{unit}s", unit=unit, file=self.stream,
                position=0, dynamic_ncols=True, mininterval=0.5,
            )  # fmt: skip
            self._step_bar = tqdm(
                total=None, desc="decode steps", unit="step", file=self.stream, position=1,
                dynamic_ncols=True, mininterval=0.5,
            )  # fmt: skip

    def _write_stream(self, line: str) -> None:
        assert self.stream is not None
        self.stream.write(line + "\n")
        self.stream.flush()

    def _meter(
        self, desc: str, n: int, total: int | None, elapsed: float, unit: str, rate: float | None
    ) -> str:
        from tqdm import tqdm

        return tqdm.format_meter(
            n, total, elapsed, prefix=desc, unit=unit, rate=rate, bar_format=_FORMAT
        )

    def on_step(self, batch: int, batches: int, t: int, H: int) -> None:
        """The engine's step hook: decode step ``t`` of planned batch ``batch`` of ``batches``
        has run."""
        now = self.clock()
        position = step_position(batch, t, H)
        self.total_steps = batches * H
        if self.first_step is None:
            self.first_step = (now, position)
        moved = max(position - self.steps, 0)
        self.steps = max(self.steps, position)
        if self._step_bar is not None:
            if self._step_bar.total != self.total_steps:
                self._step_bar.total = self.total_steps
            self._step_bar.update(moved)
            return
        if self.last_line == -float("inf"):  # the first line: decoding has begun
            self.last_line = now
            self.write(
                f"decode steps: {self.steps}/{self.total_steps} (batch {batch + 1}/{batches}, "
                f"step {t}/{H}) after {now - self.start:.1f} s of prefill and selection"
            )
            return
        if now - self.last_line >= self.interval or t == H:
            self.last_line = now
            since, first = self.first_step  # the rate from the steps after the first
            rate = (self.steps - first) / (now - since) if now > since else None
            meter = self._meter(
                "decode steps", self.steps, self.total_steps, now - self.start, "step", rate
            )
            self.write(f"{meter} (batch {batch + 1}/{batches}, step {t}/{H})")

    def document(self, name: str | None = None) -> None:
        """One more document has finished (``name``: shown on its plain line)."""
        self.done += 1
        if self._doc_bar is not None:
            self._doc_bar.update(1)
            return
        # no rate or ETA here: the documents of a batch finish together (the decode steps'
        # lines carry the rate and ETA)
        elapsed = tqdm_interval(self.clock() - self.start)
        line = f"{self.unit}s: {self.done}/{self.documents} [{elapsed}]"
        self.write(line + (f" ({name} done)" if name else ""))

    def close(self) -> None:
        """Finish the bars (nothing for plain lines)."""
        for bar in (self._step_bar, self._doc_bar):
            if bar is not None:
                bar.close()
        self._doc_bar = self._step_bar = None

    def __enter__(self) -> RolloutProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
