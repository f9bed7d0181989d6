"""The file contracts (``docs/architecture.md``, "File contracts") and the atomic writes they
share.

* :mod:`kvdiverge.io.files`: atomic writes, Parquet with JSON metadata, SHA-256, job scratch
  areas (re-exported here);
* :mod:`kvdiverge.io.documents`: the documents file of a stratum;
* :mod:`kvdiverge.io.trajectories`: trajectory files (one action, one stratum);
* :mod:`kvdiverge.io.swrb_records`: SWRB record files.
"""

from kvdiverge.io.files import (
    JobScratch,
    atomic_path,
    atomic_write_text,
    clean_stale_temporaries,
    fsync_directory,
    read_parquet_metadata,
    sha256_file,
    temporary_pattern,
    write_parquet_with_metadata,
)

__all__ = [
    "JobScratch",
    "atomic_path",
    "atomic_write_text",
    "clean_stale_temporaries",
    "fsync_directory",
    "read_parquet_metadata",
    "sha256_file",
    "temporary_pattern",
    "write_parquet_with_metadata",
]
