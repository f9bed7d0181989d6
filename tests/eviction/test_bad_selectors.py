"""The bad-selector catalogue (issue 27, items 1 and 2): a user's selector that breaks the output
contract, raises, or changes the shared prefill stops before any decoding with one line naming
the action and the selector (kvdiverge.eviction.contract), and a rollout job writes nothing.

The selectors are in tests/selector_helpers.py, one way of breaking the contract each; the
model is the committed tiny-llama demo model (2 layers, 2 KV heads) on a 34-token prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import transformers

from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
from kvdiverge.eviction import ActionError, parse_action, run_prefill, select_positions
from kvdiverge.models import chat_prompt_ids, load_model, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
MODEL = ROOT / "data" / "models" / "tiny-llama"
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
PROMPT = "The river flows north past the old mill. The magic number is 482913."
N, KEEP = 34, 8  # prompt tokens, the actions' budget

transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def model():
    return load_model(str(MODEL))


@pytest.fixture(scope="module")
def ids():
    ids = chat_prompt_ids(load_tokenizer(str(MODEL)), PROMPT)
    assert len(ids) == N
    return ids


def action(cls: str, name: str = "mine", budget: int = KEEP):
    return parse_action({"selector": f"selector_helpers:{cls}", "budget": budget}, name=name)


def one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message, message
    return message


def where(cls: str) -> str:
    return f"action 'mine': selector 'selector_helpers:{cls}'"


EXACT = f"exactly {KEEP} per layer and KV head (the action's budget)"
CASES = {
    "Duplicates": f"position 3 more than once at layer 0, KV head 0; expected distinct "
    f"positions, {EXACT}",
    "Everything": f"positions returned {N} positions per layer and KV head; expected {KEEP} "
    f"(the action's budget) of the {N}-token prompt",
    "Single": f"positions returned 1 positions per layer and KV head; expected {KEEP} (the "
    f"action's budget) of the {N}-token prompt",
    "Negative": f"position -5 at layer 1, KV head 0; expected prompt positions in [0, {N}) "
    "(-1 only as trailing padding)",
    "Padded": f"-1 padding at layer 0, KV head 1; expected {EXACT}",
    "OutOfRange": f"position {N} at layer 0, KV head 0; expected prompt positions in [0, {N}) "
    "(-1 only as trailing padding)",
    "FloatPositions": "positions returned a torch.float32 tensor; expected integer positions",
    "WrongShape": f"positions returned shape (2, {KEEP}); expected (2, 2, {KEEP}) (layers, KV "
    "heads, kept positions)",
    "NotATensor": "positions returned list; expected an integer torch.Tensor (2, 2, m)",
    "Raises": "positions raised ZeroDivisionError: integer division or modulo by zero",
    "ScalesValues": "positions changed the shared prefill (its keys, values, window queries or "
    "logits); a selector must not modify the prefill, which every action and the reference "
    "rollout read (copy a tensor before changing it)",
    "NaNScores": "score of layer 0: score nan at KV head 0, position 3; expected finite scores "
    "(NaN and inf are refused)",
    "InfScores": "score of layer 0: score inf at KV head 1, position 5; expected finite scores "
    "(NaN and inf are refused)",
    "ScoreRaises": "score raised KeyError: 'window'",
    "BadAlwaysKept": f"always_kept returned [0, 0, 99]; expected at most {KEEP} distinct integer "
    f"positions in [0, {N})",
    "RaggedShort": f"layer 1 keeps {2 * KEEP - 1} entries over its 2 KV heads; expected "
    f"{2 * KEEP}, as the selector declares (kept_per_layer)",
    "RaggedGap": "-1 before a position at layer 0, KV head 0; expected -1 only as trailing padding",
}


@pytest.mark.parametrize("cls", list(CASES))
def test_a_contract_violation_is_one_line_naming_action_and_selector(cls, model, ids):
    spec = action(cls)
    prefill = run_prefill(model, ids, actions=[spec])
    with pytest.raises(ActionError) as info:
        select_positions(prefill, spec)
    assert one_line(info) == f"{where(cls)}: {CASES[cls]}"


def test_an_exception_of_user_code_keeps_its_traceback(model, ids):
    spec = action("Raises")
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), spec)
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # chained: the log shows it


def test_an_observer_that_changes_the_cache_is_stopped_during_the_prefill(model, ids):
    spec = action("ObserveScalesKeys")
    with pytest.raises(ActionError) as info:
        run_prefill(model, ids, actions=[spec])
    assert one_line(info) == (
        "action 'mine': observe changed layer 0's keys, values or position embeddings during "
        "the prefill; a selector must not modify what the model and every other action read"
    )


def test_a_selector_that_changes_the_prefill_leaves_no_trace_in_the_other_actions(model, ids):
    """Before the check, the corrupted values reached every later action and the reference X;
    now the selector is stopped, and an honest selector after it still sees the original."""
    clean = run_prefill(model, ids)
    values = [v.clone() for v in clean.values]
    with pytest.raises(ActionError):
        select_positions(clean, action("ScalesValues"))
    assert not torch.equal(clean.values[0], values[0])  # it did change them: stopped, not hidden
    fresh = run_prefill(model, ids)
    assert all(torch.equal(a, b) for a, b in zip(fresh.values, values, strict=True))


def test_valid_output_is_accepted_in_canonical_form(model, ids):
    prefill = run_prefill(model, ids)
    kept = select_positions(prefill, action("Valid"))  # descending int32: allowed
    assert kept.dtype == torch.long
    assert torch.equal(kept, torch.arange(KEEP).expand(2, 2, KEEP))
    ragged = select_positions(prefill, action("RaggedValid"))
    counts = (ragged >= 0).sum(-1)
    assert counts.tolist() == [[KEEP + 1, KEEP - 1], [KEEP + 1, KEEP - 1]]
    assert bool((ragged[:, 1, -2:] == -1).all())  # head 1's padding stays at the end
    # the digest was checked after each selector, and the prefill is as it was
    assert torch.equal(prefill.verified, prefill.digest())


def test_built_in_selectors_pass_the_contract(model, ids):
    specs = [
        parse_action({"selector": "snapkv", "budget": 12, "window": 4}, name="snapkv"),
        parse_action({"selector": "recent", "budget": 0.5, "sinks": 2}, name="recent"),
        parse_action({"selector": "full"}, name="full"),
    ]
    prefill = run_prefill(model, ids, actions=specs)
    counts = [int((select_positions(prefill, a) >= 0).sum(-1).unique()) for a in specs]
    assert counts == [12, N // 2, N]


def test_the_digest_sees_any_changed_value_and_exchanged_rows(model, ids):
    prefill = run_prefill(model, ids)
    base = prefill.digest()
    keys = prefill.keys[1]
    keep = keys.clone()
    keys[1, 7, 3] = torch.nextafter(keys[1, 7, 3], torch.tensor(float("inf")))  # one ulp
    assert not torch.equal(prefill.digest(), base)
    keys.copy_(keep)
    assert torch.equal(prefill.digest(), base)
    keys[0, [2, 9]] = keys[0, [9, 2]].clone()  # two positions exchanged
    assert not torch.equal(prefill.digest(), base)
    keys.copy_(keep)
    prefill.last_logits[0] = float("nan")
    changed = prefill.digest()
    assert not torch.equal(changed, base) and torch.equal(prefill.digest(), changed)  # NaN-safe


def test_digest_cost_is_small_beside_the_prefill():
    """SmolLM2-135M's cache for a 4096-token prompt (30 layers, 3 KV heads, head size 64,
    float32): the digest reads it once, at about the cost of summing it (~40-60 ms on one
    thread of the shared VM; the prefill of that prompt takes seconds). Compared with a plain
    sum in the same process, the best of three each, as the VM's load varies."""
    from kvdiverge.eviction import Prefill

    keys = [torch.randn(3, 4096, 64) for _ in range(30)]
    prefill = Prefill(keys, [k.clone() for k in keys], [], torch.randn(49152), 4096, 3, 64)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    summed = best(lambda: [t.sum() for t in prefill.keys + prefill.values])
    assert best(prefill.digest) < 4 * summed + 0.05


# ---- a rollout job: one line, nothing written ----------------------------------------------------
JOB_ACTIONS = {
    "full": {"selector": "full"},
    "recent-half": {"selector": "recent", "budget": 0.5},
    "mine": {"selector": "selector_helpers:Duplicates", "budget": 0.5},
}
JOB_COHORTS = {"full": {"dev": 1}, "recent-half": {"dev": 1}, "mine": {"dev": 1}}


def test_a_rollout_job_stops_before_decoding_and_writes_nothing(tmp_path):
    out = {name: tmp_path / "out" / f"{name}.parquet" for name in JOB_ACTIONS}
    model = {"name": "tiny-llama", "path": str(MODEL)}
    with pytest.raises(ActionError) as info:
        run_stratum_rollout_job(
            DOCUMENTS, out, model, JOB_ACTIONS, JOB_COHORTS, RolloutSettings(H=4, seed=1),
            device="cpu", resume_key="test",
        )  # fmt: skip
    assert one_line(info).startswith(
        "action 'mine': selector 'selector_helpers:Duplicates': position 3 more than once at "
        "layer 0, KV head 0; expected distinct positions, exactly "
    )
    assert not any(path.exists() for path in out.values())
    # no trajectory, no finished document in a scratch area (only the scratch areas' keys,
    # written when the job opens them)
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file() and p.name != "key.json"]
    assert written == []


def test_a_job_script_writes_the_traceback_to_its_log_and_one_line_to_the_console(tmp_path):
    """As a workflow script does (kvdiverge.pipeline.logs.job_log): the console gets the rule,
    the action's line and the log's path; the log gets the user's traceback."""
    log, out = tmp_path / "logs" / "job.log", tmp_path / "out" / "mine.parquet"
    script = textwrap.dedent(
        """
        import sys, types
        from kvdiverge.pipeline.logs import job_log
        snakemake = types.SimpleNamespace(log=[sys.argv[1]], output=[sys.argv[2]], rule="rollout")
        job_log(snakemake)
        from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
        run_stratum_rollout_job(
            sys.argv[3], {"mine": sys.argv[2]}, {"name": "tiny-llama", "path": sys.argv[4]},
            {"mine": {"selector": "selector_helpers:Raises", "budget": 0.5}},
            {"mine": {"dev": 1}}, RolloutSettings(H=4, seed=1), device="cpu",
        )
        """
    )
    res = subprocess.run(
        [sys.executable, "-c", script, str(log), str(out), str(DOCUMENTS), str(MODEL)],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr == (
        "rollout: ActionError: action 'mine': selector 'selector_helpers:Raises': positions "
        f"raised ZeroDivisionError: integer division or modulo by zero (traceback in {log})\n"
    )
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "return 1 // 0" in text
    assert not out.exists()


def test_kvdiverge_compare_exits_2_with_the_line_and_writes_nothing(tmp_path, capsys):
    from kvdiverge.cli import main

    prompts = tmp_path / "mine.jsonl"
    record = {"prompt": PROMPT + " What is the magic number?", "answers": ["482913"]}
    prompts.write_text(json.dumps(record) + "\n")
    out = tmp_path / "out"
    actions = "mine=selector_helpers:Duplicates@0.5,recent@0.5"
    argv = ["compare", "--model", str(MODEL), "--prompts", str(prompts), "--actions", actions]
    assert main([*argv, "--K", "1", "--H", "4", "--draws", "20", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "kvdiverge compare: action 'mine': selector 'selector_helpers:Duplicates': position 3 "
        "more than once at layer 0, KV head 0; expected distinct positions, exactly "
    ), err
    assert not out.exists() or not any(out.iterdir())


def test_a_selector_n_keep_below_one_is_one_line(model, ids):
    spec = action("ZeroKeep")
    with pytest.raises(ActionError) as info:
        select_positions(run_prefill(model, ids), spec)
    assert one_line(info) == (
        f"{where('ZeroKeep')}: n_keep returned 0 for a {N}-token prompt; expected an integer >= 1"
    )


def test_user_code_failing_at_parse_time_is_one_config_line():
    """The config's budget check runs the selector's own check against every stratum."""
    import yaml

    from kvdiverge.config import ConfigError, check_config

    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg["actions"]["mine"] = {"selector": "selector_helpers:CheckRaises", "budget": 0.5}
    cfg["studies"]["study1"]["actions"].append("mine")
    with pytest.raises(ConfigError) as info:
        check_config(cfg, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    assert one_line(info) == (
        "config.actions.mine: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): selector 'selector_helpers:CheckRaises': "
        "check raised RuntimeError: cannot act on 992 tokens"
    )
