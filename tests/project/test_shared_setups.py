"""The tests that share a set-up run on one pytest-xdist worker (docs/testing.md, "Shared
set-ups"; tests/conftest.py): with xdist's workers and no ``--dist`` of the command's own the
tests are distributed by group, a test that requests a module- or class-scoped fixture of its
own module joins the module's group, every user of the materialized SmolLM2 joins one group,
and the modules holding slow tests run first. Without xdist (``-p no:xdist``) the suite runs,
no group marked."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    SHARED_GROUP,
    SLOW_MODULES,
    pytest_cmdline_main,
    shared_setup_group,
    xdist_present,
)

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
    """``-n N`` (or auto) without ``--dist``: loadgroup; a ``--dist`` of the command's own, no
    workers (``-n 0``, no ``-n``) and no xdist leave the option as it is."""
    for workers, dist, xdist, want in (
        (2, "no", True, "loadgroup"),
        ("auto", "no", True, "loadgroup"),
        (2, "load", True, "load"),
        (0, "no", True, "no"),
        (None, "no", True, "no"),
        (2, "no", False, "no"),
    ):
        config = SimpleNamespace(
            option=SimpleNamespace(numprocesses=workers, dist=dist, distload=False),
            pluginmanager=SimpleNamespace(hasplugin=lambda name, on=xdist: on and name == "xdist"),
        )
        pytest_cmdline_main(config)
        assert config.option.dist == want, (workers, dist, xdist)


def test_the_suite_runs_without_xdist():
    """``-p no:xdist``: this module's other tests pass in one process, no unknown marker."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "-p", "no:cacheprovider"]
        + ["-W", "error::pytest.PytestUnknownMarkWarning", THIS, "-k", "not without_xdist"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert " passed" in done.stdout.splitlines()[-1] and "failed" not in done.stdout


def test_a_test_of_a_module_fixture_joins_its_module_group(request, built_once):
    built_once.append(request.node.nodeid)
    assert shared_setup_group(request.node) == THIS
    assert _group(request.node) == (THIS if xdist_present(request.config) else None)


def test_a_test_of_function_fixtures_joins_no_group(request, built_per_test, tmp_path):
    assert shared_setup_group(request.node) is None
    assert _group(request.node) is None


def test_every_user_of_smollm2_and_every_shared_set_up_is_grouped(request):
    """Over the whole session's tests (this module's alone when run by itself)."""
    items = request.session.items
    xdist = xdist_present(request.config)  # without it, no group is marked
    for item in items:
        group = shared_setup_group(item)
        assert _group(item) == (group if xdist else None), item.nodeid
        if "smollm2_folder" in item.fixturenames:
            assert group == SHARED_GROUP, item.nodeid
    assert any(shared_setup_group(item) == THIS for item in items)


def test_the_modules_holding_slow_tests_run_first(request):
    items = request.session.items
    modules = [item.nodeid.split("::", 1)[0] for item in items]
    assert all(m in SLOW_MODULES for m, item in zip(modules, items, strict=True) if _slow(item))
    flags = [m in SLOW_MODULES for m in modules]
    assert flags == sorted(flags, reverse=True)  # every slow module before every other
    runs = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    assert len(runs) == len(set(modules))  # each module's tests together
