"""Task metrics against hand-computed values, and the accuracy table on a synthetic trajectory
set whose every number is worked out by hand below."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from kvdiverge.analysis.accuracy import (
    ACCURACY_CAVEATS,
    ACCURACY_ESTIMANDS,
    accuracy_document_stats,
    accuracy_table,
    document_metrics,
    generated_text,
    path_scores,
    write_accuracy,
)
from kvdiverge.analysis.bootstrap import stratified_bootstrap_weights
from kvdiverge.analysis.document_stats import AnalysisInputError
from kvdiverge.datasets.scoring import METRICS, normalize_answer, score
from kvdiverge.tables import accuracy_study_table, read_estimands, render_html

# ---- metrics -----------------------------------------------------------------------------------


def test_normalize_answer_is_squads():
    assert normalize_answer("The  Eiffel-Tower, in PARIS!") == "eiffeltower in paris"
    assert normalize_answer("an apple a day") == "apple day"


@pytest.mark.parametrize(
    "metric,output,answers,expected",
    [
        # RULER: fraction of gold strings found, case-insensitive; control characters → breaks
        ("string_match_all", "The numbers are 1234567 and 7654321.", ["1234567", "7654321"], 1.0),
        ("string_match_all", "It is 1234567.", ["1234567", "7654321", "1111111"], 1 / 3),
        ("string_match_all", "ALPHA beta", ["alpha", "Beta", "gamma", "delta"], 0.5),
        ("string_match_all", "12\x0034567", ["1234567"], 0.0),
        ("string_match_part", "Paris, of course", ["London", "paris"], 1.0),
        ("string_match_part", "Rome", ["London", "Paris"], 0.0),
        # HELMET RAG: normalized substring, any answer
        ("substring_exact_match", "Answer: the Eiffel-Tower.", ["Eiffel Tower", "x"], 0.0),
        ("substring_exact_match", "Answer: The Eiffel tower!", ["eiffel tower"], 1.0),
        ("substring_exact_match", "an apple", ["The Apple"], 1.0),
        # ASQA: fraction of short answers found after normalization
        ("str_em", "It was 1912 in Belfast.", ["1912", "belfast", "Southampton", "a"], 2 / 3),
        # QAMPARI: comma-separated predictions, exact after normalization, top-5 recall
        (
            "qampari_rec_top5",
            "Rome, Paris , the Berlin, Oslo.",
            ["paris", "Berlin", "Madrid"],
            2 / 3,
        ),
        ("qampari_rec_top5", "a1, a2, a3, a4, a5, a6", [f"A{i}" for i in range(1, 8)], 1.0),
        ("qampari_rec_top5", "a1, a2, a3", [f"A{i}" for i in range(1, 8)], 3 / 5),
        ("qampari_rec_top5", "Paris and Rome", ["Paris", "Rome"], 0.0),
        # custom default: any answer, case-insensitive raw substring
        ("substring_match", "The code is C-17.", ["c-17"], 1.0),
        ("substring_match", "The code is C17.", ["c-17"], 0.0),
    ],
)
def test_metrics_against_hand_computed_values(metric, output, answers, expected):
    assert score(metric, output, answers) == pytest.approx(expected, abs=1e-15)


def test_score_errors_are_one_line():
    with pytest.raises(ValueError, match=r"^metric: expected one of .*got 'bleu'$"):
        score("bleu", "x", ["x"])
    with pytest.raises(ValueError, match=r"^answers: expected at least one"):
        score("substring_match", "x", [])
    assert set(METRICS) >= {"string_match_all", "substring_exact_match", "substring_match"}


# ---- the synthetic trajectory set --------------------------------------------------------------


class WordTokenizer:
    """Token i decodes to WORDS[i]; 9 is EOS (a special token, dropped by decode)."""

    WORDS = {1: "alpha", 2: "beta", 3: "gamma", 9: "<eos>"}

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.WORDS[i] for i in ids if not (skip_special_tokens and i == 9))


H, DEPTH = 4, 2

# (doc_id, replicate): (X tokens, Y tokens); EOS flags follow the first 9
PATHS = {
    ("A", 0): ([1, 2, 2, 2], [1, 2, 2, 2]),  # never diverges: both 1
    ("A", 1): ([1, 3, 3, 3], [2, 3, 3, 3]),  # τ = 1, early: X 1, Y 0
    ("B", 0): ([3, 2, 9, 9], [3, 9, 2, 2]),  # τ = 2, early: X "gamma beta" 1, Y "gamma" 0.5
    ("B", 1): ([3, 2, 2, 2], [3, 2, 2, 3]),  # τ = 4, late: X 1, Y 1
}


def _eos(tokens):
    return np.cumsum(np.asarray(tokens) == 9) > 0


def _trajectories(paths=PATHS) -> pl.DataFrame:
    rows = []
    for (doc, rep), (x, y) in paths.items():
        for t in range(H):
            rows.append(
                {
                    "doc_id": doc,
                    "replicate": rep,
                    "t": t + 1,
                    "x_token": x[t],
                    "y_token": y[t],
                    "mismatch": x[t] != y[t],
                    "x_eos": bool(_eos(x)[t]),
                    "y_eos": bool(_eos(y)[t]),
                }
            )
    return pl.DataFrame(rows)


DOCUMENTS = pl.DataFrame(
    {
        "doc_id": ["A", "B"],
        "stratum": ["s", "s"],
        "cohort": ["study1", "study1"],
        "task": ["single", "multi"],
        "answers": [["alpha"], ["gamma", "beta"]],
    }
)


def _documents() -> pl.DataFrame:
    return document_metrics(DOCUMENTS, lambda stratum, task: "string_match_all")


def test_generated_text_stops_at_eos():
    tok = WordTokenizer()
    assert generated_text(tok, [3, 9, 2, 2], _eos([3, 9, 2, 2])) == "gamma"
    assert generated_text(tok, [3, 2, 2, 3], _eos([3, 2, 2, 3])) == "gamma beta beta gamma"
    assert generated_text(tok, [9, 9, 9, 9], _eos([9, 9, 9, 9])) == ""


def test_path_scores_by_hand():
    out = path_scores(_trajectories(), _documents(), WordTokenizer(), DEPTH)
    assert out["timing"].to_list() == [2, 0, 0, 1]  # never, early, early, late
    assert out["acc_x"].to_list() == [1.0, 1.0, 1.0, 1.0]
    assert out["acc_y"].to_list() == [1.0, 0.0, 0.5, 1.0]
    assert out["y_text"][2] == "gamma" and out["x_text"][2] == "gamma beta"


def _stats() -> pl.DataFrame:
    traj = _trajectories()
    return accuracy_document_stats({"a": [traj], "b": [traj]}, _documents(), WordTokenizer(), DEPTH)


def test_document_stats_by_hand():
    stats = _stats().filter(pl.col("action") == "a")
    a, b = stats.row(0, named=True), stats.row(1, named=True)
    assert (a["acc_x"], a["acc_y"], b["acc_x"], b["acc_y"]) == (1.0, 0.5, 1.0, 0.75)
    assert (a["share@early"], a["share@late"], a["share@never"]) == (0.5, 0.0, 0.5)
    assert (b["share@early"], b["share@late"], b["share@never"]) == (0.5, 0.5, 0.0)
    assert (a["acc_y@early"], a["acc_y@never"], b["acc_y@early"], b["acc_y@late"]) == (
        0.0,
        0.5,
        0.25,
        0.5,
    )
    assert a["n_paths"] == b["n_paths"] == 2


def test_accuracy_table_exact_values(tmp_path):
    table = accuracy_table(_stats(), model="m", actions=["a", "b"], draws=200, seed=7)
    pooled = table.filter((pl.col("stratum") == "pooled") & (pl.col("action") == "a"))
    value = dict(zip(pooled["estimand"], pooled["value"], strict=True))
    assert set(value) == set(ACCURACY_ESTIMANDS)
    expected = {
        "accuracy_x": 1.0,
        "accuracy_y": 0.625,  # (0.5 + 0.75) / 2
        "accuracy_drop": 0.375,
        "share@early": 0.5,
        "share@late": 0.25,
        "share@never": 0.25,
        "accuracy_x@early": 1.0,  # ((0.5 + 0.5) / 2) / 0.5
        "accuracy_y@early": 0.25,  # ((0 + 0.25) / 2) / 0.5
        "accuracy_drop@early": 0.75,
        "accuracy_x@late": 1.0,
        "accuracy_y@late": 1.0,  # ((0 + 0.5) / 2) / 0.25
        "accuracy_drop@late": 0.0,
        "accuracy_x@never": 1.0,
        "accuracy_y@never": 1.0,
        "accuracy_drop@never": 0.0,
    }
    assert value == pytest.approx(expected, abs=1e-15)
    row = {r["estimand"]: r for r in pooled.iter_rows(named=True)}
    assert row["accuracy_x"]["ci_low"] == row["accuracy_x"]["ci_high"] == 1.0
    assert row["accuracy_x"]["n_docs"] == 2 and row["accuracy_x"]["n_paths"] == 4
    # the late-share draws that resample only document A have no late path: undefined, dropped
    w = stratified_bootstrap_weights(np.array(["s", "s"]), 200, np.random.SeedSequence(7))
    assert row["accuracy_y@late"]["draws_dropped"] == int((w[:, 1] == 0).sum()) > 0
    assert row["accuracy_y"]["draws_dropped"] == 0
    # the drop's interval from the paired draws: document drops are 0.5 (A) and 0.25 (B)
    draws = (w @ np.array([0.5, 0.25])) / 2
    lo, hi = np.quantile(draws, [0.025, 0.975])
    assert (row["accuracy_drop"]["ci_low"], row["accuracy_drop"]["ci_high"]) == pytest.approx(
        (lo, hi), abs=1e-12
    )
    # identical trajectories give identical rows for both actions; one stratum: pooled = s
    b = table.filter((pl.col("stratum") == "pooled") & (pl.col("action") == "b"))
    assert b["value"].to_list() == pooled["value"].to_list()
    s = table.filter((pl.col("stratum") == "s") & (pl.col("action") == "a"))
    assert s["value"].to_list() == pooled["value"].to_list()
    # the CSV reads as an estimands table and renders the accuracy table
    write_accuracy(table, tmp_path / "accuracy.csv")
    again = read_estimands(tmp_path / "accuracy.csv")
    built = accuracy_study_table(again, ["a", "b"])
    assert built.data["accuracy_drop"].to_list() == [0.375, 0.375]
    assert "drop | early" in render_html(built)
    # the two caveats: drop | late small by construction; τ depends on the coupling
    assert built.notes[-2:] == ACCURACY_CAVEATS
    assert "association" in render_html(built) and "by construction" in render_html(built)


def test_accuracy_errors_are_one_line():
    traj = _trajectories()
    with pytest.raises(AnalysisInputError, match="missing column"):
        accuracy_document_stats({"a": [traj]}, DOCUMENTS, WordTokenizer(), DEPTH)
    odd = _documents().with_columns(metric=pl.lit("bleu"))
    with pytest.raises(AnalysisInputError, match="unknown metric"):
        accuracy_document_stats({"a": [traj]}, odd, WordTokenizer(), DEPTH)
    stats = accuracy_document_stats(
        {"a": [traj], "b": [traj.filter(pl.col("doc_id") == "A")]},
        _documents(),
        WordTokenizer(),
        DEPTH,
    )
    with pytest.raises(AnalysisInputError, match="'b' covers other documents"):
        accuracy_table(stats, model="m", actions=["a", "b"], draws=10)
    with pytest.raises(AnalysisInputError, match="action 'c' has no rows"):
        accuracy_table(stats, model="m", actions=["a", "c"], draws=10)


def test_accuracy_figure_in_house_style(tmp_path):
    import matplotlib.pyplot as plt

    from kvdiverge.plots.accuracy import plot_accuracy, write_accuracy_figure
    from kvdiverge.plots.base import MIN_FONT_PT, TEXT_WIDTH, smallest_font

    table = accuracy_table(_stats(), model="m", actions=["a", "b"], draws=50, seed=1)
    fig = plot_accuracy(table, ["a", "b"])
    assert fig.get_size_inches()[0] == TEXT_WIDTH
    assert smallest_font(fig) >= MIN_FONT_PT
    ticks = [t.get_text() for t in fig.axes[1].get_xticklabels()]
    assert ticks == ["early\n(50% of paths)", "late\n(25% of paths)", "never\n(25% of paths)"]
    plt.close(fig)
    write_accuracy(table, tmp_path / "accuracy.csv")
    write_accuracy_figure(tmp_path / "accuracy.csv", tmp_path / "a.png", tmp_path / "a.pdf")
    assert (tmp_path / "a.png").stat().st_size > 0 and (tmp_path / "a.pdf").stat().st_size > 0


@pytest.mark.parametrize(
    "model", ["tiny-llama", "tiny-qwen", pytest.param("smollm2", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("clean_up", [None, True])
def test_file_decoder_equals_the_tokenizers_decode(tmp_path, model, clean_up, request):
    """The accuracy rule decodes without transformers where it may; the text is the same.
    SmolLM2 comes from the session's materialization (tests/conftest.py, ``smollm2_folder``)."""
    import json
    import shutil
    from pathlib import Path

    from kvdiverge.models import load_tokenizer
    from kvdiverge.models.detokenize import TokenizerFileDecoder, load_decoder

    if model == "smollm2":
        source = request.getfixturevalue("smollm2_folder")[0]
    else:
        source = Path(__file__).resolve().parents[2] / "data" / "models" / model
    folder = tmp_path / model
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, folder / name)
    if clean_up is not None:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["clean_up_tokenization_spaces"] = clean_up
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    decoder, reference = load_decoder(folder), load_tokenizer(str(folder))
    assert isinstance(decoder, TokenizerFileDecoder)
    rng = np.random.default_rng(5)
    text = "Well , isn 't it ? Yes . It 's 4438540 ! They 're here , we 've seen ' em ."
    sequences = [reference(text, add_special_tokens=False)["input_ids"]]
    sequences += [list(reng) for reng in rng.integers(0, len(reference), size=(200, 24))]
    sequences += [[reference.eos_token_id, *sequences[0], reference.eos_token_id]]
    for ids in sequences:
        ids = [int(i) for i in ids]
        expected = reference.decode(ids, skip_special_tokens=True)
        assert decoder.decode(ids, skip_special_tokens=True) == expected, ids


def _zero_stats() -> pl.DataFrame:
    """The paths of :data:`PATHS` against answers no generation contains: every score 0."""
    docs = DOCUMENTS.with_columns(answers=pl.Series([["omega"], ["omega", "delta"]]))
    metrics = document_metrics(docs, lambda stratum, task: "string_match_all")
    traj = _trajectories()
    return accuracy_document_stats({"a": [traj], "b": [traj]}, metrics, WordTokenizer(), DEPTH)


def _drawn_points(ax) -> int:
    """How many estimates a panel draws (one errorbar container each)."""
    return len(ax.containers)


def test_accuracy_figure_and_table_say_so_when_nothing_is_answered(tmp_path):
    """Item 8 of issue 31: a model none of whose generations answers correctly (every
    accuracy 0) gets a note in both panels and in the table instead of a plot of zeros."""
    import matplotlib.pyplot as plt

    from kvdiverge.plots.accuracy import plot_accuracy
    from kvdiverge.tables.accuracy import nothing_answered, nothing_answered_note

    zero = accuracy_table(_zero_stats(), model="m", actions=["a", "b"], draws=50, seed=1)
    assert nothing_answered(zero, "m")
    fig = plot_accuracy(zero, ["a", "b"])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("no generation answers" in t for t in texts)
    assert any("nothing to compare by divergence timing" in t for t in texts)
    assert all(_drawn_points(ax) == 0 for ax in fig.axes)  # no zeros plotted
    assert not fig.legends  # nothing drawn, nothing to key
    plt.close(fig)
    built = accuracy_study_table(zero, ["a", "b"])
    assert built.notes[0] == nothing_answered_note("m")
    assert "no generation answers correctly" in render_html(built)

    # some accuracy above 0: the points are drawn and no note is shown
    some = accuracy_table(_stats(), model="m", actions=["a", "b"], draws=50, seed=1)
    assert not nothing_answered(some, "m")
    fig = plot_accuracy(some, ["a", "b"])
    assert _drawn_points(fig.axes[0]) == 2 and _drawn_points(fig.axes[1]) > 0
    assert not any("no generation" in t.get_text() for ax in fig.axes for t in ax.texts)
    assert fig.legends
    plt.close(fig)
    assert not any("no generation" in n for n in accuracy_study_table(some, ["a", "b"]).notes)

    # two models, one answering nothing: the note on its row only, the other's points drawn
    both = pl.concat([zero.with_columns(model=pl.lit("mute")), some])
    fig = plot_accuracy(both, ["a", "b"])
    mute, m = fig.axes[:2], fig.axes[2:4]
    assert all(_drawn_points(ax) == 0 for ax in mute) and _drawn_points(m[0]) == 2
    assert any("mute: no generation" in t.get_text() for t in mute[1].texts)
    assert fig.legends
    plt.close(fig)
    notes = accuracy_study_table(both, ["a", "b"]).notes
    assert nothing_answered_note("mute") in notes and nothing_answered_note("m") not in notes
