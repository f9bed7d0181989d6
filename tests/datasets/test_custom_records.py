"""The user's prompt records (kvdiverge.datasets.custom): a misspelt field leaving a literal
``{context}`` is refused in one line; JSON Lines split at ``\\n`` alone (a raw U+2028 or U+0085
inside a JSON string is text), CRLF lines still read."""

from __future__ import annotations

import json

import pytest
from refusal_helpers import one_line

from kvdiverge.datasets import DatasetError
from kvdiverge.datasets.custom import count_custom_records, read_custom_records


# ---- prompt records -----------------------------------------------------------------------------
def test_a_misspelt_context_field_leaving_the_placeholder_is_refused(tmp_path):
    path = tmp_path / "prompts.jsonl"
    row = {"prompt": "Read {context} and answer.", "contxt": "The code is 7.", "answers": ["7"]}
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as info:
        read_custom_records(path)
    assert one_line(info) == (
        f"{path}, line 1, field 'prompt': holds the placeholder {{context}} but the record has "
        "no field 'context' (it has 'contxt'); expected a 'context' field to put there, or a "
        "prompt without the placeholder"
    )


def test_a_placeholder_with_its_context_still_reads(tmp_path):
    path = tmp_path / "prompts.jsonl"
    row = {"prompt": "Read {context} and answer.", "context": "The code is 7.", "answers": ["7"]}
    path.write_text(json.dumps(row) + "\n")
    assert read_custom_records(path)[0].context == "The code is 7."


@pytest.mark.parametrize("char", ["\u2028", "\u0085", "\u2029"])
def test_raw_line_separators_inside_a_json_string_are_text(tmp_path, char):
    """JSON allows these characters raw inside a string; str.splitlines would split there."""
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": f"First{char}prompt", "answers": ["a"]},
        {"prompt": "Second prompt", "answers": ["b"]},
    ]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    assert char in text
    path.write_text(text, encoding="utf-8")
    records = read_custom_records(path)
    assert [r.prompt for r in records] == [f"First{char}prompt", "Second prompt"]
    assert [r.where for r in records] == [f"{path}, line 1", f"{path}, line 2"]
    assert count_custom_records(path) == 2


def test_crlf_lines_still_read(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(
        b'{"prompt": "a", "answers": ["x"]}\r\n\r\n{"prompt": "b", "answers": "y"}\r\n'
    )
    records = read_custom_records(path)
    assert [(r.prompt, r.where) for r in records] == [
        ("a", f"{path}, line 1"),
        ("b", f"{path}, line 3"),
    ]
