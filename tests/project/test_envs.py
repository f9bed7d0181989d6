"""The conda environment of the rules (`--sdm conda`; docs/running.md, "Running on a SLURM
cluster"), checked against pyproject.toml and against how Snakemake creates it, without conda
(not installable on the test machines).

Snakemake copies a rule's env file to `<conda-prefix>/<hash>.yaml` and runs `conda env create`
on the copy (`snakemake.deployment.conda.Env.create`), so a path in the file would be resolved
from the conda prefix, not from `envs/`; then it runs the `<name>.post-deploy.sh` beside the env
file inside the new environment, in the run's working directory. So envs/kvdiverge.yaml names
no path, and its post-deploy script installs the package from the repository root with every
dependency and the kvpress extra.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from workflow_helpers import ROOT

ENV = ROOT / "envs" / "kvdiverge.yaml"
POST_DEPLOY = ROOT / "envs" / "kvdiverge.post-deploy.sh"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_rule_runs_in_the_one_environment():
    """Every rule of workflow/rules/ declares `conda:` envs/kvdiverge.yaml; envs/ holds nothing
    else but its post-deploy script."""
    rules = 0
    for smk in sorted((ROOT / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        rules += len(re.findall(r"^\s*rule(?: \w+)?:\s*(?:#.*)?$", text, re.M))
        for env in re.findall(r"^\s*conda:\n\s*\"([^\"]+)\"", text, re.M):
            assert (smk.parent / env).resolve() == ENV, (smk.name, env)
    declared = sum(
        len(re.findall(r"^\s*conda:\s*(?:#.*)?$", p.read_text(), re.M))
        for p in (ROOT / "workflow" / "rules").glob("*.smk")
    )
    assert rules > 0 and declared == rules
    assert sorted(p.name for p in ENV.parent.iterdir()) == [POST_DEPLOY.name, ENV.name]


def test_the_env_file_names_no_path_and_python_as_pyproject_does():
    spec = yaml.safe_load(ENV.read_text())
    assert spec["channels"] == ["conda-forge", "nodefaults"]
    deps = spec["dependencies"]
    assert all(isinstance(d, str) for d in deps), "no pip: section (its paths would break)"
    assert f"python {PYPROJECT['project']['requires-python']}" in deps
    assert "pip" in deps
    assert not [d for d in deps if "/" in d or d.startswith("-")]


def test_snakemake_copies_the_file_and_finds_the_post_deploy_script():
    """What the two checks above rely on, in the installed Snakemake's code."""
    from snakemake.deployment.conda import Env
    from snakemake.sourcecache import LocalSourceFile

    create = inspect.getsource(Env.create)
    assert "copy_permission_safe(env_file, target_env_file)" in create
    assert "f'--file \"{target_env_file}\"'" in create
    found = LocalSourceFile(str(ENV)).replace_suffix([".yaml", ".yml"], ".post-deploy.sh")
    assert Path(found.get_path_or_uri(secret_free=True)) == POST_DEPLOY
    assert POST_DEPLOY.read_text().startswith("#!/usr/bin/env bash\n")  # its interpreter


def _run_post_deploy(cwd: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, str]:
    """The script with a stand-in `python` first on PATH, which records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "python-args"
    fake = bin_dir / "python"
    fake.write_text(f'#!/bin/sh\necho "$PWD $*" > {record}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", str(POST_DEPLOY)], cwd=cwd, env=env, capture_output=True, text=True
    )
    return done, record.read_text().strip() if record.exists() else ""


def test_the_post_deploy_script_installs_the_package_with_kvpress(tmp_path):
    done, call = _run_post_deploy(ROOT, tmp_path)
    assert done.returncode == 0, done.stderr
    assert call == f"{ROOT} -m pip install --no-input --editable .[kvpress]"
    assert PYPROJECT["project"]["optional-dependencies"]["kvpress"] == ["kvpress==0.5.5"]


def test_the_post_deploy_script_refuses_another_working_directory(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done, call = _run_post_deploy(elsewhere, tmp_path)
    assert done.returncode == 1 and call == ""
    assert "run snakemake from the repository root" in done.stderr


def _installed_closure(requirements: list[str]) -> set[str]:
    """The distributions pip installs for ``requirements`` (with their extras), by canonical
    name, read from this environment's metadata."""
    seen: set[str] = set()
    todo = [(Requirement(r), set()) for r in requirements]
    while todo:
        req, _ = todo.pop()
        name = canonicalize_name(req.name)
        key = name + "[" + ",".join(sorted(req.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in requires:
            sub = Requirement(line)
            extras = req.extras or {""}
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras):
                todo.append((sub, set()))
    return {k.split("[")[0] for k in seen}


def test_every_module_the_rules_import_comes_with_the_package():
    """Every third-party module imported by a rule's script or the package (workflow/scripts/,
    src/kvdiverge/) belongs to a distribution that `pip install .[kvpress]` installs."""
    import ast

    project = PYPROJECT["project"]
    closure = _installed_closure(
        project["dependencies"] + project["optional-dependencies"]["kvpress"]
    )
    modules = set()
    files = [*(ROOT / "workflow" / "scripts").glob("*.py"), *(ROOT / "src").rglob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    third_party = {
        m for m in modules if m not in sys.stdlib_module_names and m not in ("kvdiverge",)
    } - {"__future__"}
    owners = importlib.metadata.packages_distributions()
    missing = {}
    for module in sorted(third_party):
        dists = {canonicalize_name(d) for d in owners.get(module, [])}
        if not dists & closure:
            missing[module] = sorted(dists) or "not installed"
    assert not missing, missing
    assert "kvpress" in third_party and "torch" in third_party
