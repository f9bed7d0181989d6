"""A catalogue of bad inputs and faults, as a user hits them: where each run stops, and its line.

Every case asserts the stage that stops it and its one-line message:

* config values, YAML files and cross-references: at parse time (kvdiverge.config), most cases
  through :func:`check_config` directly, a few through real ``snakemake -n`` runs that plan no
  job;
* models: at parse time for a local folder (kvdiverge.engine.preflight), the rest before the rollout
  job loads the model;
* documents: before the first rollout of a job (:func:`check_documents`);
* trajectory files: when read (kvdiverge.io.trajectories), and so before any estimand;
* faults: killed writes, a killed job's scratch area, where a failing script's traceback goes.

The catalogue continues in tests/eviction/test_bad_selectors.py (a user's selector that breaks its
output contract, raises or changes the shared prefill), tests/config/test_bad_names.py (names that
would leave output_dir or break a wildcard; YTE-templated config files) and
tests/io/test_bad_stored_files.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import yaml
from config_helpers import tiny_with_extra_model
from workflow_helpers import ROOT, planned_jobs, run_snakemake, workflow_copy

from kvdiverge.analysis.document_stats import AnalysisInputError, document_stats
from kvdiverge.analysis.synthetic import stratum_pairs, write_synthetic_study
from kvdiverge.config import ConfigError, check_config, load_yaml_strict
from kvdiverge.engine.preflight import (
    PreflightError,
    check_configured_models,
    check_documents,
    check_loaded_model,
    check_model_source,
    is_local_path,
)
from kvdiverge.io import JobScratch, atomic_path, clean_stale_temporaries
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
    write_trajectories,
)

SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
TINY = ROOT / "configs" / "tiny.yaml"
DEMO = ROOT / "data" / "models" / "tiny-llama"


def tiny() -> dict:
    return yaml.safe_load(TINY.read_text())


def one_line(info: pytest.ExceptionInfo) -> str:
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ---- config values and cross-references: stopped at parse time ---------------------------------
def _set(path: str, value):
    """A mutation of the config: set the dotted ``path`` (keys may hold dashes) to ``value``."""

    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return mutate


def _study(name: str, **spec):
    return lambda cfg: cfg["studies"].__setitem__(name, spec)


def _stratum(label: str, target: int):
    def mutate(cfg: dict) -> None:
        cfg["datasets"]["strata"] = [{"env": "ruler", "label": label, "target_tokens": target}]

    return mutate


CONFIG_CASES = {
    # kinds and ranges (strict: no coercion)
    "integer written as float": (
        _set("studies.study1.K_dev", 4.0),
        "config.studies.study1.K_dev: expected integer, got 4.0",
    ),
    "boolean for an integer": (
        _set("rollout.H", True),
        "config.rollout.H: expected integer, got True",
    ),
    "text for an integer": (
        _set("rollout.H", "32"),
        "config.rollout.H: expected integer, got '32'",
    ),
    "negative cohort size": (
        _set("datasets.cohorts.dev", -1),
        "config.datasets.cohorts.dev: expected a value >= 0, got -1",
    ),
    "zero budget": (
        _set("actions.snapkv-half.budget", 0),
        "config.actions.snapkv-half.budget: expected a value > 0, got 0",
    ),
    "fraction budget above 1": (
        _set("actions.snapkv-half.budget", 1.5),
        "config.actions.snapkv-half.budget: a float budget is a fraction of n in (0, 1]",
    ),
    "unknown selector": (
        _set("actions.snapkv-half.selector", "h2o"),
        "config.actions.snapkv-half.selector: expected one of full, quantize, recent, snapkv, "
        "got 'h2o'",
    ),
    "even SnapKV kernel": (
        _set("actions.snapkv-half.kernel", 4),
        "config.actions.snapkv-half.kernel: expected an odd integer >= 1, got 4",
    ),
    "unknown key": (_set("rollout.horizon", 8), "config.rollout: unknown key(s) 'horizon'"),
    "interval level of 1": (
        _set("analysis.level", 1.0),
        "config.analysis.level: expected a value < 1, got 1.0",
    ),
    "H below the generation reserve": (
        _set("rollout.H", 64),
        "config.datasets.generation_reserve: 32 leaves less room than the rollout.H = 64",
    ),
    "EOS without a third token": (
        _set("finite_state.n_tokens", 2),
        "config.finite_state.n_tokens: expected at least 3 when eos_prob > 0",
    ),
    "figure of a system that does not exist": (
        _set("finite_state.interval_figure_systems", [0, 25]),
        "config.finite_state.interval_figure_systems: expected system indices < n_systems (25)",
    ),
    # models
    "demo and source together": (
        _set("models.tiny-llama.source", {"gguf": "x.gguf"}),
        "config.models.tiny-llama: expected `demo` or `source`, not both",
    ),
    "demo model with another path": (
        _set("models.tiny-llama.path", "elsewhere"),
        "config.models.tiny-llama.path: a demo model is built into data/models/tiny-llama",
    ),
    "model without path, demo or source": (
        _set("models.extra", {"dtype": "float32"}),
        "config.models.extra: expected `path` (directory or hub id), `demo` or `source`",
    ),
    "empty model path": (
        _set("models.extra", {"path": ""}),
        "config.models.extra.path: ",
    ),
    "training settings on a loaded model": (
        _set("models.extra", {"path": "org/name", "train": {}}),
        "config.models.extra.train: only a `demo` model is trained",
    ),
    # studies: actions, control, cohorts
    "study names an unknown action": (
        _set("studies.study1.actions", ["snapkv-999", "full"]),
        "config.studies.study1.actions: 'snapkv-999' is not in config.actions",
    ),
    "control is no configured action": (
        _set("studies.study1.control", "keep-all"),
        "config.studies.study1.control: 'keep-all' is not in config.actions",
    ),
    "control outside the study's actions": (
        _set("studies.study1.actions", ["snapkv-half", "recent-half"]),
        "config.studies.study1.control: 'full' is not one of the study's actions",
    ),
    "control that evicts": (
        _set("studies.study1.control", "snapkv-half"),
        "config.studies.study1.control: 'snapkv-half' uses selector 'snapkv'",
    ),
    "study of the control alone": (
        _set("studies.study1.actions", ["full"]),
        "config.studies.study1.actions: expected at least one action besides the control 'full'",
    ),
    "study whose cohort does not exist": (
        _study("study3", actions=["snapkv-half", "full"]),
        "config.studies.study3 (its cohort is its name): no cohort 'study3' in "
        "config.datasets.cohorts (study1, study2)",
    ),
    "study evaluated on the dev cohort": (
        _set("studies.study1.cohort", "dev"),
        "config.studies.study1.cohort: 'dev' is the development cohort every study runs",
    ),
    "evaluation cohort of size 0": (
        _set("datasets.cohorts.study1", 0),
        "config.datasets.cohorts.study1: 0 documents per stratum, but study 'study1' evaluates",
    ),
    "development cohort of size 0": (
        _set("datasets.cohorts.dev", 0),
        "config.datasets.cohorts.dev: 0 documents per stratum, but study 'study1' plans",
    ),
    # analysis and figures
    "contrast with an unknown action": (
        _set("analysis.contrasts.study1", [["snapkv-512", "h2o"]]),
        "config.analysis.contrasts.study1[0]: expected [b, a], two different non-control actions",
    ),
    "contrast of an unknown study": (
        _set("analysis.contrasts.study9", [["a", "b"]]),
        "config.analysis.contrasts: no study named 'study9' (study1, study2)",
    ),
    "contrast naming the control": (
        _set("analysis.contrasts.study1", [["snapkv-512", "full"]]),
        "config.analysis.contrasts.study1[0]: expected [b, a]",
    ),
    "prediction pair with an unknown action": (
        _set("analysis.prediction.pairs.study1", ["snapkv-512", "snapkv-999"]),
        "config.analysis.prediction.pairs.study1: expected [b, a], two different non-control",
    ),
    "prediction pair of an unknown study": (
        _set("analysis.prediction.pairs.study9", ["snapkv-512", "snapkv-half"]),
        "config.analysis.prediction.pairs: no study named 'study9'",
    ),
    "one development document per stratum": (  # the plan needs two (so does prediction)
        lambda c: (_stratum("1024", 1024)(c), _set("datasets.cohorts.dev", 1)(c)),
        "config.datasets.cohorts.dev: 1 document per stratum, but study 'study1' plans its "
        "evaluation from the variance between development documents within a stratum",
    ),
    "figure contrast that is no contrast": (
        _set("figures.main_contrast.study1", ["snapkv-half", "snapkv-512"]),
        "config.figures.main_contrast.study1: expected one of the study's contrasts",
    ),
    "unknown family estimand": (
        _set("analysis.family_estimands", ["S_99", "S_98"]),
        "config.analysis.family_estimands: 'S_98' is not a per-action estimand",
    ),
    "length tokenizer that is no model": (
        _set("datasets.length_tokenizer", "gpt-9"),
        "config.datasets.length_tokenizer: expected the name of a configured model "
        "(tiny-llama, tiny-qwen), got 'gpt-9'",
    ),
    "no length tokenizer": (
        _set("datasets.length_tokenizer", None),
        "config.datasets.length_tokenizer: expected the name of a configured model",
    ),
    "H too small for the analysis clock": (
        _set("rollout.H", 2),
        "config.rollout.H: 2 is too short for the analysis clock: analysis.clock.window 0.125 "
        "(a fraction of H) makes 1 step, and window must lie in 1..branch_depth/2 = 0; "
        "expected rollout.H >= 4, or another analysis.clock.window",
    ),
    "H of one step": (
        _set("rollout.H", 1),
        "config.rollout.H: 1 is too short for the analysis clock: H must be at least 2",
    ),
    # budgets against the strata's prompt lengths
    "absolute budget above every prompt": (
        _stratum("512", 512),
        "config.actions.snapkv-512: in stratum ruler-512 (prompts of at most 480 tokens: "
        "target_tokens 512 - generation_reserve 32): budget 512 keeps every entry",
    ),
    "SnapKV window longer than the prompts": (
        _set("actions.snapkv-half.window", 1000),
        "config.actions.snapkv-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): prompt of 992 tokens is too short for "
        "the 1000-token observation window",
    ),
    "fraction budget that keeps nothing": (
        _set("actions.snapkv-half.budget", 0.0001),
        "config.actions.snapkv-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): budget 0.0001 keeps no entry",
    ),
    "sinks beyond the budget": (
        _set("actions.recent-half.sinks", 600),
        "config.actions.recent-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): budget keeps 496 entries of a 992-token "
        "prompt, fewer than the 600 sink positions",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_case_stops_at_parse_time_with_one_line(case):
    mutate, expected = CONFIG_CASES[case]
    cfg = tiny()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, SCHEMA)
    message = one_line(info)
    assert message.startswith(expected), f"{case}: {message}"


def test_shipped_configs_pass_every_check():
    for name in (
        "config.yaml",
        "configs/tiny.yaml",
        "configs/paper.yaml",
        "configs/cpu-study.yaml",
        "configs/cpu-study-greedy.yaml",
    ):
        cfg = load_yaml_strict(ROOT / name)
        check_config(cfg, SCHEMA, files=[ROOT / name])


YAML_CASES = {
    "duplicate key": (
        "rollout:\n  H: 32\n  coupling: independent\n  H: 16\n",
        "line 4: duplicate key 'H' (first at line 2); a YAML mapping takes each key once",
    ),
    "YAML 1.1 boolean": (
        "models:\n  m:\n    path: org/m\n    trust_remote_code: yes\n",
        "line 4: 'yes' is read as a boolean by YAML 1.1; write true or false",
    ),
    "YAML 1.1 octal": ("seed: 010\n", "line 1: '010' is read as the integer 8 by YAML 1.1"),
    "not YAML": ("rollout: [H: 3\n", ": not valid YAML ("),
}


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_config_file_is_read_strictly(case, tmp_path):
    text, expected = YAML_CASES[case]
    path = tmp_path / "override.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        check_config(tiny(), SCHEMA, files=[path])
    message = one_line(info)
    assert message.startswith(str(path)) and expected in message, message


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {H: 8, coupling: independent}\nrollout:\n  <<: *b\n  H: 16\n")
    assert load_yaml_strict(path)["rollout"] == {"H": 16, "coupling": "independent"}


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


# ---- trajectory files: caught when read ----------------------------------------------------------
H = 6


def _trajectories(docs=("ruler-1/dev/000", "ruler-1/study1/000"), k=None) -> pl.DataFrame:
    k = k or {"dev": 2, "study1": 3}
    rows = []
    for doc in docs:
        for rep in range(k[doc.split("/")[1]]):
            for t in range(1, H + 1):
                y = 7 if t >= 4 else 1
                rows.append(
                    {
                        "doc_id": doc,
                        "replicate": rep,
                        "t": t,
                        "x_token": 1,
                        "y_token": y,
                        "mismatch": y != 1,
                        "tv_rollout": 0.1 * t,
                        "tv_fixed": 0.05 * t,
                        "x_eos": t >= 5,
                        "y_eos": False,
                        "n_prompt": 100,
                        "n_kept": 50,
                    }
                )
    return pl.DataFrame(rows)


META = {
    "model": "m",
    "revision": None,
    "action": {"name": "snapkv-half"},
    "H": H,
    "K": {"dev": 2, "study1": 3},
    "seed": 1,
    "coupling": "shared-reference",
    "dtype": "float32",
    "device": "cpu",
    "n_documents": 2,
}
AT = "doc_id 'ruler-1/study1/000' replicate 1 step 3"


def _at_step(frame: pl.DataFrame, **change) -> pl.DataFrame:
    row = (
        (pl.col("doc_id") == "ruler-1/study1/000") & (pl.col("replicate") == 1) & (pl.col("t") == 3)
    )
    return frame.with_columns(
        [
            pl.when(row).then(pl.lit(v, dtype=frame[c].dtype)).otherwise(pl.col(c)).alias(c)
            for c, v in change.items()
        ]
    )


TRAJECTORY_CASES = {
    "NaN δ": (
        lambda f: _at_step(f, tv_rollout=float("nan")),
        {},
        f"{AT}: tv_rollout (δ) = nan, expected a finite value in [0, 1]",
    ),
    "δ above 1": (
        lambda f: _at_step(f, tv_rollout=1.5),
        {},
        f"{AT}: tv_rollout (δ) = 1.5, expected a finite value in [0, 1]",
    ),
    "negative f": (
        lambda f: _at_step(f, tv_fixed=-0.25),
        {},
        f"{AT}: tv_fixed (f) = -0.25, expected a finite value in [0, 1]",
    ),
    "infinite f": (
        lambda f: _at_step(f, tv_fixed=float("inf")),
        {},
        f"{AT}: tv_fixed (f) = inf, expected a finite value in [0, 1]",
    ),
    "mismatch flag contradicting the tokens": (
        lambda f: _at_step(f, mismatch=True),
        {},
        f"{AT}: mismatch = True contradicts x_token = 1, y_token = 1",
    ),
    "EOS flag cleared after EOS": (
        lambda f: f.with_columns(
            x_eos=pl.when((pl.col("replicate") == 1) & (pl.col("t") == 6))
            .then(False)
            .otherwise(pl.col("x_eos"))
        ),
        {},
        "doc_id 'ruler-1/dev/000' replicate 1 step 6: x_eos is false after EOS at step 5 "
        "(EOS flags stay true once set)",
    ),
    "cache larger than the prompt": (
        lambda f: _at_step(f, n_kept=101),
        {},
        f"{AT}: n_kept = 101, expected 1..n_prompt = 100",
    ),
    "missing step": (
        lambda f: f.filter(~((pl.col("doc_id") == "ruler-1/dev/000") & (pl.col("t") == 2))),
        {},
        "doc_id 'ruler-1/dev/000' replicate 0: 5 rows with steps 1..6, expected exactly one "
        "row for each t = 1..6",
    ),
    "repeated step": (
        lambda f: pl.concat([f, f.head(1)]),
        {},
        "doc_id 'ruler-1/dev/000' replicate 0: 7 rows with steps 1..6, expected exactly one "
        "row for each t = 1..6",
    ),
    "fewer replicates than the cohort's K": (
        lambda f: f.filter(
            ~((pl.col("doc_id") == "ruler-1/study1/000") & (pl.col("replicate") == 2))
        ),
        {},
        "doc_id 'ruler-1/study1/000': 2 replicates, expected 3 (metadata K[study1] = 3)",
    ),
    "replicates not numbered from 0": (
        lambda f: f.with_columns(replicate=pl.col("replicate") + 1),
        {},
        "doc_id 'ruler-1/dev/000': replicates 1..2 in 2 paths, expected replicates 0..1",
    ),
    "more documents than the metadata": (
        lambda f: f,
        {"n_documents": 1},
        "2 documents, but the metadata says n_documents = 1",
    ),
    "steps beyond the metadata's H": (
        lambda f: f,
        {"H": 5},
        "doc_id 'ruler-1/dev/000' replicate 0: 6 rows with steps 1..6, expected exactly one row "
        "for each t = 1..5",
    ),
    "null token": (
        lambda f: _at_step(f, y_token=None),
        {},
        "column 'y_token' has 1 null value(s)",
    ),
}


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("case", list(TRAJECTORY_CASES))
def test_trajectory_case_caught_when_read(case, lazy, tmp_path):
    change, meta, expected = TRAJECTORY_CASES[case]
    path = tmp_path / "snapkv-half.parquet"
    write_trajectories(_trajectories(), path, META)
    read_trajectories(path, lazy=lazy)  # the intact file passes
    write_trajectories(change(_trajectories()), path, {**META, **meta})
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path, lazy=lazy)
    assert one_line(info) == f"{path}: {expected}"


def test_unreadable_trajectory_file(tmp_path):
    path = tmp_path / "t.parquet"
    path.write_bytes(b"")  # what a killed writer without atomic writes would leave
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(path)
    assert one_line(info).startswith(f"{path}: not a readable trajectory file (")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    pairs = {"ruler-a": stratum_pairs(5, {"full": 0.0, "strong": 0.4})}
    cohorts = {"dev": (2, 3), "study1": (2, 3)}
    return write_synthetic_study(root, "study1", "m", pairs, cohorts, 8, 3, control="full")


def test_nan_delta_stops_the_analysis_before_any_estimand(synthetic, tmp_path):
    source = synthetic["strong"]["ruler-a"]
    frame = read_trajectories(source)
    bad = tmp_path / "strong.parquet"
    nan = frame.with_columns(
        tv_rollout=pl.when(pl.int_range(pl.len()) == 17).then(np.nan).otherwise("tv_rollout")
    )
    write_trajectories(nan, bad, read_trajectory_metadata(source))
    files = {"full": [synthetic["full"]["ruler-a"]], "strong": [bad]}
    with pytest.raises(AnalysisInputError) as info:
        document_stats(files, [synthetic["documents"]["ruler-a"]], control="full")
    row = frame.row(17, named=True)
    assert one_line(info) == (
        f"{bad}: doc_id {row['doc_id']!r} replicate {row['replicate']} step {row['t']}: "
        "tv_rollout (δ) = nan, expected a finite value in [0, 1]"
    )


# ---- faults: killed writes, killed jobs, logs --------------------------------------------------
def _python(code: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_sigkill_inside_an_atomic_write_leaves_a_temporary_that_the_next_job_removes(tmp_path):
    target = tmp_path / "out" / "table.csv"
    killed = _python(
        """
        import os, signal, sys
        from kvdiverge.io import atomic_path
        with atomic_path(sys.argv[1]) as tmp:
            tmp.write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
        """,
        str(target),
    )
    assert killed.returncode == -signal.SIGKILL
    left = list(target.parent.iterdir())
    assert not target.exists() and len(left) == 1 and left[0].name.startswith(".table.csv.")
    unrelated = target.parent / ".table.csv.notes"  # not a temporary's name: kept
    unrelated.write_text("x")
    assert clean_stale_temporaries([target]) == left
    assert sorted(p.name for p in target.parent.iterdir()) == [".table.csv.notes"]


def test_atomic_write_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", "")), replace(a, b)))
    target = tmp_path / "out.txt"
    with atomic_path(target) as tmp:
        tmp.write_text("data")
    assert [e[0] for e in events] == ["fsync", "rename", "fsync"]
    assert events[0][1].startswith(".out.txt.") and events[2][1] == tmp_path.name


JOB = """
import os, signal, sys
import polars as pl
from kvdiverge.io import JobScratch, atomic_path

out, kill_at = sys.argv[1], int(sys.argv[2])
docs = [f"ruler-1/dev/{i:03d}" for i in range(5)]
scratch = JobScratch({"a": out + ".a", "b": out + ".b"}, key={"H": 8, "seed": 1})
ran = []
for i, doc in enumerate(docs):
    if scratch.done(doc):
        continue
    if i == kill_at:  # killed in the middle of this document's save
        with atomic_path(scratch.root / "partial.parquet") as tmp:
            tmp.write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGKILL)
    frames = {a: pl.DataFrame({"doc_id": [doc] * 3, "x": [i * 10 + j for j in range(3)]})
              for a in ("a", "b")}
    scratch.save(doc, frames, info={"seconds": i})
    ran.append(doc)
saved = scratch.load_all()
for a in ("a", "b"):
    pl.concat([saved[d][0][a] for d in docs]).write_parquet(out + "." + a)
scratch.clear()
print(",".join(ran))
"""


def test_a_killed_job_resumes_from_its_scratch_area_with_identical_outputs(tmp_path):
    whole = _python(JOB, str(tmp_path / "whole"), "-1")
    assert whole.returncode == 0, whole.stderr
    killed = _python(JOB, str(tmp_path / "killed"), "3")
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "killed.a").exists()
    scratch = JobScratch(
        {"a": tmp_path / "killed.a", "b": tmp_path / "killed.b"}, {"H": 8, "seed": 1}
    )
    assert scratch.doc_ids() == [f"ruler-1/dev/{i:03d}" for i in range(3)]
    resumed = _python(JOB, str(tmp_path / "killed"), "-1")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.split() == ["ruler-1/dev/003,ruler-1/dev/004"]  # only the rest ran
    for a in ("a", "b"):
        assert (tmp_path / f"killed.{a}").read_bytes() == (tmp_path / f"whole.{a}").read_bytes()
    assert not scratch.root.exists()  # cleared once the outputs are written


def test_a_scratch_area_of_other_settings_is_never_resumed(tmp_path):
    outs = {"a": tmp_path / "t.parquet"}
    first = JobScratch(outs, key={"H": 8})
    first.save("d/1", {"a": pl.DataFrame({"x": [1]})})
    assert JobScratch(outs, key={"H": 8}).done("d/1")
    assert not JobScratch(outs, key={"H": 16}).done("d/1")  # changed settings: cleared
    assert JobScratch({"a": tmp_path / "u.parquet"}, key={"H": 16}).root != first.root


def test_a_failing_script_writes_its_traceback_to_its_log_and_one_line_to_the_console(tmp_path):
    log, out = tmp_path / "logs" / "job.log", tmp_path / "out.csv"
    stale = tmp_path / ".out.csv.abcd1234.csv"
    stale.write_text("")  # a zero-byte temporary of a killed earlier run
    res = _python(
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


# ---- real Snakemake runs: a few cases end to end -----------------------------------------------
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return workflow_copy(tmp_path_factory.mktemp("bad-inputs"))


DRY_RUN_CASES = {
    "duplicate key in a config file": (
        "rollout:\n  H: 32\n  H: 16\n",
        "override.yaml line 3: duplicate key 'H' (first at line 2); a YAML mapping takes each "
        "key once",
    ),
    "integer written as float": (
        {"studies": {"study1": {"K_dev": 4.0}}},
        "config.studies.study1.K_dev: expected integer, got 4.0",
    ),
    "study whose cohort does not exist": (
        {"studies": {"study3": {"actions": ["snapkv-half", "full"]}}},
        "config.studies.study3 (its cohort is its name): no cohort 'study3' in "
        "config.datasets.cohorts (study1, study2); set config.studies.study3.cohort",
    ),
    "prediction pair with an unknown action": (
        {"analysis": {"prediction": {"pairs": {"study2": ["recent-90", "snapkv-512"]}}}},
        "config.analysis.prediction.pairs.study2: expected [b, a], two different non-control "
        "actions of the study (snapkv-90, recent-90), got ['recent-90', 'snapkv-512']",
    ),
    "H too small for the analysis clock": (
        {"rollout": {"H": 2}},
        "config.rollout.H: 2 is too short for the analysis clock: analysis.clock.window 0.125 "
        "(a fraction of H) makes 1 step, and window must lie in 1..branch_depth/2 = 0; "
        "expected rollout.H >= 4, or another analysis.clock.window",
    ),
    "cohort of size 0": (
        {"datasets": {"cohorts": {"study2": 0}}},
        "config.datasets.cohorts.study2: 0 documents per stratum, but study 'study2' evaluates "
        "on cohort 'study2'; expected an integer >= 1",
    ),
    "missing local model folder": (  # a third model: study 2's family grows to 12
        {
            "models": {"extra": {"path": "/nonexistent/models/extra"}},
            "studies": {"study2": {"family_endpoints": 12, "bootstrap_draws": 24000}},
        },
        "config.models.extra.path: /nonexistent/models/extra does not exist (expected a model "
        "folder holding config.json, or a hub id 'org/name')",
    ),
}


@pytest.mark.parametrize("case", list(DRY_RUN_CASES))
def test_dry_run_stops_before_any_job_with_one_line(case, work, tmp_path):
    override, expected = DRY_RUN_CASES[case]
    path = tmp_path / "override.yaml"
    path.write_text(override if isinstance(override, str) else yaml.safe_dump(override))
    res = run_snakemake(work, "-n", "--configfile", str(path))
    text = res.stdout + res.stderr
    assert res.returncode != 0, text[-2000:]
    assert planned_jobs(res) == {}  # stopped at parse time: no job planned
    lines = [line.strip() for line in text.splitlines()]
    wanted = str(path.parent / expected) if expected.startswith("override.yaml") else expected
    assert wanted in lines, text[-2000:]
    assert "Repo id must be in the form" not in text


def test_failing_dataset_job_logs_its_traceback_and_points_the_console_at_it(work, tmp_path):
    """The dataset and analysis scripts used to leave their log empty (kvdiverge.pipeline.logs)."""
    path = tmp_path / "override.yaml"
    path.write_text(yaml.safe_dump({"datasets": {"helmet": {"data_dir": "nowhere"}}}))
    target = "results/documents/helmet-1024.parquet"
    res = run_snakemake(work, target, "--configfile", str(path), timeout=300)
    text = res.stdout + res.stderr
    assert res.returncode != 0
    log = work / "results" / "logs" / "datasets" / "materialize_documents" / "helmet-1024.log"
    lines = [line for line in text.splitlines() if line.startswith("materialize_documents: ")]
    assert len(lines) == 1 and "HELMET file not found: nowhere/kilt/" in lines[0], text[-3000:]
    assert lines[0].endswith(f"(traceback in {log.relative_to(work)})")
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "HELMET file not found" in logged
    assert not (work / target).exists()


def test_dry_run_of_the_intact_copy_plans_every_job(work):
    res = run_snakemake(work, "-n")
    assert res.returncode == 0, res.stderr[-2000:]
    assert planned_jobs(res)["rollout_study1"] == 12
