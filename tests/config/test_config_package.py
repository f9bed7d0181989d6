"""The configuration package's public face (kvdiverge.config): every public name of its modules
is importable from the package, and every name the package exported while it was a single
module still is."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import kvdiverge.config as config

FORMER_EXPORTS = (
    "FIRST_GROUP",
    "ConfigError",
    "action_groups",
    "check_config",
    "check_generation_reserve",
    "check_references",
    "load_schema",
    "load_yaml_strict",
    "study_groups",
    "validate_config",
    "study_contrasts",  # imported by workflow/rules/common.smk, outside __all__ then
)


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(config.__path__))


def test_the_package_has_its_modules():
    assert _modules() == [
        "actions",
        "baselines",
        "bounds",
        "errors",
        "horizon",
        "models",
        "names",
        "parse_checks",
        "reading",
        "schema",
        "studies",
        "temperature",
    ]


@pytest.mark.parametrize("module", _modules())
def test_every_public_name_of_a_module_is_the_packages(module):
    mod = importlib.import_module(f"kvdiverge.config.{module}")
    missing = [n for n in mod.__all__ if n not in config.__all__]
    assert not missing, f"kvdiverge.config.{module}: {missing} not in kvdiverge.config.__all__"
    for name in mod.__all__:
        assert getattr(config, name) is getattr(mod, name), name


@pytest.mark.parametrize("name", FORMER_EXPORTS)
def test_the_former_module_names_still_import(name):
    assert name in config.__all__ and hasattr(config, name)


def test_the_package_exports_nothing_it_lacks():
    assert sorted(config.__all__) == sorted(set(config.__all__))
    assert [n for n in config.__all__ if not hasattr(config, n)] == []
