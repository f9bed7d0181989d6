"""The native prompt kernel (engine.kernels.native, prompt_attention.c) against a float64
reference.

Where the kernel is built (AVX-512, a C compiler, ``KVDIVERGE_NATIVE`` not ``0``),
``native.attend`` equals softmax attention computed here in float64 with plain torch ops
(scores = scale·q·kᵀ + bias, softmax, times v; log-sum-exp) to float32 rounding over head sizes,
prompt lengths around the 64-key block and query counts around the 6-row tile, with and without
additive masks (a row with every entry masked gets output 0 and log-sum-exp −inf); chunking the
query rows and splitting the work over threads change no bit; identical rows at different
positions and reruns are bit-identical; an empty prompt part gives 0 and −inf; unsupported head
sizes are refused (and not routed to the kernel by the registry); the packed keys are memoised
and laid out as documented; without the library the engine's shared-prefix attention falls back
to the library kernels with the same results. Where it is not built these tests are skipped with
the reason, unless ``KVDIVERGE_REQUIRE_NATIVE=1`` (``.ci/run``) makes the build mandatory. The
CPU capability is read robustly (its forms, the flags, the override) whatever the machine."""

from __future__ import annotations

import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch
from engine_reference import random_prompt

import kvdiverge.engine.attention as attention
from kvdiverge.engine.document import kept_mask
from kvdiverge.engine.kernels import native, registry

HEAD_SIZES = (16, 32, 48, 64, 128)
LENGTHS = (1, 5, 63, 64, 65, 130, 1000)
QUERIES = (1, 6, 7, 13, 40)
N_KV = 2

REQUIRED = os.environ.get("KVDIVERGE_REQUIRE_NATIVE") == "1"
REASON = native.unavailable() or (None if native.library() is not None else "it did not build")
needs_native = pytest.mark.skipif(
    REASON is not None and not REQUIRED, reason=f"native prompt kernel not built here: {REASON}"
)

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.fixture
def fresh_library():
    """``native.library()`` forgotten before and after the test (``native.reset``): it reads
    the environment the test sets, and the tests after it the environment they run under."""
    native.reset()
    yield
    native.reset()


def _native_chosen(layout="prompt_masked", d=64) -> bool:
    return registry.choose(layout, "cpu", torch.float32, d).name == "native-avx512"


def _reference(q, k, v, scale, bias=None, row_bias=None):
    """Softmax attention in float64: output (H_kv, M, d) and log-sum-exp (H_kv, M); a row with
    every entry at −inf gets output 0 and log-sum-exp −inf."""
    q, k, v = q.double(), k.double(), v.double()
    scores = scale * q @ k.transpose(-1, -2)  # (H_kv, M, n)
    if bias is not None:
        for m, g in enumerate(row_bias.tolist()):
            if g >= 0:
                scores[:, m] += bias[g].double()
    lse = torch.logsumexp(scores, dim=-1)
    empty = torch.isinf(lse)[..., None]
    weights = torch.where(empty, 0.0, torch.exp(scores - torch.where(empty, 0.0, lse[..., None])))
    return weights @ v, lse


def _close(got, want, case):
    """float32 ``got`` equals the float64 ``want`` to float32 rounding (−inf where it is)."""
    torch.testing.assert_close(
        got.double(), want, atol=1e-5, rtol=1e-5, msg=lambda s: f"{case}: {s}"
    )


def _problem(gen, m, n, d, masked):
    """Random q, k, v and, when ``masked``, a bias table of three rows — finite additive values
    with about a third of the entries at −inf, the last row dropping every entry of KV head 0 —
    and each query row's index into it (−1, 0, 1, 2 in turn)."""
    q, k, v = (torch.randn((N_KV, s, d), generator=gen) for s in (m, n, n))
    if not masked:
        return q, k, v, None, None
    bias = 0.5 * torch.randn((3, N_KV, n), generator=gen)
    bias.masked_fill_(torch.rand((3, N_KV, n), generator=gen) < 1 / 3, float("-inf"))
    bias[2, 0] = float("-inf")
    row_bias = torch.arange(m, dtype=torch.int32) % 4 - 1
    return q, k, v, bias, row_bias


def test_the_library_builds_here():
    """Where the CPU and compiler allow (always where ``.ci/run`` sets
    ``KVDIVERGE_REQUIRE_NATIVE=1``), the kernel builds and loads once, with its symbols."""
    if REASON is not None and not REQUIRED:
        pytest.skip(f"native prompt kernel not built here: {REASON}")
    assert native.unavailable() is None, native.unavailable()
    lib = native.library()
    assert lib is not None
    assert native.library() is lib  # loaded once
    assert hasattr(lib, "kvd_prompt_attention") and lib.kvd_abi_version() == 2


@needs_native
def test_attend_equals_a_float64_reference_and_chunking_changes_no_bit(monkeypatch):
    """Over the grid of head sizes, prompt lengths and query counts, with and without masks:
    outputs and log-sum-exps equal the float64 reference to float32 rounding; rows with every
    entry of a KV head masked are exactly 0 with log-sum-exp −inf; scoring the query rows in
    chunks of 1, 2 and 5 gives the unchunked results bit for bit."""
    gen = torch.Generator().manual_seed(29)
    empty_rows = 0
    for d in HEAD_SIZES:
        scale = 1.3 * d**-0.5
        for n in LENGTHS:
            width = math.ceil(n / native.BLOCK) * native.BLOCK
            for m in QUERIES:
                for masked in (False, True):
                    case = (d, n, m, masked)
                    q, k, v, bias, row_bias = _problem(gen, m, n, d, masked)
                    assert native._SCORES_FLOATS // width >= m  # unchunked by default
                    out, lse = native.attend(q, k, v, scale, bias, row_bias)
                    assert out.shape == (N_KV, m, d) and lse.shape == (N_KV, m), case
                    assert out.dtype == lse.dtype == torch.float32, case
                    ref_out, ref_lse = _reference(q, k, v, scale, bias, row_bias)
                    _close(out, ref_out, case)
                    _close(lse, ref_lse, case)
                    empty = torch.isinf(ref_lse)
                    assert torch.equal(torch.isinf(lse), empty), case
                    assert bool((lse[empty] == float("-inf")).all()), case
                    assert bool((out[empty] == 0).all()), case
                    assert torch.isfinite(out).all(), case
                    empty_rows += int(empty.sum())
                    for chunk in (1, 2, 5):
                        monkeypatch.setattr(native, "_SCORES_FLOATS", chunk * width)
                        c_out, c_lse = native.attend(q, k, v, scale, bias, row_bias)
                        assert torch.equal(c_out, out), (case, chunk)
                        assert torch.equal(c_lse, lse), (case, chunk)
                    monkeypatch.undo()
    assert empty_rows > 0  # the all-masked case was exercised


@needs_native
def test_identical_rows_are_bit_identical_wherever_they_are_and_reruns_too(monkeypatch):
    """One query row copied to the first tile, the middle of a tile, the last partial tile and
    (with chunks of 7 rows) into other chunks gives bit-identical outputs and log-sum-exps at
    every copy, for every supported head size; two calls give the same bits."""
    gen = torch.Generator().manual_seed(7)
    m, n = 40, 130
    width = math.ceil(n / native.BLOCK) * native.BLOCK
    places = [0, 3, 6, 13, 36, 39]  # rows 36..39: the last, partial tile of 6
    for d in range(16, 129, 16):
        for masked in (False, True):
            q, k, v, bias, row_bias = _problem(gen, m, n, d, masked)
            if masked:
                row_bias[places] = 1
            q[:, places] = q[:, :1]
            for chunk in (None, 7):
                if chunk is not None:
                    monkeypatch.setattr(native, "_SCORES_FLOATS", chunk * width)
                out, lse = native.attend(q, k, v, d**-0.5, bias, row_bias)
                again, again_lse = native.attend(q, k, v, d**-0.5, bias, row_bias)
                assert torch.equal(out, again) and torch.equal(lse, again_lse), (d, masked, chunk)
                for p in places[1:]:
                    assert torch.equal(out[:, p], out[:, 0]), (d, masked, chunk, p)
                    assert torch.equal(lse[:, p], lse[:, 0]), (d, masked, chunk, p)
                # the copies differ from their neighbours (the comparison is not vacuous)
                assert not torch.equal(out[:, 1], out[:, 0])
            monkeypatch.undo()


@needs_native
@pytest.mark.parametrize("d", [20, 144])
def test_unsupported_head_sizes_are_refused(d):
    """Head sizes that are not a multiple of 16 up to 128 raise from ``attend``, and the engine
    does not route them to the kernel (while it does a supported size)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn((N_KV, s, d), generator=gen) for s in (5, 30, 30))
    with pytest.raises(RuntimeError, match="not supported"):
        native.attend(q, k, v, d**-0.5)
    assert not _native_chosen(d=d)
    assert _native_chosen(d=64)


def test_pack_keys_is_memoised_and_laid_out_in_blocks_of_64():
    """``pack_keys`` returns the same tensor for the same keys (another tensor, even equal, gets
    its own) laid out (H_kv, ⌈n/64⌉, d, 64) with packed[h, b, :, j] = k[h, 64 b + j], zero
    past n."""
    gen = torch.Generator().manual_seed(2)
    h, n, d = 2, 130, 16
    k = torch.randn((h, n, d), generator=gen)
    packed = native.pack_keys(k)
    assert native.pack_keys(k) is packed
    assert native.pack_keys(k.clone()) is not packed
    assert packed.shape == (h, 3, d, 64) and packed.is_contiguous()
    for head in range(h):
        for b in range(3):
            for j in range(64):
                if 64 * b + j < n:
                    assert torch.equal(packed[head, b, :, j], k[head, 64 * b + j])
                else:
                    assert not packed[head, b, :, j].any()


@needs_native
def test_engine_falls_back_without_the_library(monkeypatch, fresh_library):
    """With the library absent, the registry chooses the library kernel and shared-prefix
    attention (a masked pass with a ragged mask, a gathered group) gives the native path's
    results to 1e-5."""
    gen = torch.Generator().manual_seed(3)
    n_kv, groups, d, n, layers = 2, 3, 16, 70, 2
    prompt, prefill = random_prompt(gen, n_kv, n, d, layers)
    kept = torch.full((layers, n_kv, n), -1, dtype=torch.long)
    kept[0, 0, :10] = torch.arange(0, 30, 3)
    kept[0, 1, :25] = torch.arange(15, 40)
    kept[1, 0, :5] = torch.tensor([1, 7, 8, 20, 69])
    kept[1, 1, :66] = torch.arange(66)
    masks = [None, kept_mask(prefill, kept)]
    rows = [torch.tensor([0, 3]), torch.tensor([1, 4]), torch.tensor([2, 5])]
    batch, own = 6, 4
    q = torch.randn(batch, n_kv * groups, 1, d, generator=gen)
    key, value = (torch.randn(batch, n_kv, own, d, generator=gen) for _ in range(2))
    modules = [SimpleNamespace(layer_idx=layer) for layer in range(layers)]
    half = [(pk[:, : n // 2], pv[:, : n // 2]) for pk, pv in prompt]

    def prefix():
        part = attention.PromptPass([0, 1], prompt, masks)
        return attention.SharedPrefix(rows, [prompt, prompt, half], True, [part], native=True)

    registry.reset()
    with_native = [
        attention.shared_prefix_attention(m, q, key, value, None, kvd_prefix=prefix())[0]
        for m in modules
    ]
    assert registry.kernel_choices()["prompt_masked"] == "native-avx512"
    monkeypatch.setenv("KVDIVERGE_NATIVE", "0")
    native.reset()
    registry.reset()
    assert native.library() is None
    for m, want in zip(modules, with_native, strict=True):
        got = attention.shared_prefix_attention(m, q, key, value, None, kvd_prefix=prefix())[0]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert registry.kernel_choices()["prompt_masked"] == "library-flash-cpu"
    registry.reset()


@pytest.mark.parametrize("heads, rows", [(1, 1), (2, 40), (3, 7), (8, 13), (1, 100)])
def test_work_items_cover_every_head_and_row_once(heads, rows):
    """For 1 to 5 threads, the pieces partition the (KV head, query row) grid exactly, and with
    several threads there are at least as many pieces as threads where the rows allow."""
    for threads in range(1, 6):
        items = native.work_items(heads, rows, threads)
        seen = torch.zeros((heads, rows), dtype=torch.long)
        for h0, h1, r0, r1 in items:
            assert 0 <= h0 < h1 <= heads and 0 <= r0 < r1 <= rows
            seen[h0:h1, r0:r1] += 1
        assert bool((seen == 1).all()), (threads, items)
        if threads == 1:
            assert items == [(0, heads, 0, rows)]
        elif heads * -(-rows // 6) >= threads:
            assert len(items) >= threads


@needs_native
def test_threads_change_no_bit():
    """``attend`` on 2, 3 and 4 threads (KV heads and row pieces in parallel) equals one thread
    bit for bit, masked and unmasked; torch's thread count is the default (calls below a size
    on one thread; with that size 0, every call split)."""
    gen = torch.Generator().manual_seed(11)
    for m, n, d in ((40, 130, 64), (7, 1000, 16), (13, 65, 128)):
        for masked in (False, True):
            q, k, v, bias, row_bias = _problem(gen, m, n, d, masked)
            one = native.attend(q, k, v, d**-0.5, bias, row_bias, threads=1)
            for threads in (2, 3, 4):
                got = native.attend(q, k, v, d**-0.5, bias, row_bias, threads=threads)
                assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1]), threads
            torch.set_num_threads(2)
            try:
                for pairs in (native._PARALLEL_PAIRS, 0):  # small calls on one thread, or not
                    native._PARALLEL_PAIRS, saved = pairs, native._PARALLEL_PAIRS
                    try:
                        got = native.attend(q, k, v, d**-0.5, bias, row_bias)
                    finally:
                        native._PARALLEL_PAIRS = saved
                    assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
            finally:
                torch.set_num_threads(1)
            assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])


@needs_native
def test_native_kernel_is_chosen_with_several_threads():
    """The registry chooses the native kernel whatever torch's thread count (it splits its work
    over them), so multi-thread jobs and ``kvdiverge compare`` use it."""
    registry.reset()
    torch.set_num_threads(2)
    try:
        assert _native_chosen("prompt_masked") and _native_chosen("prompt_gathered")
    finally:
        torch.set_num_threads(1)
        registry.reset()


@needs_native
def test_an_empty_prompt_part_gives_zero_and_minus_infinity():
    """A prompt part with no entry (n = 0, e.g. a ragged selector keeping nothing) gives output
    0 and log-sum-exp −inf for every row, with and without a bias table, on any thread count;
    through the attention function the rows then attend to their own entries alone."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(N_KV, 5, 32, generator=gen)
    empty = torch.zeros((N_KV, 0, 32))
    for bias, rows in (
        (None, None),
        (torch.zeros((1, N_KV, 0)), torch.zeros(5, dtype=torch.int32)),
    ):
        for threads in (1, 2):
            out, lse = native.attend(q, empty, empty, 0.2, bias, rows, threads=threads)
            assert out.shape == (N_KV, 5, 32) and bool((out == 0).all())
            assert lse.shape == (N_KV, 5) and bool(torch.isneginf(lse).all())
    # the engine: a gathered part of width 0 for the second group
    query = torch.randn(4, N_KV * 2, 1, 32, generator=gen)
    key, value = (torch.randn(4, N_KV, 3, 32, generator=gen) for _ in range(2))
    full = [(torch.randn(N_KV, 9, 32, generator=gen), torch.randn(N_KV, 9, 32, generator=gen))]
    prefix = attention.SharedPrefix(
        [torch.tensor([0, 1]), torch.tensor([2, 3])], [full, [(empty, empty)]]
    )
    got = attention.shared_prefix_attention(
        SimpleNamespace(layer_idx=0), query, key, value, None, kvd_prefix=prefix
    )[0]
    folded = query.reshape(4, N_KV, 2, 32)[2:]
    own = torch.softmax(folded @ key[2:].transpose(-1, -2) * 32**-0.5, -1) @ value[2:]
    torch.testing.assert_close(got[2:].transpose(1, 2).reshape(2, N_KV, 2, 32), own)


@pytest.mark.parametrize(
    "capability, has",
    [
        ("AVX512", True),
        ("avx512", True),
        ("AVX512_BF16", True),
        ("avx512f", True),
        ("AVX-512", True),
        (" AVX512 ", True),
        ("AVX2", False),
        ("DEFAULT", False),
        ("NONE", False),
        ("ZVECTOR", False),
        ("", False),
    ],
)
def test_cpu_capability_is_read_in_any_form(capability, has):
    assert native.capability_has_avx512(capability) is has


def test_cpu_flags_and_the_override_decide(tmp_path, monkeypatch):
    """The override wins; else the flags of /proc/cpuinfo (avx512f and fma both); a file
    without flags (or none) leaves torch's capability."""
    monkeypatch.delenv("KVDIVERGE_CPU_CAPABILITY", raising=False)
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse2 avx2 fma\n")
    assert native._cpuinfo_flags(info) == {"fpu", "sse2", "avx2", "fma"}
    info.write_text("processor : 0\nFeatures : fp asimd\n")  # ARM's name for them
    assert native._cpuinfo_flags(info) == {"fp", "asimd"}
    assert native._cpuinfo_flags(tmp_path / "absent") is None
    monkeypatch.setattr(native, "_cpuinfo_flags", lambda: {"avx512f", "fma", "sse2"})
    assert native.cpu_has_avx512()[0]
    monkeypatch.setattr(native, "_cpuinfo_flags", lambda: {"avx512f", "sse2"})
    assert not native.cpu_has_avx512()[0]
    monkeypatch.setenv("KVDIVERGE_CPU_CAPABILITY", "AVX512")
    assert native.cpu_has_avx512() == (True, "KVDIVERGE_CPU_CAPABILITY='AVX512'")


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"KVDIVERGE_NATIVE": "0"}, "turned off by KVDIVERGE_NATIVE=0"),
        ({"KVDIVERGE_CPU_CAPABILITY": "AVX2"}, "this CPU has no AVX-512 (read from"),
    ],
)
def test_the_kernel_can_be_turned_off_and_the_library_kernels_run(
    env, reason, monkeypatch, caplog, fresh_library
):
    """``KVDIVERGE_NATIVE=0``, or a CPU capability read as without AVX-512: ``library()`` is
    ``None`` with one logged line naming why, and the registry chooses the library kernel for
    every prompt layout."""
    for name in ("KVDIVERGE_NATIVE", "KVDIVERGE_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    registry.reset()
    with caplog.at_level(logging.INFO, logger="kvdiverge.engine.kernels.native"):
        assert native.library() is None
    lines = [r.getMessage() for r in caplog.records if r.name == "kvdiverge.engine.kernels.native"]
    assert len(lines) == 1 and reason in lines[0], lines
    for layout in ("prompt_gathered", "prompt_ragged", "prompt_masked"):
        assert registry.choose(layout, "cpu", torch.float32, 64).name == "library-flash-cpu"
    registry.reset()
