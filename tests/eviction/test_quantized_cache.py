"""transformers' QuantizedCache as an action (kvdiverge.eviction.quantized_cache).

On the tiny random Llama model, against transformers' own ``QuantizedCache`` with the same
backend and parameters after the same prefill: the action's prompt cache equals, bit for bit,
what that cache attends to at the next call (the keys and values its layers' ``update``
returns: the dequantized prompt, an empty residual, the new entry), because the engine's
prefill holds the same keys and values bit for bit and the same library code quantizes them on
the CPU; the engine's laws equal transformers' own logits with that cache fed the same tokens
at steps 1 … max(R, 2) + 1 (1e-5: the engine's attention sums in another order), and differ
after it, where transformers re-quantizes (the module docstring says so); the full control is
exact. Independently of the backends: quanto's min/max quantizer written here in numpy float32
with the module docstring's groups (the same float32 operations in the same order, so equal bit
for bit); hqq's groups each holding at most 2^b values; the bytes against the stored tensors
of transformers' cache; the shape rule against where the backends fail. A backend whose
package is not installed is skipped with the reason; its refusal is tested without it."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import cache_utils

from kvdiverge.engine import RolloutSettings, paths_under_actions
from kvdiverge.eviction import (
    ActionError,
    is_transform,
    parse_action,
    run_prefill,
    transformed_prefix,
)
from kvdiverge.eviction import quantized_cache as qc
from kvdiverge.models import chat_prompt_ids, eos_token_ids, load_model, load_tokenizer

transformers.utils.logging.disable_progress_bar()
pytestmark = pytest.mark.usefixtures("one_thread_module")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "Read the following context carefully. Document 1: The river flows north through the "
    "valley, past the old mill and the stone bridge. The special magic number is 482913. "
) * 4
N = 88  # prompt tokens: 16 does not divide it, so quanto's axis -1 groups cross KV heads
FULL = {"name": "full", "selector": "full"}


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _needs(backend: str):
    package = qc.BACKENDS[backend].package
    extra = "hqq" if backend == "hqq" else "test"  # pyproject.toml's extra that installs it
    reason = f"{package} is not installed (pip install {package}, or pip install -e '.[{extra}]')"
    return pytest.mark.skipif(not _installed(package), reason=reason)


def _case(backend, nbits, axis_key, axis_value, group, residual=128, id=None):
    spec = {
        "selector": "quantized-cache",
        "backend": backend,
        "nbits": nbits,
        "axis_key": axis_key,
        "axis_value": axis_value,
        "q_group_size": group,
        "residual_length": residual,
    }
    return pytest.param(spec, marks=_needs(backend), id=id)


CASES = [
    _case("quanto", 4, 0, 0, 64, id="quanto-defaults"),  # groups span 4 tokens (d = 16)
    _case("quanto", 2, -1, 0, 16, 4, id="quanto-2bit-key-channels"),
    _case("quanto", 4, -1, -1, 8, id="quanto-4bit-channels"),
    _case("hqq", 4, 0, 0, 64, id="hqq-defaults"),
    _case("hqq", 2, 1, 0, 16, id="hqq-2bit"),
    _case("hqq", 3, 0, 0, 32, id="hqq-3bit"),
    _case("hqq", 8, 1, 1, 8, id="hqq-8bit"),
    _case("hqq", 1, 1, 0, 16, id="hqq-1bit"),
]


@pytest.fixture(scope="module")
def demo():
    path = ROOT / "data" / "models" / "tiny-llama"
    model, tok = load_model(str(path)), load_tokenizer(str(path))
    ids = chat_prompt_ids(tok, PROMPT)
    assert len(ids) >= N
    return model, list(ids[:N]), eos_token_ids(model, tok)


def _transformers_cache(model, spec):
    return transformers.QuantizedCache(
        spec["backend"],
        model.config,
        nbits=spec["nbits"],
        axis_key=spec["axis_key"],
        axis_value=spec["axis_value"],
        q_group_size=spec["q_group_size"],
        residual_length=spec["residual_length"],
    )


@torch.no_grad()
def transformers_attended(model, spec, ids):
    """Per layer, the prompt keys and values (H_kv, n, d) transformers' QuantizedCache attends
    to at the call after the prefill (what its layer's ``update`` returns, new entry dropped),
    and the cache itself."""
    cache = _transformers_cache(model, spec)
    model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    out = []
    for layer in cache.layers:
        stored = _stored_bytes(spec["backend"], layer)
        _, h, _, d = layer._dequantize(layer._quantized_keys).shape
        new = torch.zeros(1, h, 1, d)
        keys, values = layer.update(new, new)
        out.append((keys[0, :, : len(ids)], values[0, :, : len(ids)], stored))
    return out


def _stored_bytes(backend, layer) -> int:
    """The bytes transformers' layer holds: codes, scales and shifts (zero points) of keys and
    values as the backend stores them, and the full-precision residual."""
    total = layer.keys.nbytes + layer.values.nbytes
    for q in (layer._quantized_keys, layer._quantized_values):
        if backend == "quanto":
            total += q._data._data.nbytes + q._scale.nbytes + q._shift.nbytes
        else:
            codes, meta = q
            total += codes.nbytes + meta["scale"].nbytes + meta["zero"].nbytes
    return total


@pytest.mark.parametrize("spec", CASES)
def test_prompt_cache_equals_transformers_quantized_cache(demo, spec):
    model, ids, _ = demo
    action = parse_action(spec, name="q")
    assert is_transform(action)
    prefill = run_prefill(model, ids, actions=[action])
    with torch.no_grad():
        plain = model(torch.tensor([ids]), use_cache=True).past_key_values
    ours = transformed_prefix(prefill, action)
    again = transformed_prefix(prefill, action)  # deterministic
    theirs = transformers_attended(model, spec, ids)
    n_kv, n, d = prefill.keys[0].shape
    for layer, ((k, v), (tk, tv, stored)) in enumerate(zip(ours, theirs, strict=True)):
        # the same input: the engine's prefill holds transformers' own keys and values
        assert torch.equal(prefill.keys[layer], plain.layers[layer].keys[0])
        assert torch.equal(prefill.values[layer], plain.layers[layer].values[0])
        assert torch.equal(k, tk) and torch.equal(v, tv), layer
        assert torch.equal(k, again[layer][0]) and torch.equal(v, again[layer][1])
        assert not torch.equal(k, prefill.keys[layer]) and not torch.equal(v, prefill.values[layer])
        assert stored == action.method.layer_bytes(action, n, n_kv, d, 4), layer


def _quanto_groups(x: np.ndarray, axis: int, group: int) -> np.ndarray:
    """The module docstring's quanto groups of x (H, n, d), one per row."""
    if axis == 0:
        return x.reshape(-1, group)
    rows = x.reshape(-1, x.shape[-1])  # (H·n, d): G consecutive rows per channel
    return rows.reshape(-1, group, x.shape[-1]).transpose(0, 2, 1).reshape(-1, group)


def _quanto_ungroup(groups: np.ndarray, axis: int, shape) -> np.ndarray:
    if axis == 0:
        return groups.reshape(shape)
    group, d = groups.shape[1], shape[-1]
    return groups.reshape(-1, d, group).transpose(0, 2, 1).reshape(shape)


def reference_quanto(x: np.ndarray, bits: int, axis: int, group: int) -> np.ndarray:
    """quanto's min/max affine quantize-dequantize in float32: scale (max − min)/(2^b − 1),
    shift −min, code clip(round((x + shift)/scale), 0, 2^b − 1), entry scale·code − shift."""
    g = _quanto_groups(x.astype(np.float32), axis, group)
    low, high = g.min(axis=1, keepdims=True), g.max(axis=1, keepdims=True)
    scale = (high - low) / np.float32(2**bits - 1)
    shift = -low
    codes = np.clip(np.round((g + shift) / scale), 0, 2**bits - 1).astype(np.float32)
    return _quanto_ungroup(scale * codes - shift, axis, x.shape)


QUANTO = [
    pytest.param(bits, axis, group, marks=_needs("quanto"))
    for bits, axis, group in [(2, 0, 16), (4, 0, 64), (4, 0, 8), (2, -1, 16), (4, -1, 8)]
]


@pytest.mark.parametrize("bits, axis, group", QUANTO)
def test_quanto_equals_independent_quantizer(bits, axis, group):
    gen = torch.Generator().manual_seed(bits * 10 + group)
    keys = torch.randn(2, N, 16, generator=gen) * 3
    values = torch.randn(2, N, 16, generator=gen)
    spec = {"selector": "quantized-cache", "backend": "quanto", "nbits": bits}
    spec |= {"axis_key": axis, "axis_value": axis, "q_group_size": group}
    method = parse_action(spec, name="q").method
    k, v = qc.quantized_entries(method, keys, values)
    for ours, x in ((k, keys), (v, values)):
        expected = reference_quanto(x.numpy(), bits, axis, group)
        assert np.array_equal(ours.numpy(), expected)
        steps = _quanto_groups(x.numpy(), axis, group)
        step = (steps.max(1) - steps.min(1)) / (2**bits - 1)
        error = np.abs(_quanto_groups(ours.numpy() - x.numpy(), axis, group)).max(1)
        assert np.all(error <= step / 2 * (1 + 1e-5) + 1e-6)  # half a step, float rounding


HQQ = [
    pytest.param(bits, axis, group, marks=_needs("hqq"))
    for bits, axis, group in [(2, 0, 16), (4, 0, 64), (3, 0, 32), (4, 1, 32), (1, 1, 16)]
]


@pytest.mark.parametrize("bits, axis, group", HQQ)
def test_hqq_groups_hold_at_most_two_to_the_bits_values(bits, axis, group):
    """Each group of the module docstring's hqq grouping (axis 1: consecutive elements; axis 0:
    the columns of the (G, N/G) view) takes at most 2^b values; the other grouping does not."""
    gen = torch.Generator().manual_seed(bits + group)
    x = torch.randn(2, N, 16, generator=gen)
    spec = {"selector": "quantized-cache", "backend": "hqq", "nbits": bits}
    spec |= {"axis_key": axis, "axis_value": axis, "q_group_size": group}
    k, _ = qc.quantized_entries(parse_action(spec, name="q").method, x, x)
    flat = k.numpy().reshape(-1)
    ours = flat.reshape(-1, group) if axis == 1 else flat.reshape(group, -1).T
    other = flat.reshape(group, -1).T if axis == 1 else flat.reshape(-1, group)
    assert max(len(np.unique(g)) for g in ours) <= 2**bits
    assert max(len(np.unique(g)) for g in other) > 2**bits


SHAPES = [(2, 13, 16), (2, 12, 16), (3, 5, 8), (1, 7, 4), (1, 2, 4)]  # (1, 2, 4): one group of 8
GRID = [
    pytest.param(backend, bits, axis, marks=_needs(backend))
    for backend in qc.BACKENDS
    for bits in qc.BACKENDS[backend].nbits
    for axis in qc.BACKENDS[backend].axes
    if not (backend == "hqq" and bits == 3 and axis == 1)
]


@pytest.mark.parametrize("backend, bits, axis", GRID)
def test_shape_rule_and_bytes_match_the_backend(backend, bits, axis):
    """shape_problem refuses exactly the shapes where transformers' layer of the backend fails
    (or gives another shape); where it runs, the bytes formula equals what the layer stores."""
    layer_class = getattr(cache_utils, qc.BACKENDS[backend].layer)
    checked = 0
    for h, n, d in SHAPES:
        for group in (4, 6, 8, 13, 16, 26, 32):
            if backend == "quanto" and h * n * d == group:
                continue  # a single group: refused, though quanto runs (module docstring)
            gen = torch.Generator().manual_seed(n * group)
            x = torch.randn(1, h, n, d, generator=gen)
            try:
                layer = layer_class(bits, axis, axis, group, 128)
                layer.update(x, x)
                runs = layer._dequantize(layer._quantized_keys).shape == x.shape
            except (RuntimeError, ValueError, AssertionError):
                runs = False
            problem = qc.shape_problem(backend, bits, axis, group, n, h, d)
            assert (problem is None) == runs, (h, n, d, group, problem)
            if runs:
                checked += 1
                stored = _stored_bytes(backend, layer)
                expected = qc.quantized_cache_layer_bytes(
                    backend, n, h, d, bits, axis, axis, group, 4
                )
                assert stored == expected, (h, n, d, group)
    assert checked > 0


@torch.no_grad()
def transformers_logits(model, spec, ids, tokens) -> torch.Tensor:
    """transformers' own run with its QuantizedCache: the prefill, then ``tokens`` fed at
    positions n, n + 1, …; the logits of steps 1 … len(tokens) + 1."""
    cache = _transformers_cache(model, spec)
    out = [model(torch.tensor([ids]), past_key_values=cache, use_cache=True).logits[0, -1]]
    for j, token in enumerate(tokens):
        result = model(
            input_ids=torch.tensor([[int(token)]]),
            past_key_values=cache,
            position_ids=torch.tensor([[len(ids) + j]]),
            use_cache=True,
        )
        out.append(result.logits[0, -1])
    return torch.stack(out)


LAWS = [
    # transformers' re-quantizations (at n + 4 and n + 8 entries) must be groupable too
    _case("quanto", 2, -1, 0, 8, 4, id="quanto-R4"),
    _case("hqq", 2, 0, 0, 64, 4, id="hqq-R4"),
    _case("quanto", 4, 0, 0, 64, 128, id="quanto-R128"),
]


@pytest.mark.parametrize("spec", LAWS)
def test_engine_laws_equal_transformers_logits(demo, spec):
    """Q on Y's and on X's history against transformers' own logits with its QuantizedCache:
    equal at steps 1 … max(R, 2) + 1 (the first decoding step among them), different after it
    (transformers re-quantizes its residual there); the full control exact; the bytes."""
    model, ids, eos = demo
    H, K = 8, 3
    settings = RolloutSettings(H, 5, keep_logits=True)
    out = paths_under_actions(model, ids, [{"name": "q", **spec}, FULL], "doc-q", K, eos, settings)
    r, full = out["q"], out["full"]
    exact = min(max(spec["residual_length"], 2) + 1, H)
    assert r.tv_rollout[:, 1:].max() > 0  # the quantized cache changes the law
    for k in range(K):
        for stream, tokens in (("q", r.y_token[k, :-1]), ("q_fixed", r.x_token[k, :-1])):
            expected = transformers_logits(model, spec, ids, tokens).double().softmax(-1)
            got = torch.from_numpy(r.logits[stream][k]).double().softmax(-1)
            difference = (got - expected).abs().amax(-1)
            assert float(difference[:exact].max()) <= 1e-5, (stream, k)
            if exact < H:
                assert float(difference[exact:].min()) > 1e-4, (stream, k)
    assert np.all(full.tv_rollout == 0) and np.all(full.tv_fixed == 0)
    assert np.array_equal(full.x_token, full.y_token) and np.array_equal(full.x_token, r.x_token)
    config = model.config
    n_kv, d, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    action = parse_action(spec, name="q")
    start = action.method.layer_bytes(action, len(ids), n_kv, d, 4)
    assert r.cache_bytes["start"] == [start] * layers
    assert r.cache_bytes["end"] == [start + (H - 1) * n_kv * 2 * d * 4] * layers


def _spec(**fields):
    return {"selector": "quantized-cache", **fields}


REFUSALS = [
    (
        {"budget": 0.5},
        "actions.q.budget: selector 'quantized-cache' takes nbits, not a budget",
        None,
    ),
    (
        {"backend": "bnb"},
        "actions.q.backend: expected one of quanto, hqq (transformers' QuantizedCache "
        "backends), got 'bnb'",
        None,
    ),
    ({"nbits": 8}, "actions.q.nbits: expected one of 2, 4 for backend quanto, got 8", "quanto"),
    (
        {"backend": "hqq", "nbits": 5},
        "actions.q.nbits: expected one of 1, 2, 3, 4, 8 for backend hqq, got 5",
        "hqq",
    ),
    (
        {"axis_key": 1},
        "actions.q.axis_key: expected one of 0, -1 for backend quanto, got 1",
        "quanto",
    ),
    (
        {"backend": "hqq", "axis_value": -1},
        "actions.q.axis_value: expected one of 0, 1 for backend hqq, got -1",
        "hqq",
    ),
    (
        {"backend": "hqq", "nbits": 3, "axis_key": 1},
        "actions.q.axis_key: axis 1 with nbits 3 is refused for backend hqq",
        "hqq",
    ),
    (
        {"q_group_size": 0},
        "actions.q.q_group_size: expected an integer >= 1, got 0",
        "quanto",
    ),
    (
        {"residual_length": -1},
        "actions.q.residual_length: expected an integer >= 0, got -1",
        "quanto",
    ),
    ({"nbits": 4.0}, "actions.q.nbits: expected an integer, got 4.0", None),
    ({"backend": 1}, "actions.q.backend: expected text, got 1", None),
    ({"bits": 4}, "actions.q.bits: not a parameter of selector 'quantized-cache'", None),
]


@pytest.mark.parametrize(
    "fields, message",
    [
        pytest.param(f, m, marks=_needs(b) if b else ())
        for f, m, b in REFUSALS  # a check after the package's needs the package
    ],
)
def test_bad_parameters_are_one_line(fields, message):
    with pytest.raises(ActionError) as info:
        parse_action(_spec(**fields), name="q")
    assert str(info.value).startswith(message), info.value
    assert "\n" not in str(info.value)


def test_missing_or_old_backend_package_is_refused_in_one_line(monkeypatch):
    """Without the backend's package (or with one older than transformers takes), the action is
    refused at parse time, before any model loads, in one line naming the package."""
    real = importlib.metadata.version

    def version(package):
        if package == "hqq":
            raise importlib.metadata.PackageNotFoundError(package)
        if package == "optimum-quanto":
            return "0.2.4"
        return real(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    for backend, message in (
        (
            "hqq",
            "actions.q.backend: hqq needs the hqq package: not installed; install it with pip "
            "install hqq",
        ),
        (
            "quanto",
            "actions.q.backend: quanto needs the optimum-quanto package: 0.2.4 is installed; "
            "transformers needs >= 0.2.5",
        ),
    ):
        with pytest.raises(ActionError) as info:
            parse_action(_spec(backend=backend), name="q")
        assert str(info.value) == message


@pytest.mark.parametrize(
    "spec, message",
    [
        pytest.param(
            _spec(backend="quanto", axis_key=-1, q_group_size=7),
            "action 'q': selector 'quantized-cache': backend quanto with axis_key -1 groups 7 "
            "consecutive tokens per channel over 2 KV heads × 88 tokens = 176 rows, which 7 "
            "does not divide, for this 88-token prompt; transformers' QuantizedCache cannot "
            "hold it either",
            marks=_needs("quanto"),
        ),
        pytest.param(
            _spec(backend="hqq", q_group_size=11),
            "action 'q': selector 'quantized-cache': backend hqq with axis_key 0 packs 2 codes "
            "of 4 bits along 11 rows, not a multiple of 2 (hqq does not pad them), for this "
            "88-token prompt",
            marks=_needs("hqq"),
        ),
    ],
)
def test_prompt_the_backend_cannot_group_is_refused_before_decoding(demo, spec, message):
    model, ids, _ = demo
    action = parse_action(spec, name="q")
    prefill = run_prefill(model, ids, actions=[action])
    with pytest.raises(ActionError) as info:
        transformed_prefix(prefill, action)
    assert str(info.value).startswith(message), info.value
    assert "\n" not in str(info.value)


@_needs("hqq")
def test_compare_spec_sets_nbits():
    from kvdiverge.compare.actions import CompareError, parse_actions

    parsed = parse_actions("quantized-cache@4bit+backend=hqq,h2=quantized-cache@2bit+backend=hqq")
    methods = [(a.label, a.action.method) for a in parsed]
    assert [(label, m.backend, m.nbits, m.q_group_size) for label, m in methods] == [
        ("quantized-cache@4bit+backend=hqq", "hqq", 4, 64),
        ("h2", "hqq", 2, 64),
    ]
    assert all(a.action.budget is None for a in parsed)
    with pytest.raises(CompareError, match=r"nbits given twice$"):
        parse_actions("quantized-cache@4bit+nbits=2+backend=hqq")
    with pytest.raises(CompareError, match="takes nbits, not a budget"):
        parse_actions("quantized-cache@0.5")


@_needs("hqq")
def test_cache_bytes_table_shows_bits_and_backend():
    from kvdiverge.analysis.cache_bytes import budget_label

    action = parse_action(_spec(backend="hqq", nbits=2), name="h2").as_dict()
    assert action["budget"] is None and budget_label(action) == "2 bits (hqq)"
