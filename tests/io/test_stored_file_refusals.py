"""Stored files are verified when read (kvdiverge.io.parquet: page checksums and the SHA-256
digests they were written with): single-bit flips at a seeded sample of positions of real
trajectory, SWRB record, documents and document-statistics files either raise one line naming
the file or leave the decoded table and metadata identical; a file without digests is refused.
A trajectory file records the SHA-256 of its documents file and the analysis refuses another;
a job's damaged scratch unit is one line and rolled out again; a doc_id longer than a file name
rolls out (its scratch folder takes a digest)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from refusal_helpers import one_line, tiny

from kvdiverge.analysis.accuracy import accuracy_document_stats, metric_documents
from kvdiverge.analysis.document_stats import AnalysisInputError, document_stats
from kvdiverge.engine import RolloutSettings, run_stratum_rollout_job
from kvdiverge.engine.swrb_job import run_swrb_job
from kvdiverge.io import sha256_file
from kvdiverge.io.documents import (
    DocumentsFormatError,
    read_documents,
    read_documents_table,
    write_documents,
)
from kvdiverge.io.swrb_records import SwrbFormatError, read_swrb_metadata, read_swrb_records
from kvdiverge.io.trajectories import (
    TrajectoryFormatError,
    read_trajectories,
    read_trajectory_metadata,
)

ROOT = Path(__file__).resolve().parents[2]


FIXTURE = ROOT / "tests" / "data" / "documents" / "ruler-1024.parquet"


MODEL = {"name": "tiny-llama", "path": str(ROOT / "data" / "models" / "tiny-llama")}


ACTIONS = {"full": {"selector": "full"}, "recent-half": {"selector": "recent", "budget": 0.5}}


COHORTS = {name: {"dev": 2} for name in ACTIONS}


def fixture_documents() -> pl.DataFrame:
    """The documents fixture with its ``n_tokens`` (tiny-llama's chat-wrapped lengths), a
    documents table of the current contract."""
    from kvdiverge.models import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(MODEL["path"])
    frame = read_documents_table(FIXTURE)
    lengths = [len(chat_prompt_ids(tokenizer, p)) for p in frame["prompt"]]
    return frame.with_columns(n_tokens=pl.Series(lengths, dtype=pl.Int64))


@pytest.fixture(scope="module")
def rolled_out(tmp_path_factory) -> dict:
    """A real rollout job (tiny-llama, the fixture's two dev documents, H = 8) from the
    documents fixture written by today's writer: its documents and trajectory files."""
    root = tmp_path_factory.mktemp("rolled")
    documents = root / "documents" / "ruler-1024.parquet"
    write_documents(fixture_documents(), documents)
    out = {name: root / "trajectories" / name / "ruler-1024.parquet" for name in ACTIONS}
    run_stratum_rollout_job(documents, out, MODEL, ACTIONS, COHORTS, RolloutSettings(8, 1))
    return {"documents": documents, "trajectories": out, "root": root}


def _flips(data: bytes, count: int, seed: int) -> list[tuple[int, bytes]]:
    """``count`` single-bit flips of ``data`` at seeded random bit positions."""
    positions = random.Random(seed).sample(range(len(data) * 8), count)
    out = []
    for bit in positions:
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        out.append((bit, bytes(flipped)))
    return out


def _flip_outcomes(source: Path, target: Path, read, error, count: int, seed: int) -> dict:
    """Read every flipped copy of ``source`` at ``target``: each must raise one ``error`` line
    naming ``target`` or decode to exactly what ``source`` decodes to; returns the counts of
    the error kinds (the text after the file, up to its first parenthesis) and of 'identical'."""
    expected = read(source)
    kinds: dict[str, int] = {}
    for bit, data in _flips(source.read_bytes(), count, seed):
        target.write_bytes(data)
        try:
            got = read(target)
        except error as exc:
            message = str(exc)
            assert "\n" not in message and message.startswith(f"{target}: "), (bit, message)
            kind = message[len(f"{target}: ") :].split(" (")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        else:
            frame, meta = got
            assert frame.equals(expected[0]) and meta == expected[1], f"bit {bit} changed values"
            kinds["identical"] = kinds.get("identical", 0) + 1
    return kinds


def _read_trajectory(path: Path) -> tuple[pl.DataFrame, dict]:
    return read_trajectories(path), read_trajectory_metadata(path)


@pytest.mark.slow
def test_bit_flips_in_a_trajectory_file_raise_one_line_naming_it_or_change_nothing(
    rolled_out, tmp_path
):
    source = rolled_out["trajectories"]["recent-half"]
    target = tmp_path / "flipped.parquet"
    kinds = _flip_outcomes(source, target, _read_trajectory, TrajectoryFormatError, 600, 27)
    assert sum(kinds.values()) == 600
    assert kinds.get("identical", 0) > 0  # a flip in, e.g., the writer's name changes nothing
    # the page checksums and the digests each catch flips the other does not
    assert kinds.get("not a readable trajectory file", 0) > 0
    assert kinds.get("damaged trajectory file: its metadata does not match the SHA-256 recorded "
                     "when it was written; rerun the job that writes it", 0) > 0  # fmt: skip
    assert kinds.get("damaged trajectory file: its table does not match the SHA-256 recorded "
                     "when it was written; rerun the job that writes it", 0) > 0  # fmt: skip


@pytest.mark.slow
def test_page_checksums_alone_would_let_flips_change_values(rolled_out, tmp_path):
    """Why the files carry digests too: read with pyarrow's page-checksum verification alone,
    some flips of the same sample (page headers, footer, key-value metadata) decode to other
    values or other metadata without an error."""
    source = rolled_out["trajectories"]["recent-half"]
    expected = pq.ParquetFile(source).read()
    target = tmp_path / "flipped.parquet"
    silent = 0
    for _, data in _flips(source.read_bytes(), 600, 27):
        target.write_bytes(data)
        try:
            got = pq.ParquetFile(target, page_checksum_verification=True).read()
            got.validate(full=True)
        except Exception:  # noqa: BLE001 - any error is a caught flip here
            continue
        silent += not got.equals(expected, check_metadata=True)
    assert silent > 0


@pytest.mark.slow
def test_a_flipped_data_page_fails_its_page_checksum(rolled_out, tmp_path):
    """The files carry Parquet page checksums and are read with their verification: a flip in
    a column's data page values is a CRC failure naming the file."""
    source = rolled_out["trajectories"]["recent-half"]
    column = pq.ParquetFile(source).metadata.row_group(0).column(6)  # tv_rollout
    assert column.path_in_schema == "tv_rollout"
    start = column.dictionary_page_offset or column.data_page_offset
    end = start + column.total_compressed_size
    data = bytearray(source.read_bytes())
    data[end - 2] ^= 0x10  # the chunk's last page ends with its (compressed) values
    target = tmp_path / "page.parquet"
    target.write_bytes(bytes(data))
    with pytest.raises(TrajectoryFormatError) as info:
        read_trajectories(target)
    assert one_line(info).startswith(
        f"{target}: not a readable trajectory file (OSError: could not verify page integrity, "
        "CRC checksum verification failed"
    )


@pytest.mark.slow
def test_bit_flips_in_documents_and_swrb_record_files(rolled_out, tmp_path):
    documents = rolled_out["documents"]

    def read_docs(path):
        return read_documents(path), {}

    kinds = _flip_outcomes(documents, tmp_path / "d.parquet", read_docs, DocumentsFormatError,
                           200, 3)  # fmt: skip
    assert kinds.get("identical", 0) > 0 and len(kinds) > 2, kinds
    records = {name: tmp_path / "swrb" / f"{name}.parquet" for name in ACTIONS}
    run_swrb_job(documents, records, MODEL, ACTIONS, COHORTS, H=8, seed=1)
    assert read_swrb_metadata(records["recent-half"])["documents"] == {
        "file": str(documents),
        "sha256": sha256_file(documents),
    }

    def read_records(path):
        return read_swrb_records(path), read_swrb_metadata(path)

    kinds = _flip_outcomes(records["recent-half"], tmp_path / "r.parquet", read_records,
                           SwrbFormatError, 200, 5)  # fmt: skip
    assert kinds.get("identical", 0) > 0 and len(kinds) > 2, kinds


@pytest.mark.slow
def test_a_file_without_digests_is_refused_with_a_line_saying_to_rerun(rolled_out, tmp_path):
    source = rolled_out["trajectories"]["recent-half"]
    table = pq.read_table(source)
    old = {
        k: v
        for k, v in table.schema.metadata.items()
        if k not in (b"kvdiverge.metadata_sha256", b"kvdiverge.table_sha256")
    }
    path = tmp_path / "old.parquet"
    pq.write_table(table.replace_schema_metadata(old), path)
    expected = (
        f"{path}: this trajectory file carries no content checksum (written by an older "
        "kvdiverge or another tool, or damaged), so it cannot be verified: rerun the job that "
        "writes it (remove the file and run again)"
    )
    for read in (read_trajectories, read_trajectory_metadata):
        with pytest.raises(TrajectoryFormatError) as info:
            read(path)
        assert one_line(info) == expected


# ---- the documents a trajectory file was rolled out from -------------------------------------
@pytest.mark.slow
def test_trajectory_files_record_their_documents_file(rolled_out):
    documents = rolled_out["documents"]
    for path in rolled_out["trajectories"].values():
        assert read_trajectory_metadata(path)["documents"] == {
            "file": str(documents),
            "sha256": sha256_file(documents),
        }
    files = {name: [path] for name, path in rolled_out["trajectories"].items()}
    stats, _ = document_stats(files, [documents], control="full")
    assert stats.height == 4  # 2 documents x 2 actions


def _datasets_section() -> dict:
    from kvdiverge.config import check_config

    cfg = tiny()
    check_config(cfg, ROOT / "workflow" / "schemas" / "config.schema.yaml")  # fills defaults
    return cfg["datasets"]


@pytest.mark.slow
def test_changed_documents_are_refused_naming_both_files(rolled_out, tmp_path):
    """The issue's case: the documents file replaced by other content, its modification time
    kept (so Snakemake reruns nothing); document statistics and accuracy refuse it."""
    documents = tmp_path / "documents" / "ruler-1024.parquet"
    documents.parent.mkdir()
    shutil.copy2(rolled_out["documents"], documents)
    files = {name: [path] for name, path in rolled_out["trajectories"].items()}
    recorded = sha256_file(rolled_out["documents"])
    document_stats(files, [documents], control="full")  # an identical copy passes
    stat = documents.stat()
    changed = read_documents(documents).with_columns(answers=pl.lit(["other"]))
    write_documents(changed, documents)
    os.utime(documents, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    now = sha256_file(documents)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    full = rolled_out["trajectories"]["full"]
    expected = (
        f"{full}: rolled out from a documents file with SHA-256 {recorded[:16]}, but "
        f"{documents} has SHA-256 {now[:16]}: the documents changed after the rollout; rerun "
        f"the rollout (remove {full}, or touch {documents}, and run again)"
    )
    with pytest.raises(AnalysisInputError) as info:
        document_stats(files, [documents], control="full")
    assert one_line(info) == expected
    scored = metric_documents([documents], _datasets_section())
    with pytest.raises(AnalysisInputError) as info:
        accuracy_document_stats(files, scored, tokenizer=None, depth=4)
    assert one_line(info) == expected
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.slow
def test_a_trajectory_file_recording_no_documents_is_refused(rolled_out, tmp_path):
    from kvdiverge.io.trajectories import write_trajectories

    source = rolled_out["trajectories"]["recent-half"]
    meta = read_trajectory_metadata(source)
    del meta["documents"]
    path = tmp_path / "recent-half.parquet"
    write_trajectories(read_trajectories(source), path, meta)
    with pytest.raises(AnalysisInputError) as info:
        document_stats({"recent-half": [path]}, [rolled_out["documents"]])
    assert one_line(info) == (
        f"{path}: its metadata records no SHA-256 of the documents file it was rolled out from "
        f"(written by an older kvdiverge), so it cannot be matched to {rolled_out['documents']}: "
        "rerun its rollout (remove the file and run again)"
    )


@pytest.mark.slow
def test_a_doc_id_longer_than_a_file_name_rolls_out(tmp_path):
    """Its scratch folder (the one place a doc_id reaches a file name) takes a digest instead,
    so the job runs and writes the doc_id whole."""
    long_id = "ruler-1024/dev/" + "x" * 300
    frame = fixture_documents()
    first = frame.filter(pl.col("cohort") == "dev")["doc_id"].sort()[0]
    renamed = frame.with_columns(
        doc_id=pl.when(pl.col("doc_id") == first).then(pl.lit(long_id)).otherwise("doc_id")
    )
    documents = tmp_path / "ruler-1024.parquet"
    write_documents(renamed, documents)
    out = {"recent-half": tmp_path / "out" / "recent-half.parquet"}
    actions = {"recent-half": ACTIONS["recent-half"]}
    run_stratum_rollout_job(
        documents, out, MODEL, actions, {"recent-half": {"dev": 2}}, RolloutSettings(8, 1)
    )
    written = read_trajectories(out["recent-half"])
    assert long_id in set(written["doc_id"]) and written["doc_id"].n_unique() == 2
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["recent-half.parquet"]


def test_the_table_digest_is_of_the_decoded_values():
    """Equal tables give one digest however they are chunked; any change of a value, a null,
    a list's length or a type gives another."""
    from kvdiverge.io.parquet import frame_digest

    base = pl.DataFrame(
        {
            "s": ["a", "", None],
            "n": [1, 2, 3],
            "l": [[1.0], [], [2.0, 3.0]],
            "b": [True, False, True],
        }
    )
    chunked = pl.concat([base.head(1), base.tail(2)], rechunk=False)
    assert chunked.n_chunks() == 2 and frame_digest(chunked) == frame_digest(base)
    changes = [
        base.with_columns(s=pl.Series(["a", None, None])),  # empty string -> null
        base.with_columns(s=pl.Series(["a", "", ""])),  # null -> empty string
        base.with_columns(n=pl.Series([1, 2, 4])),
        base.with_columns(n=pl.col("n").cast(pl.Int32)),
        base.with_columns(l=pl.Series([[1.0], [2.0], [3.0]])),  # same items, other lengths
        base.with_columns(b=pl.Series([True, True, True])),
        base.rename({"b": "c"}),
    ]
    digests = {frame_digest(f) for f in changes}
    assert len(digests) == len(changes) and frame_digest(base) not in digests


def test_a_damaged_scratch_unit_is_one_line_and_rolled_out_again(tmp_path):
    """A job's scratch area (finished documents kept across a kill) is verified as well: a
    flipped bit in a saved frame is one line naming the file, and the unit is discarded, so
    the rerun rolls that document out again instead of writing damaged values."""
    from kvdiverge.io import JobScratch, StoredFileError

    scratch = JobScratch([tmp_path / "out.parquet"], key={"H": 8})
    frame = pl.DataFrame({"doc_id": ["s/dev/000"] * 3, "x": [1, 2, 3]})
    scratch.save("s/dev/000", {"a": frame}, info={"seconds": 1})
    assert scratch.load("s/dev/000")[0]["a"].equals(frame)
    path = next(scratch.root.glob("*/a.parquet"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(StoredFileError) as info:
        scratch.load_all()
    message = one_line(info)
    assert message.startswith(f"{path}: ")
    assert message.endswith(
        "[the scratch unit of doc_id 's/dev/000' is discarded: rerun the job to roll that "
        "document out again]"
    )
    assert not scratch.done("s/dev/000") and scratch.doc_ids() == []


@pytest.mark.slow
def test_bit_flips_in_a_document_stats_file(rolled_out, tmp_path):
    """The statistics the estimands read sit on disk between rules too: verified the same way."""
    from kvdiverge.analysis.document_stats import read_document_stats, write_document_stats

    files = {name: [path] for name, path in rolled_out["trajectories"].items()}
    stats, clock = document_stats(files, [rolled_out["documents"]], control="full")
    path = tmp_path / "document_stats.parquet"
    write_document_stats(stats, path, clock)

    def read(p):
        frame, back = read_document_stats(p)
        return frame, {"clock": back}

    assert read(path)[0].equals(stats) and read(path)[1] == {"clock": clock}
    kinds = _flip_outcomes(path, tmp_path / "f.parquet", read, AnalysisInputError, 200, 9)
    assert kinds.get("identical", 0) > 0 and len(kinds) > 2, kinds
