"""Live progress of rollouts (kvdiverge.pipeline.progress): bars on a terminal, plain lines
with rate and ETA anywhere else, never a carriage return in a file; the engine's step hook is
called once per decode step of every batch while it runs; compare's Python API reports to
stderr by default and is silent with ``quiet``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvdiverge.compare import compare
from kvdiverge.pipeline.progress import (
    RolloutProgress,
    is_terminal,
    quiet_library_bars,
    step_position,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_step_position_counts_every_earlier_batch():
    assert [step_position(b, t, 4) for b, t in [(0, 1), (0, 4), (1, 1), (2, 3)]] == [1, 4, 5, 11]


def test_plain_lines_in_a_file_with_rate_and_eta_and_no_carriage_return():
    clock, stream = Clock(), io.StringIO()
    assert not is_terminal(stream)
    bar = RolloutProgress(2, stream=stream, interval=5.0, clock=clock, unit="prompt")
    for b in range(2):
        for t in range(1, 9):
            clock.now += 1.0
            bar.on_step(b, 2, t, 8)
        bar.document(f"prompt {b}")
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    # the first step, every 5 s, each batch's last step; a line per finished prompt
    steps = [line for line in lines if line.startswith("decode steps:")]
    assert steps == [
        "decode steps: 1/16 (batch 1/2, step 1/8) after 1.0 s of prefill and selection",
        "decode steps: 6/16 [00:06<00:10,  1.00step/s] (batch 1/2, step 6/8)",
        "decode steps: 8/16 [00:08<00:08,  1.00step/s] (batch 1/2, step 8/8)",
        "decode steps: 13/16 [00:13<00:03,  1.00step/s] (batch 2/2, step 5/8)",
        "decode steps: 16/16 [00:16<00:00,  1.00step/s] (batch 2/2, step 8/8)",
    ]
    docs = [line for line in lines if line.startswith("prompts:")]
    assert docs == [
        "prompts: 1/2 [00:08] (prompt 0 done)",
        "prompts: 2/2 [00:16] (prompt 1 done)",
    ]


def test_a_write_callable_gets_plain_lines():
    got: list[str] = []
    bar = RolloutProgress(1, write=got.append, interval=0.0, clock=Clock())
    bar.on_step(0, 1, 1, 4)
    bar.document()
    assert len(got) == 2 and all("\r" not in g and "\n" not in g for g in got)
    assert got[1].startswith("documents: 1/1")


def test_a_terminal_gets_two_moving_bars():
    stream = Terminal()
    with RolloutProgress(3, stream=stream, done=1) as bar:
        for t in range(1, 5):
            bar.on_step(0, 2, t, 4)
        assert bar._step_bar.n == 4 and bar._step_bar.total == 8
        bar.document("a")
        assert bar._doc_bar.n == 2  # one resumed, one finished
    assert "decode steps" in stream.getvalue() and "documents" in stream.getvalue()


def test_transformers_bars_are_off_unless_a_terminal():
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    with quiet_library_bars(io.StringIO()):
        assert not hf_logging.is_progress_bar_enabled()
    assert hf_logging.is_progress_bar_enabled()
    with quiet_library_bars(Terminal()):
        assert hf_logging.is_progress_bar_enabled()


def test_the_engine_calls_the_hook_at_every_step_of_every_batch():
    from kvdiverge.engine.batches import batched_paths
    from kvdiverge.engine.settings import RolloutSettings
    from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

    tok, lm = load_tokenizer(str(MODEL)), load_model(str(MODEL), device="cpu")
    docs = [
        (f"d{i}", chat_prompt_ids(tok, f"Tell me about the owl number {i}."), 2) for i in (1, 2)
    ]
    actions = [{"name": "r", "selector": "recent", "budget": 0.5}]
    calls: list[tuple[int, int, int, int]] = []
    settings = RolloutSettings(H=5, seed=0, max_batch_rows=6)  # each document its own batch
    done = []
    for doc_id, _ in batched_paths(
        lm, docs, actions, eos_token_ids(lm, tok), settings, on_step=lambda *a: calls.append(a)
    ):
        done.append((doc_id, len(calls)))
    batches = calls[-1][1]
    assert batches == 2 and calls == [(b, 2, t, 5) for b in range(2) for t in range(1, 6)]
    assert done == [("d1", 5), ("d2", 10)]  # the hook ran while each batch decoded


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"Which number is {i}? It is {i}.", "answers": [str(i)]}
            for i in range(2)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_compare_reports_to_stderr_by_default_and_is_quiet_on_request(prompts, capsys):
    compare(MODEL, prompts, "recent@0.5", K=1, H=4, draws=5)
    err = capsys.readouterr().err
    assert "\r" not in err
    assert "decode steps: 4/4 [" in err and "prompts: 2/2 [" in err
    assert "(prompt id 'q1' done)" in err and "model loaded" in err
    compare(MODEL, prompts, "recent@0.5", K=1, H=4, draws=5, quiet=True)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    got: list[str] = []
    compare(MODEL, prompts, "recent@0.5", K=1, H=4, draws=5, log=got.append)
    assert any(g.startswith("decode steps:") for g in got) and capsys.readouterr().err == ""
