"""The kernel registry (engine.kernels.registry, dispatch, library).

``kernel_choices()`` is empty in a fresh process and names, per layout, the kernels the calls
so far used; each candidate is validated against the float32 reference once per (layout,
device, dtype, head size), one that is missing, raises, ignores the mask or returns another
log-sum-exp convention is never chosen, and one failing at run time is dropped for that key
(one warning) in favour of the next. The CUDA candidates are selected in their order on CUDA
keys (simulated: no GPU here, their validation replaced), and the engine's ``auto`` layout
attends to gathered caches where the masked layout has no fused kernel. The padded-stride bias
the memory-efficient CUDA kernel needs has the values of the reference's bias and a row stride
that is a multiple of the alignment; through the CPU flash kernel and through SDPA's math
kernel it gives the reference's attention, rows keeping nothing at output 0 and −inf. On the
CPU a candidate must also give a row the same bits wherever it lies in a call
(``reference.stable``): torch's flash kernel called on all M rows at once does not, and is
never chosen so; in blocks of 32 rows it does, as does the reference."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvdiverge.engine.attention as attention_module
from kvdiverge.engine.kernels import dispatch, library, registry
from kvdiverge.engine.kernels.reference import (
    ROW_BLOCK,
    full_bias,
    math_attention,
    prompt_reference,
    stable,
)


@pytest.fixture
def fresh(monkeypatch):
    """The registry's candidates as registered, on a copy this test may change; choices reset
    before and after."""
    monkeypatch.setattr(registry, "_CANDIDATES", list(registry._CANDIDATES))
    registry.reset()
    yield
    registry.reset()


def test_kernel_choices_is_empty_in_a_fresh_process_then_names_each_layout():
    code = (
        "import json, torch\n"
        "from kvdiverge.engine.kernels import attend_own, attend_prompt, kernel_choices\n"
        "print(json.dumps(kernel_choices()))\n"
        "q = torch.randn(2, 2, 3, 16); k = torch.randn(2, 2, 9, 16)\n"
        "attend_own(q, k, k, 0.25)\n"
        "t = torch.zeros(1, 2, 9); r = torch.zeros(6, dtype=torch.int32)\n"
        "attend_prompt('prompt_masked', q.reshape(2, 6, 16)[:, :6], k[0], k[0], 0.25, t, r)\n"
        "print(json.dumps(kernel_choices()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert json.loads(out[0]) == {}
    after = json.loads(out[1])
    assert set(after) == {"rows_own", "prompt_masked"}
    assert after["rows_own"] in ("native-avx512", "library-flash-cpu")
    assert after["prompt_masked"] in ("native-avx512", "library-flash-cpu")
    assert all(isinstance(v, str) for v in after.values())


def test_each_candidate_is_validated_once_and_wrong_ones_are_never_chosen(fresh, caplog):
    """For ``rows_own`` on the CPU: a missing kernel, one that raises on validation and one with
    a base-2 log-sum-exp are skipped; a good one is chosen, validated once for the key; when it
    fails at run time it is dropped for that key with one warning, the reference gives the
    result (bit-identical to calling it) and the choices list both."""
    calls = {"good": 0}

    def missing(q, k, v, scale):
        raise NotImplementedError("no such kernel here")

    def base_two(q, k, v, scale):
        out, lse = math_attention(q, k, v, scale)
        return out, lse / np.log(2.0)

    def good(q, k, v, scale):
        calls["good"] += 1
        if q.shape[0] == 4:  # fails at run time on the real problem's shape
            raise RuntimeError("unsupported stride")
        return math_attention(q, k, v, scale)

    registry._CANDIDATES[:] = [c for c in registry._CANDIDATES if "rows_own" not in c.layouts]
    cpu = lambda key: key[1] == "cpu"  # noqa: E731
    for name, run in (("missing", missing), ("base-two", base_two), ("good", good)):
        registry.register(registry.Candidate(name, ("rows_own",), run, cpu))
    registry.register(
        registry.Candidate(
            "reference-float32", ("rows_own",), math_attention, cpu, kind="reference"
        )
    )
    assert registry.choose("rows_own", "cpu", torch.float32, 16).name == "good"
    validation = calls["good"]  # agrees (one problem) and stable (the whole batch, five cuts)
    assert validation == 1 + 6
    for _ in range(2):
        assert registry.choose("rows_own", "cpu", torch.float32, 16).name == "good"
    assert calls["good"] == validation  # validated once
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(4, 2, s, 16, generator=gen) for s in (3, 40, 40))
    with caplog.at_level(logging.WARNING, logger="kvdiverge.engine.kernels.registry"):
        out, lse = dispatch.attend_own(q, k, v, 0.25)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "good failed" in warned[0] and "unsupported stride" in warned[0]
    want = math_attention(q, k, v, 0.25)
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert registry.choose("rows_own", "cpu", torch.float32, 16).name == "reference-float32"
    assert registry.kernel_choices()["rows_own"] == "good, reference-float32"
    # another head size is its own key: validated and chosen afresh
    assert registry.choose("rows_own", "cpu", torch.float32, 32).name == "good"


def test_settings_restrict_the_choice(fresh):
    """``fused=False``: the reference for every layout; ``native=False``: never the native
    kernel."""
    for layout in registry.LAYOUTS:
        cand = registry.choose(layout, "cpu", torch.float32, 64, fused=False)
        assert cand.name == "reference-float32" and cand.oracle
        assert registry.choose(layout, "cpu", torch.float32, 64, native=False).kind != "native"


def test_cuda_candidates_in_order_and_the_auto_layout_without_a_masked_kernel(fresh, monkeypatch):
    """On CUDA keys (validation replaced: no GPU here): bf16 ``rows_own`` and
    ``prompt_gathered`` take the flash kernel, float32 the memory-efficient one, every masked or
    ragged layout the memory-efficient kernel with the padded bias — never the reference while a
    fused kernel validates; where none does, ``fused_masked_kernel`` is false (the engine's auto
    layout then gathers) and only then the reference runs."""
    monkeypatch.setattr(registry, "agrees", lambda *args: True)
    monkeypatch.setenv("KVDIVERGE_KERNEL_TIMING", "0")  # the order itself (on a GPU too)
    want = {
        ("rows_own", torch.bfloat16): "library-flash-cuda",
        ("prompt_gathered", torch.bfloat16): "library-flash-cuda",
        ("rows_own", torch.float32): "library-efficient-cuda",
        ("prompt_gathered", torch.float32): "library-efficient-cuda",
    }
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for layout in registry.LAYOUTS:
            name = want.get((layout, dtype), "library-efficient-cuda")
            if dtype == torch.float16 and layout in ("rows_own", "prompt_gathered"):
                name = "library-flash-cuda"
            assert registry.choose(layout, "cuda", dtype, 128).name == name, (layout, dtype)
        assert dispatch.fused_masked_kernel("cuda", dtype, 128)
    registry.reset()
    monkeypatch.setattr(registry, "agrees", lambda run, layout, *args: layout == "rows_own")
    assert not dispatch.fused_masked_kernel("cuda", torch.bfloat16, 128)
    assert registry.choose("prompt_masked", "cuda", torch.bfloat16, 128).oracle


def test_auto_layout_gathers_where_the_masked_layout_has_no_fused_kernel(monkeypatch):
    """The engine's auto layout: masked for a half cache where a fused masked kernel validates
    (the CPU), gathered when none does."""
    from kvdiverge.engine import document

    seen = []
    real = document.fused_masked_kernel
    for available in (True, False):
        monkeypatch.setattr(
            document, "fused_masked_kernel", lambda *a, ok=available: seen.append(a) or ok
        )
        doc, kept = _half_document()
        assert [act.masked for act in doc.interventions] == [available]
    assert seen[0][0].type == "cpu" and seen[0][1] == torch.float32
    monkeypatch.setattr(document, "fused_masked_kernel", real)


def _half_document():
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvdiverge.engine import RolloutSettings
    from kvdiverge.engine.document import DocumentRollout
    from kvdiverge.eviction import parse_action

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = LlamaForCausalLM(config).eval()
    action = parse_action({"selector": "recent", "budget": 0.5}, "recent-half")
    doc = DocumentRollout.plan("d", list(range(1, 41)), [action], 2, "shared-reference")
    doc.prepare(model, RolloutSettings(3, 1))
    return doc, doc.kept


@pytest.mark.parametrize("n", [1, 15, 16, 17, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_padded_bias_has_the_reference_values_and_an_aligned_row_stride(n, dtype):
    gen = torch.Generator().manual_seed(n)
    table = torch.randn((3, 2, n), generator=gen)
    table.masked_fill_(torch.rand((3, 2, n), generator=gen) < 0.3, float("-inf"))
    rows = torch.tensor([-1, 0, 2, 2, 1, -1, 0], dtype=torch.int32)
    bias = library.padded_bias(table, rows, dtype)
    assert bias.shape == (1, 2, 7, n) and bias.dtype == dtype
    assert bias.stride(-1) == 1 and bias.stride(-2) % library.BIAS_ALIGN == 0
    assert bias.stride(-2) >= n and bias.stride(-2) - n < library.BIAS_ALIGN
    assert torch.equal(bias[0].float(), full_bias(table, rows).to(dtype).float())
    empty = library.empty_rows(table, rows)
    assert torch.equal(empty, torch.isneginf(full_bias(table, rows)).all(-1))


def test_the_padded_bias_through_fused_kernels_equals_the_reference():
    """The prompt convention on the CPU flash kernel (the library wrapper the CUDA efficient
    kernel shares: padded bias, empty rows set to 0 and −inf) and the padded bias through SDPA's
    math kernel give the reference's output and log-sum-exp, rows keeping nothing included."""
    gen = torch.Generator().manual_seed(3)
    h, m, n, d = 2, 11, 37, 32
    q, k, v = (torch.randn((h, s, d), generator=gen) for s in (m, n, n))
    table = torch.zeros((2, h, n)).masked_fill_(
        torch.rand((2, h, n), generator=gen) < 0.5, float("-inf")
    )
    table[1, 0] = float("-inf")  # the second mask keeps nothing in KV head 0
    rows = torch.arange(m, dtype=torch.int32) % 3 - 1
    want = prompt_reference(q, k, v, d**-0.5, table, rows)
    got = library.prompt_call(library.cpu_flash)(q, k, v, d**-0.5, table, rows)
    assert bool(torch.isneginf(want[1]).any())
    assert torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1]))
    assert bool((got[0][torch.isneginf(want[1])] == 0).all())
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(want[1])
    torch.testing.assert_close(got[1][finite], want[1][finite], atol=1e-5, rtol=1e-5)
    bias = library.padded_bias(table, rows, torch.float32)
    keep = ~library.empty_rows(table, rows)  # SDPA gives NaN on rows keeping nothing
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=bias, scale=d**-0.5
    )[0]
    torch.testing.assert_close(sdpa[keep], want[0][keep], atol=1e-5, rtol=1e-5)


def test_asking_about_the_masked_layout_is_not_a_use(fresh):
    """The engine's layout question (``fused_masked_kernel``) leaves ``kernel_choices()`` empty;
    a call through the layout then records its kernel."""
    assert dispatch.fused_masked_kernel("cpu", torch.float32, 16)
    assert registry.kernel_choices() == {}
    q, k = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    table, rows = torch.zeros(1, 2, 9), torch.zeros(5, dtype=torch.int32)
    dispatch.attend_prompt("prompt_masked", q, k, k, 0.25, table, rows)
    assert set(registry.kernel_choices()) == {"prompt_masked"}


def test_cuda_choice_by_timing_among_validated_candidates(fresh, monkeypatch, tmp_path):
    """On CUDA keys (simulated: validation and timings replaced) every validated candidate is
    timed once per GPU model, torch version and key; a later one displaces the preferred only
    when 1.2 times faster; a single candidate is not timed; the milliseconds are kept in the
    cache and read back by a fresh process (no second timing); CPU keys are never timed."""
    monkeypatch.setattr(registry, "agrees", lambda *args: True)
    monkeypatch.setattr(registry, "_timed", lambda key: key[1] == "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU 80GB")
    monkeypatch.setenv("KVDIVERGE_CACHE", str(tmp_path))
    fake = {  # (layout, kernel) -> ms
        ("rows_own", "library-flash-cuda"): 1.0,
        ("rows_own", "library-efficient-cuda"): 0.5,  # twice as fast: displaces flash
        ("prompt_gathered", "library-flash-cuda"): 1.0,
        ("prompt_gathered", "library-efficient-cuda"): 0.9,  # within the margin: flash stays
    }
    timed = []

    def measure(cand, key):
        timed.append((key[0], cand.name))
        return fake[(key[0], cand.name)]

    monkeypatch.setattr(registry, "measure", measure)
    bf16 = torch.bfloat16
    assert registry.choose("rows_own", "cuda", bf16, 128).name == "library-efficient-cuda"
    assert registry.choose("prompt_gathered", "cuda", bf16, 128).name == "library-flash-cuda"
    assert registry.choose("prompt_masked", "cuda", bf16, 128).name == "library-efficient-cuda"
    assert sorted(timed) == sorted(fake)  # once each; the masked layout has one candidate
    kept = json.loads((tmp_path / "kernel_timings.json").read_text())
    assert kept["Fake GPU 80GB|torch " + torch.__version__ + "|rows_own|torch.bfloat16|128"] == {
        "library-efficient-cuda": 0.5,
        "library-flash-cuda": 1.0,
    }
    registry.reset()  # a fresh process on the same GPU model reads the timings back
    timed.clear()
    assert registry.choose("rows_own", "cuda", bf16, 128).name == "library-efficient-cuda"
    assert timed == []
    for layout in registry.LAYOUTS:  # CPU: the order of preference, never timed
        assert registry.choose(layout, "cpu", torch.float32, 64).kind != "reference"
    assert timed == []


def test_fastest_keeps_the_preferred_within_the_margin():
    a, b, c = (registry.Candidate(n, ("rows_own",), None, None) for n in "abc")
    assert registry.fastest([a, b, c], {"a": 1.0, "b": 0.8, "c": 0.9}) is b  # 1.25x
    assert registry.fastest([a, b, c], {"a": 1.0, "b": 0.85, "c": 0.9}) is a  # 1.18x: noise
    assert registry.fastest([a, b], {"a": float("inf"), "b": 2.0}) is b  # a failed to time
    assert registry.fastest([a], {"a": 3.0}) is a


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_measure_times_every_layout_on_cuda():
    for layout in registry.LAYOUTS:
        key = (layout, "cuda", torch.bfloat16, 128)
        cand = next(c for c in registry.candidates(layout) if c.claims(key) and not c.oracle)
        assert 0 < registry.measure(cand, key) < 1e3


def test_masked_kernel_is_validated_and_falls_back(fresh, caplog):
    """A masked candidate is used only after it matches the reference with masks (rows keeping
    nothing included); one that ignores the mask is refused; one failing at run time is dropped
    for that key with one warning and the next candidate (here the reference) gives the result."""

    def ignores_mask(q, k, v, scale, table=None, rows=None):
        return prompt_reference(q, k, v, scale)

    def fails(q, k, v, scale, table=None, rows=None):
        if q.shape[1] == 6:  # passes validation (7, 13, 5 rows; STABLE_COUNTS and 100), fails
            # on the real problem
            raise RuntimeError("unsupported stride")
        return prompt_reference(q, k, v, scale, table, rows)

    on_cpu = lambda key: key[1] == "cpu"  # noqa: E731
    for cand in (
        registry.Candidate("ignores-mask", ("prompt_masked",), ignores_mask, on_cpu),
        registry.Candidate("fails-later", ("prompt_masked",), fails, on_cpu),
    ):
        registry.register(cand)
    registry._CANDIDATES[:] = [c for c in registry._CANDIDATES if c.kind != "native"]
    registry._CANDIDATES[:] = [
        c
        for c in registry._CANDIDATES
        if not (c.name == "library-flash-cpu" and c.layouts != ("rows_own",))
    ]
    d, n = 16, 12
    assert registry.choose("prompt_masked", "cpu", torch.float32, d).name == "fails-later"
    gen = torch.Generator().manual_seed(5)
    prompt = [(torch.randn(2, n, d, generator=gen), torch.randn(2, n, d, generator=gen))]
    mask = torch.rand((2, n), generator=gen) < 0.5
    mask[:, 0] = True
    part = attention_module.PromptPass([0], prompt, [[mask]])
    query = torch.randn(2, 6, 1, d, generator=gen)
    key = value = torch.randn(2, 2, 1, d, generator=gen)
    shared = attention_module.SharedPrefix([torch.arange(2)], [prompt], True, [part])
    module = SimpleNamespace(layer_idx=0)
    with caplog.at_level("WARNING", logger="kvdiverge.engine.kernels.registry"):
        got = attention_module.shared_prefix_attention(
            module, query, key, value, None, kvd_prefix=shared
        )
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and "fails-later failed" in warned[0], warned
    assert registry.kernel_choices()["prompt_masked"] == "fails-later, reference-float32"
    shared = attention_module.SharedPrefix([torch.arange(2)], [prompt], False, [part])
    want = attention_module.shared_prefix_attention(
        module, query, key, value, None, kvd_prefix=shared
    )
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
    registry.reset()


def _same_rows(run, q, k, v, table, rows, count, start):
    """Whether ``run`` on rows [start, start + count) of q gives the whole call's bits there."""
    whole = run(q, k, v, 0.25, table, rows)
    cut = slice(start, start + count)
    part = run(q[:, cut], k, v, 0.25, table, None if rows is None else rows[cut])
    return all(torch.equal(p, w[:, cut]) for p, w in zip(part, whole, strict=True))


@pytest.mark.parametrize("layout", ["prompt_gathered", "prompt_ragged", "prompt_masked"])
def test_a_row_has_the_same_bits_wherever_it_lies_in_a_call(layout):
    """The CPU flash kernel on all M query rows at once leaves a row in a product of its own
    when M is just past a multiple of 32 (its query blocks), and torch's matrix products round
    a product of at most three rows differently: ``stable`` refuses it and the row differs.
    Blocked (``ROW_BLOCK`` rows per product, as registered) it passes, as does the reference
    (which runs in the same blocks), and the registry's choice on the CPU is stable."""
    unblocked = library.prompt_call(library.cpu_flash)
    blocked = library.prompt_call(library.cpu_flash, ROW_BLOCK)
    assert ROW_BLOCK == 32
    assert not stable(unblocked, layout, torch.float32, "cpu", 16)
    assert stable(blocked, layout, torch.float32, "cpu", 16)
    assert stable(prompt_reference, layout, torch.float32, "cpu", 16)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn((2, s, 16), generator=gen) for s in (67, 45, 45))
    table = rows = None
    if layout != "prompt_gathered":
        table = torch.zeros((2, 2, 45)).masked_fill_(
            torch.rand((2, 2, 45), generator=gen) < 0.4, float("-inf")
        )
        rows = torch.arange(67, dtype=torch.int32) % 3 - 1
    # rows 32..34 of a 35-row call: the unblocked kernel's own 3-row block
    assert not _same_rows(unblocked, q, k, v, table, rows, 35, 0)
    for run in (blocked, prompt_reference):
        for count, start in ((35, 0), (3, 32), (1, 66), (67, 0)):
            assert _same_rows(run, q, k, v, table, rows, count, start), (run, count, start)
    cand = registry.choose(layout, "cpu", torch.float32, 16, record=False)
    assert stable(cand.run, layout, torch.float32, "cpu", 16), cand.name


def test_an_unstable_candidate_is_refused_for_a_stable_one(fresh, caplog):
    """A CPU candidate that agrees with the reference to rounding but whose rows' bits depend on
    the call (here: the unblocked flash kernel) is refused with one warning; the next candidate
    that passes both checks is chosen."""
    registry._CANDIDATES[:] = [
        c for c in registry._CANDIDATES if "prompt_gathered" not in c.layouts
    ]
    on_cpu = lambda key: key[1] == "cpu"  # noqa: E731
    unblocked = library.prompt_call(library.cpu_flash)
    registry.register(registry.Candidate("unblocked", ("prompt_gathered",), unblocked, on_cpu))
    registry.register(
        registry.Candidate(
            "blocked", ("prompt_gathered",), library.prompt_call(library.cpu_flash, 32), on_cpu
        )
    )
    registry.register(
        registry.Candidate(
            "reference-float32", ("prompt_gathered",), prompt_reference, on_cpu, kind="reference"
        )
    )
    with caplog.at_level(logging.WARNING, logger="kvdiverge.engine.kernels.registry"):
        assert registry.choose("prompt_gathered", "cpu", torch.float32, 16).name == "blocked"
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unblocked" in warned[0] and "place in the call" in warned[0]
