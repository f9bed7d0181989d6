"""Bad model folders and documents, stopped by the preflight checks (kvdiverge.engine.preflight)
with one line: a local model folder at parse time, the rest before the rollout job loads the
model; documents before the first rollout of a job (:func:`check_documents`), also in an SWRB
job."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest
from refusal_helpers import one_line, tiny_with_extra_model
from workflow_helpers import ROOT

from kvdiverge.engine.preflight import (
    PreflightError,
    check_configured_models,
    check_documents,
    check_loaded_model,
    check_model_folder,
    check_model_source,
    is_local_path,
)

DEMO = ROOT / "data" / "models" / "tiny-llama"


# ---- models: parse time for a local folder, else before the job loads it -----------------------
def _model_copy(tmp_path: Path, name: str = "model") -> Path:
    folder = tmp_path / "models" / name
    shutil.copytree(DEMO, folder)
    return folder


def _break_config_json(folder: Path) -> None:
    (folder / "config.json").write_text("{not json")


def _only_bin_weights(folder: Path) -> None:
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")


def _truncate_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])


def _garbage_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\xff" * 64)


def _no_chat_template(folder: Path) -> None:
    (folder / "chat_template.jinja").unlink()


def _short_context(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))


def _missing_shard(folder: Path) -> None:
    index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


MODEL_CASES = {
    "folder without config.json": (
        lambda f: (f / "config.json").unlink(),
        "config.json not found: {f} is not a model folder",
    ),
    "config.json that is not JSON": (_break_config_json, "config.json is not valid JSON"),
    "only PyTorch .bin weights": (
        _only_bin_weights,
        "no *.safetensors weights in {f} (only pytorch_model.bin: PyTorch pickles are not loaded)",
    ),
    "truncated weights file": (
        _truncate_weights,
        "model.safetensors is not a whole safetensors file (tensors need",
    ),
    "corrupt weights file": (
        _garbage_weights,
        "model.safetensors is not a whole safetensors file (header of",
    ),
    "no chat template": (_no_chat_template, "has no chat template"),
    "context window below the longest prompt plus H": (
        _short_context,
        "config.json gives a context window of 1024 positions, below the longest prompt plus H "
        "(the strata's target_tokens - generation_reserve + rollout.H) (2048 tokens)",
    ),
    "a shard of the index missing": (
        _missing_shard,
        "model-00002-of-00002.safetensors (listed in",
    ),
}


@pytest.mark.parametrize("case", list(MODEL_CASES))
def test_model_folder_case_stops_at_parse_time(case, tmp_path):
    folder = _model_copy(tmp_path)
    cfg = tiny_with_extra_model(folder)
    check_configured_models(cfg)  # the intact copy passes
    breaker, expected = MODEL_CASES[case]
    breaker(folder)
    with pytest.raises(PreflightError) as info:
        check_configured_models(cfg)
    message = one_line(info)
    assert message.startswith("config.models.extra.path: "), message
    assert expected.format(f=folder) in message, message


def test_missing_model_folder_names_the_field_not_the_hub(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    cfg = tiny_with_extra_model(missing)
    with pytest.raises(PreflightError) as info:
        check_configured_models(cfg)
    assert one_line(info) == (
        f"config.models.extra.path: {missing} does not exist (expected a model folder holding "
        "config.json, or a hub id 'org/name')"
    )


def test_hub_ids_and_built_models_are_left_to_the_job():
    cfg = tiny_with_extra_model("meta-llama/Llama-3.1-8B-Instruct")
    check_configured_models(cfg)  # a hub id: no parse-time look-up; demo folders skipped
    assert not is_local_path("meta-llama/Llama-3.1-8B-Instruct")
    assert is_local_path("data/extra/eos-ab") and is_local_path("./m") and is_local_path("/m")
    spec = {"path": "no-such-org/no-such-model-kvdiverge", "revision": None}
    assert check_model_source(spec, "config.models.x.path") is None  # not cached: after load


def test_rollout_job_model_checks(tmp_path):
    """What the rollout job calls: the folder before loading (here a sourced model's folder),
    the loaded model's template and window after loading a hub model."""
    folder = _model_copy(tmp_path)
    info = check_model_source({"path": str(folder)}, "config.models.m.path", 2048)
    assert info == {"max_positions": 32768}
    with pytest.raises(PreflightError) as err:
        check_model_source({"path": str(folder)}, "config.models.m.path", 40000)
    assert one_line(err).endswith(
        "gives a context window of 32768 positions, below the longest prompt plus H (40000 tokens)"
    )

    class Tokenizer:
        chat_template = None

    class Model:
        config = {"max_position_embeddings": 4096}

    with pytest.raises(PreflightError) as err:
        check_loaded_model(Model(), Tokenizer(), "config.models.hub.path")
    assert one_line(err) == "config.models.hub.path: the tokenizer has no chat template"
    Tokenizer.chat_template = "{{ x }}"
    with pytest.raises(PreflightError) as err:
        check_loaded_model(Model(), Tokenizer(), "config.models.hub.path", 8192)
    assert "context window of 4096 positions is below" in one_line(err)
    assert check_loaded_model(Model(), Tokenizer(), "config.models.hub.path", 4096) == 4096


# ---- documents: before the first rollout of a job ------------------------------------------------
ACTIONS = {
    "full": {"selector": "full"},
    "snapkv-half": {"selector": "snapkv", "budget": 0.5, "window": 64},
    "recent-half": {"selector": "recent", "budget": 0.5, "sinks": 4},
}


def _documents(**change) -> pl.DataFrame:
    frame = pl.DataFrame(
        {
            "doc_id": ["ruler-1024/dev/000", "ruler-1024/dev/001", "ruler-1024/study1/000"],
            "stratum": ["ruler-1024"] * 3,
            "cohort": ["dev", "dev", "study1"],
            "prompt": ["word " * 300] * 3,
            "n_tokens": [300, 300, 300],
        }
    )
    for column, value in change.items():
        frame = frame.with_columns(
            pl.when(pl.col("doc_id") == "ruler-1024/dev/001")
            .then(pl.lit(value, dtype=frame[column].dtype))
            .otherwise(pl.col(column))
            .alias(column)
        )
    return frame


DOC = "docs.parquet: doc_id 'ruler-1024/dev/001' (stratum ruler-1024)"


DOCUMENT_CASES = {
    "empty prompt": (dict(prompt="   "), {}, f"{DOC}: prompt is empty"),
    "missing prompt": (dict(prompt=None), {}, f"{DOC}: prompt is missing (null)"),
    "prompt of no tokens": (
        dict(n_tokens=0),
        {},
        f"{DOC}: prompt length n = 0, expected at least 1 token",
    ),
    "prompt shorter than the SnapKV window": (
        dict(n_tokens=60),
        {},
        f"{DOC}, action 'snapkv-half': prompt of 60 tokens is too short for the 64-token "
        "observation window; a window of at most 30 tokens fits every prompt of the job: e.g. "
        "window: 16 in config.actions.snapkv-half",
    ),
    "budget below the window for a short prompt": (
        dict(n_tokens=100),
        {},
        f"{DOC}, action 'snapkv-half': budget keeps 50 entries of a 100-token prompt, fewer "
        "than the 64-token observation window; a window of at most 50 tokens fits every prompt "
        "of the job: e.g. window: 32 in config.actions.snapkv-half",
    ),
    "prompt plus H beyond the context window": (
        dict(n_tokens=4000),
        {"max_positions": 4096, "H": 128},
        f"{DOC}: prompt of 4000 tokens plus H = 128 generated tokens exceeds the model's "
        "context window of 4096 positions",
    ),
    "duplicate doc_id": (
        dict(doc_id="ruler-1024/dev/000"),
        {},
        "docs.parquet: doc_id 'ruler-1024/dev/000' appears more than once",
    ),
    "no documents of the job's cohorts": (
        {},
        {"cohorts": ["study2"]},
        "docs.parquet: no documents of the job's cohort(s) ['study2']",
    ),
}


@pytest.mark.parametrize("case", list(DOCUMENT_CASES))
def test_document_case_stops_before_the_first_rollout(case):
    change, options, expected = DOCUMENT_CASES[case]
    kwargs = {"max_positions": 32768, "H": 32, **options}
    frame = _documents(**change)
    with pytest.raises(PreflightError) as info:
        check_documents(frame, ACTIONS, where="docs.parquet", **kwargs)
    assert one_line(info) == expected


def test_documents_checked_with_the_job_models_lengths():
    frame = _documents().drop("n_tokens")
    with pytest.raises(PreflightError) as info:
        check_documents(frame, ACTIONS, 32768, 32, "docs.parquet")
    assert one_line(info) == "docs.parquet: documents table lacks column(s) n_tokens"
    checked = check_documents(
        frame, ACTIONS, 32768, 32, "docs.parquet", length_fn=len, cohorts=["dev"]
    )
    assert checked["n_tokens"].to_list() == [1500, 1500] and set(checked["cohort"]) == {"dev"}


def test_a_too_short_window_refusal_gives_a_window_that_fits_every_prompt():
    """The fix is taken over every prompt of the job (a later one shorter than the refused
    one), and the window it suggests passes the same check."""
    frame = _documents().with_columns(n_tokens=pl.Series([100, 300, 70]))
    with pytest.raises(PreflightError) as info:
        check_documents(frame, ACTIONS, 32768, 32, "docs.parquet")
    assert one_line(info) == (
        "docs.parquet: doc_id 'ruler-1024/dev/000' (stratum ruler-1024), action 'snapkv-half': "
        "budget keeps 50 entries of a 100-token prompt, fewer than the 64-token observation "
        "window; a window of at most 35 tokens fits every prompt of the job: e.g. window: 32 in "
        "config.actions.snapkv-half"
    )
    fixed = {**ACTIONS, "snapkv-half": {**ACTIONS["snapkv-half"], "window": 32}}
    assert check_documents(frame, fixed, 32768, 32, "docs.parquet").height == 3
    with pytest.raises(PreflightError) as info:  # compare spells its own fix
        check_documents(frame, ACTIONS, 32768, 32, "docs.parquet", actions_field=None)
    assert one_line(info).endswith("fewer than the 64-token observation window")


def test_swrb_job_checks_its_documents_before_any_rollout(tmp_path):
    """An SWRB job (coupling: swrb) checks its documents as a trajectory rollout job does:
    one line naming the document, before the model loads and before any scratch area."""
    from kvdiverge.engine.swrb_job import run_swrb_job

    path = tmp_path / "docs.parquet"
    _documents(prompt="word " * 20).write_parquet(path)
    out = {"snapkv-half": tmp_path / "snapkv-half.parquet"}
    with pytest.raises(PreflightError) as info:
        run_swrb_job(
            path,
            out,
            {"name": "tiny-llama", "path": str(DEMO)},
            {"snapkv-half": ACTIONS["snapkv-half"]},
            {"snapkv-half": {"dev": 2}},
            H=8,
            seed=1,
            device="cpu",
        )
    message = one_line(info)
    assert message.startswith(
        f"{path}: doc_id 'ruler-1024/dev/001' (stratum ruler-1024), action 'snapkv-half': "
        "prompt of "
    ), message
    assert "too short for the 64-token observation window; a window of at most" in message
    assert message.endswith("in config.actions.snapkv-half"), message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.parquet"]


# ---- the smaller cases ----------------------------------------------------------------------
def test_config_vocab_size_that_disagrees_with_the_weights(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(DEMO, folder)
    config = json.loads((folder / "config.json").read_text())
    rows = config["vocab_size"]
    check_model_folder(folder, "config.models.m.path")  # the demo model's own config passes
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": rows + 88}))
    expected = (
        f"{folder / 'config.json'} says vocab_size = {rows + 88}, but "
        f"{folder / 'model.safetensors'} holds lm_head.weight with {rows} rows (one per "
        "token): the config does not belong to these weights"
    )
    with pytest.raises(PreflightError) as info:
        check_model_folder(folder, "config.models.m.path")
    assert one_line(info) == f"config.models.m.path: {expected}"
    # at the workflow's parse, for a model configured from a local folder
    with pytest.raises(PreflightError) as info:
        check_configured_models(tiny_with_extra_model(folder))
    assert one_line(info) == f"config.models.extra.path: {expected}"
