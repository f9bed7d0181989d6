"""The coupled rollout engine (kvdiverge.engine: attention, rows, document, batches,
rollout_job)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
import pytest
import scipy.stats
import torch
import transformers
from engine_reference import law_differences, reference_logits
from transformers import LlamaConfig, LlamaForCausalLM

import kvdiverge.engine.attention as attention
import kvdiverge.engine.document as document_module
import kvdiverge.engine.kernels.reference as kernel_reference
import kvdiverge.engine.rows as rows_module
from kvdiverge.analysis.control import check_full_retention_control
from kvdiverge.analysis.planning import cost_from_timing, read_timing
from kvdiverge.engine import (
    RolloutSettings,
    paths_under_action,
    paths_under_actions,
    reference_groups,
    run_stratum_rollout_job,
    trajectory_frame,
    trajectory_tables,
)
from kvdiverge.engine.kernels import math_attention
from kvdiverge.eviction import kept_positions, parse_action, run_prefill
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)
from kvdiverge.models import (
    build_demo_model,
    chat_prompt_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
)
from kvdiverge.theory.coupling import maximal_coupling_joint

transformers.utils.logging.disable_progress_bar()

PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 5
SNAPKV_HALF = {"name": "snapkv-half", "selector": "snapkv", "budget": 0.5, "window": 32}
RECENT_HALF = {"name": "recent-half", "selector": "recent", "budget": 0.5}
FULL = {"name": "full", "selector": "full"}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def demo_path(request, tmp_path_factory) -> Path:
    return build_demo_model(request.param, tmp_path_factory.mktemp(request.param) / "m", seed=11)


@pytest.fixture(scope="module")
def demo(demo_path):
    path = demo_path
    tok = load_tokenizer(str(path))
    model = load_model(str(path))
    return model, tok, chat_prompt_ids(tok, PROMPT), eos_token_ids(model, tok)


def test_distributions_equal_plain_forward_before_and_after_divergence(demo):
    model, _, ids, eos = demo
    H, K = 24, 4
    r = paths_under_action(
        model, ids, SNAPKV_HALF, "doc-a", K, eos, RolloutSettings(H, 5, keep_logits=True)
    )
    kept = kept_positions(model, ids, SNAPKV_HALF)
    everything = kept_positions(model, ids, FULL)
    diverged = r.x_token != r.y_token
    assert diverged[:, 1:].any(axis=1).sum() >= 2  # several paths split inside the horizon
    # until the histories split (up to and including the first mismatch) Z equals Y: f_t = δ_t
    before_split = np.cumsum(diverged, axis=1) - diverged == 0
    # (before its split a replicate's Z row does not run: its Q is Y's, bit for bit)
    assert np.array_equal(r.tv_fixed[before_split], r.tv_rollout[before_split])
    assert np.array_equal(r.logits["q_fixed"][before_split], r.logits["q"][before_split])
    post_divergence_checked = 0
    for k in range(K):
        for name, difference in law_differences(model, ids, kept, everything, r, k).items():
            assert difference <= 1e-5, name
        if diverged[k].any():
            post_divergence_checked += H - int(np.argmax(diverged[k])) - 1
    assert post_divergence_checked >= 10


def test_first_step_and_full_control(demo):
    model, _, ids, eos = demo
    r = paths_under_action(model, ids, RECENT_HALF, "doc-b", 6, eos, RolloutSettings(16, 1))
    assert np.all(r.tv_rollout[:, 0] == 0) and np.all(r.tv_fixed[:, 0] == 0)  # δ_1 = f_1 = 0
    assert np.all(r.x_token[:, 0] == r.y_token[:, 0])
    assert r.tv_rollout[:, 1:].max() > 0
    # the control runs its own rows over the gathered full cache: P and Q agree to rounding
    full = paths_under_action(model, ids, FULL, "doc-b", 6, eos, RolloutSettings(16, 1))
    assert full.tv_rollout.max() < 1e-5 and full.tv_fixed.max() < 1e-5
    assert np.array_equal(full.x_token, full.y_token)
    assert full.n_kept == full.n_prompt == len(ids)
    assert full.rows_per_replicate == 3  # X, the control's Y and (after a split) Z
    # with one thread the matrix products are bit-exact: δ ≡ f ≡ 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exact = paths_under_action(model, ids, FULL, "doc-b", 6, eos, RolloutSettings(16, 1))
    finally:
        torch.set_num_threads(threads)
    assert np.all(exact.tv_rollout == 0) and np.all(exact.tv_fixed == 0)
    # the benchmarks' shortcut: Q := P, no rows of its own
    shortcut = paths_under_action(
        model, ids, FULL, "doc-b", 6, eos, RolloutSettings(16, 1, identity_shortcut=True)
    )
    assert np.all(shortcut.tv_rollout == 0) and np.all(shortcut.tv_fixed == 0)
    assert shortcut.rows_per_replicate == 1
    assert np.array_equal(shortcut.x_token, full.x_token)


def test_reference_is_shared_across_actions_and_reruns_are_bit_identical(demo):
    model, _, ids, eos = demo
    runs = {
        a["name"]: paths_under_action(model, ids, a, "doc-c", 5, eos, RolloutSettings(20, 9))
        for a in (SNAPKV_HALF, RECENT_HALF, FULL)
    }
    x = runs["full"].x_token
    for r in runs.values():
        assert np.array_equal(r.x_token, x)
    again = paths_under_action(model, ids, SNAPKV_HALF, "doc-c", 5, eos, RolloutSettings(20, 9))
    for field in ("x_token", "y_token", "tv_rollout", "tv_fixed", "x_eos", "y_eos"):
        assert np.array_equal(getattr(again, field), getattr(runs["snapkv-half"], field))
    # a different seed or document changes the reference; independent coupling decouples actions
    other = paths_under_action(model, ids, FULL, "doc-d", 5, eos, RolloutSettings(20, 9))
    assert not np.array_equal(other.x_token, x)
    indep = {
        a["name"]: paths_under_action(
            model, ids, a, "doc-c", 5, eos, RolloutSettings(20, 9, coupling="independent")
        )
        for a in (SNAPKV_HALF, RECENT_HALF)
    }
    assert not np.array_equal(indep["snapkv-half"].x_token, indep["recent-half"].x_token)
    with pytest.raises(ValueError, match="coupling"):
        paths_under_action(model, ids, FULL, "d", 1, eos, RolloutSettings(4, 9, coupling="shared"))


def test_replicates_are_keyed_not_positional_and_batches_split(demo, monkeypatch):
    model, _, ids, eos = demo
    whole = paths_under_action(model, ids, SNAPKV_HALF, "doc-e", 6, eos, RolloutSettings(12, 2))
    small = paths_under_action(
        model, ids, SNAPKV_HALF, "doc-e", 6, eos, RolloutSettings(12, 2, max_batch_rows=6)
    )
    subset = paths_under_action(
        model, ids, SNAPKV_HALF, "doc-e", [4, 5], eos, RolloutSettings(12, 2)
    )
    assert np.array_equal(small.x_token, whole.x_token)
    assert np.array_equal(small.y_token, whole.y_token)
    # other batch sizes may take other matrix kernels (rounding), not other laws
    np.testing.assert_allclose(small.tv_rollout, whole.tv_rollout, atol=1e-5)
    assert np.array_equal(subset.y_token, whole.y_token[4:])

    real_chunk = document_module.rollout_chunk
    sizes = []

    def fake_oom(*args, **kwargs):
        sizes.append(len(args[4]))
        if len(args[4]) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(document_module, "rollout_chunk", fake_oom)
    split = paths_under_action(model, ids, SNAPKV_HALF, "doc-e", 6, eos, RolloutSettings(12, 2))
    assert sizes[0] == 6 and sizes.count(6) == 1
    assert sum(size for size in sizes if size <= 2) == 6  # the chunks that ran cover K once
    assert split.batch_rows == 3 * 2  # later documents start from the size that fitted
    assert np.array_equal(split.x_token, whole.x_token)
    assert np.array_equal(split.y_token, whole.y_token)


def test_eos_is_absorbing(demo):
    model, _, ids, _ = demo
    # Make frequent tokens "EOS" so that both sequences end inside the horizon.
    probe = paths_under_action(model, ids, FULL, "doc-f", 8, [0], RolloutSettings(16, 4))
    common = np.bincount(probe.x_token[:, 1:].ravel()).argsort()[::-1][:4].tolist()
    r = paths_under_action(model, ids, RECENT_HALF, "doc-f", 8, common, RolloutSettings(32, 4))
    assert r.x_eos[:, -1].any() and r.y_eos[:, -1].any()
    for k in range(8):
        for tokens, ended in ((r.x_token[k], r.x_eos[k]), (r.y_token[k], r.y_eos[k])):
            assert np.all(np.diff(ended.astype(int)) >= 0)  # once ended, always ended
            assert np.array_equal(ended, np.maximum.accumulate(np.isin(tokens, common)))
            if ended.any():
                first = int(np.argmax(ended))
                assert np.all(tokens[first:] == min(common))  # the merged EOS outcome
        both = r.x_eos[k] & r.y_eos[k]
        shifted = np.concatenate([[False], both[:-1]])  # kernels are point masses from t+1
        assert np.all(r.tv_rollout[k][shifted] == 0)
        x_ended_before = np.concatenate([[False], r.x_eos[k][:-1]])
        assert np.all(r.tv_fixed[k][x_ended_before] == 0)


def test_several_eos_ids_are_one_outcome(demo):
    model, _, ids, _ = demo
    specs = [SNAPKV_HALF, RECENT_HALF, FULL]
    # EOS ids: the most common token of X and of each action's Y (then X's next ones, up to
    # four), so that every action's sequences end within the horizon on any machine's rounding
    probe = paths_under_actions(model, ids, specs, "doc-f", 8, [0], RolloutSettings(16, 4))
    by_x = np.bincount(probe["full"].x_token[:, 1:].ravel()).argsort()[::-1].tolist()
    common: list[int] = []
    for tokens in [probe["full"].x_token, *(r.y_token for r in probe.values())]:
        top = next(t for t in np.bincount(tokens[:, 1:].ravel()).argsort()[::-1] if t not in common)
        common.append(int(top))
    common += [t for t in by_x if t not in common][: max(0, 4 - len(common))]
    orders = [common, common[::-1], [common[2], common[0], common[3], common[1]]]
    runs = [
        paths_under_actions(model, ids, specs, "doc-f", 8, order, RolloutSettings(32, 4))
        for order in orders
    ]
    fields = ("x_token", "y_token", "tv_rollout", "tv_fixed", "x_eos", "y_eos")
    for other in runs[1:]:  # exactly invariant to the order of eos_ids
        for name, result in runs[0].items():
            for field in fields:
                assert np.array_equal(getattr(result, field), getattr(other[name], field)), field
    for name, r in runs[0].items():
        assert r.x_eos[:, -1].any() and r.y_eos[:, -1].any(), name
        # an EOS outcome is recorded as the smallest id; two ended sequences agree
        assert np.all(r.x_token[r.x_eos] == min(common))
        assert np.all(r.y_token[r.y_eos] == min(common))
        assert not np.any((r.x_token != r.y_token) & r.x_eos & r.y_eos)
    # the merged outcome is not the first id's alone: a run that knows only one id differs
    alone = paths_under_action(
        model, ids, RECENT_HALF, "doc-f", 8, common[:1], RolloutSettings(32, 4)
    )
    assert not np.array_equal(alone.x_eos, runs[0]["recent-half"].x_eos)


@pytest.fixture(scope="module")
def tiny_vocab_model():
    config = LlamaConfig(
        vocab_size=6,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0, 0.8 if name.startswith("lm_head") else 0.3)
    return model


def test_coupling_frequencies_match_exact_law(tiny_vocab_model):
    """(X_1, X_2, Y_2) over many replicates against the exact stepwise maximal coupling."""
    model = tiny_vocab_model
    ids = torch.randint(0, 6, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    action = {"name": "s", "selector": "snapkv", "budget": 24, "window": 16}
    n_rep = 6000
    r = paths_under_action(
        model, ids, action, "tiny", n_rep, [5], RolloutSettings(2, 3, max_batch_rows=3 * n_rep)
    )
    kept = kept_positions(model, ids, action)
    everything = kept_positions(model, ids, {"name": "f", "selector": "full"})
    p1 = reference_logits(model, ids, everything, [])[0].double().softmax(-1).numpy()
    exact = np.zeros((6, 6, 6))  # (x1, x2, y2); Y_1 = X_1 since δ_1 = 0
    tv2 = np.zeros(6)
    for x1 in range(6):
        p2 = reference_logits(model, ids, everything, [x1])[1].double().softmax(-1).numpy()
        q2 = reference_logits(model, ids, kept, [x1])[1].double().softmax(-1).numpy()
        if x1 == 5:  # EOS absorbing
            p2 = q2 = np.eye(6)[5]
        exact[x1] = p1[x1] * maximal_coupling_joint(p2, q2)
        tv2[x1] = 0.5 * np.abs(p2 - q2).sum()
    np.testing.assert_allclose(r.tv_rollout[:, 1], tv2[r.x_token[:, 0]], atol=1e-5)
    assert np.array_equal(r.x_token[:, 0], r.y_token[:, 0])
    counts = np.zeros((6, 6, 6))
    np.add.at(counts, (r.x_token[:, 0], r.x_token[:, 1], r.y_token[:, 1]), 1)
    expected = exact * n_rep
    cells = expected > 5
    assert counts[~cells].sum() <= max(5 * expected[~cells].sum(), 10)
    chi2 = ((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum()
    p_value = scipy.stats.chi2.sf(chi2, df=cells.sum() - 1)
    assert p_value > 1e-3, (chi2, cells.sum())
    mismatch = (r.x_token[:, 1] != r.y_token[:, 1]).mean()
    exact_mismatch = (p1 * tv2).sum()
    assert 0.05 < exact_mismatch < 0.95  # the test has power
    assert abs(mismatch - exact_mismatch) < 4 * np.sqrt(exact_mismatch / n_rep)


def test_trajectory_parquet_round_trip_and_malformed_file(demo, tmp_path):
    model, tok, _, eos = demo
    docs = [("d/0", PROMPT, 3), ("d/1", PROMPT[::-1], 2)]
    docs = [(doc_id, prompt, {SNAPKV_HALF["name"]: k}) for doc_id, prompt, k in docs]
    frame = trajectory_tables(model, tok, docs, [SNAPKV_HALF], eos, RolloutSettings(8, 1))[
        SNAPKV_HALF["name"]
    ]
    assert frame.height == (3 + 2) * 8
    assert frame.filter(pl.col("doc_id") == "d/1")["replicate"].unique().sort().to_list() == [0, 1]
    assert frame["t"].min() == 1 and frame["t"].max() == 8
    assert (frame["mismatch"] == (frame["x_token"] != frame["y_token"])).all()
    meta = {
        "model": "demo",
        "revision": None,
        "action": SNAPKV_HALF,
        "H": 8,
        "K": 3,
        "seed": 1,
        "coupling": "shared-reference",
        "dtype": "float32",
        "device": "cpu",
    }
    path = tmp_path / "t.parquet"
    write_trajectories(frame, path, meta)
    back = read_trajectories(path)
    assert back.equals(frame)
    assert read_trajectory_metadata(path)["action"] == SNAPKV_HALF
    write_trajectories(frame, path, meta)
    frame.drop("tv_fixed").write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(TrajectoryFormatError, match="tv_fixed"):
        read_trajectories(tmp_path / "bad.parquet")
    frame.with_columns(pl.col("mismatch").cast(pl.String)).write_parquet(tmp_path / "bad2.parquet")
    with pytest.raises(TrajectoryFormatError, match="mismatch"):
        read_trajectories(tmp_path / "bad2.parquet")
    assert trajectory_frame([]).height == 0


def test_prompt_cache_is_shared_not_copied(demo, monkeypatch):
    """Every row group attends to one (H_kv, n, d) prompt tensor; each row's cache holds only
    its ≤ H generated entries (gathered layout; the masked one:
    tests/engine/test_prompt_layouts.py)."""
    model, _, ids, eos = demo
    seen = []
    real = attention.shared_prefix_attention

    def spy(module, query, key, value, attention_mask, **kwargs):
        prefix = kwargs.get("kvd_prefix")
        if prefix is not None and module.layer_idx == 0:
            parts = zip(prefix.rows, prefix.prompts, strict=True)
            groups = [(rows.tolist(), prompt[0][0]) for rows, prompt in parts]
            seen.append((key.shape, groups))
        return real(module, query, key, value, attention_mask, **kwargs)

    # the instance's own mapping: kvpress, once imported, wraps every registered function there
    interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    previous = interface[attention.ATTENTION_NAME]
    interface[attention.ATTENTION_NAME] = spy
    try:
        pre = run_prefill(model, ids, 32)
        settings = RolloutSettings(6, 1, prompt_attention="gathered")
        paths_under_action(model, ids, SNAPKV_HALF, "doc-g", 7, eos, settings, prefill=pre)
    finally:
        interface[attention.ATTENTION_NAME] = previous
    n, n_kv = len(ids), model.config.num_key_value_heads
    assert len(seen) == 5  # one model call per decoding step for every row
    evicted_keys = seen[0][1][1][1]
    for step, (own, ((x_rows, x_prompt), (yz_rows, yz_prompt))) in enumerate(seen, start=1):
        assert 14 <= own[0] <= 21 and own[2] == step  # rows: X, Y, split Z; own entries only
        assert x_rows == list(range(7))  # X rows attend to the full prompt, Y and Z rows to
        assert yz_rows[:7] == list(range(7, 14)) and yz_rows[7:] == list(range(14, own[0]))
        assert x_prompt is pre.keys[0]  # the evicted one: one tensor each, never copied
        assert yz_prompt is evicted_keys and yz_prompt.shape == (n_kv, n // 2, pre.head_dim)


def test_attention_paths_agree(demo, monkeypatch):
    """The plain float32 path (used where no fused kernel is validated) and the fused CPU
    kernel give the same laws."""
    model, _, ids, eos = demo
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, s, 16, generator=gen) for s in (6, 50, 50))
    out, lse = math_attention(q, k, v, 0.25)
    scores = (q @ k.transpose(-1, -2)) * 0.25
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-6, rtol=1e-6)
    fused = paths_under_action(
        model, ids, SNAPKV_HALF, "doc-h", 3, eos, RolloutSettings(12, 1, keep_logits=True)
    )
    monkeypatch.setattr(kernel_reference, "MAX_SCORES", 4096)  # also exercise the query chunking
    plain = paths_under_action(
        model,
        ids,
        SNAPKV_HALF,
        "doc-h",
        3,
        eos,
        RolloutSettings(12, 1, keep_logits=True, fused_attention=False),
    )
    assert np.array_equal(fused.x_token, plain.x_token)  # same histories, so laws comparable
    assert np.array_equal(fused.y_token, plain.y_token)
    for name in ("p", "q", "q_fixed"):
        a = torch.from_numpy(fused.logits[name]).double().softmax(-1)
        b = torch.from_numpy(plain.logits[name]).double().softmax(-1)
        assert (a - b).abs().max() <= 1e-5


def test_documents_selection_and_errors(tmp_path):
    from kvdiverge.engine import select_documents

    fixture = Path(__file__).resolve().parents[1] / "data" / "documents" / "ruler-1024.parquet"
    docs = select_documents(fixture, {"dev": 2, "study1": 5})
    table = pl.read_parquet(fixture)
    assert [d[0] for d in docs] == sorted(
        table.filter(pl.col("cohort") == "dev")["doc_id"]
    ) + sorted(table.filter(pl.col("cohort") == "study1")["doc_id"])
    assert {d[2] for d in docs[:2]} == {2} and {d[2] for d in docs[2:]} == {5}
    table.drop("prompt").write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match="lacks column.s. prompt"):
        select_documents(tmp_path / "bad.parquet", {"dev": 1})
    with pytest.raises(ValueError, match="not a readable documents file"):
        select_documents(tmp_path / "missing.parquet", {"dev": 1})
    pl.concat([table, table.head(1)]).write_parquet(tmp_path / "dup.parquet")
    with pytest.raises(ValueError, match="not unique"):
        select_documents(tmp_path / "dup.parquet", {"dev": 1})


FIXTURE = Path(__file__).resolve().parents[1] / "data" / "documents" / "ruler-1024.parquet"
STUDY_ACTIONS = {
    "snapkv-512": {"name": "snapkv-512", "selector": "snapkv", "budget": 512},
    "snapkv-half": {"name": "snapkv-half", "selector": "snapkv", "budget": 0.5},
    "recent-half": {"name": "recent-half", "selector": "recent", "budget": 0.5},
    "full": {"name": "full", "selector": "full"},
}
STUDY_COHORTS = {
    name: {"dev": 2, "study1": 2 if name == "full" else 3} for name in STUDY_ACTIONS
}  # the control runs K_control = 2 replicates, the other actions K = 3


@pytest.mark.parametrize("coupling", ["shared-reference", "independent"])
def test_multi_action_job_files_equal_single_action_jobs(demo_path, tmp_path, coupling):
    """One job for all of a study's actions (one model load, one prefill per document, one
    model call per step for all rows) writes the same files as one job per action: the same rows
    and tokens, δ and f equal to float rounding (the model calls' batches differ); a rerun of the
    job reproduces its files bit for bit."""
    model = {"name": "demo", "path": str(demo_path)}
    settings = {"settings": RolloutSettings(8, 7, coupling=coupling), "device": "cpu"}
    multi = {name: tmp_path / "multi" / f"{name}.parquet" for name in STUDY_ACTIONS}
    run_stratum_rollout_job(FIXTURE, multi, model, STUDY_ACTIONS, STUDY_COHORTS, **settings)
    frames = {}
    for name, action in STUDY_ACTIONS.items():
        alone = tmp_path / "single" / f"{name}.parquet"
        run_stratum_rollout_job(
            FIXTURE, {name: alone}, model, {name: action}, {name: STUDY_COHORTS[name]}, **settings
        )
        frames[name] = read_trajectories(multi[name])
        single = read_trajectories(alone)
        laws = ["tv_rollout", "tv_fixed"]
        assert frames[name].drop(laws).equals(single.drop(laws)), name
        for law in laws:
            np.testing.assert_allclose(frames[name][law], single[law], atol=1e-5, err_msg=name)
        # timing holds measured wall-clock seconds, which differ between any two runs
        meta_multi, meta_alone = (
            read_trajectory_metadata(multi[name]),
            read_trajectory_metadata(alone),
        )
        assert meta_multi.pop("timing").keys() == meta_alone.pop("timing").keys()
        assert meta_multi == meta_alone
        assert frames[name].height == (2 * 2 + 3 * STUDY_COHORTS[name]["study1"]) * 8
    assert frames["snapkv-half"]["mismatch"].any()
    full = frames["full"]
    assert full["tv_rollout"].max() < 1e-5 and (full["x_token"] == full["y_token"]).all()
    check_full_retention_control([multi["full"]])  # the pipeline's control check passes
    shared = [
        frames[name].filter(pl.col("replicate") < 2).sort("doc_id", "replicate", "t")["x_token"]
        for name in STUDY_ACTIONS
    ]
    same_x = [s.equals(shared[0]) for s in shared[1:]]
    assert all(same_x) if coupling == "shared-reference" else not any(same_x)
    again = {name: tmp_path / "again" / f"{name}.parquet" for name in STUDY_ACTIONS}
    run_stratum_rollout_job(FIXTURE, again, model, STUDY_ACTIONS, STUDY_COHORTS, **settings)
    for name, path in again.items():
        assert read_trajectories(path).equals(frames[name]), name
    with pytest.raises(ValueError, match="actions.full: the spec is named 'recent-half'"):
        bad = {**STUDY_ACTIONS, "full": STUDY_ACTIONS["recent-half"]}
        run_stratum_rollout_job(FIXTURE, multi, model, bad, STUDY_COHORTS, **settings)
    with pytest.raises(ValueError, match="out_paths: expected one entry per action"):
        run_stratum_rollout_job(FIXTURE, {}, model, STUDY_ACTIONS, STUDY_COHORTS, **settings)


@pytest.fixture
def call_rows(monkeypatch) -> list[int]:
    """The batch rows of every decoding model call the engine makes, in order."""
    rows: list[int] = []
    real = rows_module.decode_step

    def spy(model, tokens, position, cache, shared):
        rows.append(tokens.shape[0])
        return real(model, tokens, position, cache, shared)

    monkeypatch.setattr(rows_module, "decode_step", spy)
    return rows


def test_reference_groups_and_batches_of_a_multi_action_document(demo, call_rows):
    """X rows run once per replicate set (the control, with fewer replicates, apart), in one
    model call per step with each evicting action's k Y rows and the Z rows of the
    replicates that have split; the full-retention control runs its own Y rows too."""
    model, _, ids, eos = demo
    specs = [parse_action(STUDY_ACTIONS[n]) for n in ("snapkv-half", "recent-half", "full")]
    reps = {"snapkv-half": np.arange(4), "recent-half": np.arange(4), "full": np.arange(2)}
    assert reference_groups(specs, reps, "shared-reference") == [
        (0, (0, 1, 2, 3), [0, 1]),
        (0, (0, 1), [2]),
    ]
    independent = reference_groups(specs, {n: np.arange(4) for n in reps}, "independent")
    assert [members for _, _, members in independent] == [[0], [1], [2]]
    assert len({salt for salt, _, _ in independent}) == 3

    counts = {name: len(r) for name, r in reps.items()}
    out = paths_under_actions(model, ids, specs, "doc-m", counts, eos, RolloutSettings(12, 3))

    def z_rows(r) -> np.ndarray:  # per decoding step: the Z rows of the split replicates
        return np.logical_or.accumulate(r.x_token != r.y_token, axis=1)[:, :11].sum(axis=0)

    z = z_rows(out["snapkv-half"]) + z_rows(out["recent-half"])
    assert z[0] == 0 and z[-1] > 0  # Z rows join as paths split
    # H − 1 = 11 decoding steps per group: X and both actions' Y rows, then the Z rows; the
    # control's X and its own Y rows (over the gathered full cache; no split, so no Z rows)
    assert np.array_equal(out["full"].x_token, out["full"].y_token)
    assert call_rows == (4 + 4 + 4 + z).tolist() + [2 + 2] * 11
    alone = paths_under_action(model, ids, specs[0], "doc-m", 4, eos, RolloutSettings(12, 3))
    for field in ("x_token", "y_token", "x_eos", "y_eos"):
        assert np.array_equal(getattr(out["snapkv-half"], field), getattr(alone, field))
    for field in ("tv_rollout", "tv_fixed"):  # another batch: equal to rounding
        np.testing.assert_allclose(
            getattr(out["snapkv-half"], field), getattr(alone, field), atol=1e-5
        )
    assert np.array_equal(out["full"].x_token, out["snapkv-half"].x_token[:2])
    with pytest.raises(ValueError, match="no replicate count for action.s. recent-half, full"):
        paths_under_actions(model, ids, specs, "d", {"snapkv-half": 1}, eos, RolloutSettings(4, 1))


def test_rollout_job_records_measured_timing_in_metadata(demo_path, tmp_path):
    """Each trajectory file carries the action's measured prefill, selection and decode
    seconds with its document and path counts (the cost model of sample-size planning)."""
    model = {"name": "demo", "path": str(demo_path)}
    actions = {name: STUDY_ACTIONS[name] for name in ("snapkv-half", "full")}
    cohorts = {name: STUDY_COHORTS[name] for name in actions}
    out = {name: tmp_path / f"{name}.parquet" for name in actions}
    frames = run_stratum_rollout_job(
        FIXTURE, out, model, actions, cohorts, RolloutSettings(4, 3), device="cpu"
    )
    timings = {name: read_trajectory_metadata(path)["timing"] for name, path in out.items()}
    for name, timing in timings.items():
        frame = frames[name]
        assert timing["documents"] == frame["doc_id"].n_unique()
        assert timing["paths"] == frame.select("doc_id", "replicate").unique().height
        assert timing["prefill_seconds"] > 0 and timing["decode_seconds"] > 0
        assert timing["selection_seconds"] >= 0
    # one prefill per document serves both actions: the same seconds charged to each
    assert timings["full"]["prefill_seconds"] == timings["snapkv-half"]["prefill_seconds"]
    # sample-size planning reads its per-document and per-replicate costs from these files
    cost = cost_from_timing([read_timing(out["snapkv-half"])])
    assert cost["c_doc"] > 0 and cost["c_rep"] > 0


def test_ended_rows_leave_the_batch(demo, call_rows):
    """Rows whose stream has emitted EOS leave the batch (a quarter of it at a time) without
    changing the rollouts: the same tokens and EOS flags as a run that keeps every row
    (``keep_logits``), δ and f equal to float rounding."""
    model, _, ids, _ = demo
    probe = paths_under_action(model, ids, FULL, "doc-e", 8, [0], RolloutSettings(16, 4))
    common = np.bincount(probe.x_token[:, 1:].ravel()).argsort()[::-1][:4].tolist()
    call_rows.clear()  # (the probe's calls)
    specs = [parse_action(RECENT_HALF), parse_action(SNAPKV_HALF)]
    dropping = paths_under_actions(model, ids, specs, "doc-e", 8, common, RolloutSettings(32, 4))
    kept = paths_under_actions(
        model, ids, specs, "doc-e", 8, common, RolloutSettings(32, 4, keep_logits=True)
    )
    for name in ("recent-half", "snapkv-half"):
        a, b = dropping[name], kept[name]
        assert a.x_eos[:, -1].any() and a.y_eos[:, -1].any()
        for field in ("x_token", "y_token", "x_eos", "y_eos"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), (name, field)
        for field in ("tv_rollout", "tv_fixed"):
            np.testing.assert_allclose(getattr(a, field), getattr(b, field), atol=1e-5)
    steps = dropping["recent-half"].x_eos.shape[1] - 1
    assert len(call_rows) == 2 * steps  # one call per decoding step in each run
    dropping_rows, keeping_rows = call_rows[:steps], call_rows[steps:]
    assert dropping_rows[0] == keeping_rows[0] == 8 * 3  # X and both actions' Y rows
    assert min(dropping_rows) < 8 * 3 and sum(dropping_rows) < sum(keeping_rows)
    assert min(keeping_rows) >= 8 * 3  # every row stays when the logits are kept
