"""The memory plan of a rollout job: its peak device memory from the model's shapes, the
documents' lengths and the batch plan, before any weight is loaded (``docs/running.md``,
"Memory and time per job").

A rollout job holds, at its peak (:func:`batch_peak`):

* the weights, every parameter counted from the shapes of ``config.json``
  (:meth:`ModelShape.parameters`, equal to the transformers model's own count: tested);
* for each document of the running batch, its prompt caches: the full cache (keys and values of
  every layer, :func:`kv_bytes`), each gathered action's kept entries, each masked action's
  per-layer mask and additive bias (:func:`mask_bytes`); a prompt transformation's and a
  decoding action's own prompt part is gathered whatever its share of the prompt
  (:class:`HeldPart`);
* then the larger of the prefill of the batch's longest document (:func:`prefill_bytes`) and
  the decoding state: the rows' own generated entries (:func:`row_cache_bytes`) with a step's
  logits and float64 coupling buffers (:func:`decode_bytes`), and in a batch with a decoding
  action the masks of what each row keeps and their additive biases
  (:func:`decoding_mask_bytes`).

The batches are the engine's own (:func:`kvdiverge.engine.batches.plan_batches`), so the plan
counts exactly the rows each model call holds. With ``max_batch_rows: auto`` the budget is the
largest that fits the device (:func:`auto_batch_rows`): a whole number of documents' rows,
evaluation rows and control together, so the control never runs in a batch of its own. A job
that cannot fit even one replicate per call is refused in one line with the numbers
(:func:`check_fits`). The terms assume the fused attention kernels (no score matrix over the
prompt is held). The estimate is checked against measured peaks on CPU
(``tests/engine/test_memory_plan.py``); the device's allocator keeps some memory besides, so a plan
fits when it is at most :data:`USABLE_FRACTION` of the device's memory less
:data:`CONTEXT_BYTES`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdiverge.engine.batch_plan import MASKED_MIN_FRACTION, plan_batches
from kvdiverge.engine.preflight import PreflightError

__all__ = [
    "CONTEXT_BYTES",
    "KNOWN_CONFIGS",
    "USABLE_FRACTION",
    "HeldPart",
    "JobPlan",
    "ModelShape",
    "auto_batch_rows",
    "batch_peak",
    "check_fits",
    "check_job_memory",
    "decode_bytes",
    "decoding_mask_bytes",
    "format_plan",
    "job_plan_args",
    "kv_bytes",
    "mask_bytes",
    "masked_bias_bytes",
    "plan_config",
    "plan_job",
    "prefill_bytes",
    "row_cache_bytes",
]

log = logging.getLogger(__name__)

GB = 1e9
USABLE_FRACTION = 0.92  # of a device's memory: the rest for the allocator's fragmentation
CONTEXT_BYTES = 1 << 30  # CUDA context and library workspaces, outside the allocator

# The published config.json values (the hub's files) of the paper's models, for a plan made
# where the model folder is not present (a dry run on a login node, no download).
KNOWN_CONFIGS: Mapping[str, Mapping[str, Any]] = {
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen2.5-7B-Instruct": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
}

_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan needs of a decoder-only model (Llama/Qwen2/Mistral families)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    dtype_bytes: int
    source: str = "config.json"

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], dtype: str = "auto", source: str = "config.json"
    ) -> ModelShape:
        """The shape from a ``config.json`` dict; ``dtype`` ``auto`` takes the config's
        (``torch_dtype`` or ``dtype``, float32 when absent)."""
        c = dict(config.get("text_config") or config)
        heads = int(c["num_attention_heads"])
        name = (c.get("torch_dtype") or c.get("dtype") or "float32") if dtype == "auto" else dtype
        if str(name).removeprefix("torch.") not in _DTYPE_BYTES:
            raise PreflightError(f"{source}: dtype {name!r} is not one the memory plan knows")
        return cls(
            layers=int(c["num_hidden_layers"]),
            hidden=int(c["hidden_size"]),
            heads=heads,
            kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            intermediate=int(c["intermediate_size"]),
            vocab=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            dtype_bytes=_DTYPE_BYTES[str(name).removeprefix("torch.")],
            source=source,
        )

    def parameters(self) -> int:
        """Parameters: embeddings V·h (and an untied head V·h), per layer the q, k, v, o
        projections h·(H + 2H_kv)·d + H·d·h (q/k/v biases (H + 2H_kv)·d), the MLP 3·h·I and two
        norms 2h, and the final norm h."""
        h, d, qkv = self.hidden, self.head_dim, (self.heads + 2 * self.kv_heads) * self.head_dim
        layer = h * qkv + self.heads * d * h + 3 * h * self.intermediate + 2 * h
        layer += qkv if self.qkv_bias else 0
        return self.vocab * h * (1 if self.tied else 2) + self.layers * layer + h


def kv_bytes(shape: ModelShape, entries: float) -> float:
    """A prompt part of ``entries`` entries per layer and KV head: 2·L·H_kv·entries·d·b."""
    return 2 * shape.layers * shape.kv_heads * entries * shape.head_dim * shape.dtype_bytes


def mask_bytes(shape: ModelShape, n: int) -> float:
    """A masked action's kept set over an n-token prompt: per layer a (H_kv, n) bool mask, its
    float32 additive bias and that bias in the pass's stacked table, L·H_kv·n·(1 + 4 + 4)."""
    return shape.layers * shape.kv_heads * n * 9


class HeldPart(int):
    """Prompt entries per layer and KV head (:func:`job_kept`) held gathered whatever their
    share: a prompt transformation's (n for KIVI, the kept count for MergingPress) and, with
    ``decoding``, a decoding action's, whose rows also hold :func:`decoding_mask_bytes`."""

    decoding: bool

    def __new__(cls, entries: int, decoding: bool = False) -> HeldPart:
        held = super().__new__(cls, entries)
        held.decoding = decoding
        return held


def decoding_mask_bytes(
    shape: ModelShape, rows: int, width: int, H: int, biased: Sequence[tuple[int, int]] = ()
) -> float:
    """What a batch with a decoding action holds for it besides the entries
    (:class:`kvdiverge.engine.decoding_compression.CompressingRowCache`): per layer a bool mask
    over every batch row's prompt part (``width``: the batch's longest decoding prompt part)
    and own entries (max(H − 1, 1)), L·rows·H_kv·(width + max(H − 1, 1)); and, once a group has
    evicted, each layer's float32 additive prompt bias of its rows and their int32 query row
    index, L·(4·r·H_kv·n_g + 4·r·G) for each ``biased`` group of r rows and n_g prompt entries
    (G: query heads per KV head)."""
    L, n_kv = shape.layers, shape.kv_heads
    masks = L * rows * n_kv * (width + max(H - 1, 1))
    groups = shape.heads // n_kv
    bias = sum(L * 4 * r * (n_kv * n_g + groups) for r, n_g in biased)
    return float(masks + bias)


def row_cache_bytes(shape: ModelShape, rows: int, H: int) -> float:
    """The rows' own generated entries, preallocated for H − 1 steps: 2·L·rows·H_kv·(H−1)·d·b."""
    return kv_bytes(shape, rows * max(H - 1, 1))


def decode_bytes(shape: ModelShape, rows: int, k_max: int) -> float:
    """One decoding step's transients: the step's logits in the model's dtype, their float64
    copy and softmax, and the previous step's float64 laws still held (rows·V·(b + 24)); a
    unit's float64 laws and coupling buffers (8 of k·V); the layers' activations
    (rows·(4h + 3I)·b)."""
    V, b = shape.vocab, shape.dtype_bytes
    activations = rows * (4 * shape.hidden + 3 * shape.intermediate) * b
    return rows * V * (b + 24) + 8 * k_max * V * 8 + activations


def prefill_bytes(shape: ModelShape, n: int, window: int = 0) -> float:
    """The prefill of an n-token prompt besides its cache: a layer's activations (the MLP's
    three n·I products, four n·h hidden states, the q, k, v projections and their rotated
    copies, the keys and values repeated to every query head for SDPA and its output,
    3·n·H·d), the last position's logits in float32, and SnapKV's window scores of a layer
    (H·w·n float32)."""
    b = shape.dtype_bytes
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
    attention = 3 * shape.heads * shape.head_dim
    activations = n * (3 * shape.intermediate + 4 * shape.hidden + 2 * qkv + attention) * b
    return activations + 4 * shape.vocab + 4 * shape.heads * window * n


@dataclass(frozen=True)
class JobPlan:
    """A job's plan: its batches' rows and peak bytes, by part at the largest peak."""

    max_batch_rows: int
    batches: int
    rows: list[int]
    peak: float
    parts: dict[str, float]
    documents: tuple[tuple[int, ...], ...] = ()  # each batch's documents

    @property
    def peak_gb(self) -> float:
        return self.peak / GB


def _groups(actions: Sequence[str], K: int, K_control: int, control: str | None) -> list[tuple]:
    """Reference groups (rows per replicate, replicates) as the engine forms them: the actions
    with the same replicates share X; every member counts its Y and Z rows."""
    if control is None or K == K_control:
        return [(1 + 2 * len(actions), K)]
    return [(1 + 2 * (len(actions) - 1), K), (3, K_control)]


def _part_bytes(shape: ModelShape, n: int, kept: Sequence[int], packed: bool = False) -> float:
    """A document's prompt caches: the full cache, and per action its gathered entries (kept
    below :data:`MASKED_MIN_FRACTION` of n, or a :class:`HeldPart` of any size) or its mask (a
    masked action keeping less than n). ``packed``: the CPU's native prompt kernel also holds
    each part's keys packed in blocks (half its bytes again)."""
    held = [keep for keep in kept if isinstance(keep, HeldPart)]
    selected = [keep for keep in kept if not isinstance(keep, HeldPart)]
    parts = [n] + [keep for keep in selected if keep < MASKED_MIN_FRACTION * n] + held
    total = sum(kv_bytes(shape, entries) for entries in parts) * (1.5 if packed else 1.0)
    masked = sum(MASKED_MIN_FRACTION * n <= keep < n for keep in selected)
    return total + masked * mask_bytes(shape, n)


def batch_peak(
    shape: ModelShape,
    lengths: Sequence[int],
    kept: Sequence[Sequence[int]],
    rows: int,
    k_max: int,
    H: int,
    window: int = 0,
    packed: bool = False,
    bias_rows: int = 0,
    decoding_masks: float = 0.0,
) -> dict[str, float]:
    """Peak bytes of one batch, by part: the weights, the prompt caches of its documents
    (``lengths``, ``kept[d]`` per action), and the larger of the longest document's prefill and
    the decoding state of ``rows`` rows (units of at most ``k_max`` replicates). ``bias_rows``:
    the rows of the largest masked pass, whose additive bias the CUDA library kernels take
    materialised, (1, H_kv, rows·G, n) in the model's dtype, one layer at a time
    (:func:`masked_bias_bytes`). ``decoding_masks``: a decoding action's masks and biases
    (:func:`decoding_mask_bytes`), part of the decoding state."""
    prefill = prefill_bytes(shape, max(lengths), window)
    bias = masked_bias_bytes(shape, bias_rows, max(lengths))
    decoding = row_cache_bytes(shape, rows, H) + decode_bytes(shape, rows, k_max) + bias
    decoding += decoding_masks  # a decoding action's
    decodes = decoding >= prefill
    return {
        "weights": shape.parameters() * shape.dtype_bytes,
        "prompt caches": sum(
            _part_bytes(shape, n, k, packed) for n, k in zip(lengths, kept, strict=True)
        ),
        "row caches": row_cache_bytes(shape, rows, H) if decodes else 0.0,
        "logits and coupling": decode_bytes(shape, rows, k_max) if decodes else 0.0,
        "masked bias": bias if decodes else 0.0,
        "decoding masks": decoding_masks if decodes else 0.0,
        "prefill": prefill if not decodes else 0.0,
    }


def masked_bias_bytes(shape: ModelShape, rows: int, n: int) -> float:
    """A masked pass's materialised additive bias for ``rows`` rows over an n-token prompt:
    rows·H·n·b (every query head of every row, one layer at a time)."""
    return rows * shape.heads * n * shape.dtype_bytes


def plan_job(
    shape: ModelShape,
    lengths: Sequence[int],
    kept: Sequence[Sequence[int]],
    actions: Sequence[str],
    K: int,
    K_control: int,
    control: str | None,
    H: int,
    max_batch_rows: int,
    window: int = 0,
    packed: bool = False,
    bias: bool = False,
) -> JobPlan:
    """The job's batches (:func:`kvdiverge.engine.batches.plan_batches`, every member counted as
    evicting) and the largest batch peak. ``kept[d]``: document d's kept entries per action, in
    ``actions`` order (the control among them); ``control``: the control's name, if any;
    ``packed``: the CPU native kernel's packed keys; ``bias``: the CUDA masked pass's bias (a
    document's rows in the batch, all counted as in its pass: a bound)."""
    groups = _groups(actions, K, K_control, control)
    per = [[g[0] for g in groups] for _ in lengths]
    reps = [[list(range(g[1])) for g in groups] for _ in lengths]
    batches = plan_batches(per, reps, max_batch_rows)
    best: dict[str, float] = {}
    rows, documents = [], []
    for batch in batches:
        docs = sorted({p.doc for p in batch})
        documents.append(tuple(docs))
        n_rows = sum(p.rows for p in batch)
        rows.append(n_rows)
        per_doc = [sum(p.rows for p in batch if p.doc == d) for d in docs]
        masked = [any(MASKED_MIN_FRACTION * lengths[d] <= k for k in kept[d]) for d in docs]
        bias_rows = max((r for r, m in zip(per_doc, masked, strict=True) if m), default=0)
        parts = batch_peak(
            shape,
            [lengths[d] for d in docs],
            [kept[d] for d in docs],
            n_rows,
            max(len(p.replicates) for p in batch),
            H,
            window,
            packed,
            bias_rows if bias else 0,
            _decoding_masks(shape, batch, kept, n_rows, H),
        )
        if sum(parts.values()) > sum(best.values()):
            best = parts
    return JobPlan(max_batch_rows, len(batches), rows, sum(best.values()), best, tuple(documents))


def _decoding_masks(
    shape: ModelShape, batch: Sequence[Any], kept: Sequence[Sequence[int]], rows: int, H: int
) -> float:
    """A batch's :func:`decoding_mask_bytes` (0 without a decoding action): each document's
    decoding actions' biases over their Y and Z rows, two per replicate of its group 0."""
    docs = sorted({p.doc for p in batch})
    parts = {d: [k for k in kept[d] if getattr(k, "decoding", False)] for d in docs}
    if not any(parts.values()):
        return 0.0
    width = max(int(k) for d in docs for k in parts[d])
    biased = []
    for d in docs:
        replicates = sum(len(p.replicates) for p in batch if p.doc == d and p.group == 0)
        biased += [(2 * replicates, int(k)) for k in parts[d] if replicates]
    return decoding_mask_bytes(shape, rows, width, H, biased)


def usable_bytes(device_bytes: float) -> float:
    """What a plan may use of a device: :data:`USABLE_FRACTION` of it less
    :data:`CONTEXT_BYTES`."""
    return USABLE_FRACTION * device_bytes - CONTEXT_BYTES


def auto_batch_rows(
    shape: ModelShape,
    lengths: Sequence[int],
    kept: Sequence[Sequence[int]],
    actions: Sequence[str],
    K: int,
    K_control: int,
    control: str | None,
    H: int,
    device_bytes: float,
    window: int = 0,
    packed: bool = False,
    bias: bool = False,
) -> JobPlan:
    """The plan with the largest row budget that fits the device: whole documents' rows
    (evaluation and control together) up to every document in one call; below one document's
    rows, the largest budget of whole replicates that fits. Raises :class:`PreflightError`
    (:func:`check_fits`) when one replicate per call does not fit."""
    groups = _groups(actions, K, K_control, control)
    per_doc = sum(r * k for r, k in groups)
    limit = usable_bytes(device_bytes)

    def plan(budget: int) -> JobPlan:
        args = (shape, lengths, kept, actions, K, K_control, control, H, budget, window)
        return plan_job(*args, packed, bias)

    fitting = None
    for docs in range(1, len(lengths) + 1):
        candidate = plan(docs * per_doc)
        if candidate.peak > limit:
            break
        fitting = candidate
    if fitting is not None:
        return fitting
    low, high = max(r for r, _ in groups), per_doc - 1  # replicates of one document
    check_fits(plan(low), device_bytes, "auto")
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if plan(mid).peak <= limit else (low, mid - 1)
    return plan(low)


def check_fits(plan: JobPlan, device_bytes: float, setting: int | str, job: str = "") -> None:
    """Raise :class:`PreflightError` in one line with the numbers when ``plan`` does not fit
    ``device_bytes`` (:func:`usable_bytes`)."""
    if plan.peak <= usable_bytes(device_bytes):
        return
    parts = ", ".join(f"{name} {value / GB:.1f}" for name, value in plan.parts.items() if value)
    smallest = " (one replicate per call)" if setting == "auto" else ""
    raise PreflightError(
        f"rollout.max_batch_rows: {setting}: job {job or 'the job'} needs {plan.peak_gb:.1f} GB"
        f"{smallest} ({parts} GB) but the device holds {device_bytes / GB:.1f} GB "
        f"({usable_bytes(device_bytes) / GB:.1f} GB usable); use a smaller max_batch_rows, "
        "fewer replicates, shorter documents or a larger device"
    )


def model_shape(spec: Mapping[str, Any], folder: str | Path | None = None) -> ModelShape | None:
    """A configured model's shape: its folder's ``config.json`` (``folder``, else its ``path``
    when that is a folder), else :data:`KNOWN_CONFIGS` by hub id; None when neither, or when
    the folder's config lacks a shape the plan needs (logged: no plan, nothing refused; the
    folder's own checks name what is wrong with it)."""
    dtype = str(spec.get("dtype", "auto"))
    for candidate in (folder, spec.get("path")):
        if candidate and (Path(candidate) / "config.json").is_file():
            where = f"{candidate}/config.json"
            try:
                config = json.loads((Path(candidate) / "config.json").read_text())
                return ModelShape.from_config(config, dtype, where)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.info("%s: no memory plan (%s: %s)", where, type(exc).__name__, exc)
                return None
    known = KNOWN_CONFIGS.get(str(spec.get("path")))
    if known is not None:
        return ModelShape.from_config(known, dtype, f"known config of {spec['path']}")
    return None


def format_plan(rows: Sequence[Mapping[str, Any]], device_gb: float) -> str:
    """The plan as a Markdown table, one line per job (``plan_rows``' dicts)."""
    lines = [
        f"memory plan (estimates; fits: peak <= {USABLE_FRACTION:.0%} of {device_gb:g} GB "
        f"- {CONTEXT_BYTES / GB:.1f} GB)",
        "| job | n | K | rows/call | batches | weights GB | caches GB | decode GB | "
        "prefill GB | peak GB | fits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        p = r["plan"]
        decode = sum(p.parts[k] for k in ("row caches", "logits and coupling", "masked bias"))
        decode += p.parts.get("decoding masks", 0.0)
        lines.append(
            f"| {r['job']} | {r['n']} | {r['K']} | {p.max_batch_rows} | {p.batches} | "
            f"{p.parts['weights'] / GB:.1f} | {p.parts['prompt caches'] / GB:.1f} | "
            f"{decode / GB:.1f} | {p.parts['prefill'] / GB:.1f} | {p.peak_gb:.1f} | "
            f"{'yes' if p.peak <= usable_bytes(device_gb * GB) else 'NO'} |"
        )
    return "\n".join(lines)


def job_kept(actions: Sequence[Any], n: int) -> list[int]:
    """Each parsed action's kept entries of an n-token prompt (n for the control); a prompt
    transformation's and a decoding action's as a :class:`HeldPart` (held gathered whatever
    their share; a decoding action's rows hold masks besides)."""
    from kvdiverge.eviction import is_decoding, is_transform

    out = []
    for a in actions:
        keep = n if a.keeps_everything else min(int(a.n_keep(n)), n)
        if is_decoding(a):
            out.append(HeldPart(keep, decoding=True))
        elif is_transform(a):
            out.append(HeldPart(keep))
        else:
            out.append(keep)
    return out


def plan_config(
    config: Mapping[str, Any], device_gb: float, folders: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """The plan of every rollout job of a config, at the documents' length bound (a stratum's
    ``target_tokens − generation_reserve``) and the largest K (``K: plan`` at
    ``analysis.planning.max_K``): one row per study, stage (development, evaluation), model
    and stratum, with ``max_batch_rows`` as configured (``auto``: sized to ``device_gb``; where
    one replicate per call does not fit, the plan at one replicate per call, which
    :func:`format_plan` shows as not fitting, and the job refuses on its own device).
    Models whose shape is unknown (:func:`model_shape`) are left out. ``folders``: a model's
    folder by name (else its ``path``)."""
    from kvdiverge.eviction import parse_action, selector_entry

    datasets = config.get("datasets", {})
    reserve = int(datasets.get("generation_reserve", 128))
    cohorts = datasets.get("cohorts", {})
    rollout = config.get("rollout", {})
    H, budget = int(rollout.get("H", 128)), rollout.get("max_batch_rows", 192)
    max_K = int(config.get("analysis", {}).get("planning", {}).get("max_K", 1))
    specs = {  # the entries without their display keys (label), as the rollout rules parse them
        name: parse_action(selector_entry(a), name=name)
        for name, a in config.get("actions", {}).items()
    }
    rows = []
    for model, spec in config.get("models", {}).items():
        shape = model_shape(spec, (folders or {}).get(model))
        if shape is None:
            continue
        for study, s in config.get("studies", {}).items():
            actions = [specs[a] for a in s["actions"]]
            names = [a.name for a in actions]
            control = next((a.name for a in actions if a.keeps_everything), None)
            window = max((int(a.params.get("window", 0)) for a in actions), default=0)
            K_eval = max_K if s.get("K") == "plan" else int(s.get("K", 1))
            cohort = s.get("cohort", study)
            stages = (("dev", int(s.get("K_dev", 2)), "dev"), ("eval", K_eval, cohort))
            for stage, K, cohort in stages:
                docs = int(cohorts.get(cohort, 0))
                K_control = int(s.get("K_control", K))
                for stratum in datasets.get("strata", []):
                    n = int(stratum["target_tokens"]) - reserve
                    lengths, kept = [n] * docs, [job_kept(actions, n)] * docs
                    if not docs:
                        continue
                    job = f"{study}/{stage}/{model}/{stratum['env']}-{stratum['label']}"
                    args = (shape, lengths, kept, names, K, K_control, control, H)
                    if budget == "auto":  # a CUDA plan: the masked pass's bias counted
                        try:
                            plan = auto_batch_rows(*args, device_gb * GB, window, bias=True)
                        except PreflightError:  # shown as not fitting; the job itself refuses
                            smallest = max(r for r, _ in _groups(names, K, K_control, control))
                            plan = plan_job(*args, smallest, window, bias=True)
                    else:
                        plan = plan_job(*args, int(budget), window, bias=True)
                    rows.append({"job": job, "n": n, "K": K, "plan": plan, "shape": shape})
    return rows


def job_plan_args(
    model: Mapping[str, Any],
    specs: Mapping[str, Any],
    cohorts: Mapping[str, Mapping[str, int]],
    lengths: Sequence[int],
    H: int,
) -> tuple[tuple, int] | None:
    """:func:`plan_job`'s arguments before ``max_batch_rows`` for a rollout job (its model, its
    documents' ``lengths``, its actions ``specs`` by name and ``cohorts``: action → cohort →
    K; the largest K of the evaluating actions and of the control), and the SnapKV window;
    None when the model's shape is unknown (:func:`model_shape`) or the job has no documents."""
    shape = model_shape(model)
    if shape is None or not lengths:
        return None
    actions = list(specs.values())
    control = next((a.name for a in actions if a.keeps_everything), None)
    ks = {name: max(per.values(), default=0) for name, per in cohorts.items()}
    K = max((ks[a.name] for a in actions if a.name != control), default=0)
    K_control = ks.get(control, 0) if control else 0
    if K == 0:  # only the control: its replicates are the group's
        K, control = K_control, None
    kept = [job_kept(actions, n) for n in lengths]
    names = [a.name for a in actions]
    window = max((int(a.params.get("window", 0)) for a in actions), default=0)
    return (shape, lengths, kept, names, K, K_control, control, H), window


def check_job_memory(
    model: Mapping[str, Any],
    specs: Mapping[str, Any],
    cohorts: Mapping[str, Mapping[str, int]],
    lengths: Sequence[int],
    H: int,
    max_batch_rows: int,
    device_bytes: float,
    job: str = "",
) -> JobPlan | None:
    """A rollout job's memory plan against its device, before the model loads: the job's
    documents (``lengths``, the job model's own), its actions (``specs``, parsed, by name) and
    replicates (``cohorts``: action → cohort → K; the largest K of the evaluating actions and
    of the control). Raises :class:`PreflightError` in one line with the numbers when the peak
    exceeds the device's whole memory (no batch of that budget can fit); a peak above the
    usable part (:func:`usable_bytes`) is left to the engine's halving on out-of-memory. None
    when the model's shape is unknown (:func:`model_shape`) or the job has no documents."""
    found = job_plan_args(model, specs, cohorts, lengths, H)
    if found is None:
        return None
    args, window = found
    plan = plan_job(*args, max_batch_rows, window, bias=True)  # CUDA: the masked pass's bias
    if plan.peak > device_bytes:
        check_fits(plan, device_bytes, max_batch_rows, job)
    return plan
