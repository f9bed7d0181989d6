"""Reruns (issue 6; `docs/architecture.md`, "Reruns"): editing a package module reruns exactly
the jobs of the rules that use it, and editing a config value reruns exactly the jobs that take
it (plus the jobs downstream of their outputs, whose inputs change)."""

from __future__ import annotations

import pytest
import yaml
from workflow_helpers import package_env, planned_jobs, run_snakemake, workflow_copy

TARGETS = [
    "results/finite_state/figures/estimators.png",
    "results/theory/figures/fig1_introductory_example.png",
]
SMALL = {
    "finite_state": {
        "n_systems": 2,
        "horizon": 6,
        "n_states": 3,
        "n_tokens": 4,
        "alt_strength": 0.3,
        "n_reps": 400,
        "window_depths": [1, 2, 6],
        "interval_figure_systems": [0, 1],
    },
    "figures": {"introductory": {"eps": 0.2, "horizon": 16}},
}
FINITE_STATE_JOBS = {"finite_state_systems": 1, "finite_state_figures": 1}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reruns")
    work = workflow_copy(tmp, package=True)
    config = tmp / "small.yaml"
    config.write_text(yaml.safe_dump(SMALL))
    env = package_env(work)
    res = run_snakemake(work, *TARGETS, "--configfile", str(config), env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return work, config, env


def _planned(work, config, env):
    res = run_snakemake(work, "-n", *TARGETS, "--configfile", str(config), env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return planned_jobs(res)


def _edited(path, fn):
    original = path.read_text()
    path.write_text(original + "\n_AN_EDIT = 1\n")  # code: docstrings and comments do not count
    try:
        return fn()
    finally:
        path.write_text(original)


@pytest.mark.slow
def test_nothing_to_do_after_a_run(built):
    assert _planned(*built) == {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, expected",
    [
        ("plots/theory.py", {"introductory_figure": 1}),
        ("theory/finite_state.py", FINITE_STATE_JOBS),
        ("theory/finite_state_study.py", FINITE_STATE_JOBS),
        ("plots/finite_state.py", {"finite_state_figures": 1}),
        ("plots/base.py", {"finite_state_figures": 1, "introductory_figure": 1}),
        # finite_state reaches risk through identification (KernelPair): found from the imports
        ("theory/risk.py", {"introductory_figure": 1, **FINITE_STATE_JOBS}),
    ],
)
def test_module_edit_reruns_exactly_its_rules(built, module, expected):
    work, config, env = built
    planned = _edited(work / "pkg" / "kvdiverge" / module, lambda: _planned(*built))
    assert planned == expected, planned
    assert _planned(*built) == {}  # reverted: the fingerprint is a function of the source


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, expected",
    [
        ({"figures": {"introductory": {"eps": 0.3}}}, {"introductory_figure": 1}),
        ({"finite_state": {"n_reps": 500}}, FINITE_STATE_JOBS),
        ({"finite_state": {"interval_figure_systems": [1]}}, {"finite_state_figures": 1}),
        ({"seed": 7}, FINITE_STATE_JOBS),
    ],
)
def test_config_edit_reruns_exactly_the_jobs_that_take_it(built, tmp_path, change, expected):
    work, config, env = built
    merged = yaml.safe_load(config.read_text())
    for key, value in change.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    merged[key][sub].update(v)
                else:
                    merged[key][sub] = v
        else:
            merged[key] = value
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(merged))
    assert _planned(work, edited, env) == expected
