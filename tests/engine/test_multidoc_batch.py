"""Several documents in one model call (kvdiverge.engine.batches: batched_paths, plan_batches).

A batch holds the rows of several documents, each with its own prompt groups (full and evicted
caches), positions and common random numbers. Every document's results must equal its
one-document run (paths_under_actions) to float rounding: the same tokens and EOS flags,
δ and f within 1e-5; the laws must equal a plain transformers forward; reruns are bit-identical.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from engine_reference import law_differences

import kvdiverge.engine.batches as batches_module
import kvdiverge.engine.rows as rows_module
from kvdiverge.engine import (
    RolloutSettings,
    batched_paths,
    paths_under_actions,
    plan_batches,
)
from kvdiverge.eviction import kept_positions, parse_action
from kvdiverge.models import (
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
)

transformers.utils.logging.disable_progress_bar()

TEXT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
)
ACTIONS = [
    parse_action({"selector": "snapkv", "budget": 0.5, "window": 16}, name="snapkv-half"),
    parse_action({"selector": "recent", "budget": 0.5}, name="recent-half"),
    parse_action({"selector": "full"}, name="full"),
]
# three documents of different lengths; the control runs K_control = 2 (its own reference
# group) except in the second document, where every action runs 2 (one group); the third does
# not run recent-half
REPLICATES = [
    {"snapkv-half": 3, "recent-half": 3, "full": 2},
    {"snapkv-half": 2, "recent-half": 2, "full": 2},
    {"snapkv-half": 3, "full": 2},
]
FIELDS = ("x_token", "y_token", "x_eos", "y_eos")
LAWS = ("tv_rollout", "tv_fixed")


pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo(request, tmp_path_factory):
    path = build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=11)
    tok = load_tokenizer(str(path))
    model = load_model(str(path))
    prompts = [TEXT * 4, TEXT[::-1] * 2, TEXT * 3 + "Answer briefly."]
    docs = [
        (f"doc/{i}", chat_prompt_ids(tok, prompt), reps)
        for i, (prompt, reps) in enumerate(zip(prompts, REPLICATES, strict=True))
    ]
    assert len({len(ids) for _, ids, _ in docs}) == 3  # ragged prompt lengths
    return model, docs, eos_token_ids(model, tok)


@pytest.fixture
def unit_batches(monkeypatch) -> list[list[int]]:
    """The documents' prompt lengths of every batch the engine decodes, in order."""
    batches: list[list[int]] = []
    real = batches_module.rollout_units

    def spy(model, units, eos_ids, settings, on_step=None):
        batches.append([unit.prefill.n for unit in units])
        return real(model, units, eos_ids, settings, on_step)

    monkeypatch.setattr(batches_module, "rollout_units", spy)  # several documents a call
    monkeypatch.setattr(rows_module, "rollout_units", spy)  # one document's groups at a time
    return batches


def _alone(model, docs, eos, settings):
    return {
        doc_id: paths_under_actions(
            model, ids, [a for a in ACTIONS if a.name in reps], doc_id, reps, eos, settings
        )
        for doc_id, ids, reps in docs
    }


def _assert_equal_to_rounding(batched, alone) -> None:
    assert batched.keys() == alone.keys()
    for doc_id, results in alone.items():
        assert batched[doc_id].keys() == results.keys(), doc_id
        for name, want in results.items():
            got = batched[doc_id][name]
            assert np.array_equal(got.replicates, want.replicates)
            assert (got.n_prompt, got.n_kept) == (want.n_prompt, want.n_kept)
            for field in FIELDS:
                assert np.array_equal(getattr(got, field), getattr(want, field)), (doc_id, name)
            for field in LAWS:  # another batch in the matrix products: equal to rounding
                np.testing.assert_allclose(
                    getattr(got, field), getattr(want, field), atol=1e-5, err_msg=doc_id
                )


def test_documents_in_one_batch_equal_their_one_document_runs(demo, unit_batches):
    model, docs, eos = demo
    settings = RolloutSettings(10, 3)
    batched = dict(batched_paths(model, docs, ACTIONS, eos, settings))
    lengths = [len(ids) for _, ids, _ in docs]
    # one batch: every document's groups (two for the first and third, one for the second)
    assert unit_batches == [[lengths[0], lengths[0], lengths[1], lengths[2], lengths[2]]]
    unit_batches.clear()
    alone = _alone(model, docs, eos, settings)
    assert len(unit_batches) == 5  # one document's group at a time
    _assert_equal_to_rounding(batched, alone)
    split = sum(int((r.x_token != r.y_token).any(axis=1).sum()) for r in alone["doc/0"].values())
    assert split >= 2  # paths split, so the Z rows and later positions are exercised
    for results in batched.values():  # the control: P and Q agree to rounding
        full = results["full"]
        assert np.array_equal(full.x_token, full.y_token) and full.tv_rollout.max() < 1e-5
        assert full.document_seconds > 0
    # the shared reference: X is the same for every action of a document
    assert np.array_equal(
        batched["doc/0"]["full"].x_token, batched["doc/0"]["snapkv-half"].x_token[:2]
    )
    # reruns are bit-identical
    again = dict(batched_paths(model, docs, ACTIONS, eos, settings))
    for doc_id, results in batched.items():
        for name, r in results.items():
            for field in FIELDS + LAWS:
                assert np.array_equal(getattr(again[doc_id][name], field), getattr(r, field))


def test_laws_of_a_batched_document_equal_a_plain_forward(demo):
    """The laws each row of a several-document batch decodes with (P on X's history over the
    full cache, Q on Y's and on X's over the kept cache) against plain transformers decoding of
    that document alone: positions and prompt groups are the document's own."""
    model, docs, eos = demo
    settings = RolloutSettings(10, 4, keep_logits=True)
    docs = [(doc_id, ids, {"snapkv-half": 2}) for doc_id, ids, _ in docs]
    batched = dict(batched_paths(model, docs, ACTIONS[:1], eos, settings))
    for doc_id, ids, _ in docs[1:]:  # the shorter documents (not the batch's first prompt)
        r = batched[doc_id]["snapkv-half"]
        kept = kept_positions(model, ids, ACTIONS[0])
        everything = kept_positions(model, ids, ACTIONS[2])
        for k in range(len(r.replicates)):
            for name, difference in law_differences(model, ids, kept, everything, r, k).items():
                assert difference <= 1e-5, (doc_id, name)


def test_row_budget_packs_documents_and_ended_rows_leave(demo, unit_batches):
    """A smaller budget packs the documents' groups into several batches (a group larger than
    the budget in chunks); with frequent tokens as EOS, rows end and leave mid-batch. Every
    document still equals its one-document run."""
    model, docs, _ = demo
    probe = paths_under_actions(model, docs[0][1], ACTIONS[2:], "p", 4, [0], RolloutSettings(8, 4))
    common = np.bincount(probe["full"].x_token[:, 1:].ravel()).argsort()[::-1][:3].tolist()
    unit_batches.clear()
    settings = RolloutSettings(12, 4, max_batch_rows=24)
    batched = dict(batched_paths(model, docs, ACTIONS, common, settings))
    assert len(unit_batches) > 1 and max(len(b) for b in unit_batches) > 1
    ended = [
        r.x_eos[:, -1].any() or r.y_eos[:, -1].any() for d in batched.values() for r in d.values()
    ]
    assert any(ended)
    _assert_equal_to_rounding(batched, _alone(model, docs, common, settings))


def test_skipped_documents_and_out_of_memory(demo, unit_batches, monkeypatch):
    """A resumed job skips its finished documents: a batch of only skipped documents does not
    run, one with others runs whole (the same bits as an uninterrupted run). On out-of-memory a
    batch is cut in halves and the budget drops; tokens are unchanged."""
    model, docs, eos = demo
    settings = RolloutSettings(8, 2, max_batch_rows=16)  # doc/0: 15 | 6, doc/1: 14, doc/2: 9 + 6
    whole = dict(batched_paths(model, docs, ACTIONS, eos, settings))
    n_whole = len(unit_batches)
    unit_batches.clear()
    resumed = dict(batched_paths(model, docs, ACTIONS, eos, settings, skip={"doc/0"}.__contains__))
    assert list(resumed) == ["doc/1", "doc/2"]
    assert len(unit_batches) < n_whole  # doc/0's own batch did not run
    for doc_id, results in resumed.items():
        for name, r in results.items():
            for field in FIELDS + LAWS:
                assert np.array_equal(getattr(r, field), getattr(whole[doc_id][name], field))

    real = batches_module.rollout_units

    def small_memory(model, units, eos_ids, settings, on_step=None):
        if sum(unit.rows for unit in units) > 9:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, units, eos_ids, settings, on_step)

    monkeypatch.setattr(batches_module, "rollout_units", small_memory)
    split = dict(batched_paths(model, docs, ACTIONS, eos, settings))
    for doc_id, results in split.items():
        for name, r in results.items():
            for field in FIELDS:
                assert np.array_equal(getattr(r, field), getattr(whole[doc_id][name], field))


def test_plan_batches():
    """Groups are packed in order while their rows fit; a group above the budget is cut into
    chunks of budget // rows-per-replicate replicates."""
    per = [[7, 3], [7], [5]]
    reps = [[range(4), range(2)], [range(2)], [range(3)]]
    plan = plan_batches(per, reps, 40)
    assert [[(p.doc, p.group, p.rows) for p in batch] for batch in plan] == [
        [(0, 0, 28), (0, 1, 6)],
        [(1, 0, 14), (2, 0, 15)],
    ]
    chunks = plan_batches([[7]], [[range(10)]], 20)
    assert [[p.replicates.tolist() for p in batch] for batch in chunks] == [
        [[0, 1]],
        [[2, 3]],
        [[4, 5]],
        [[6, 7]],
        [[8, 9]],
    ]
    assert plan_batches([[7]], [[range(2)]], 3)[0][0].replicates.tolist() == [0]
    assert len(plan_batches([[7]], [[range(2)]], 3)) == 2  # at least one replicate per batch


def test_bad_documents_fail_before_any_model_call(demo, unit_batches):
    model, docs, eos = demo
    bad = [*docs, ("doc/x", docs[0][1], {"snapkv-90": 2})]
    with pytest.raises(
        ValueError, match=r"document doc/x: replicates for unknown action\(s\) snapkv-90"
    ):
        list(batched_paths(model, bad, ACTIONS, eos, RolloutSettings(4, 1)))
    with pytest.raises(ValueError, match="doc_id values are not unique"):
        list(batched_paths(model, [*docs, docs[0]], ACTIONS, eos, RolloutSettings(4, 1)))
    assert unit_batches == []
