/* Decoding rows' attention to a document's prompt cache, one pass over the cache (AVX-512).
 *
 * kvdiverge.engine.kernels.build compiles this file with the system C compiler, and
 * kvdiverge.engine.kernels.native calls it through
 * ctypes (docs/engine.md, "The native prompt kernel"). For each KV head h, the M queries q[h]
 * (a document's decoding rows, grouped-query heads folded) are scored against the prompt's
 * n keys, each row's additive bias (its action's evicted entries at -inf) added, softmaxed,
 * and the weights applied to the n values: out[h, m] = softmax(scale * q·Kᵀ + bias) V and
 * lse[h, m] = log Σ_j exp(scale * q·k_j + bias_j).
 *
 * Why a kernel of our own: a document's pass holds a few dozen queries per KV head, so every
 * prompt entry read from memory serves few products; the library kernels run these skinny
 * products at a third of the matrix rate and do not overlap them with the reads
 * (benchmarks/README.md, "Native prompt kernel"). Here each block of 64 keys (16 KiB at d = 64)
 * is read from memory once and used by every query from the first level of cache.
 *
 * Layout: keys packed once per document as kt[h][b][k][j] = K[h][64 b + j][k] (zero beyond
 * n), values as they are, (H_kv, n, d). Every row is computed by the same instruction sequence
 * whatever its position among the rows, so identical rows give identical results (the control
 * reproduces the reference rows bit for bit) and reruns are bit-identical.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "attention_math.h"

#define KB 64       /* keys per packed block */
#define RT_QK 6     /* query rows per score tile: 6 x 4 accumulators */
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T1
#endif
#ifndef PF_DIST
#define PF_DIST 2
#endif
/* A block's cache lines asked for ahead of use, a few per iteration of every tile's inner
 * loop, so that the reads spread over the block's arithmetic (a burst at one tile's start
 * would wait on the fill buffers). */
typedef struct {
    const char *at, *end;
    int per;
} cursor;

INLINE void advance(cursor *c) {
    for (int i = 0; i < c->per; i++)
        if (c->at < c->end) {
            _mm_prefetch(c->at, PF_HINT);
            c->at += 64;
        }
}

static cursor make_cursor(const float *block, const int64_t lines, const int64_t slots) {
    cursor c = {(const char *)block, (const char *)block + (block ? 64 * lines : 0),
                (int)((lines + slots - 1) / slots)};
    return c;
}

/* s[r][0:64] = q[r]·kt_block for rt query rows (row stride d) into rows of stride ld. */
INLINE void score_tile(const int rt, const int d, const float *q, const float *kt, float *s,
                       const int64_t ld, cursor *pf) {
    __m512 c[RT_QK][4];
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < 4; i++) c[r][i] = _mm512_setzero_ps();
    for (int k = 0; k < d; k++) {
        const float *row = kt + (int64_t)k * KB;
        advance(pf);
        const __m512 b0 = _mm512_loadu_ps(row), b1 = _mm512_loadu_ps(row + 16);
        const __m512 b2 = _mm512_loadu_ps(row + 32), b3 = _mm512_loadu_ps(row + 48);
        for (int r = 0; r < rt; r++) {
            const __m512 a = _mm512_set1_ps(q[(int64_t)r * d + k]);
            c[r][0] = _mm512_fmadd_ps(a, b0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(a, b1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(a, b2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(a, b3, c[r][3]);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(s + r * ld + 16 * i, c[r][i]);
}

static void score_rows(const int rows, const int d, const float *q, const float *kt, float *s,
                       const int64_t ld, const float *next) {
    const int tiles = (rows + RT_QK - 1) / RT_QK;
    cursor cur = make_cursor(next, 4 * (int64_t)d, (int64_t)tiles * d);
    cursor *pf = &cur;
    int r0 = 0;
    for (; r0 + RT_QK <= rows; r0 += RT_QK)
        score_tile(RT_QK, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf);
    switch (rows - r0) {
    case 5: score_tile(5, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf); break;
    case 4: score_tile(4, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf); break;
    case 3: score_tile(3, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf); break;
    case 2: score_tile(2, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf); break;
    case 1: score_tile(1, d, q + (int64_t)r0 * d, kt, s + r0 * ld, ld, pf); break;
    default: break;
    }
}

/* acc[r][0:16 dv] += Σ_j p[r][j] v[j] over kn keys, rt rows (p rows of stride ld). */
INLINE void value_tile(const int rt, const int dv, const int kn, const float *p,
                       const int64_t ld, const float *v, float *acc, cursor *pf) {
    __m512 c[6][8];
    const int d = 16 * dv;
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < dv; i++) c[r][i] = _mm512_loadu_ps(acc + r * d + 16 * i);
    for (int j = 0; j < kn; j++) {
        __m512 b[8];
        for (int i = 0; i < dv; i++) b[i] = _mm512_loadu_ps(v + (int64_t)j * d + 16 * i);
        advance(pf);
        for (int r = 0; r < rt; r++) {
            const __m512 a = _mm512_set1_ps(p[r * ld + j]);
            for (int i = 0; i < dv; i++) c[r][i] = _mm512_fmadd_ps(a, b[i], c[r][i]);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < dv; i++) _mm512_storeu_ps(acc + r * d + 16 * i, c[r][i]);
}

/* rows x (16 dv) accumulators over one block of kn keys, in tiles of RT rows, then one tile
 * of the rows left (fewer than RT; a tail case of RT rows or more is never reached). */
#define VALUE_TAIL(DV, T)                                                                    \
    case (T):                                                                                \
        value_tile((T), (DV), kn, p + r0 * ld, ld, v, acc + r0 * 16 * (DV), pf);             \
        break;
#define VALUE_ROWS(DV, RT)                                                                   \
    static void value_rows_##DV(const int rows, const int kn, const float *p, const int64_t ld,  \
                                const float *v, float *acc, const float *next) {             \
        const int tiles = (rows + (RT) - 1) / (RT);                                          \
        cursor cur = make_cursor(next, (int64_t)KB * (DV), (int64_t)tiles * kn);             \
        cursor *pf = &cur;                                                                   \
        int r0 = 0;                                                                          \
        for (; r0 + (RT) <= rows; r0 += (RT))                                                \
            value_tile((RT), (DV), kn, p + r0 * ld, ld, v, acc + r0 * 16 * (DV), pf);        \
        switch (rows - r0) {                                                                 \
        VALUE_TAIL(DV, 5) VALUE_TAIL(DV, 4) VALUE_TAIL(DV, 3) VALUE_TAIL(DV, 2)              \
        VALUE_TAIL(DV, 1) default: break;                                                    \
        }                                                                                    \
    }
VALUE_ROWS(1, 6)
VALUE_ROWS(2, 6)
VALUE_ROWS(3, 6)
VALUE_ROWS(4, 6)
VALUE_ROWS(5, 4)
VALUE_ROWS(6, 3)
VALUE_ROWS(7, 3)
VALUE_ROWS(8, 3)

typedef void (*value_fn)(int, int, const float *, int64_t, const float *, float *,
                         const float *);
static const value_fn VALUE_FNS[9] = {0,          value_rows_1, value_rows_2,
                                      value_rows_3, value_rows_4, value_rows_5,
                                      value_rows_6, value_rows_7, value_rows_8};

/* Softmax of one score row in place over its n entries (bias added first, when given):
 * returns the row's maximum; *total receives Σ exp(s - max) (0 when every entry is -inf). */
static float softmax_row(float *s, const int n, const float scale, const float *bias,
                         float *total) {
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    __m512 vmax = ninf;
    int j = 0;
    for (; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + j), vscale);
        if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + j));
        x = _mm512_mask_mov_ps(ninf, m, x);
        _mm512_storeu_ps(s + j, x);  /* rows are padded to a multiple of 64 entries */
        vmax = _mm512_max_ps(vmax, x);
    }
    const float mx = _mm512_reduce_max_ps(vmax);
    if (mx == -INFINITY) {
        for (j = 0; j < n; j++) s[j] = 0.0f;
        *total = 0.0f;
        return mx;
    }
    const __m512 vm = _mm512_set1_ps(mx);
    __m512 sum = _mm512_setzero_ps();
    for (j = 0; j < n; j += 16) {
        const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    *total = _mm512_reduce_add_ps(sum);
    return mx;
}

/* The ABI of kvd_prompt_attention (checked by kvdiverge.engine.kernels.build before use). */
int kvd_abi_version(void) { return 2; }

/* The pass: see the file's head. q (n_kv, M, d); kt packed (n_kv, ceil(n/64), d, 64);
 * v (n_kv, n, d); bias (n_bias, n_kv, n) additive or NULL; row_bias (M): each query row's
 * index into bias, -1 for none; out (n_kv, M, d); lse (n_kv, M); scratch: chunk rows of
 * ceil(n/64)·64 floats (the scores of up to ``chunk`` query rows at once) plus chunk floats.
 * Only KV heads h0 <= h < h1 and query rows r0 <= r < r1 are computed (so that threads can
 * share a call's work, each with its own scratch; every row is computed alike wherever it is,
 * so the split changes no bit). Returns 0, or -1 when d is not a multiple of 16 up to 128 or a
 * range is out of bounds. */
int kvd_prompt_attention(const int n_kv, const int M, const int n, const int d, const int h0,
                         const int h1, const int r0, const int r1, const float *q,
                         const float *kt, const float *v, const float *bias,
                         const int32_t *row_bias, const float scale, float *out, float *lse,
                         float *scratch, const int chunk) {
    if (d % 16 != 0 || d > 128 || d <= 0 || chunk <= 0) return -1;
    if (h0 < 0 || h1 > n_kv || r0 < 0 || r1 > M || n <= 0) return -1;
    const int nb = (n + KB - 1) / KB;
    const int64_t ld = (int64_t)nb * KB;
    const value_fn value_rows = VALUE_FNS[d / 16];
    float *totals = scratch + (int64_t)chunk * ld;
    for (int h = h0; h < h1; h++) {
        const float *kth = kt + (int64_t)h * nb * d * KB;
        const float *vh = v + (int64_t)h * n * d;
        for (int c0 = r0; c0 < r1; c0 += chunk) {
            const int mc = r1 - c0 < chunk ? r1 - c0 : chunk;
            const float *qc = q + ((int64_t)h * M + c0) * d;
            float *oc = out + ((int64_t)h * M + c0) * d;
            for (int b = 0; b < nb; b++)
                score_rows(mc, d, qc, kth + (int64_t)b * d * KB, scratch + (int64_t)b * KB, ld,
                           b + PF_DIST < nb ? kth + (int64_t)(b + PF_DIST) * d * KB : 0);
            for (int r = 0; r < mc; r++) {
                const int32_t g = row_bias ? row_bias[c0 + r] : -1;
                const float *bi = g >= 0 ? bias + ((int64_t)g * n_kv + h) * n : 0;
                const float mx = softmax_row(scratch + r * ld, n, scale, bi, totals + r);
                lse[(int64_t)h * M + c0 + r] =
                    totals[r] > 0.0f ? mx + logf(totals[r]) : -INFINITY;
            }
            for (int64_t i = 0; i < (int64_t)mc * d; i++) oc[i] = 0.0f;
            for (int b = 0; b < nb; b++) {
                const int kn = n - b * KB < KB ? n - b * KB : KB;
                value_rows(mc, kn, scratch + (int64_t)b * KB, ld, vh + (int64_t)b * KB * d, oc,
                           (b + PF_DIST) * KB < n ? vh + (int64_t)(b + PF_DIST) * KB * d : 0);
            }
            for (int r = 0; r < mc; r++) {
                const float t = totals[r];
                const __m512 inv = _mm512_set1_ps(t > 0.0f ? 1.0f / t : 0.0f);
                for (int i = 0; i < d; i += 16)
                    _mm512_storeu_ps(oc + r * d + i,
                                     _mm512_mul_ps(_mm512_loadu_ps(oc + r * d + i), inv));
            }
        }
    }
    return 0;
}
