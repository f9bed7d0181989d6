"""Config validation (one clear line naming the field) and module fingerprints."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path

import pytest
import yaml

from kvdiverge.config import (
    ConfigError,
    check_generation_reserve,
    module_fingerprint,
    validate_config,
)
from kvdiverge.provenance import module_file

ROOT = Path(__file__).resolve().parents[1]
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


def test_module_fingerprint_tracks_source(tmp_path, monkeypatch):
    # the name is shared with tests/test_provenance.py on purpose: whichever runs first in a
    # worker must not change what the other finds (modules are located without importing)
    module_file.cache_clear()
    pkg = tmp_path / "fp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("X = 1\n")
    (pkg / "b.py").write_text("Y = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fa, fb, fall = (
        module_fingerprint("fp_pkg.a"),
        module_fingerprint("fp_pkg.b"),
        module_fingerprint("fp_pkg"),
    )
    (pkg / "a.py").write_text("X = 2\n")
    assert module_fingerprint("fp_pkg.a") != fa
    assert module_fingerprint("fp_pkg.b") == fb
    assert module_fingerprint("fp_pkg") != fall
    with pytest.raises(ConfigError, match="no module named 'fp_pkg.missing'"):
        module_fingerprint("fp_pkg.missing")
    importlib.import_module("fp_pkg.a")  # a stale fp_pkg in sys.modules, as another test leaves it
    module_file.cache_clear()


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
