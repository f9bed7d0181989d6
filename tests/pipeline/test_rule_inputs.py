"""Named inputs read back by key (kvdiverge.pipeline.rule_inputs; `keyed` in
workflow/rules/helpers/analysis.smk)."""

import pytest
from snakemake.iocontainers import InputFiles

from kvdiverge.pipeline.rule_inputs import keyed_inputs, split_keys


def _named(entries: dict) -> InputFiles:
    """A Snakemake named list as a job's `snakemake.input` holds it."""
    return InputFiles(fromdict=entries)


def test_keyed_inputs_returns_one_prefix_by_key_in_rule_order():
    named = _named(
        {
            "stats/tiny-qwen": "b.parquet",
            "lock": "lock.json",
            "stats/tiny-llama": "a.parquet",
            "statsx/other": "c.parquet",
            "trajectories/full": ["f1.parquet", "f2.parquet"],
        }
    )
    stats = keyed_inputs(named, "stats")
    assert stats == {"tiny-qwen": "b.parquet", "tiny-llama": "a.parquet"}
    assert list(stats) == ["tiny-qwen", "tiny-llama"]
    assert keyed_inputs(named, "trajectories") == {"full": ["f1.parquet", "f2.parquet"]}
    assert keyed_inputs(named, "amendment") == {}


def test_split_keys_gives_tuples_and_names_a_malformed_key():
    entries = {"m/snapkv-half/ruler-1024": "x.parquet", "m/full/ruler-1024": "y.parquet"}
    assert split_keys(entries, 3) == {
        ("m", "snapkv-half", "ruler-1024"): "x.parquet",
        ("m", "full", "ruler-1024"): "y.parquet",
    }
    with pytest.raises(ValueError, match="input key 'm/full': expected 3 names"):
        split_keys({"m/full": "z"}, 3)
