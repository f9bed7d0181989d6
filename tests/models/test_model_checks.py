"""A model folder's tokenizer checked when it loads, before any rollout (kvdiverge.models.checks): a
chat template that raises or drops the user's text, a tokenizer with more ids than the
embedding and an EOS id beyond the vocabulary are one line each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers
from refusal_helpers import one_line

from kvdiverge.models import chat_prompt_ids, load_tokenizer
from kvdiverge.models.checks import ModelFolderError, check_tokenizer

ROOT = Path(__file__).resolve().parents[2]


MODEL = ROOT / "data" / "models" / "tiny-llama"


transformers.utils.logging.disable_progress_bar()


# ---- model folders ------------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path):
    out = tmp_path / "model"
    shutil.copytree(MODEL, out)
    return out


def test_the_demo_folder_passes(folder):
    tok = load_tokenizer(str(folder))
    check_tokenizer(tok, folder)


def test_a_chat_template_that_drops_the_users_text_is_refused(folder):
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}<|user|>\nHello<|end|>\n{% if add_generation_prompt %}<|assistant|>\n"
        "{% endif %}"
    )
    with pytest.raises(ModelFolderError) as info:
        load_tokenizer(str(folder))
    assert one_line(info) == (
        f"{folder}: the tokenizer's chat template drops the user's text (two different prompts "
        "both render as '<|endoftext|><|user|>\\nHello<|end|>\\n<|assistant|>\\n'); expected a "
        "template that writes the user message's content, or every prompt would be the same"
    )


def test_a_chat_template_that_raises_is_one_line(folder):
    (folder / "chat_template.jinja").write_text(
        "{{ raise_exception('this template needs a system message') }}"
    )
    with pytest.raises(ModelFolderError) as info:
        load_tokenizer(str(folder))
    assert one_line(info) == (
        f"{folder}: the tokenizer's chat template raised TemplateError: this template needs a "
        "system message on a one-message user prompt; expected a template that renders "
        "[{role: user, content: ...}] with add_generation_prompt"
    )


def test_a_template_raising_on_one_prompt_only_is_one_line():
    tok = load_tokenizer(str(MODEL))
    tok.chat_template = (
        "{% if 'forbidden' in messages[0]['content'] %}{{ raise_exception('no') }}{% endif %}"
        + tok.chat_template
    )
    with pytest.raises(ModelFolderError) as info:
        chat_prompt_ids(tok, "a forbidden word")
    assert one_line(info).endswith(
        "the tokenizer's chat template raised TemplateError: no on a one-message user prompt; "
        "expected a template that renders [{role: user, content: ...}] with "
        "add_generation_prompt"
    )


def test_an_eos_id_beyond_the_vocabulary_is_one_line(folder):
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [4, 512]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(ModelFolderError) as info:
        load_tokenizer(str(folder))
    assert one_line(info) == (
        f"{folder}: {folder / 'generation_config.json'} eos_token_id is 512; expected a token "
        f"id in [0, 512) (the vocab_size of {folder / 'config.json'})"
    )


def test_a_tokenizer_with_more_ids_than_the_embedding_is_one_line(folder):
    tok = load_tokenizer(str(folder))
    tok.add_tokens(["<|extra-one|>", "<|extra-two|>"])
    tok.save_pretrained(str(folder))
    with pytest.raises(ModelFolderError) as info:
        load_tokenizer(str(folder))
    assert one_line(info) == (
        f"{folder}: the tokenizer has 514 ids (len(tokenizer)), more than the 512 embedding rows "
        f"of {folder / 'config.json'} (vocab_size); expected at most 512: the tokenizer does "
        "not belong to these weights"
    )
