"""A model's folder has one reading (kvdiverge.config.models.model_path): the parse-time check
and the workflow's rules (workflow/rules/common.smk) both call it, so they cannot disagree on
where a model is or on the one line refusing it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdiverge.config import ConfigError, check_models, model_path

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "demo": {"demo": "llama"},
    "gguf": {"source": {"file": "x.gguf"}},
    "restated": {"demo": "qwen2", "path": "data/models/restated"},
    "local": {"path": "/models/smol"},
    "hub": {"path": "org/model"},
}
NO_FORM = "config.models.m: expected `path` (directory or hub id), `demo` or `source`"


@pytest.mark.parametrize(
    "name, folder",
    [
        ("demo", "data/models/demo"),
        ("gguf", "data/models/gguf"),
        ("restated", "data/models/restated"),
        ("local", "/models/smol"),
        ("hub", "org/model"),
    ],
)
def test_each_form_has_its_folder(name, folder):
    config = {"models": MODELS}
    check_models(config)
    assert model_path(config, name) == folder


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"demo": "llama", "source": {"file": "x.gguf"}},
            "config.models.m: expected `demo` or `source`, not both",
        ),
        (
            {"demo": "llama", "path": "elsewhere"},
            "config.models.m.path: a demo model is built into data/models/m, got 'elsewhere'",
        ),
        (
            {"source": {"file": "x.gguf"}, "path": "elsewhere"},
            "config.models.m.path: a sourced model is written into data/models/m, got 'elsewhere'",
        ),
        ({}, NO_FORM),
        ({"path": ""}, NO_FORM),
    ],
)
def test_the_check_and_the_folder_refuse_with_one_line(spec, message):
    config = {"models": {"m": spec}}
    for call in (lambda: check_models(config), lambda: model_path(config, "m")):
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == message


def test_train_only_for_a_demo_model_and_unknown_names():
    with pytest.raises(ConfigError) as info:
        check_models({"models": {"m": {"path": "org/m", "train": {"steps": 3}}}})
    assert str(info.value) == (
        "config.models.m.train: only a `demo` model is trained; remove `train`"
    )
    with pytest.raises(ConfigError) as info:
        model_path({"models": MODELS}, "other")
    assert str(info.value) == (
        "config.models: no model named 'other' (demo, gguf, restated, local, hub)"
    )


def test_the_rules_read_the_same_function():
    """common.smk's model_path delegates to kvdiverge.config.model_path and restates no rule."""
    common = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    body = common.split("def model_path(name):", 1)[1].split("\ndef ", 1)[0]
    assert "return configured_model_path(config, name)" in body
    assert "from kvdiverge.config import model_path as configured_model_path" in common
    assert "data/models" not in body.split('"""', 2)[-1]  # no second reading of the rule
