"""The native ``rows_own`` kernel (engine.kernels.native.attend_own, own_attention.c): each
decoding row's G query heads per KV head against its own generated entries, merged with the
prompt part when given.

Where the kernel is built (AVX-512, a C compiler, ``KVDIVERGE_NATIVE`` not ``0``),
``attend_own`` equals softmax attention computed here in float64 with plain torch ops, and the
float32 reference ``math_attention``, to float32 rounding over entry counts around the 16-key
block (t = 1, odd, up to 200), batches up to 200 rows, head sizes 16 to 128 and 1 to 17 query
heads per KV head, read from row-cache views (a (B_cap, H_kv, capacity, d) buffer sliced to
[:rows, :, :t]); merged with a prompt part (an empty one among them) it equals the log-sum-exp
merge computed here in float64; a row's bits depend neither on its batch, its position in it,
nor the thread count; an empty own part gives 0 and −inf (merged: the prompt part);
unsupported head sizes and mismatched inputs are refused in one line. The registry chooses it
for ``rows_own`` where it validates (not with ``native=False`` or ``KVDIVERGE_NATIVE=0``), and
shared-prefix attention through it (merge inside the kernel) equals the library kernels' path,
identical rows giving identical bits. Where it is not built these tests are skipped with the
reason, unless ``KVDIVERGE_REQUIRE_NATIVE=1`` (``.ci/run``) makes the build mandatory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import kvdiverge.engine.attention as attention
from kvdiverge.engine.kernels import dispatch, native, registry
from kvdiverge.engine.kernels.reference import math_attention

REQUIRED = os.environ.get("KVDIVERGE_REQUIRE_NATIVE") == "1"
REASON = native.unavailable() or (None if native.library() is not None else "it did not build")
needs_native = pytest.mark.skipif(
    REASON is not None and not REQUIRED, reason=f"native kernel not built here: {REASON}"
)

pytestmark = [pytest.mark.usefixtures("one_thread_module"), needs_native]


@pytest.fixture
def fresh_choices():
    """The registry's choices forgotten before and after the test."""
    registry.reset()
    yield
    registry.reset()


def _reference(q, k, v, scale):
    """Softmax attention in float64: (B, h, G, d) queries over (B, h, t, d) entries → output
    (B, h, G, d) and log-sum-exp (B, h, G)."""
    scores = scale * q.double() @ k.double().transpose(-1, -2)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ v.double(), lse


def _merged(o_own, lse_own, o_pre, lse_pre):
    """The attention over both parts in float64: Σ over the union of exp(score − lse) · v is
    each part's output weighted by exp(lse_part − lse_union)."""
    lse = torch.logaddexp(lse_own.double(), lse_pre.double())
    w_own = torch.exp(lse_own.double() - lse)[..., None]
    w_pre = torch.exp(lse_pre.double() - lse)[..., None]
    return w_own * o_own.double() + w_pre * o_pre.double()


def _close(got, want, case):
    torch.testing.assert_close(
        got.double(), want.double(), atol=1e-5, rtol=1e-5, msg=lambda s: f"{case}: {s}"
    )


def _row_cache(gen, rows, n_kv, t, d, spare=3):
    """Keys and values as the row cache hands them out: views [:rows, :, :t] of
    (rows + spare, n_kv, t + 5, d) buffers (row and head strides of the capacity)."""
    shape = (rows + spare, n_kv, t + 5, d)
    keys, values = (torch.randn(shape, generator=gen) for _ in range(2))
    return keys[:rows, :, :t], values[:rows, :, :t]


def _queries(gen, rows, n_kv, groups, d):
    """(B, H_kv, G, d) as the attention function folds them: a view of (B, H, 1, d) queries
    laid out (B, 1, H, d) (the projection's order, transposed)."""
    query = torch.randn((rows, 1, n_kv * groups, d), generator=gen).transpose(1, 2)
    return query.reshape(rows, n_kv, groups, d)


CASES = [
    # (rows, n_kv, groups, t, d)
    (1, 1, 3, 1, 64),
    (3, 3, 3, 7, 64),
    (97, 3, 3, 64, 64),
    (97, 3, 3, 128, 64),
    (200, 3, 3, 129, 64),
    (5, 2, 3, 200, 64),
    (4, 3, 3, 1, 128),
    (97, 3, 3, 17, 128),
    (50, 2, 4, 128, 128),
    (7, 2, 3, 131, 128),
    (6, 2, 1, 16, 16),
    (6, 1, 7, 33, 32),
    (3, 2, 17, 15, 48),
    (2, 1, 5, 63, 112),
]


@pytest.mark.parametrize("rows, n_kv, groups, t, d", CASES)
def test_attend_own_equals_float64_and_the_reference(rows, n_kv, groups, t, d):
    """Output and log-sum-exp equal float64 attention and ``math_attention`` to float32
    rounding, read in place from row-cache views; contiguous copies give the same bits."""
    gen = torch.Generator().manual_seed(rows * 1000 + t * 10 + d)
    case = (rows, n_kv, groups, t, d)
    q = _queries(gen, rows, n_kv, groups, d)
    k, v = _row_cache(gen, rows, n_kv, t, d)
    assert k.stride()[:3] == ((t + 5) * d * n_kv, (t + 5) * d, d)  # the cache's strides
    scale = 1.3 * d**-0.5
    out, lse = native.attend_own(q, k, v, scale)
    assert out.shape == (rows, n_kv, groups, d) and lse.shape == (rows, n_kv, groups), case
    assert out.dtype == lse.dtype == torch.float32 and out.is_contiguous(), case
    want_out, want_lse = _reference(q, k, v, scale)
    _close(out, want_out, case)
    _close(lse, want_lse, case)
    ref_out, ref_lse = math_attention(q, k, v, scale)
    _close(out, ref_out, case)
    _close(lse, ref_lse, case)
    copies = native.attend_own(q.contiguous(), k.contiguous(), v.contiguous(), scale)
    assert torch.equal(copies[0], out) and torch.equal(copies[1], lse), case


@pytest.mark.parametrize("rows, n_kv, groups, t, d", CASES[::2])
def test_the_merge_equals_the_float64_union(rows, n_kv, groups, t, d):
    """With a prompt part (random outputs, log-sum-exps about the own ones, a few empty: −inf),
    the output is the attention over both parts (float64 here) to float32 rounding, the
    log-sum-exp returned is the own part's bit for bit, an empty prompt part leaves the own
    output, and the prompt part read through strided views gives the same bits."""
    gen = torch.Generator().manual_seed(rows + t + d)
    q = _queries(gen, rows, n_kv, groups, d)
    k, v = _row_cache(gen, rows, n_kv, t, d)
    scale = d**-0.5
    o_own, lse_own = native.attend_own(q, k, v, scale)
    o_pre = torch.randn(o_own.shape, generator=gen)
    lse_pre = lse_own + 3 * torch.randn(lse_own.shape, generator=gen)
    empty = torch.rand(lse_pre.shape, generator=gen) < 0.2
    empty.view(-1)[0] = True
    lse_pre[empty] = float("-inf")
    o_pre[empty] = 0.0
    out, lse = native.attend_own(q, k, v, scale, o_pre, lse_pre)
    assert torch.equal(lse, lse_own)
    _close(out, _merged(o_own, lse_own, o_pre, lse_pre), (rows, n_kv, groups, t, d))
    assert torch.equal(out[empty], o_own[empty])
    # the prompt part as the attention function holds it, views of (H_kv, B, G, ·) buffers
    o_first, lse_first = o_pre.transpose(0, 1).contiguous(), lse_pre.transpose(0, 1).contiguous()
    strided = native.attend_own(q, k, v, scale, o_first.transpose(0, 1), lse_first.transpose(0, 1))
    assert torch.equal(strided[0], out)
    # the library path's merge (dispatch.merge) agrees to float32 rounding
    _close(out, dispatch.merge(o_own, lse_own, o_pre, lse_pre), "dispatch.merge")


def test_no_own_entry_gives_zero_and_minus_inf_or_the_prompt_part():
    gen = torch.Generator().manual_seed(4)
    q = _queries(gen, 3, 2, 3, 64)
    k = v = torch.zeros((3, 2, 0, 64))
    out, lse = native.attend_own(q, k, v, 0.125)
    assert torch.equal(out, torch.zeros(3, 2, 3, 64)) and bool(torch.isneginf(lse).all())
    o_pre, lse_pre = torch.randn((3, 2, 3, 64), generator=gen), torch.randn((3, 2, 3))
    out, _ = native.attend_own(q, k, v, 0.125, o_pre, lse_pre)
    assert torch.equal(out, o_pre)


@pytest.mark.parametrize("d", [64, 128])
def test_a_row_is_the_same_bits_in_every_batch_position_and_thread_count(d):
    """One row (queries and own entries) placed at the first, a middle and the last position of
    batches of 1, 2, 7, 97 and 200 rows (the others random) gives its one-row bits, merged or
    not, on 1 and 2 threads; the copies differ from their neighbours (not vacuous)."""
    gen = torch.Generator().manual_seed(d)
    n_kv, groups, t = 3, 3, 129
    q1 = _queries(gen, 1, n_kv, groups, d).contiguous()
    k1, v1 = (x.contiguous() for x in _row_cache(gen, 1, n_kv, t, d))
    p1 = torch.randn((1, n_kv, groups, d), generator=gen)
    l1 = torch.randn((1, n_kv, groups), generator=gen) + 2
    alone = native.attend_own(q1, k1, v1, d**-0.5, threads=1)
    alone_merged = native.attend_own(q1, k1, v1, d**-0.5, p1, l1, threads=1)[0]
    for rows in (1, 2, 7, 97, 200):
        q = _queries(gen, rows, n_kv, groups, d).contiguous()
        k, v = (x.contiguous() for x in _row_cache(gen, rows, n_kv, t, d))
        o_pre = torch.randn((rows, n_kv, groups, d), generator=gen)
        lse_pre = torch.randn((rows, n_kv, groups), generator=gen) + 2
        places = sorted({0, rows // 2, rows - 1})
        for p in places:
            q[p], k[p], v[p], o_pre[p], lse_pre[p] = q1[0], k1[0], v1[0], p1[0], l1[0]
        for threads in (1, 2):
            out, lse = native.attend_own(q, k, v, d**-0.5, threads=threads)
            merged = native.attend_own(q, k, v, d**-0.5, o_pre, lse_pre, threads=threads)[0]
            for p in places:
                assert torch.equal(out[p], alone[0][0]), (rows, p, threads)
                assert torch.equal(lse[p], alone[1][0]), (rows, p, threads)
                assert torch.equal(merged[p], alone_merged[0]), (rows, p, threads)
            if rows > 2:
                assert not torch.equal(out[1], out[0])


def test_a_call_split_over_threads_gives_the_one_thread_bits():
    """200 rows on 1, 2, 3 and 8 threads (and torch's default): the same bits."""
    gen = torch.Generator().manual_seed(8)
    q = _queries(gen, 200, 3, 3, 64)
    k, v = _row_cache(gen, 200, 3, 128, 64)
    o_pre, lse_pre = torch.randn((200, 3, 3, 64), generator=gen), torch.randn((200, 3, 3))
    want = native.attend_own(q, k, v, 0.125, o_pre, lse_pre, threads=1)
    for threads in (2, 3, 8, None):
        got = native.attend_own(q, k, v, 0.125, o_pre, lse_pre, threads=threads)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), threads


def test_bad_inputs_are_refused_in_one_line():
    gen = torch.Generator().manual_seed(9)
    q, k = torch.randn((2, 2, 3, 64), generator=gen), torch.randn((2, 2, 5, 64), generator=gen)
    for d in (40, 144):
        with pytest.raises(RuntimeError, match=f"head size {d} not supported"):
            native.attend_own(
                torch.randn(2, 2, 3, d), torch.randn(2, 2, 5, d), torch.randn(2, 2, 5, d), 0.1
            )
    with pytest.raises(ValueError, match="keys and values must be"):
        native.attend_own(q, k, k[:, :, :4], 0.1)
    with pytest.raises(ValueError, match="float32 CPU"):
        native.attend_own(q.bfloat16(), k.bfloat16(), k.bfloat16(), 0.1)
    with pytest.raises(ValueError, match="come together"):
        native.attend_own(q, k, k, 0.1, torch.zeros(q.shape))
    with pytest.raises(ValueError, match="o_pre must be"):
        native.attend_own(q, k, k, 0.1, torch.zeros((2, 2, 3, 32)), torch.zeros((2, 2, 3)))


def test_the_registry_chooses_it_for_rows_own_where_it_validates(fresh_choices):
    """Every supported head size: the native kernel; 40 and 144, ``native=False``, bf16: the
    CPU flash kernel; in a process with ``KVDIVERGE_NATIVE=0``: the CPU flash kernel again."""
    for d in range(16, 129, 16):
        assert registry.choose("rows_own", "cpu", torch.float32, d).name == "native-avx512", d
    for d in (40, 144):
        assert registry.choose("rows_own", "cpu", torch.float32, d).name == "library-flash-cpu"
    flash = registry.choose("rows_own", "cpu", torch.float32, 64, native=False)
    assert flash.name == "library-flash-cpu"
    assert registry.choose("rows_own", "cpu", torch.bfloat16, 64).name == "library-flash-cpu"
    code = (
        "import torch\n"
        "from kvdiverge.engine.kernels import registry\n"
        "print(registry.choose('rows_own', 'cpu', torch.float32, 64).name)\n"
    )
    env = {**os.environ, "KVDIVERGE_NATIVE": "0"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.split() == ["library-flash-cpu"]


class _Layer(torch.nn.Module):
    def __init__(self, layer: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer


def test_shared_prefix_attention_through_it_equals_the_library_path(fresh_choices):
    """A call with a gathered group, a ragged group and the own entries of a row-cache view:
    the native path (merge in the kernel) equals ``native=False`` (library kernels, merge by
    ``dispatch.merge``) to 1e-5, records ``native-avx512`` for ``rows_own``, and two rows with
    the same queries, own entries and prompt part in different groups get the same bits."""
    gen = torch.Generator().manual_seed(11)
    n_kv, groups, d, n, t, batch = 3, 3, 64, 90, 37, 7
    full = [(torch.randn(n_kv, n, d, generator=gen), torch.randn(n_kv, n, d, generator=gen))]
    mask = torch.rand((n_kv, n), generator=gen) < 0.7
    mask[:, 0] = True
    ragged = [(full[0][0], full[0][1], mask)]
    rows = [torch.tensor([0, 3, 6]), torch.tensor([1, 4]), torch.tensor([2, 5])]
    query = torch.randn(batch, n_kv * groups, 1, d, generator=gen)
    key, value = _row_cache(gen, batch, n_kv, t, d)
    # row 3 (group 0) and row 2 (group 2, the same prompt part) are copies
    query[2], key[2], value[2] = query[3], key[3], value[3]

    def run(native_flag):
        shared = attention.SharedPrefix(rows, [full, ragged, full], True, native=native_flag)
        return attention.shared_prefix_attention(
            _Layer(), query, key, value, None, kvd_prefix=shared
        )[0]

    got = run(True)
    assert registry.kernel_choices()["rows_own"] == "native-avx512"
    assert torch.equal(got[2], got[3]) and not torch.equal(got[2], got[0])
    want = run(False)
    assert "library-flash-cpu" in registry.kernel_choices()["rows_own"]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.shape == (batch, 1, n_kv * groups, d)
