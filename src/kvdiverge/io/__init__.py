"""The file contracts (``docs/architecture.md``, "File contracts") and the atomic writes they
share.

* :mod:`kvdiverge.io.files`: atomic writes and SHA-256 (re-exported here);
* :mod:`kvdiverge.io.parquet`: verified Parquet files with JSON metadata (page checksums and
  content digests; re-exported here);
* :mod:`kvdiverge.io.scratch`: a rollout job's scratch area (:class:`JobScratch`, re-exported
  here);
* :mod:`kvdiverge.io.documents`: the documents file of a stratum;
* :mod:`kvdiverge.io.trajectories`: trajectory files (one action, one stratum);
* :mod:`kvdiverge.io.swrb_records`: SWRB record files;
* :mod:`kvdiverge.io.roles`: a stored file's role against where it is read;
* :mod:`kvdiverge.io.locks`: a study's lock file, its registration history and rollout side;
* :mod:`kvdiverge.io.model_digest`: the digests of a model folder's weights and tokenizer.
"""

from kvdiverge.io.files import (
    atomic_path,
    atomic_write_text,
    clean_stale_temporaries,
    fsync_directory,
    sha256_file,
    temporary_pattern,
)
from kvdiverge.io.parquet import (
    StoredFileError,
    read_parquet_metadata,
    read_verified_parquet,
    write_parquet_with_metadata,
)
from kvdiverge.io.scratch import JobScratch

__all__ = [
    "JobScratch",
    "StoredFileError",
    "atomic_path",
    "atomic_write_text",
    "clean_stale_temporaries",
    "fsync_directory",
    "read_parquet_metadata",
    "read_verified_parquet",
    "sha256_file",
    "temporary_pattern",
    "write_parquet_with_metadata",
]
