"""The native prompt kernel (engine.native, prompt_attention.c) against a float64 reference.

The library builds on this machine (AVX-512 and a C compiler); ``native.attend`` equals softmax
attention computed here in float64 with plain torch ops (scores = scale·q·kᵀ + bias, softmax,
times v; log-sum-exp) to float32 rounding over head sizes, prompt lengths around the 64-key
block and query counts around the 6-row tile, with and without additive masks (a row with
every entry masked gets output 0 and log-sum-exp −inf); chunking the query rows changes no bit;
identical rows at different positions and reruns are bit-identical; unsupported head sizes are
refused (and not routed to the kernel by the engine); the packed keys are memoised and laid out
as documented; the build cache builds once, and a broken compiler is an error for ``_build``
and a logged ``None`` for ``library``; without the library the engine's shared-prefix attention
falls back to the plain path with the same results."""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch
from engine_reference import random_prompt

import kvdiverge.engine.attention as attention
from kvdiverge.engine import native
from kvdiverge.engine.document import kept_mask

HEAD_SIZES = (16, 32, 48, 64, 128)
LENGTHS = (1, 5, 63, 64, 65, 130, 1000)
QUERIES = (1, 6, 7, 13, 40)
N_KV = 2


pytestmark = pytest.mark.usefixtures("one_thread_module")


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
    """This machine has AVX-512 and a C compiler, so the kernel must build and load (no skip:
    a build broken here would otherwise silently send the engine to the library kernels)."""
    assert torch.backends.cpu.get_cpu_capability() == "AVX512"
    assert os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    lib = native.library()
    assert lib is not None
    assert native.library() is lib  # loaded once
    assert hasattr(lib, "kvd_prompt_attention")


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


@pytest.mark.parametrize("d", [20, 144])
def test_unsupported_head_sizes_are_refused(d):
    """Head sizes that are not a multiple of 16 up to 128 raise from ``attend``, and the engine
    does not route them to the kernel (while it does a supported size)."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn((N_KV, s, d), generator=gen) for s in (5, 30, 30))
    with pytest.raises(RuntimeError, match="not supported"):
        native.attend(q, k, v, d**-0.5)
    prompt = [(k, v)]
    prefix = attention.SharedPrefix([torch.tensor([0, 1])], [prompt], True, native=True)
    assert not attention._use_native(prefix, torch.randn(2, N_KV, 3, d, generator=gen))
    assert attention._use_native(prefix, torch.randn(2, N_KV, 3, 64, generator=gen))


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


def _broken(tmp_path, version_ok):
    script = tmp_path / ("cc-fails-compile" if version_ok else "cc-fails")
    first = 'if [ "$1" = --version ]; then echo fake-cc 1.0; exit 0; fi\n' if version_ok else ""
    script.write_text(f"#!/bin/sh\n{first}echo 'fake-cc: error' >&2\nexit 1\n")
    script.chmod(0o755)
    return str(script)


def test_build_cache_builds_once_and_a_broken_compiler_is_reported(tmp_path, monkeypatch, caplog):
    """``_build`` puts one shared library into $KVDIVERGE_CACHE and, called again, returns it
    without rebuilding; a compiler that fails (its version query, or the compilation) raises
    CalledProcessError and leaves nothing behind; ``library`` with that compiler as $CC is
    ``None`` with a warning."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVDIVERGE_CACHE", str(cache))
    compiler = shutil.which("cc") or "gcc"
    target = native._build(compiler)
    assert target.parent == cache and target.suffix == ".so"
    assert list(cache.rglob("*")) == [target]
    mtime = target.stat().st_mtime_ns
    assert native._build(compiler) == target
    assert target.stat().st_mtime_ns == mtime
    assert list(cache.rglob("*")) == [target]

    for version_ok in (False, True):
        broken = _broken(tmp_path, version_ok)
        with pytest.raises(subprocess.CalledProcessError):
            native._build(broken)
        assert list(cache.rglob("*")) == [target], version_ok  # no temporary file left

    monkeypatch.setattr(native, "_LIB", [])
    monkeypatch.setenv("CC", _broken(tmp_path, True))
    with caplog.at_level(logging.WARNING, logger="kvdiverge.engine.native"):
        assert native.library() is None
    warnings = [r for r in caplog.records if r.name == "kvdiverge.engine.native"]
    assert [r.levelno for r in warnings] == [logging.WARNING]
    assert "not built" in warnings[0].getMessage()
    assert native._LIB == [None]  # remembered: not rebuilt on every call
    assert list(cache.rglob("*")) == [target]


def test_engine_falls_back_without_the_library(monkeypatch):
    """With the library absent, ``_use_native`` is false and shared-prefix attention (a masked
    pass with a ragged mask, a gathered group) gives the native path's results to 1e-5."""
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

    folded = q.reshape(batch, n_kv, groups, d)
    assert attention._use_native(prefix(), folded)
    with_native = [
        attention.shared_prefix_attention(m, q, key, value, None, kvd_prefix=prefix())[0]
        for m in modules
    ]
    monkeypatch.setattr(native, "_LIB", [None])
    monkeypatch.setattr(attention, "_NATIVE", [])
    assert not attention._use_native(prefix(), folded)
    assert attention._NATIVE == [False]
    for m, want in zip(modules, with_native, strict=True):
        got = attention.shared_prefix_attention(m, q, key, value, None, kvd_prefix=prefix())[0]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_native_kernel_only_on_one_thread():
    """The kernel runs on one thread; with more torch threads the library kernels (which use
    them) take the prompt parts."""
    q = torch.randn(2, 2, 3, 64)
    prefix = attention.SharedPrefix([torch.arange(2)], [[]], True)
    assert attention._use_native(prefix, q)
    torch.set_num_threads(2)
    try:
        assert not attention._use_native(prefix, q)
    finally:
        torch.set_num_threads(1)
    assert attention._use_native(prefix, q)
