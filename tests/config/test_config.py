"""Config validation (one clear line naming the field) and module fingerprints."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from kvdiverge.config import (
    ConfigError,
    check_generation_reserve,
    check_references,
    validate_config,
)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "workflow" / "schemas" / "config.schema.yaml"


def default_config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.mark.parametrize("name", ["config.yaml", "configs/tiny.yaml", "configs/paper.yaml"])
def test_shipped_configs_are_valid_and_defaults_filled(name):
    cfg = yaml.safe_load((ROOT / name).read_text())
    validate_config(cfg, SCHEMA)
    assert isinstance(cfg["seed"], int)
    assert "finite_state" in cfg


def test_empty_config_gets_defaults():
    cfg: dict = {}
    validate_config(cfg, SCHEMA)
    assert cfg["seed"] == 20261129


@pytest.mark.parametrize(
    "mutate, field, expected",
    [
        (lambda c: c.__setitem__("bogus_key", 1), "config", "unknown key(s) 'bogus_key'"),
        (lambda c: c.__setitem__("seed", -1), "config.seed", "expected a value >= 0"),
        (lambda c: c.__setitem__("seed", "x"), "config.seed", "expected integer"),
        (
            # K_dev 1 is the schema's floor (greedy decoding); above 0 temperature the schema
            # asks for 2 (tests/config/test_schema_rules.py)
            lambda c: c.__setitem__("studies", {"s": {"actions": ["full"], "K_dev": 0}}),
            "config.studies.s.K_dev",
            "expected a value >= 1",
        ),
        (
            lambda c: c.__setitem__("studies", {"s": {"K": 3}}),
            "config.studies.s",
            "missing required key 'actions'",
        ),
    ],
)
def test_bad_config_one_line_naming_field(mutate, field, expected):
    cfg = default_config()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        validate_config(cfg, SCHEMA)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(field + ":"), msg
    assert expected in msg, msg


def test_validation_does_not_mutate_on_error_path_types():
    cfg = default_config()
    before = copy.deepcopy(cfg)
    validate_config(cfg, SCHEMA)
    for key, value in before.items():
        if not isinstance(value, dict):
            assert cfg[key] == value


def test_generation_reserve_must_cover_the_horizon():
    """A prompt fitted with less reserve than H would run past its stratum's length."""
    config = default_config()
    validate_config(config, SCHEMA)
    check_generation_reserve(config)  # the embedded default: reserve = H
    for reserve, ok in ((config["rollout"]["H"] + 1, True), (config["rollout"]["H"] - 1, False)):
        changed = copy.deepcopy(config)
        changed["datasets"]["generation_reserve"] = reserve
        if ok:
            check_generation_reserve(changed)
            continue
        with pytest.raises(ConfigError) as err:
            check_generation_reserve(changed)
        message = str(err.value)
        assert "\n" not in message
        assert message.startswith("config.datasets.generation_reserve: ")
        assert f"expected an integer >= {config['rollout']['H']}" in message


def test_swrb_coupling_is_accepted_and_refuses_rollout_groups():
    """``rollout.coupling: swrb`` validates; a study split into rollout groups is refused in
    one line (each later group's amendment lock is not read by the SWRB tables)."""
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config["rollout"]["coupling"] = "swrb"
    validate_config(config, SCHEMA)
    check_references(config)
    config["studies"]["study1"]["groups"] = {
        "main": ["snapkv-512", "snapkv-half", "full"],
        "more": ["recent-half"],
    }
    with pytest.raises(ConfigError) as info:
        check_references(config)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config.studies.study1.groups: ")
    assert "swrb" in msg
    config["rollout"]["coupling"] = "shared-reference"
    check_references(config)  # the same groups pass under a trajectory coupling
