"""``kvdiverge fetch-model`` (issue 31, item 6): a config's model materialized from its `source`
without a pipeline run, on a tiny local GGUF; bad inputs one line, exit status 2."""

from __future__ import annotations

import hashlib
import json

import pytest
import yaml
from gguf_helpers import write_tiny_gguf

from kvdiverge.cli import main
from kvdiverge.models import load_model


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf")


def _config(tmp_path, source) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": {"tiny": {"source": source}, "demo": {"demo": "x"}}}))
    return str(path)


def test_fetch_model_materializes_the_source(gguf, tmp_path, capsys):
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    config = _config(tmp_path, {"gguf": str(gguf), "sha256": digest})
    out = tmp_path / "models" / "tiny"
    assert main(["fetch-model", "tiny", "--config", config, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert captured.err.splitlines()[-1].startswith(f"saved {out} in ")  # one line per step
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["source"]["gguf"] == str(gguf)
    assert main(["fetch-model", "tiny", "--config", config, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == f"{out} exists already (remove it to fetch again)"
    assert load_model(str(out)).config.vocab_size > 0


def test_fetch_model_bad_inputs_are_one_line(gguf, tmp_path, capsys):
    config = _config(tmp_path, {"gguf": str(gguf), "sha256": "0" * 64})
    cases = [
        (["fetch-model", "nope", "--config", config],
         f"kvdiverge fetch-model: {config}: models.nope: expected a model with a `source` "
         "(models with one: tiny)"),
        (["fetch-model", "tiny", "--config", str(tmp_path / "none.yaml")],
         f"kvdiverge fetch-model: --config: cannot read {tmp_path / 'none.yaml'} (No such file "
         "or directory)"),
        (["fetch-model", "tiny", "--config", config, "--out", str(tmp_path / "m")],
         f"kvdiverge fetch-model: {config}: models.tiny.source.sha256"),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(message) and "\n" not in err, err
    assert not (tmp_path / "m").exists()
