"""A failing workflow script (kvdiverge.pipeline.logs): its traceback, output and warnings go to its
log, one line naming the log to the console, and stale temporaries of its outputs are removed."""

from __future__ import annotations

from refusal_helpers import run_python


def test_a_failing_script_writes_its_traceback_to_its_log_and_one_line_to_the_console(tmp_path):
    log, out = tmp_path / "logs" / "job.log", tmp_path / "out.csv"
    stale = tmp_path / ".out.csv.abcd1234.csv"
    stale.write_text("")  # a zero-byte temporary of a killed earlier run
    res = run_python(
        """
        import sys, types, warnings
        from kvdiverge.pipeline.logs import job_log
        snakemake = types.SimpleNamespace(log=[sys.argv[1]], output=[sys.argv[2]], rule="demo")
        log = job_log(snakemake)
        log.info("started")
        print("on stdout")
        sys.stderr.write("on stderr\\n")
        warnings.warn("careful")
        raise ValueError("doc 'x' is bad\\nsecond line")
        """,
        str(log),
        str(out),
    )
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == f"demo: ValueError: doc 'x' is bad (traceback in {log})\n"
    text = log.read_text()
    for piece in ("started", "on stdout", "on stderr", "careful", "Traceback", "second line"):
        assert piece in text, piece
    assert not stale.exists()
