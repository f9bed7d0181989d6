"""Names and templated config files (kvdiverge.config.names, kvdiverge.config.reading), as a user
writes them.

Names of models, actions, studies, rollout groups and strata follow one pattern: checked at
parse time with one line naming the key, and every wildcard constraint built from them is
regex-escaped, so a model named ``x+lora`` is planned like any other (the dry runs:
tests/workflow/test_dry_run_refusals.py). A config file with ``__use_yte__`` is refused."""

from __future__ import annotations

import re

import pytest
from refusal_helpers import NAME_RULE, SCHEMA, one_line, tiny
from workflow_helpers import ROOT

from kvdiverge.config import ConfigError, check_config, load_schema
from kvdiverge.config.names import name_problem, wildcard_alternation
from kvdiverge.config.reading import templated

GOOD = ["smollm2+lora", "snapkv@0.5", "budget=0.25", "ruler-4k", "study_1", "Qwen2.5-0.5B", "x"]


BAD = ["a/b", "../x", "a..b", ".hidden", "-x", "_x", "{x}", "a b", "", "a\\b", "x+lora/../y"]


@pytest.mark.parametrize("name", GOOD)
def test_realistic_names_are_names(name):
    assert name_problem(name) is None


@pytest.mark.parametrize("name", BAD)
def test_names_that_leave_their_folder_or_break_a_pattern_are_refused(name):
    assert name_problem(name) == f"{NAME_RULE}, got {name!r}"


def test_the_schema_documents_the_same_pattern():
    schema = load_schema(SCHEMA)
    props = schema["properties"]
    study = props["studies"]["additionalProperties"]["properties"]
    label = props["datasets"]["properties"]["strata"]["items"]["properties"]["label"]
    patterns = [
        props["models"]["propertyNames"]["pattern"],
        props["actions"]["propertyNames"]["pattern"],
        props["studies"]["propertyNames"]["pattern"],
        study["groups"]["propertyNames"]["pattern"],
        label["pattern"],
    ]
    for pattern in patterns:
        for name in GOOD + BAD:
            assert (re.search(pattern, name) is not None) == (name_problem(name) is None), name


def test_wildcard_alternation_matches_exactly_the_names():
    names = ["x+lora", "x", "a.b", "snapkv@0.5"]
    constraint = wildcard_alternation(names, "no-model")
    for name in names:
        assert re.fullmatch(f"(?:{constraint})", name)
    for other in ["xxlora", "x+lorax", "aXb", "xx", "snapkv@005"]:
        assert not re.fullmatch(f"(?:{constraint})", other), other
    assert re.fullmatch(wildcard_alternation([], "no-model"), "no-model")
    assert "|".join(names) != constraint  # the raw join, which matched 'xxlora' and not 'x+lora'
    assert not re.fullmatch("|".join(names[:1]), "x+lora")


def _rename(section: str, old: str, new: str):
    def mutate(cfg: dict) -> None:
        cfg[section] = {new if k == old else k: v for k, v in cfg[section].items()}

    return mutate


def _group(name: str):
    def mutate(cfg: dict) -> None:
        cfg["studies"]["study1"]["groups"] = {"main": ["snapkv-half", "full"], name: []}

    return mutate


def _label(label: str):
    def mutate(cfg: dict) -> None:
        cfg["datasets"]["strata"][0]["label"] = label

    return mutate


NAME_CASES = {
    "model with a slash": (
        _rename("models", "tiny-qwen", "org/qwen"),
        "models.org/qwen",
        "org/qwen",
    ),
    "model climbing out": (_rename("models", "tiny-qwen", "../qwen"), "models.../qwen", "../qwen"),
    "action climbing out": (
        _rename("actions", "recent-half", "../../x"),
        "actions.../../x",
        "../../x",
    ),
    "action with a slash": (
        _rename("actions", "recent-half", "recent/half"),
        "actions.recent/half",
        "recent/half",
    ),
    "study with dots": (_rename("studies", "study2", "st..udy"), "studies.st..udy", "st..udy"),
    "rollout group with a slash": (_group("g/1"), "studies.study1.groups.g/1", "g/1"),
    "stratum label climbing out": (_label(".."), "datasets.strata[0].label", ".."),
    "stratum label with a slash": (_label("4k/x"), "datasets.strata[0].label", "4k/x"),
}


@pytest.mark.parametrize("case", list(NAME_CASES))
def test_a_bad_name_stops_at_parse_time_with_one_line_naming_the_key(case):
    mutate, key, name = NAME_CASES[case]
    cfg = tiny()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, SCHEMA)
    assert one_line(info) == f"config.{key}: {NAME_RULE}, got {name!r}"


def test_realistic_names_pass_every_check():
    cfg = tiny()
    cfg["actions"]["snapkv@0.5"] = {"selector": "snapkv", "budget": 0.5, "window": 16}
    cfg["studies"]["study1"]["actions"].append("snapkv@0.5")
    cfg["studies"]["study1"]["groups"] = {
        "main": ["snapkv-512", "snapkv-half", "recent-half", "full"],
        "mine+v2": ["snapkv@0.5"],
    }
    cfg["models"]["smollm2+lora"] = cfg["models"].pop("tiny-qwen")
    cfg["datasets"]["strata"][0]["label"] = "1k+short"
    check_config(cfg, SCHEMA)


def test_templating_is_told_from_the_top_level_keys_without_evaluating(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text("rollout:\n  H: 8\nnote: '__use_yte__ is only text here'\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("rollout:\n  __use_yte__: true\n")
    off = tmp_path / "off.yaml"
    off.write_text("__use_yte__: false\nrollout: {H: 8}\n")
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout: [\n")
    assert not templated(plain) and not templated(nested) and not templated(broken)
    assert templated(off)  # refused whatever its value: a config file is data
    with pytest.raises(ConfigError) as info:
        check_config(tiny(), SCHEMA, files=[off])
    assert one_line(info).startswith(f"{off}: __use_yte__: YTE templating is refused")


def test_no_rule_builds_a_constraint_from_raw_names():
    """Every constraint from names goes through wildcard_alternation (the x+lora bug)."""
    files = sorted((ROOT / "workflow").rglob("*.smk")) + [ROOT / "Snakefile"]
    raw = [f.name for f in files if re.search(r"""["']\|["']\s*\.join""", f.read_text())]
    assert raw == []
    used = sum(f.read_text().count("wildcard_alternation(") for f in files)
    assert used >= 15
