"""``metrics.json`` (kvdiverge.tables.metrics) and ``kvdiverge merge`` (kvdiverge.compare.merge):
one results file per run, read back exactly; runs merged into one table and figure, refused
in one line when a setting that makes numbers incomparable differs, unless allowed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import polars as pl
import pytest

from kvdiverge.cli import main
from kvdiverge.compare import compare
from kvdiverge.compare.merge import MergeError, merge_runs
from kvdiverge.tables.metrics import (
    COMPARED_SETTINGS,
    MetricsError,
    metrics_record,
    read_metrics,
    write_metrics,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "data" / "models" / "tiny-llama"
SETTINGS = {"H": 8, "temperature": 1.0, "K": 2, "coupling": "shared-reference", "level": 0.95,
            "draws": 50, "metric": "substring_match", "documents": "abc", "seed": 0}  # fmt: skip


def _estimands(shift: float) -> pl.DataFrame:
    rows = []
    for action, base in (("snapkv", 0.5), ("mine", 0.25)):
        for estimand, v in (("div_prob", base), ("mean_entry_time", 4 + base), ("R_smc", base / 2)):
            rows.append(
                {"model": "m", "action": action, "contrast": "", "stratum": "pooled",
                 "estimand": estimand, "value": v + shift, "ci_low": v - 0.1, "ci_high": v + 0.1,
                 "ci_level": 0.95, "n_docs": 4, "n_paths": 8, "draws_dropped": 0}
            )  # fmt: skip
    rows.append(rows[0] | {"stratum": "custom-prompts", "value": float("nan")})
    return pl.DataFrame(rows)


def _contrasts() -> pl.DataFrame:
    return pl.DataFrame(
        [{"action": "mine", "baseline": "snapkv", "estimand": "R_smc", "value": -0.125,
          "ci_low": -0.2, "ci_high": -0.05, "ci_level": 0.95, "n_docs": 4}]
    )  # fmt: skip


def _run(folder: Path, name: str, shift: float = 0.0, **settings) -> Path:
    record = metrics_record(
        kind="compare", name=name, models=["m"], actions={"snapkv": {"budget": 0.5}, "mine": {}},
        baseline="snapkv", settings=SETTINGS | settings, estimands=_estimands(shift),
        contrasts=_contrasts(),
    )  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    write_metrics(record, folder / "metrics.json")
    return folder


def test_a_record_reads_back_as_strict_json(tmp_path):
    folder = _run(tmp_path / "a", "a")
    text = (folder / "metrics.json").read_text()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON {c}"))
    record = read_metrics(folder)
    assert record["settings"]["H"] == 8 and len(record["digest"]) == 64
    nan_row = [r for r in record["estimands"] if r["stratum"] != "pooled"]
    assert nan_row[0]["value"] is None  # NaN written as null
    again = _run(tmp_path / "b", "b", shift=0.1)
    assert read_metrics(again)["digest"] == record["digest"]  # same design, other numbers


@pytest.mark.parametrize(
    "content,message",
    [
        ("{", "not a readable JSON file"),
        ("[]", "expected a JSON object, got list"),
        ('{"version": 1}', "not a kvdiverge metrics file (no kind, name, models"),
    ],
)
def test_a_broken_metrics_file_is_one_line(tmp_path, content, message):
    (tmp_path / "metrics.json").write_text(content)
    with pytest.raises(MetricsError) as err:
        read_metrics(tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'metrics.json'}: ") and message in str(err.value)


def test_merged_rows_are_the_runs_own_numbers(tmp_path):
    a, b = _run(tmp_path / "a", "a"), _run(tmp_path / "b", "b", shift=0.05, seed=1)
    merged, records = merge_runs([a, b])
    assert merged["run"].unique(maintain_order=True).to_list() == ["a", "b"]
    for run, record in zip(["a", "b"], records, strict=True):
        for row in record["estimands"]:
            if row["stratum"] != "pooled":
                continue
            found = merged.filter(
                (pl.col("run") == run) & (pl.col("action") == row["action"])
                & (pl.col("estimand") == row["estimand"]) & (pl.col("table") == "estimands")
            )  # fmt: skip
            assert found.select("value", "ci_low", "ci_high").row(0) == (
                row["value"],
                row["ci_low"],
                row["ci_high"],
            )
    con = merged.filter(pl.col("table") == "contrasts")
    assert con["contrast"].to_list() == ["mine - snapkv"] * 2 and con["value"][0] == -0.125
    assert "seed" not in merged.columns  # seeds may differ: not a compared setting


@pytest.mark.parametrize("field,value", [("H", 16), ("temperature", 0.0), ("documents", "x")])
def test_incomparable_runs_are_refused_unless_allowed(tmp_path, field, value):
    a, b = _run(tmp_path / "a", "a"), _run(tmp_path / "b", "b", **{field: value})
    with pytest.raises(MergeError) as err:
        merge_runs([a, b])
    assert str(err.value) == (
        f"{b / 'metrics.json'}: {field} = {value!r}, but {a / 'metrics.json'}: {field} = "
        f"{SETTINGS[field]!r}; runs with different {field} are not comparable (pass --allow "
        f"{field} to merge them anyway)"
    )
    merged, _ = merge_runs([a, b], allow=[field])
    assert set(merged[field]) == {str(SETTINGS[field]), str(value)}
    assert set(COMPARED_SETTINGS) >= {"H", "temperature", "K", "documents", "level"}


def test_bad_merge_arguments_are_one_line(tmp_path, capsys):
    a = _run(tmp_path / "a", "a")
    with pytest.raises(MergeError, match="expected at least two folders"):
        merge_runs([a])
    with pytest.raises(MergeError, match="--allow: 'seed' is not a compared setting"):
        merge_runs([a, _run(tmp_path / "b", "b")], allow=["seed"])
    assert main(["merge", str(a), str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvdiverge merge: ") and "no such file" in err and "\n" not in err


def test_the_command_writes_one_table_and_one_figure(tmp_path, capsys):
    a, b = _run(tmp_path / "a", "a"), _run(tmp_path / "b", "b", shift=0.05)
    out = tmp_path / "merged"
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"merged.{e}") for e in ("csv", "md", "html", "png", "pdf")]
    md = (out / "merged.md").read_text()
    assert (
        "| a | m | snapkv | 50.0% [40.0, 60.0] | 4.5 steps [4.4, 4.6] | 25.0% [15.0, 35.0] |" in md
    )
    assert "| b | m | mine - snapkv | -12.5 [-20.0, -5.0] |" in md
    assert (out / "merged.png").stat().st_size > 10_000 and "<table>" in (
        out / "merged.html"
    ).read_text()
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 2
    assert "holds merged.csv of an earlier merge; pass --force" in capsys.readouterr().err
    assert main(["merge", str(a), str(b), "--out", str(out), "--force"]) == 0


def test_a_compare_folder_writes_its_metrics(tmp_path):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": f"q{i}", "prompt": f"The owl keeps the number {i}. Which number?",
             "answers": [str(i)]} for i in range(2)]  # fmt: skip
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = compare(MODEL, prompts, "recent@0.5", baseline="full", K=1, H=4, draws=10,
                     out=tmp_path / "out", quiet=True)  # fmt: skip
    record = read_metrics(tmp_path / "out")
    assert record["kind"] == "compare" and record["models"] == ["tiny-llama"]
    assert record["settings"]["H"] == 4 and record["settings"]["K"] == 1
    assert record["baseline"] == {"recent@0.5": "full"}
    assert len(record["estimands"]) == result.estimands.height
    csv = pl.read_csv(tmp_path / "out" / "estimands.csv", infer_schema_length=None)
    first = csv.row(0, named=True)
    stored = record["estimands"][0]
    for key in ("action", "estimand", "stratum", "n_docs"):
        assert stored[key] == first[key]
    assert math.isclose(stored["value"], first["value"], rel_tol=1e-12)
    assert [r["action"] for r in record["contrasts"]][:1] == ["recent@0.5"]
    # one replicate per prompt: its τ is shown once, not as "τ of every replicate"
    assert "τ of every replicate" not in (tmp_path / "out" / "generations.html").read_text()
