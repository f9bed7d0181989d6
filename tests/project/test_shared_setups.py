"""The tests that share a set-up run on one pytest-xdist worker (docs/testing.md, "Shared
set-ups"; tests/conftest.py): pyproject.toml's pytest options distribute by group, a test that
requests a module- or class-scoped fixture of its own module joins the module's group, every
user of the materialized SmolLM2 joins one group, and the modules holding slow tests run first."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from conftest import SHARED_GROUP, SLOW_MODULES, shared_setup_group

ROOT = Path(__file__).resolve().parents[2]
THIS = "tests/project/test_shared_setups.py"


@pytest.fixture(scope="module")
def built_once():
    """A set-up this module's tests share (a stand-in for a Snakemake run)."""
    return []


@pytest.fixture
def built_per_test():
    return []


def _slow(item: pytest.Item) -> bool:
    return item.get_closest_marker("slow") is not None


def _group(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark is not None else None


def test_pytest_distributes_the_tests_by_group():
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]
    assert "--dist loadgroup" in options["ini_options"]["addopts"]


def test_a_test_of_a_module_fixture_joins_its_module_group(request, built_once):
    built_once.append(request.node.nodeid)
    assert shared_setup_group(request.node) == THIS
    assert _group(request.node) == THIS


def test_a_test_of_function_fixtures_joins_no_group(request, built_per_test, tmp_path):
    assert shared_setup_group(request.node) is None
    assert _group(request.node) is None


def test_every_user_of_smollm2_and_every_shared_set_up_is_grouped(request):
    """Over the whole session's tests (this module's alone when run by itself)."""
    items = request.session.items
    for item in items:
        group = shared_setup_group(item)
        assert _group(item) == group, item.nodeid
        if "smollm2_folder" in item.fixturenames:
            assert group == SHARED_GROUP, item.nodeid
    assert any(_group(item) == THIS for item in items)


def test_the_modules_holding_slow_tests_run_first(request):
    items = request.session.items
    modules = [item.nodeid.split("::", 1)[0] for item in items]
    assert all(m in SLOW_MODULES for m, item in zip(modules, items, strict=True) if _slow(item))
    flags = [m in SLOW_MODULES for m in modules]
    assert flags == sorted(flags, reverse=True)  # every slow module before every other
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(runs) == len(set(modules))  # each module's tests together
