"""Bad configuration values, YAML files and cross-references, as a user writes them: each stopped at
parse time (:func:`kvdiverge.config.check_config`, :func:`kvdiverge.config.load_yaml_strict`) with
one line naming the field. The same refusals through real ``snakemake -n`` runs:
tests/workflow/test_dry_run_refusals.py."""

from __future__ import annotations

import pytest
from refusal_helpers import SCHEMA, one_line, tiny
from workflow_helpers import ROOT

from kvdiverge.config import ConfigError, check_config, load_yaml_strict


# ---- config values and cross-references: stopped at parse time ---------------------------------
def _set(path: str, value):
    """A mutation of the config: set the dotted ``path`` (keys may hold dashes) to ``value``."""

    def mutate(cfg: dict) -> None:
        *parents, last = path.split(".")
        node = cfg
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value

    return mutate


def _study(name: str, **spec):
    return lambda cfg: cfg["studies"].__setitem__(name, spec)


def _stratum(label: str, target: int):
    def mutate(cfg: dict) -> None:
        cfg["datasets"]["strata"] = [{"env": "ruler", "label": label, "target_tokens": target}]

    return mutate


CONFIG_CASES = {
    # kinds and ranges (strict: no coercion)
    "integer written as float": (
        _set("studies.study1.K_dev", 4.0),
        "config.studies.study1.K_dev: expected integer, got 4.0",
    ),
    "boolean for an integer": (
        _set("rollout.H", True),
        "config.rollout.H: expected integer, got True",
    ),
    "text for an integer": (
        _set("rollout.H", "32"),
        "config.rollout.H: expected integer, got '32'",
    ),
    "negative cohort size": (
        _set("datasets.cohorts.dev", -1),
        "config.datasets.cohorts.dev: expected a value >= 0, got -1",
    ),
    "zero budget": (
        _set("actions.snapkv-half.budget", 0),
        "config.actions.snapkv-half.budget: expected a value > 0, got 0",
    ),
    "fraction budget above 1": (
        _set("actions.snapkv-half.budget", 1.5),
        "config.actions.snapkv-half.budget: a float budget is a fraction of n in (0, 1]",
    ),
    "unknown selector": (
        _set("actions.snapkv-half.selector", "h2o"),
        "config.actions.snapkv-half.selector: expected one of full, quantize, quantized-cache, "
        "recent, snapkv, streaming, got 'h2o' (or kvpress with a `press`, or "
        "'package.module:Class' naming a Selector subclass of your own)",
    ),
    "even SnapKV kernel": (
        _set("actions.snapkv-half.kernel", 4),
        "config.actions.snapkv-half.kernel: expected an odd integer >= 1, got 4",
    ),
    "unknown key": (_set("rollout.horizon", 8), "config.rollout: unknown key(s) 'horizon'"),
    "interval level of 1": (
        _set("analysis.level", 1.0),
        "config.analysis.level: expected a value < 1, got 1.0",
    ),
    "H below the generation reserve": (
        _set("rollout.H", 64),
        "config.datasets.generation_reserve: 32 leaves less room than the rollout.H = 64",
    ),
    "EOS without a third token": (
        _set("finite_state.n_tokens", 2),
        "config.finite_state.n_tokens: expected at least 3 when eos_prob > 0",
    ),
    "figure of a system that does not exist": (
        _set("finite_state.interval_figure_systems", [0, 25]),
        "config.finite_state.interval_figure_systems: expected system indices < n_systems (25)",
    ),
    # models
    "demo and source together": (
        _set("models.tiny-llama.source", {"gguf": "x.gguf"}),
        "config.models.tiny-llama: expected `demo` or `source`, not both",
    ),
    "demo model with another path": (
        _set("models.tiny-llama.path", "elsewhere"),
        "config.models.tiny-llama.path: a demo model is built into data/models/tiny-llama",
    ),
    "model without path, demo or source": (
        _set("models.extra", {"dtype": "float32"}),
        "config.models.extra: expected `path` (directory or hub id), `demo` or `source`",
    ),
    "empty model path": (
        _set("models.extra", {"path": ""}),
        "config.models.extra.path: ",
    ),
    "training settings on a loaded model": (
        _set("models.extra", {"path": "org/name", "train": {}}),
        "config.models.extra.train: only a `demo` model is trained",
    ),
    # studies: actions, control, cohorts
    "study names an unknown action": (
        _set("studies.study1.actions", ["snapkv-999", "full"]),
        "config.studies.study1.actions: 'snapkv-999' is not in config.actions",
    ),
    "control is no configured action": (
        _set("studies.study1.control", "keep-all"),
        "config.studies.study1.control: 'keep-all' is not in config.actions",
    ),
    "control outside the study's actions": (
        _set("studies.study1.actions", ["snapkv-half", "recent-half"]),
        "config.studies.study1.control: 'full' is not one of the study's actions",
    ),
    "control that evicts": (
        _set("studies.study1.control", "snapkv-half"),
        "config.studies.study1.control: 'snapkv-half' uses selector 'snapkv'",
    ),
    "study of the control alone": (
        _set("studies.study1.actions", ["full"]),
        "config.studies.study1.actions: expected at least one action besides the control 'full'",
    ),
    "study whose cohort does not exist": (
        _study("study3", actions=["snapkv-half", "full"]),
        "config.studies.study3 (its cohort is its name): no cohort 'study3' in "
        "config.datasets.cohorts (study1, study2)",
    ),
    "study evaluated on the dev cohort": (
        _set("studies.study1.cohort", "dev"),
        "config.studies.study1.cohort: 'dev' is the development cohort every study runs",
    ),
    "evaluation cohort of size 0": (
        _set("datasets.cohorts.study1", 0),
        "config.datasets.cohorts.study1: 0 documents per stratum, but study 'study1' evaluates",
    ),
    "development cohort of size 0": (
        _set("datasets.cohorts.dev", 0),
        "config.datasets.cohorts.dev: 0 documents per stratum, but study 'study1' plans",
    ),
    # analysis and figures
    "contrast with an unknown action": (
        _set("analysis.contrasts.study1", [["snapkv-512", "h2o"]]),
        "config.analysis.contrasts.study1[0]: expected [b, a], two different non-control actions",
    ),
    "contrast of an unknown study": (
        _set("analysis.contrasts.study9", [["a", "b"]]),
        "config.analysis.contrasts: no study named 'study9' (study1, study2)",
    ),
    "contrast naming the control": (
        _set("analysis.contrasts.study1", [["snapkv-512", "full"]]),
        "config.analysis.contrasts.study1[0]: expected [b, a]",
    ),
    "prediction pair with an unknown action": (
        _set("analysis.prediction.pairs.study1", ["snapkv-512", "snapkv-999"]),
        "config.analysis.prediction.pairs.study1: expected [b, a], two different non-control",
    ),
    "prediction pair of an unknown study": (
        _set("analysis.prediction.pairs.study9", ["snapkv-512", "snapkv-half"]),
        "config.analysis.prediction.pairs: no study named 'study9'",
    ),
    "one development document per stratum": (  # the plan needs two (so does prediction)
        lambda c: (_stratum("1024", 1024)(c), _set("datasets.cohorts.dev", 1)(c)),
        "config.datasets.cohorts.dev: 1 document per stratum, but study 'study1' plans its "
        "evaluation from the variance between development documents within a stratum",
    ),
    "figure contrast that is no contrast": (
        _set("figures.main_contrast.study1", ["snapkv-half", "snapkv-512"]),
        "config.figures.main_contrast.study1: expected one of the study's contrasts",
    ),
    "unknown family estimand": (
        _set("analysis.family_estimands", ["S_99", "S_98"]),
        "config.analysis.family_estimands: 'S_98' is not a per-action estimand",
    ),
    "length tokenizer that is no model": (
        _set("datasets.length_tokenizer", "gpt-9"),
        "config.datasets.length_tokenizer: expected the name of a configured model "
        "(tiny-llama, tiny-qwen), got 'gpt-9'",
    ),
    "no length tokenizer": (
        _set("datasets.length_tokenizer", None),
        "config.datasets.length_tokenizer: expected the name of a configured model",
    ),
    "H too small for the analysis clock": (
        _set("rollout.H", 2),
        "config.rollout.H: 2 is too short for the analysis clock: analysis.clock.window 0.125 "
        "(a fraction of H) makes 1 step, and window must lie in 1..branch_depth/2 = 0; "
        "expected rollout.H >= 4, or another analysis.clock.window",
    ),
    "H of one step": (
        _set("rollout.H", 1),
        "config.rollout.H: 1 is too short for the analysis clock: H must be at least 2",
    ),
    # budgets against the strata's prompt lengths
    "absolute budget above every prompt": (
        _stratum("512", 512),
        "config.actions.snapkv-512: in stratum ruler-512 (prompts of at most 480 tokens: "
        "target_tokens 512 - generation_reserve 32): budget 512 keeps every entry",
    ),
    "SnapKV window longer than the prompts": (
        _set("actions.snapkv-half.window", 1000),
        "config.actions.snapkv-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): prompt of 992 tokens is too short for "
        "the 1000-token observation window",
    ),
    "fraction budget that keeps nothing": (
        _set("actions.snapkv-half.budget", 0.0001),
        "config.actions.snapkv-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): budget 0.0001 keeps no entry",
    ),
    "sinks beyond the budget": (
        _set("actions.recent-half.sinks", 600),
        "config.actions.recent-half: in stratum helmet-1024 (prompts of at most 992 tokens: "
        "target_tokens 1024 - generation_reserve 32): budget keeps 496 entries of a 992-token "
        "prompt, fewer than the 600 sink positions",
    ),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_config_case_stops_at_parse_time_with_one_line(case):
    mutate, expected = CONFIG_CASES[case]
    cfg = tiny()
    mutate(cfg)
    with pytest.raises(ConfigError) as info:
        check_config(cfg, SCHEMA)
    message = one_line(info)
    assert message.startswith(expected), f"{case}: {message}"


def test_shipped_configs_pass_every_check():
    for name in (
        "config.yaml",
        "configs/tiny.yaml",
        "configs/paper.yaml",
        "configs/cpu-study.yaml",
        "configs/cpu-study-greedy.yaml",
    ):
        cfg = load_yaml_strict(ROOT / name)
        check_config(cfg, SCHEMA, files=[ROOT / name])


YAML_CASES = {
    "duplicate key": (
        "rollout:\n  H: 32\n  coupling: independent\n  H: 16\n",
        "line 4: duplicate key 'H' (first at line 2); a YAML mapping takes each key once",
    ),
    "YAML 1.1 boolean": (
        "models:\n  m:\n    path: org/m\n    trust_remote_code: yes\n",
        "line 4: 'yes' is read as a boolean by YAML 1.1; write true or false",
    ),
    "YAML 1.1 octal": ("seed: 010\n", "line 1: '010' is read as the integer 8 by YAML 1.1"),
    "not YAML": ("rollout: [H: 3\n", ": not valid YAML ("),
}


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_config_file_is_read_strictly(case, tmp_path):
    text, expected = YAML_CASES[case]
    path = tmp_path / "override.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        check_config(tiny(), SCHEMA, files=[path])
    message = one_line(info)
    assert message.startswith(str(path)) and expected in message, message


def test_merge_keys_may_be_overridden(tmp_path):
    path = tmp_path / "anchors.yaml"
    path.write_text("base: &b {H: 8, coupling: independent}\nrollout:\n  <<: *b\n  H: 16\n")
    assert load_yaml_strict(path)["rollout"] == {"H": 16, "coupling": "independent"}
