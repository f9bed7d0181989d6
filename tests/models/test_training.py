"""Training the demo models (kvdiverge.models.training; docs/models.md, "Training")."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from kvdiverge.config import validate_config
from kvdiverge.models import (
    chat_prompt_ids,
    demo_tokenizer_and_config,
    load_model,
    load_tokenizer,
)
from kvdiverge.models.curriculum import (
    Stage,
    TrainSettings,
    answer_text,
    batch_loss,
    drill_ids,
    make_batch,
    sample_task_prompt,
)
from kvdiverge.models.training import (
    TRAINING_FILE,
    StaleModelError,
    check_demo_model_folder,
    check_trained_model,
    demo_model_fingerprint,
    train_model,
    training_fingerprint,
)

transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parents[2]
SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
TINY = {
    "stages": [{"max_tokens": 128, "steps": 60, "drill_needles": 1}],
    "batch_tokens": 512,
    "warmup_steps": 5,
}


def _config() -> dict:
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    validate_config(config, ROOT / "workflow" / "schemas" / "config.schema.yaml")
    return config


def _demo_models() -> dict[str, dict]:
    return {n: s for n, s in _config()["models"].items() if s.get("demo")}


def _fresh(kind: str, seed: int = 0):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    tokenizer, config = demo_tokenizer_and_config(kind)
    torch.manual_seed(seed)
    return (LlamaForCausalLM if kind == "llama" else Qwen2ForCausalLM)(config), tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def kind(request):
    return request.param


def test_training_lowers_heldout_loss_and_is_deterministic(kind):
    torch.set_num_threads(1)
    settings = TrainSettings.from_config(TINY)
    model, tokenizer = _fresh(kind)
    gen_rng = random.Random(12345)  # a batch no training step draws (training keys by step)
    from kvdiverge.models.training import _generator

    gen, plain = _generator(tokenizer, seed=3)
    heldout = make_batch(gen, settings, settings.stages[0], plain, gen_rng)
    with torch.no_grad():
        before = batch_loss(model, heldout, settings.context_weight)
    history = train_model(model, tokenizer, settings, seed=3)
    with torch.no_grad():
        after = batch_loss(model, heldout, settings.context_weight)
    assert after[0] < 0.7 * before[0]  # ln(V) ≈ 6.3 at initialisation
    assert after[1] < before[1] and after[2] < before[2]  # answer and context parts both
    assert history[-1]["loss"] < history[0]["loss"]
    again, _ = _fresh(kind)
    assert train_model(again, tokenizer, settings, seed=3) == history
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)


def test_batch_masks_mark_the_answer_and_eos():
    raw = {"stages": [{"max_tokens": 600, "steps": 1}], "drill_fraction": 0, "plain_fraction": 0}
    settings = TrainSettings.from_config(raw)
    _, tokenizer = _fresh("llama")
    from kvdiverge.models.training import _generator

    gen, plain = _generator(tokenizer, seed=1)
    rng = random.Random(7)
    sample = sample_task_prompt(gen, "niah_single_1", 500, rng)
    assert sample is not None and len(chat_prompt_ids(tokenizer, sample.prompt)) <= 500
    assert sample_task_prompt(gen, "niah_single_1", 100, rng) is None  # shorter than any
    batch = make_batch(gen, settings, settings.stages[0], plain, random.Random(8))
    ids, ans, ctx = batch["input_ids"], batch["answer_mask"], batch["context_mask"]
    assert ids.shape[0] == 2048 // 600 and not (ans & ctx).any()
    for row in range(ids.shape[0]):
        first = int(ans[row].nonzero()[0])
        last = int(ans[row].nonzero()[-1])
        assert ans[row, first : last + 1].all() and ids[row, last] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[row, :first]).endswith("<|assistant|>\n")  # after the header
        assert ctx[row, 1:first].all() and not ctx[row, 0] and not ctx[row, last + 1 :].any()
        assert (ids[row, last + 1 :] == tokenizer.pad_token_id).all()
    assert answer_text("cwe", ["a", "b"]) == "1. a 2. b"
    assert answer_text("vt", ["AB", "CD"]) == "AB CD"
    assert answer_text("niah_multivalue", ["1", "2"]) == "1, 2."


@pytest.mark.parametrize("max_tokens", [128, 256, 512])
def test_drills_ask_for_values_that_precede_them(max_tokens):
    _, tokenizer = _fresh("llama")
    for seed in range(40):
        ids, mask = drill_ids(tokenizer, max_tokens, 4, random.Random(seed))
        assert len(ids) == len(mask) and any(mask)
        text = tokenizer.decode(ids)
        body, *queries = text.split("The special magic")
        assert 1 <= len(queries) <= 3
        if len(ids) > max_tokens:  # only when a single needle and its query do not fit
            assert len(queries) == 1 and body.count("is: ") == 1
        answers = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
        for query in queries:
            value = query.rsplit(" is ", 1)[1].strip().removesuffix(".")
            assert f"is: {value}." in body  # the queried needle is in the text
            assert f" {value}." in answers  # and its value is what the loss scores


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, "train.stages: expected a non-empty list"),
        ({"stages": [{"max_tokens": 128}]}, "train.stages[0]: expected {max_tokens, steps"),
        ({"stages": [{"max_tokens": 8, "steps": 1}]}, "max_tokens >= 64"),
        ({**TINY, "lr2": 1}, "train: unknown key(s) 'lr2'"),
        ({**TINY, "tasks": {"qa_1": 1}}, "train.tasks: expected non-negative weights"),
        ({**TINY, "batch_tokens": 64}, "train.batch_tokens: expected at least"),
        ({**TINY, "plain_fraction": 1.0}, "train.plain_fraction"),
    ],
)
def test_settings_errors_are_one_line(raw, message):
    with pytest.raises(ValueError) as err:
        TrainSettings.from_config(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_fingerprint_covers_settings_seed_and_kind():
    settings = TrainSettings.from_config(TINY)
    base = training_fingerprint("llama", settings, 1)
    assert base == training_fingerprint("llama", TrainSettings.from_config(TINY), 1)
    more = TrainSettings.from_config({**TINY, "lr": 1e-3})
    assert len({base, training_fingerprint("llama", more, 1)}) == 2
    assert base != training_fingerprint("llama", settings, 2)
    assert base != training_fingerprint("qwen2", settings, 1)
    assert settings.stages == (Stage(128, 60, 1),)


@pytest.mark.parametrize("name", sorted(_demo_models()))
def test_committed_weights_load_and_match_the_config(name):
    spec = _demo_models()[name]
    path = ROOT / "data" / "models" / name
    record = check_demo_model_folder(path, spec, spec["seed"], where=f"models.{name}")
    assert record is not None
    assert record["fingerprint"] == demo_model_fingerprint(spec, spec["seed"])
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 4_000_000
    model = load_model(str(path), device="cpu")
    tokenizer = load_tokenizer(str(path))
    fresh_tokenizer, fresh_config = demo_tokenizer_and_config(spec["demo"])
    # the documents of the default are fitted with this tokenizer: it must be the demo one
    assert tokenizer.get_vocab() == fresh_tokenizer.get_vocab()
    assert tokenizer.chat_template == fresh_tokenizer.chat_template
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "vocab_size"):
        assert getattr(model.config, key) == getattr(fresh_config, key)
    # trained, not random: the held-out answer loss recorded at training is far below ln(V)
    assert record["loss_history"][-1]["answer_loss"] < 0.5 * torch.log(torch.tensor(512.0))


@pytest.mark.parametrize("name", sorted(_demo_models())[:1])
def test_stale_or_missing_fingerprint_is_one_clear_line(name, tmp_path):
    spec = _demo_models()[name]
    seed = spec["seed"]  # a demo model has its own seed, apart from the master seed
    settings = TrainSettings.from_config(spec["train"])
    folder = tmp_path / name
    shutil.copytree(ROOT / "data" / "models" / name, folder)
    assert check_trained_model(folder, spec["demo"], settings, seed)["kind"] == spec["demo"]
    changed = TrainSettings.from_config({**spec["train"], "lr": settings.lr * 2})
    with pytest.raises(StaleModelError) as err:
        check_trained_model(folder, spec["demo"], changed, seed)
    message = str(err.value)
    assert "\n" not in message and "fingerprint" in message
    assert f"rm -r {folder} && snakemake --cores 2 {folder}" in message
    with pytest.raises(StaleModelError, match="fingerprint"):
        check_trained_model(folder, spec["demo"], settings, seed + 1)
    (folder / TRAINING_FILE).unlink()
    with pytest.raises(StaleModelError, match="no readable training fingerprint"):
        check_trained_model(folder, spec["demo"], settings, seed)
    assert check_demo_model_folder(tmp_path / "absent", spec, seed) is None
    with pytest.raises(ValueError, match=r"models\.x\.train: expected the training settings"):
        check_demo_model_folder(folder, {"demo": "llama"}, seed, where="models.x")


@pytest.mark.slow
def test_workflow_refuses_stale_weights_at_parse_time(tmp_path):
    work = tmp_path / "wf"
    work.mkdir()
    shutil.copy(ROOT / "Snakefile", work / "Snakefile")
    shutil.copy(ROOT / "configs" / "tiny.yaml", work / "config.yaml")
    for folder in ("workflow", "envs", "data/fixtures"):
        shutil.copytree(ROOT / folder, work / folder)
    for model in (ROOT / "data" / "models").glob("tiny-*"):
        shutil.copytree(model, work / "data" / "models" / model.name)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [SNAKEMAKE, "--cores", "1", "--workflow-profile", "none", "-n"]
    name = sorted(_demo_models())[0]
    ok = subprocess.run(
        [*cmd, f"data/models/{name}"], cwd=work, capture_output=True, text=True, env=env
    )
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "Nothing to be done" in ok.stdout + ok.stderr  # committed weights are used as they are
    record_path = work / "data" / "models" / name / TRAINING_FILE
    record = json.loads(record_path.read_text())
    record["fingerprint"] = "0" * 16
    record_path.write_text(json.dumps(record))
    bad = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    assert bad.returncode != 0
    retrain = f"rm -r data/models/{name} && snakemake --cores 2 data/models/{name}"
    assert retrain in bad.stdout + bad.stderr
    # run with a config file, as the README runs configs/tiny.yaml: the command carries it
    (work / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "tiny.yaml", work / "configs" / "tiny.yaml")
    options = ["--configfile", "configs/tiny.yaml", "--replace-workflow-config"]
    named = subprocess.run([*cmd, *options], cwd=work, capture_output=True, text=True, env=env)
    assert named.returncode != 0
    retrain = (
        f"rm -r data/models/{name} && snakemake --cores 2 --configfile configs/tiny.yaml "
        f"--replace-workflow-config data/models/{name}"
    )
    assert retrain in named.stdout + named.stderr
    shutil.rmtree(work / "data" / "models" / name)  # deleted weights: the rule retrains them
    again = subprocess.run(
        [*cmd, f"data/models/{name}"], cwd=work, capture_output=True, text=True, env=env
    )
    assert again.returncode == 0 and "build_demo_model" in again.stdout + again.stderr


@pytest.mark.slow
def test_committed_weights_older_than_the_workflow_are_not_retrained(tmp_path):
    """A fresh clone writes data/models/ before workflow/ (git's path order): the committed
    weights are then older than every rule file, and must still be used as they are."""
    from workflow_helpers import planned_jobs, run_snakemake, workflow_copy

    work = workflow_copy(tmp_path)
    past = 1_000_000_000  # 2001
    for f in (work / "data" / "models").rglob("*"):
        os.utime(f, (past, past))
    names = sorted(_demo_models())
    res = run_snakemake(work, "-n", *[f"data/models/{n}" for n in names])
    assert res.returncode == 0, res.stderr[-2000:]
    assert planned_jobs(res) == {}, res.stdout[-2000:]
