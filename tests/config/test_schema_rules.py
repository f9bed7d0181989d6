"""The schema says what the code does (kvdiverge.config.schema; workflow/schemas/
config.schema.yaml): ``K_dev`` 1 only at ``rollout.temperature`` 0, refused by the schema file
itself as any JSON-schema validator reads it, and by the run's parse-time check in the same
cases with the same line; and the schema's and config.yaml's text put the logs and documents
where the rules write them (under ``output_dir``; the dry run of another ``output_dir`` in
tests/workflow/test_pipeline_configs.py shows every planned path there)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml

from kvdiverge.config import ConfigError, check_config, load_schema, validate_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"
K_DEV_REFUSED = (
    "config.studies.study1.K_dev: expected a value >= 2, got 1 (the plan needs the "
    "within-document variance; 1 only at rollout.temperature 0)"
)
ABSENT = object()
"""``rollout.temperature`` not written (the schema's default, 1)."""


def _config(temperature, K_dev: int) -> dict:
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["rollout"].pop("temperature", None)
    if temperature is not ABSENT:
        config["rollout"]["temperature"] = temperature
    config["studies"]["study1"]["K_dev"] = K_dev
    return config


def _plain_schema_errors(config: dict) -> list[str]:
    """The schema file's own verdict, by jsonschema's stock 2020-12 validator (no defaults
    filled, no project code): the fields it refuses."""
    validator = jsonschema.Draft202012Validator(load_schema(SCHEMA))
    return [".".join(map(str, e.absolute_path)) for e in validator.iter_errors(config)]


TEMPERATURES = [ABSENT, 1, 0.5, 2.0, 0, 0.0]


@pytest.mark.parametrize("T", TEMPERATURES, ids=lambda T: "absent" if T is ABSENT else repr(T))
def test_the_schema_file_allows_K_dev_1_only_under_greedy_decoding(T):
    greedy = T is not ABSENT and T == 0
    assert _plain_schema_errors(_config(T, 1)) == ([] if greedy else ["studies.study1.K_dev"])
    assert _plain_schema_errors(_config(T, 2)) == []


@pytest.mark.parametrize("T", TEMPERATURES, ids=lambda T: "absent" if T is ABSENT else repr(T))
def test_the_parse_time_check_agrees_with_the_schema_file(T):
    greedy = T is not ABSENT and T == 0
    config = _config(T, 1)
    if greedy:
        check_config(config, SCHEMA)
        assert config["studies"]["study1"]["K_dev"] == 1
    else:
        with pytest.raises(ConfigError) as info:
            check_config(config, SCHEMA)
        assert str(info.value) == K_DEV_REFUSED
        with pytest.raises(ConfigError) as info:  # the schema alone gives the same line
            validate_config(_config(T, 1), SCHEMA)
        assert str(info.value) == K_DEV_REFUSED
    config = _config(T, 2)
    check_config(config, SCHEMA)
    assert config["studies"]["study1"]["K_dev"] == (1 if greedy else 2)


def test_K_dev_0_is_refused_by_the_floor_of_1_first():
    with pytest.raises(ConfigError) as info:
        validate_config(_config(0, 0), SCHEMA)
    assert str(info.value) == "config.studies.study1.K_dev: expected a value >= 1, got 0"


def test_a_rule_comment_is_the_reason_in_the_line():
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 3, "$comment": "three  at\nleast"}},
    }
    with pytest.raises(ConfigError) as info:
        validate_config({"n": 2}, schema)
    assert str(info.value) == "config.n: expected a value >= 3, got 2 (three at least)"
    with pytest.raises(ConfigError) as info:  # without one, the line ends with the value
        validate_config({"n": 2}, {"properties": {"n": {"minimum": 3}}})
    assert str(info.value) == "config.n: expected a value >= 3, got 2"


def _directives(name: str) -> list[str]:
    """The first line after every ``<name>:`` directive of workflow/rules/*.smk."""
    found = []
    for path in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        lines = path.read_text().splitlines()
        found += [lines[i + 1].strip() for i, line in enumerate(lines) if line.strip() == name]
    return found


def test_every_log_and_the_documents_go_under_output_dir():
    """What the text below says, read from the rules: every ``log:`` is ``logs(...)``
    (``<output_dir>/logs``, workflow/rules/common.smk) and the documents are ``results(...)``."""
    logged = _directives("log:")
    assert len(logged) >= 24, logged
    assert [text for text in logged if not text.startswith("logs(")] == []
    documents = (ROOT / "workflow" / "rules" / "datasets.smk").read_text()
    assert 'results("documents/{stratum}.parquet")' in documents
    common = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    assert 'return results(os.path.join("logs", path))' in common
    assert 'return os.path.join(config["output_dir"], path)' in common


def test_the_schema_and_config_yaml_say_where_logs_and_documents_go():
    description = " ".join(load_schema(SCHEMA)["properties"]["output_dir"]["description"].split())
    for text in (description, " ".join((ROOT / "config.yaml").read_text().split())):
        assert "<output_dir>/logs/" in text and "<output_dir>/documents/" in text, text
        assert "data/models/" in text, text  # the one thing written outside it
    assert "Logs stay under logs/" not in description
