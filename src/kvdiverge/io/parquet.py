"""Verified Parquet files: what is read back is what was written, or one line naming the file.

The documents, trajectory, SWRB record and document-statistics files (and a rollout job's
scratch frames) sit on disk for months; a flipped bit must not change a value silently.
Parquet's own page checksums (CRC-32 of each page's data) cover the
column values but not the page headers, the footer (schema, offsets, statistics) or the
key-value metadata, so each file also carries two SHA-256 digests of what it decodes to:

* ``kvdiverge.metadata_sha256``: of the ``kvdiverge.`` key-value metadata, decoded from JSON
  (:func:`metadata_digest`), checked by every read, the metadata-only one included;
* ``kvdiverge.table_sha256``: of the decoded table (:func:`frame_digest`: column names, types,
  values and nulls), checked by every read of the rows.

:func:`write_parquet_with_metadata` writes both, with page checksums (zstd, atomic);
:func:`read_verified_parquet` reads with page-checksum verification, validates the Arrow
arrays, and compares both digests; :func:`read_parquet_metadata` reads the metadata alone.
Every failure of a reader, including a Rust panic of a decoding library (a
``BaseException``), becomes one ``error`` naming the file (:func:`reading`). A file without
the digests (written by an older kvdiverge or another tool) is refused with a line saying to
rerun the job that writes it, unless the reader accepts unverified files (``require=False``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from kvdiverge.io.files import atomic_path

if TYPE_CHECKING:  # polars is imported where it runs: the workflow's parse uses this package
    import polars as pl

__all__ = [
    "DIGEST_KEYS",
    "METADATA_PREFIX",
    "StoredFileError",
    "checked_schema",
    "frame_digest",
    "metadata_digest",
    "read_parquet_metadata",
    "read_verified_parquet",
    "reading",
    "write_parquet_with_metadata",
]

METADATA_PREFIX = "kvdiverge."
"""The prefix of the project's keys in a Parquet file's key-value metadata."""

DIGEST_KEYS = ("metadata_sha256", "table_sha256")
"""The metadata keys (after the prefix) holding the file's two digests."""

_PASS = (KeyboardInterrupt, SystemExit, GeneratorExit)


class StoredFileError(ValueError):
    """A stored file cannot be read back as written; one line naming the file."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    first = first if len(first) <= 200 else first[:197] + "..."
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


@contextlib.contextmanager
def reading(
    path: str | os.PathLike, what: str, error: type[Exception] = StoredFileError
) -> Iterator[None]:
    """Turn any failure inside the block (an ``OSError``, a pyarrow or polars error, a JSON
    error, a Rust panic) into one ``error`` naming ``path``: ``<path>: not a readable <what>
    (<exception type>: <its first line>)``. An ``error`` raised inside passes unchanged, as do
    ``KeyboardInterrupt`` and ``SystemExit``."""
    try:
        yield
    except _PASS:
        raise
    except error:
        raise
    except BaseException as exc:  # noqa: BLE001 - pyo3's PanicException derives from it
        raise error(f"{path}: not a readable {what} ({_reason(exc)})") from exc


def checked_schema(schema: Any) -> Any:
    """``schema`` (a ``pyarrow.Schema``) without its key-value metadata, once every field name,
    type and metadata entry, nested ones included, decodes as text (Python raises an error;
    polars panics on text that is not UTF-8)."""

    def text(metadata: Any) -> None:
        for k, v in (metadata or {}).items():
            k.decode(), v.decode()

    def walk(field: Any) -> None:
        str(field.name), str(field.type)
        text(field.metadata)
        for i in range(field.type.num_fields):
            walk(field.type.field(i))

    text(schema.metadata)
    for i in range(len(schema)):
        walk(schema.field(i))
    return schema.remove_metadata()


def _feed(digest: Any, series: pl.Series) -> None:
    import polars as pl

    dtype = series.dtype
    digest.update(f"{series.name}\0{dtype}\0{series.len()}\0".encode())
    digest.update(series.is_null().to_numpy().tobytes())
    if isinstance(dtype, pl.List):
        digest.update(series.list.len().fill_null(0).cast(pl.Int64).to_numpy().tobytes())
        _feed(digest, series.explode().rename("item"))
    elif dtype == pl.String:
        filled = series.fill_null("")
        digest.update(filled.str.len_bytes().cast(pl.Int64).to_numpy().tobytes())
        digest.update((filled.str.join("").item() if len(filled) else "").encode())
    elif dtype == pl.Boolean:
        digest.update(series.fill_null(False).to_numpy().tobytes())
    elif dtype.is_numeric():
        digest.update(series.fill_null(0).to_numpy().tobytes())
    else:
        digest.update(json.dumps(series.to_list(), default=str).encode())


def frame_digest(frame: pl.DataFrame) -> str:
    """SHA-256 hex digest of a table's decoded content: each column's name, type, length,
    nulls and values (strings by their UTF-8 bytes and lengths, lists by their lengths and
    items), in column order; equal tables have equal digests however they are chunked."""
    digest = hashlib.sha256(f"{frame.width}\0{frame.height}\0".encode())
    for series in frame.get_columns():
        _feed(digest, series)
    return digest.hexdigest()


def metadata_digest(metadata: Mapping[str, Any]) -> str:
    """SHA-256 hex digest of decoded metadata (canonical JSON: sorted keys, no spaces), the
    digest keys themselves left out."""
    kept = {k: v for k, v in metadata.items() if k not in DIGEST_KEYS}
    text = json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def write_parquet_with_metadata(
    frame: pl.DataFrame, path: str | os.PathLike, metadata: Mapping[str, Any]
) -> None:
    """Write ``frame`` to ``path`` atomically (zstd Parquet with page checksums), its schema
    carrying every item of ``metadata`` as ``kvdiverge.<key>`` → JSON (sorted keys), the
    package version as ``kvdiverge.package_version`` and the two digests (module docstring).
    Digest keys in ``metadata`` are replaced by this file's own."""
    import pyarrow.parquet as pq

    from kvdiverge import __version__

    decoded = {
        k: json.loads(json.dumps(v, sort_keys=True, default=str))
        for k, v in metadata.items()
        if k not in DIGEST_KEYS
    }
    decoded["package_version"] = __version__
    decoded["metadata_sha256"] = metadata_digest(decoded)
    decoded["table_sha256"] = frame_digest(frame)
    meta = {f"{METADATA_PREFIX}{k}": json.dumps(v, sort_keys=True) for k, v in decoded.items()}
    table = frame.to_arrow()
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **meta})
    with atomic_path(path, suffix=".parquet") as tmp:
        pq.write_table(table, tmp, compression="zstd", write_page_checksum=True)


def _decode_metadata(raw: Mapping[bytes, bytes] | None) -> dict[str, Any]:
    return {
        k.decode()[len(METADATA_PREFIX) :]: json.loads(v.decode())
        for k, v in (raw or {}).items()
        if k.decode().startswith(METADATA_PREFIX)
    }


def _unverified(path: str | os.PathLike, what: str) -> str:
    return (
        f"{path}: this {what} carries no content checksum (written by an older kvdiverge or "
        f"another tool, or damaged), so it cannot be verified: rerun the job that writes it "
        f"(remove the file and run again)"
    )


def _verified_metadata(
    path: str | os.PathLike, what: str, error: type[Exception], raw: Any
) -> tuple[dict[str, Any], bool]:
    """(metadata without the digest keys, whether the file carries digests)."""
    with reading(path, what, error):
        metadata = _decode_metadata(raw)
    recorded = metadata.get("metadata_sha256")
    if recorded is not None and recorded != metadata_digest(metadata):
        raise error(
            f"{path}: damaged {what}: its metadata does not match the SHA-256 recorded when it "
            f"was written; rerun the job that writes it (remove the file and run again)"
        )
    return {k: v for k, v in metadata.items() if k not in DIGEST_KEYS}, recorded is not None


def read_parquet_metadata(
    path: str | os.PathLike,
    what: str = "Parquet file",
    error: type[Exception] = StoredFileError,
    require: bool = True,
) -> dict[str, Any]:
    """The ``kvdiverge.`` key-value metadata of a Parquet file, decoded from JSON and checked
    against its digest (the schema alone is read); the digest keys are left out. Any failure
    is one ``error`` naming the file (module docstring)."""
    import pyarrow.parquet as pq

    with reading(path, what, error):
        raw = pq.read_schema(path).metadata
    metadata, digested = _verified_metadata(path, what, error, raw)
    if require and not digested:
        raise error(_unverified(path, what))
    return metadata


def read_verified_parquet(
    path: str | os.PathLike,
    what: str = "Parquet file",
    error: type[Exception] = StoredFileError,
    require: bool = True,
    conform: Callable[[pl.DataFrame], pl.DataFrame] | None = None,
) -> tuple[pl.DataFrame, dict[str, Any]]:
    """The table and ``kvdiverge.`` metadata of a Parquet file, as written: page checksums
    verified, the Arrow arrays validated, both digests compared (module docstring). Any
    failure is one ``error`` naming the file. ``conform``: the contract's column and type
    check, run once the digests hold (so a damaged file is called damaged) and before a file
    without digests is refused (so a table missing a column is called that); ``require=False``
    accepts a file without digests (then only its page checksums, where it has them, are
    verified)."""
    import polars as pl
    import pyarrow as pa
    import pyarrow.parquet as pq

    with reading(path, what, error):
        table = pq.ParquetFile(path, page_checksum_verification=True).read()
        table.validate(full=True)
        schema = checked_schema(table.schema)
    metadata, digested = _verified_metadata(path, what, error, table.schema.metadata)
    with reading(path, what, error):
        frame = pl.from_arrow(pa.Table.from_batches(table.to_batches(), schema))
        assert isinstance(frame, pl.DataFrame)
        recorded = _decode_metadata(table.schema.metadata).get("table_sha256")
        same = frame_digest(frame) == recorded
    if digested and not same:
        raise error(
            f"{path}: damaged {what}: its table does not match the SHA-256 recorded when it was "
            f"written; rerun the job that writes it (remove the file and run again)"
        )
    if conform is not None:
        frame = conform(frame)
    if require and not digested:
        raise error(_unverified(path, what))
    return frame, metadata
