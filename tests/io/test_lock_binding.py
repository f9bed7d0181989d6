"""A lock that binds outcomes (issue 28 item 1): the evaluation seed comes from the lock's hash,
the lock records its evaluation documents and the code computing its endpoints, and every
registration is kept in an append-only history; and the SWRB control check (item 4)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml

from kvdiverge.analysis.control import ControlCheckError, check_swrb_control
from kvdiverge.analysis.prespecification import (
    PrespecificationError,
    check_lock,
    endpoint_fingerprint,
    history_path,
    make_lock,
    prespecified,
    read_history,
    read_lock,
    register,
    registration_line,
    write_lock,
)
from kvdiverge.config import validate_config
from kvdiverge.eviction import parse_action
from kvdiverge.io.locks import (
    check_evaluation_documents,
    evaluation_documents_digest,
    evaluation_seed,
)

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"
MODEL = {"name": "tiny-llama", "path": str(ROOT / "data" / "models" / "tiny-llama")}
PLAN = {"study": "study2", "K": 2, "K_planned": 2, "K_source": "plan", "notes": [], "plans": []}


def _spec(family_estimands=None) -> dict:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    if family_estimands is not None:
        config["analysis"]["family_estimands"] = family_estimands
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    actions = {
        name: parse_action({"name": name, **a}).as_dict() for name, a in config["actions"].items()
    }
    return prespecified(config, "study2", ["ruler-1024"], actions)


def _lock(family_estimands=None, code="c0de000000000000") -> dict:
    documents = evaluation_documents_digest([DOCUMENTS], "study2")
    return make_lock(_spec(family_estimands), PLAN, documents, code)


def test_the_lock_records_its_documents_and_endpoint_code_and_keeps_measured_seconds_out():
    lock = _lock()
    assert lock["design"]["documents"] == evaluation_documents_digest([DOCUMENTS], "study2")
    assert set(lock["design"]["documents"]) == {"ruler-1024"}
    assert lock["endpoints"]["code"] == "c0de000000000000"
    assert make_lock(_spec(), PLAN, lock["design"]["documents"], "0" * 16)["hash"] != lock["hash"]
    measured = {**PLAN, "measured": {"units": "seconds", "pairs": [{"seconds": 1.0}]}}
    again = make_lock(_spec(), measured, lock["design"]["documents"], "c0de000000000000")
    assert again["hash"] == lock["hash"] and "measured" not in again["plan"]


def test_the_history_survives_a_relock(tmp_path):
    path = tmp_path / "study2" / "lock.json"
    path.parent.mkdir()
    first = register(_lock(), path, time=datetime(2026, 12, 1, 9, 0, tzinfo=UTC))
    write_lock(first, path)
    assert first["registration"] == {
        "number": 1,
        "earlier": 0,
        "time": "2026-12-01T09:00:00+00:00",
        "reason": "first registration",
        "history": str(history_path(path)),
    }
    assert registration_line(read_lock(path)) == (
        f"Registration 1 of study2 (lock {first['hash']}, 2026-12-01T09:00:00+00:00; no earlier "
        "registration; first registration)."
    )
    line_one = history_path(path).read_text()
    # Snakemake removes the old lock before the job re-locks: the history is a file beside it
    path.unlink()
    second = register(_lock(["S_99"]), path, time=datetime(2026, 12, 1, 10, 0, tzinfo=UTC))
    write_lock(second, path)
    text = history_path(path).read_text()
    assert text.startswith(line_one) and text.count("\n") == 2
    history = read_history(history_path(path))
    assert [h["hash"] for h in history] == [first["hash"], second["hash"]]
    assert history[0]["lock"]["endpoints"]["estimands"] == ["S_99", "branch_contrast_B"]
    assert second["registration"]["number"] == 2 and second["registration"]["earlier"] == 1
    assert second["registration"]["reason"] == (
        'endpoints.estimands changed (was ["S_99", "branch_contrast_B"], now ["S_99"])'
    )
    assert "; 1 earlier registration; endpoints.estimands changed" in registration_line(second)
    history_path(path).write_text(text + "{not json\n")
    with pytest.raises(PrespecificationError) as info:
        register(_lock(), path)
    assert str(info.value).startswith(f"{history_path(path)}:3: not a registration (")
    assert history_path(path).read_text() == text + "{not json\n"  # nothing written


def test_an_edit_to_the_endpoint_code_after_locking_stops_the_estimands_step(tmp_path):
    """The fingerprint covers the script's own code and every module it reaches (docstrings
    and comments aside); the estimands step's check_lock refuses another in one line."""
    script = tmp_path / "estimands.py"
    script.write_text('"""Doc."""\nimport kvdiverge.analysis.bootstrap\nx = 1\n')
    code = endpoint_fingerprint(script)
    script.write_text('"""Other doc."""\nimport kvdiverge.analysis.bootstrap  # note\nx = 1\n')
    assert endpoint_fingerprint(script) == code
    script.write_text('"""Doc."""\nimport kvdiverge.analysis.bootstrap\nx = 2\n')
    edited = endpoint_fingerprint(script)
    assert edited != code
    path = tmp_path / "lock.json"
    lock = register(_lock(code=code), path)
    assert check_lock(path, _spec(), {}, endpoint_code=code)["hash"] == lock["hash"]
    with pytest.raises(PrespecificationError) as info:
        check_lock(path, _spec(), {}, endpoint_code=edited)
    assert str(info.value) == (
        f"{path}: the code that computes the locked endpoints changed after registration "
        f"(fingerprint {edited}, registered {code}); restore it, or register anew: delete "
        f"{path} and rerun the workflow (docs/prespecification.md)"
    )


def test_the_evaluation_seed_comes_from_the_registration():
    lock, changed = _lock(), _lock(["S_99"])
    assert evaluation_seed(lock) != evaluation_seed(changed)
    assert evaluation_seed(lock) == evaluation_seed(json.loads(json.dumps(lock)))
    assert 0 <= evaluation_seed(lock) < 2**63
    amendment = {"group": "g", "study_lock": lock["hash"], "hash": "ffff"}
    assert evaluation_seed(amendment) == evaluation_seed(lock)  # a later group's X is the same


def test_changing_an_endpoint_and_relocking_changes_every_evaluation_trajectory(tmp_path):
    """The same job under two registrations that differ only in an endpoint: no path (document,
    replicate) of the evaluation cohort is the same, where the model samples more than one text
    (a document whose two replicates generate the same text under one registration is one on
    which the model is all but deterministic: no seed can change it)."""
    from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job

    actions = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}
    cohorts = {name: {"study2": 2} for name in actions}
    paths = {}
    for label, lock in (("first", _lock()), ("changed", _lock(["S_99"]))):
        out = {name: tmp_path / label / f"{name}.parquet" for name in actions}
        settings = RolloutSettings(16, evaluation_seed(lock))
        run_stratum_rollout_job(DOCUMENTS, out, MODEL, actions, cohorts, settings, device="cpu")
        paths[label] = out["recent-half"]
    a, b = (
        pl.read_parquet(paths[k])
        .sort("doc_id", "replicate", "t")
        .group_by("doc_id", "replicate", maintain_order=True)
        .agg(pl.col("x_token"))
        for k in ("first", "changed")
    )
    assert a.height == b.height > 0
    texts = {}
    for doc, x in zip(a["doc_id"].to_list(), a["x_token"].to_list(), strict=True):
        texts.setdefault(doc, []).append(x)
    sampled = {doc for doc, xs in texts.items() if any(x != xs[0] for x in xs)}
    assert sampled  # at least one document on which the randomness shows
    pairs = zip(a["doc_id"], a["x_token"].to_list(), b["x_token"].to_list(), strict=True)
    same = [x == y for doc, x, y in pairs if doc in sampled]
    # a path repeats under a new seed only with the probability the model gives its text
    assert same and sum(same) <= len(same) / 2, f"{sum(same)} of {len(same)} paths unchanged"


def test_evaluation_documents_other_than_the_registered_stop_the_rollout(tmp_path):
    lock_path = tmp_path / "lock.json"
    lock = _lock()
    write_lock(lock, lock_path)
    check_evaluation_documents(read_lock(lock_path), lock_path, DOCUMENTS)  # passes
    frame = pl.read_parquet(DOCUMENTS)
    first = frame.filter(pl.col("cohort") == "study2")["doc_id"][0]
    edited = frame.with_columns(
        prompt=pl.when(pl.col("doc_id") == first)
        .then(pl.col("prompt") + " (edited)")
        .otherwise(pl.col("prompt"))
    )
    changed = tmp_path / "ruler-1024.parquet"
    edited.write_parquet(changed)
    digest = evaluation_documents_digest([changed], "study2")["ruler-1024"]
    with pytest.raises(PrespecificationError) as info:
        check_evaluation_documents(read_lock(lock_path), lock_path, changed)
    assert str(info.value).startswith(
        f"{changed}: the study2 documents of stratum ruler-1024 are not those registered in "
        f"{lock_path} (digest {digest}, registered {lock['design']['documents']['ruler-1024']}); "
        "rerun the workflow to re-lock"
    )


def test_a_broken_gather_fails_the_swrb_control_check(tmp_path, monkeypatch):
    """Under coupling: swrb the control runs through the gather like any action: sound, its
    e_s vanish; with the gathered values halved the SWRB estimands' control check fails in one
    line."""
    import kvdiverge.engine.document as document
    import kvdiverge.engine.swrb_rollout as swrb_rollout
    from kvdiverge.engine.swrb_job import run_swrb_job

    actions = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}

    def job(folder):
        out = {name: tmp_path / folder / f"{name}.parquet" for name in actions}
        cohorts = {name: {"study2": 2} for name in actions}
        run_swrb_job(DOCUMENTS, out, MODEL, actions, cohorts, H=6, seed=3, device="cpu")
        return out["full"]

    sound = job("sound")
    check_swrb_control([sound])  # passes
    # item 5 under SWRB: a stratum of one document has no interval, the pooled two have one
    from kvdiverge.analysis.swrb import swrb_study_table
    from kvdiverge.io.swrb_records import read_swrb_metadata, read_swrb_records, write_swrb_records

    records = read_swrb_records(sound)
    first, second = sorted(set(records["doc_id"]))
    files = {}
    for stratum, doc in (("a", first), ("b", second)):
        files[stratum] = tmp_path / f"one-{stratum}.parquet"
        meta = {**read_swrb_metadata(sound), "n_documents": 1}
        one = records.filter(pl.col("doc_id") == doc)  # one document as stratum a (b)
        one = one.with_columns(pl.col("doc_id").str.replace(r"^[^/]+/", f"{stratum}/"))
        write_swrb_records(one, files[stratum], meta)
    model = read_swrb_metadata(sound)["model"]["name"]  # each file is read as its own model's
    table = swrb_study_table({model: {"full": files}}, draws=50)
    strata = table.filter(pl.col("stratum") != "pooled")
    assert (strata["n_docs"] == 1).all() and strata["ci_low"].is_nan().all()
    pooled = table.filter((pl.col("stratum") == "pooled") & (pl.col("estimand") == "R_smc"))
    assert pooled["n_docs"].to_list() == [2] and pooled["ci_low"].is_finite().all()
    gather = document.gather_prefix

    def broken(prefill, kept):
        return [(keys, 0.5 * values) for keys, values in gather(prefill, kept)]

    monkeypatch.setattr(document, "gather_prefix", broken)
    monkeypatch.setattr(swrb_rollout, "gather_prefix", broken)  # bound there by name
    path = job("broken")
    with pytest.raises(ControlCheckError) as info:
        check_swrb_control([path])
    message = str(info.value)
    assert message.startswith(f"{path}: full-retention control failed for document ")
    assert "deviate from e ≤ 0.0001" in message and "\n" not in message
    assert np.isfinite(float(message.split("max e=")[1].split(")")[0]))
