"""SWRB record files: the Parquet contract of survival-weighted residual branching replicates.

One row per (document, replicate) of one action (`docs/method.md`, "Survival-weighted residual
branching"; produced by :func:`kvdiverge.engine.swrb_rollout.swrb_rollout_document`): the trunk's
per-step e_s and tokens U_s, the entry time J, the weight M, the branch trajectory's tokens
(x_token, y_token: U_<J, the residual pair at J, the continuation) and the cost in model
row-steps. File-level metadata (Parquet key-value, JSON) records the model, action, H, K, seed,
coupling (``swrb``), dtype, device and the number of documents.

:func:`read_swrb_records` checks every file against its contract (:func:`check_swrb_records`),
one line naming the file, document and replicate: columns and types; lists of length H; e_s in
[0, 1] (up to :data:`E_TOLERANCE`); M = 1 − Π_s(1 − e_s); J in 1..H with w_J > 0 when M > 0,
J = H + 1 when M = 0; x = y = U before J and x ≠ y at J; cost_scan = 2·(scan_steps − 1) and
costs ≥ 0; replicates of a document 0..k − 1 with k at most the metadata's K (its largest
value when K is per cohort); the number of documents equal to the metadata's ``n_documents``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from kvdiverge.io.parquet import (
    read_parquet_metadata,
    read_verified_parquet,
    write_parquet_with_metadata,
)
from kvdiverge.io.roles import role_problem, token_ids_problem
from kvdiverge.theory.survival import survival_weights

__all__ = [
    "SwrbRollout",
    "E_TOLERANCE",
    "SWRB_METADATA_KEYS",
    "SWRB_SCHEMA",
    "SwrbFormatError",
    "check_swrb_records",
    "check_swrb_role",
    "read_swrb_metadata",
    "read_swrb_records",
    "record_arrays",
    "swrb_frame",
    "write_swrb_records",
]

SWRB_SCHEMA: dict[str, pl.DataType] = {
    "doc_id": pl.String,
    "replicate": pl.Int32,
    "J": pl.Int16,
    "M": pl.Float64,
    "e": pl.List(pl.Float64),
    "trunk": pl.List(pl.Int32),
    "x_token": pl.List(pl.Int32),
    "y_token": pl.List(pl.Int32),
    "scan_steps": pl.Int16,
    "cost_scan": pl.Int32,
    "cost_continuation": pl.Int32,
    "n_prompt": pl.Int32,
    "n_kept": pl.Int32,
}

SWRB_METADATA_KEYS = (
    "model",
    "action",
    "H",
    "K",
    "seed",
    "coupling",
    "dtype",
    "device",
    "n_documents",
)

E_TOLERANCE = 1e-9
"""e_s may leave [0, 1], and M differ from 1 − Π(1 − e_s), by this much (float rounding)."""


class SwrbFormatError(ValueError):
    """An SWRB record file does not follow its contract (module docstring); one line."""


WHAT = "SWRB record file"


@dataclass
class SwrbRollout:
    """One document's SWRB replicates under one action; arrays (k,) or (k, H).

    ``e`` (k, H): e_s on the trunk (0 after the scan stopped); ``trunk`` (k, H): U_s, −1 where
    not drawn (after the scan stopped, or at a step with e_s = 1); ``weight`` M and ``entry`` J
    (H + 1 when M = 0); ``x_token``/``y_token`` (k, H): U_<J, then the residual pair at J and
    the continuation (when M = 0: the trunk, EOS after its EOS); ``scan_steps``: steps the scan
    evaluated; ``cost_scan`` and ``cost_continuation``: model row-steps (module docstring).
    """

    doc_id: str
    action: str
    replicates: np.ndarray
    e: np.ndarray
    trunk: np.ndarray
    weight: np.ndarray
    entry: np.ndarray
    x_token: np.ndarray
    y_token: np.ndarray
    scan_steps: np.ndarray
    cost_scan: np.ndarray
    cost_continuation: np.ndarray
    n_prompt: int
    n_kept: int

    @property
    def H(self) -> int:
        """The horizon."""
        return int(self.e.shape[1])

    @property
    def mismatch(self) -> np.ndarray:
        """I_t = 1{X_t ≠ Y_t} of the branch trajectory (k, H)."""
        return self.x_token != self.y_token

    @property
    def cost(self) -> np.ndarray:
        """Model row-steps per replicate: scan plus continuation."""
        return self.cost_scan + self.cost_continuation


def swrb_frame(rollouts: Sequence[SwrbRollout]) -> pl.DataFrame:
    """The records of one action's document rollouts, one row per (document, replicate)."""
    parts = []
    for r in rollouts:
        k = r.replicates.size
        parts.append(
            pl.DataFrame(
                {
                    "doc_id": [r.doc_id] * k,
                    "replicate": r.replicates,
                    "J": r.entry,
                    "M": r.weight,
                    "e": r.e.tolist(),
                    "trunk": r.trunk.tolist(),
                    "x_token": r.x_token.tolist(),
                    "y_token": r.y_token.tolist(),
                    "scan_steps": r.scan_steps,
                    "cost_scan": r.cost_scan,
                    "cost_continuation": r.cost_continuation,
                    "n_prompt": [r.n_prompt] * k,
                    "n_kept": [r.n_kept] * k,
                }
            )
        )
    if not parts:
        return pl.DataFrame(schema=SWRB_SCHEMA)
    return _conform(pl.concat(parts, how="vertical_relaxed"), "swrb_frame")


def _conform(frame: pl.DataFrame, where: str) -> pl.DataFrame:
    missing = [c for c in SWRB_SCHEMA if c not in frame.columns]
    if missing:
        raise SwrbFormatError(f"{where}: missing SWRB column(s) {', '.join(missing)}")
    try:
        return frame.select([pl.col(n).cast(d, strict=True) for n, d in SWRB_SCHEMA.items()])
    except (pl.exceptions.ComputeError, pl.exceptions.InvalidOperationError) as exc:
        raise SwrbFormatError(f"{where}: a column has the wrong type ({exc})") from exc


def record_arrays(frame: pl.DataFrame) -> dict[str, np.ndarray]:
    """The records as numpy arrays: (n,) scalars and (n, H) lists (``e``, tokens)."""
    out = {}
    for name in SWRB_SCHEMA:
        col = frame[name]
        if isinstance(SWRB_SCHEMA[name], pl.List):
            out[name] = np.array(col.to_list()) if frame.height else np.zeros((0, 0))
        else:
            out[name] = col.to_numpy()
    return out


def check_swrb_records(
    frame: pl.DataFrame, where: str, metadata: Mapping[str, Any] | None = None
) -> None:
    """Check SWRB records (conformed to :data:`SWRB_SCHEMA`) against the contract (module
    docstring); :class:`SwrbFormatError` naming ``where``, the document and the replicate."""
    meta = dict(metadata or {})
    nulls = frame.null_count().row(0, named=True)
    for name, count in nulls.items():
        if count:
            raise SwrbFormatError(f"{where}: column {name!r} has {count} null value(s)")
    if frame.height == 0:
        if meta.get("n_documents") not in (None, 0):
            raise SwrbFormatError(f"{where}: no rows, but n_documents = {meta['n_documents']}")
        return
    H = meta.get("H")
    lengths = frame.select(
        [pl.col(c).list.len().alias(c) for c in ("e", "trunk", "x_token", "y_token")]
    )
    H = int(H) if isinstance(H, int) else int(lengths["e"].max())
    docs, reps = frame["doc_id"].to_list(), frame["replicate"].to_list()

    def fail(i: int, text: str) -> None:
        raise SwrbFormatError(f"{where}: doc_id {docs[i]!r} replicate {reps[i]}: {text}")

    for c in lengths.columns:
        bad = np.flatnonzero(lengths[c].to_numpy() != H)
        if bad.size:
            fail(int(bad[0]), f"{c} has {lengths[c][int(bad[0])]} steps, expected H = {H}")
    a = record_arrays(frame)
    e, M, J = a["e"], a["M"], a["J"].astype(np.int64)
    bad = np.flatnonzero(~np.isfinite(e).all(1) | (e < -E_TOLERANCE).any(1))
    bad = np.union1d(bad, np.flatnonzero((e > 1 + E_TOLERANCE).any(1)))
    if bad.size:
        fail(int(bad[0]), "e_s outside [0, 1]")
    w, expected_M = survival_weights(np.clip(e, 0, 1))
    bad = np.flatnonzero(~(np.abs(M - expected_M) <= E_TOLERANCE))
    if bad.size:
        i = int(bad[0])
        fail(i, f"M = {M[i]!r}, expected 1 − Π(1 − e_s) = {expected_M[i]!r}")
    branch = M > 0
    bad = np.flatnonzero(np.where(branch, (J < 1) | (J > H), J != H + 1))
    if bad.size:
        i = int(bad[0])
        fail(i, f"J = {J[i]} with M = {M[i]!r}, expected 1..{H} when M > 0, else {H + 1}")
    idx = np.arange(J.size)
    j0 = np.clip(J, 1, H) - 1
    bad = np.flatnonzero(branch & ~(w[idx, j0] > 0))
    if bad.size:
        fail(int(bad[0]), f"entry J = {J[int(bad[0])]} has survival weight w_J = 0")
    t = np.arange(1, H + 1)[None, :]
    before = t < J[:, None]
    x, y, trunk = a["x_token"], a["y_token"], a["trunk"]
    bad = np.flatnonzero((before & ((x != y) | (x != trunk))).any(1))
    if bad.size:
        fail(int(bad[0]), "x_token and y_token must equal the trunk before J")
    bad = np.flatnonzero(branch & (x[idx, j0] == y[idx, j0]))
    if bad.size:
        fail(int(bad[0]), f"x_token = y_token at J = {J[int(bad[0])]} (the residual pair differs)")
    bad = np.flatnonzero(
        (a["cost_scan"] != 2 * np.maximum(a["scan_steps"] - 1, 0)) | (a["cost_continuation"] < 0)
    )
    if bad.size:
        fail(int(bad[0]), "cost_scan must be 2·(scan_steps − 1), costs non-negative")
    per_doc = frame.group_by("doc_id", maintain_order=True).agg(
        k=pl.len(), r_min=pl.col("replicate").min(), r_max=pl.col("replicate").max()
    )
    K = meta.get("K")
    for doc_id, k, lo, hi in per_doc.iter_rows():
        if (
            lo != 0
            or hi != k - 1
            or frame.filter(pl.col("doc_id") == doc_id)["replicate"].n_unique() != k
        ):
            raise SwrbFormatError(
                f"{where}: doc_id {doc_id!r}: replicates {lo}..{hi} in {k} rows, "
                f"expected 0..{k - 1} once each"
            )
        bound = max(K.values()) if isinstance(K, Mapping) and K else K
        if isinstance(bound, int) and k > bound:
            raise SwrbFormatError(f"{where}: doc_id {doc_id!r}: {k} replicates, metadata K = {K}")
    n_documents = meta.get("n_documents")
    if isinstance(n_documents, int) and n_documents != per_doc.height:
        raise SwrbFormatError(
            f"{where}: {per_doc.height} documents, but the metadata says n_documents = "
            f"{n_documents}"
        )


def write_swrb_records(
    frame: pl.DataFrame, path: str | os.PathLike, metadata: Mapping[str, Any]
) -> None:
    """Write SWRB records to ``path`` atomically with their metadata, after checking them.

    ``metadata`` must hold every key of :data:`SWRB_METADATA_KEYS`; values are stored as JSON.
    """
    missing = [k for k in SWRB_METADATA_KEYS if k not in metadata]
    if missing:
        raise SwrbFormatError(f"{path}: metadata missing key(s) {', '.join(missing)}")
    frame = _conform(frame, str(path))
    check_swrb_records(frame, str(path), metadata)
    write_parquet_with_metadata(frame, path, metadata)


def read_swrb_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The kvdiverge key-value metadata of an SWRB record file, decoded from JSON and checked
    against the digest it was written with (:mod:`kvdiverge.io.parquet`)."""
    return read_parquet_metadata(path, WHAT, SwrbFormatError)


def read_swrb_records(
    path: str | os.PathLike, check: bool = True, role: Mapping[str, Any] | None = None
) -> pl.DataFrame:
    """Read an SWRB record file and check it against its contract (module docstring).

    The file is verified first (page checksums and the digests it was written with,
    :func:`kvdiverge.io.parquet.read_verified_parquet`); the metadata must say
    ``coupling: swrb``. ``check=False`` checks columns and types only. ``role``: what the
    reader expects the file to be (model, action, ...; :func:`check_swrb_role`). Token ids
    (trunk, x_token, y_token) are >= 0, or −1 where the scan did not reach, and below the
    metadata's ``vocab_size`` where it records one.
    """
    frame, metadata = read_verified_parquet(
        path, WHAT, SwrbFormatError, conform=lambda data: _conform(data, str(path))
    )
    if metadata.get("coupling") != "swrb":
        raise SwrbFormatError(
            f"{path}: metadata coupling = {metadata.get('coupling')!r}, expected 'swrb'"
        )
    if role:
        check_swrb_role(path, metadata, role, frame["doc_id"].unique())
    _check_swrb_tokens(frame, path, metadata)
    if check:
        check_swrb_records(frame, str(path), metadata)
    return frame


def check_swrb_role(
    path: str | os.PathLike, metadata: Mapping[str, Any], role: Mapping[str, Any], doc_ids: Any
) -> None:
    """The file read as ``role`` (study, model, action, stratum, cohort) is that file: one
    :class:`SwrbFormatError` line otherwise (:func:`kvdiverge.io.roles.role_problem`)."""
    if problem := role_problem(path, metadata, role, doc_ids, WHAT):
        raise SwrbFormatError(problem)


def _check_swrb_tokens(frame: pl.DataFrame, path: str | os.PathLike, meta: Mapping) -> None:
    """Token ids in [0, vocab_size), −1 aside (a step the trunk's scan did not reach)."""
    for column in ("trunk", "x_token", "y_token"):
        ids = frame[column].explode().drop_nulls()
        ids = ids.filter(ids != -1)
        if ids.len() == 0:
            continue
        problem = token_ids_problem(path, column, ids.min(), ids.max(), meta.get("vocab_size"))
        if problem:
            raise SwrbFormatError(problem)
