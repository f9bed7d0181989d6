/* Each decoding row's attention to its own generated entries, merged with its prompt part when
 * that is given (AVX-512).
 *
 * kvdiverge.engine.kernels.build compiles this file with prompt_attention.c into one library,
 * and kvdiverge.engine.kernels.native calls it through ctypes (docs/engine.md, "The native
 * own-entries kernel"). For row b and KV head h, the G query heads sharing the KV head,
 * q[b, h, g], are scored against the row's own t keys k[b, h, j], softmaxed, and the weights
 * applied to its t values:
 *
 *     o[b, h, g] = softmax_j(scale * q·k_j) V,   lse[b, h, g] = log Σ_j exp(scale * q·k_j).
 *
 * Given the prompt part's output and log-sum-exp (o_pre, lse_pre), the exact attention over the
 * union of the two parts is written instead of o:
 *
 *     out = o + w (o_pre - o),   w = sigmoid(lse_pre - lse)
 *
 * (w = 0 where the prompt part is empty, lse_pre = -inf).
 *
 * Why a kernel of our own: a row holds a few queries per KV head (G, 3 for SmolLM2) against
 * at most H entries, a product far too small for the library kernels' blocking; here each
 * row's keys and values are read once, straight from the row cache's views (any row and head
 * strides), and the merge costs no further pass over the outputs.
 *
 * Every (row, KV head) is computed by the same instruction sequence whatever its position in
 * the batch and whichever thread runs it, so identical rows give identical bits (the full
 * control's rows reproduce the reference rows) and reruns are bit-identical.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "attention_math.h"

#define KS 16 /* keys per score block: one vector of 16 scores */
#ifndef OWN_PF
#define OWN_PF 1 /* the next (row, KV head)'s entries asked for while this one's are used */
#endif

/* The cache lines of one entry (16 dv floats at e) asked into the second-level cache. */
INLINE void prefetch_entry(const int dv, const float *e) {
    if (OWN_PF && e)
        for (int i = 0; i < dv; i++) _mm_prefetch((const char *)(e + 16 * i), _MM_HINT_T1);
}

/* r[j] = Σ_l a[j][l] for j < 16: the lane sums of 16 vectors as one vector, by a fixed tree
 * (pairs of vectors interleaved and added, then quadruples, then halves of 256 bits). */
INLINE __m512 lane_sums(const __m512 a[KS]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                         _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* The scores q·k_j of one query (dv vectors qv) against kn <= 16 keys (row stride ks), 0 in
 * the lanes past kn. */
INLINE __m512 score_block(const int dv, const __m512 *qv, const float *k, const int64_t ks,
                          const int kn) {
    __m512 a[KS];
    for (int j = 0; j < KS; j++) {
        if (j < kn) {
            const float *kj = k + (int64_t)j * ks;
            __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kj));
            for (int i = 1; i < dv; i++)
                s = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kj + 16 * i), s);
            a[j] = s;
        } else {
            a[j] = _mm512_setzero_ps();
        }
    }
    return lane_sums(a);
}

/* acc[r][0:16 dv] = Σ_{j<t} p[r][j] v[j] for rt query rows (p rows of stride ld, v rows of
 * stride vs); the values nv (the next head's, or NULL) are prefetched alongside. */
INLINE void value_tile(const int rt, const int dv, const int t, const float *p, const int64_t ld,
                       const float *v, const int64_t vs, float *acc, const float *nv) {
    __m512 c[4][8];
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < dv; i++) c[r][i] = _mm512_setzero_ps();
    for (int j = 0; j < t; j++) {
        __m512 a[4];
        for (int r = 0; r < rt; r++) a[r] = _mm512_set1_ps(p[r * ld + j]);
        const float *vj = v + (int64_t)j * vs;
        prefetch_entry(dv, nv ? nv + (int64_t)j * vs : 0);
        for (int i = 0; i < dv; i++) {
            const __m512 b = _mm512_loadu_ps(vj + 16 * i);
            for (int r = 0; r < rt; r++) c[r][i] = _mm512_fmadd_ps(a[r], b, c[r][i]);
        }
    }
    for (int r = 0; r < rt; r++)
        for (int i = 0; i < dv; i++) _mm512_storeu_ps(acc + r * 16 * dv + 16 * i, c[r][i]);
}

/* One (row, KV head): G queries (stride qg) against t >= 1 keys and values (strides ks, vs).
 * s: G rows of ld >= t rounded up to 16 floats (scores, then weights); tot: 2 G floats (each
 * query's total weight, then its log-sum-exp); o: the G normalised outputs (G x d,
 * contiguous), merged when o_pre is given (G rows of stride pg, with lse_pre of stride lg);
 * lse (G) or NULL. rt: query rows per value tile (registers: rt x dv accumulators). */
INLINE void own_head(const int dv, const int rt, const int G, const int t, const float *q,
                     const int64_t qg, const float *k, const int64_t ks, const float *v,
                     const int64_t vs, const float scale, float *s, const int64_t ld,
                     float *tot, const float *o_pre, const int64_t pg, const float *lse_pre,
                     const int64_t lg, float *o, float *lse, const float *nk,
                     const float *nv) {
    const int d = 16 * dv;
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int j0 = 0; j0 < t; j0 += KS) {
        const int kn = t - j0 < KS ? t - j0 : KS;
        const __mmask16 m = kn == KS ? (__mmask16)0xFFFF : (__mmask16)((1u << kn) - 1);
        for (int j = 0; j < kn; j++) prefetch_entry(dv, nk ? nk + (int64_t)(j0 + j) * ks : 0);
        for (int g = 0; g < G; g++) {
            __m512 qv[8];
            for (int i = 0; i < dv; i++) qv[i] = _mm512_loadu_ps(q + g * qg + 16 * i);
            const __m512 x = score_block(dv, qv, k + (int64_t)j0 * ks, ks, kn);
            const __m512 y = _mm512_mask_mov_ps(ninf, m, _mm512_mul_ps(x, vscale));
            _mm512_storeu_ps(s + g * ld + j0, y);
        }
    }
    for (int g = 0; g < G; g++) {
        float *row = s + g * ld;
        __m512 vmax = ninf;
        for (int j = 0; j < t; j += KS) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + j));
        const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
        __m512 sum = _mm512_setzero_ps();
        for (int j = 0; j < t; j += KS) {
            const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm));
            _mm512_storeu_ps(row + j, e);
            sum = _mm512_add_ps(sum, e);
        }
        tot[g] = _mm512_reduce_add_ps(sum);
        tot[G + g] = _mm512_cvtss_f32(vm) + logf(tot[g]);
        if (lse) lse[g] = tot[G + g];
    }
    int g0 = 0;
    for (; g0 + rt <= G; g0 += rt) {
        value_tile(rt, dv, t, s + g0 * ld, ld, v, vs, o + g0 * d, g0 ? 0 : nv);
    }
    const float *nv_left = g0 ? 0 : nv; /* prefetched by the first tile */
    switch (G - g0) {
    case 3: value_tile(3, dv, t, s + g0 * ld, ld, v, vs, o + g0 * d, nv_left); break;
    case 2: value_tile(2, dv, t, s + g0 * ld, ld, v, vs, o + g0 * d, nv_left); break;
    case 1: value_tile(1, dv, t, s + g0 * ld, ld, v, vs, o + g0 * d, nv_left); break;
    default: break;
    }
    for (int c0 = 0; c0 < G; c0 += 16) { /* 16 query heads at a time */
        const int cn = G - c0 < 16 ? G - c0 : 16;
        float w[16]; /* the prompt part's weight: sigmoid(lse_pre - lse), by the sign of the
                      * difference so that exp's argument is never positive */
        if (o_pre) {
            const __mmask16 m = cn == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cn) - 1);
            const __m512 zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
            float pre[16];
            for (int i = 0; i < cn; i++) pre[i] = lse_pre[(c0 + i) * lg];
            const __m512 diff = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, pre),
                                              _mm512_maskz_loadu_ps(m, tot + G + c0));
            const __m512 e = exp_neg(_mm512_min_ps(diff, _mm512_sub_ps(zero, diff)));
            const __mmask16 pos = _mm512_cmp_ps_mask(diff, zero, _CMP_GE_OQ);
            _mm512_storeu_ps(w, _mm512_div_ps(_mm512_mask_mov_ps(e, pos, one),
                                              _mm512_add_ps(one, e)));
        }
        for (int g = c0; g < c0 + cn; g++) {
            const __m512 inv = _mm512_set1_ps(1.0f / tot[g]);
            float *og = o + g * d;
            for (int i = 0; i < d; i += 16) {
                const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(og + i), inv);
                if (o_pre) {
                    const __m512 pre = _mm512_loadu_ps(o_pre + g * pg + i);
                    _mm512_storeu_ps(og + i, _mm512_fmadd_ps(_mm512_set1_ps(w[g - c0]),
                                                             _mm512_sub_ps(pre, y), y));
                } else {
                    _mm512_storeu_ps(og + i, y);
                }
            }
        }
    }
}

#define OWN_HEAD(DV, RT)                                                                     \
    static void own_head_##DV(const int G, const int t, const float *q, const int64_t qg,    \
                              const float *k, const int64_t ks, const float *v,              \
                              const int64_t vs, const float scale, float *s,                 \
                              const int64_t ld, float *tot, const float *o_pre,              \
                              const int64_t pg, const float *lse_pre, const int64_t lg,      \
                              float *o, float *lse, const float *nk, const float *nv) {      \
        own_head((DV), (RT), G, t, q, qg, k, ks, v, vs, scale, s, ld, tot, o_pre, pg, lse_pre, \
                 lg, o, lse, nk, nv);                                                        \
    }
OWN_HEAD(1, 4)
OWN_HEAD(2, 4)
OWN_HEAD(3, 4)
OWN_HEAD(4, 4)
OWN_HEAD(5, 3)
OWN_HEAD(6, 3)
OWN_HEAD(7, 3)
OWN_HEAD(8, 3)

typedef void (*own_fn)(int, int, const float *, int64_t, const float *, int64_t, const float *,
                       int64_t, float, float *, int64_t, float *, const float *, int64_t,
                       const float *, int64_t, float *, float *, const float *,
                       const float *);
static const own_fn OWN_FNS[9] = {0,          own_head_1, own_head_2, own_head_3, own_head_4,
                                  own_head_5, own_head_6, own_head_7, own_head_8};

/* The pass: see the file's head. q (B, n_kv, G, d), k and v (B, n_kv, t, d), each with unit
 * stride along d and the other strides (in floats) in strides[0:3] (q: row, head, query head),
 * strides[3:6] (k: row, head, entry) and strides[6:9] (v); o_pre (B, n_kv, G, d), unit stride
 * along d, and lse_pre (B, n_kv, G), their strides in strides[9:12] and strides[12:15], or both
 * NULL (no merge); out (B, n_kv, G, d) contiguous; lse
 * (B, n_kv, G) or NULL; scratch: G rows of ceil(t/16)*16 floats plus 2 G floats. Only rows
 * b0 <= b < b1 are computed (threads share a call's rows, each with its own scratch; every row
 * is computed alike wherever it is, so the split changes no bit). A row with no entry (t = 0)
 * gets output 0 and log-sum-exp -inf (merged: the prompt part's output). Returns 0, or -1 when
 * d is not a multiple of 16 up to 128 or a range is out of bounds. */
int kvd_own_attention(const int B, const int n_kv, const int G, const int t, const int d,
                      const int b0, const int b1, const float *q, const float *k, const float *v,
                      const int64_t *strides, const float scale, const float *o_pre,
                      const float *lse_pre, float *out, float *lse, float *scratch) {
    if (d % 16 != 0 || d > 128 || d <= 0 || G <= 0 || t < 0) return -1;
    if (b0 < 0 || b1 > B || n_kv < 0) return -1;
    const int64_t ld = ((int64_t)t + KS - 1) / KS * KS;
    const own_fn head = OWN_FNS[d / 16];
    for (int b = b0; b < b1; b++)
        for (int h = 0; h < n_kv; h++) {
            const int64_t at = ((int64_t)b * n_kv + h) * G;
            float *o = out + at * d;
            float *l = lse ? lse + at : 0;
            if (t == 0) {
                for (int64_t i = 0; i < (int64_t)G * d; i++)
                    o[i] = o_pre ? o_pre[b * strides[9] + h * strides[10] +
                                         i / d * strides[11] + i % d]
                                 : 0.0f;
                if (l)
                    for (int g = 0; g < G; g++) l[g] = -INFINITY;
                continue;
            }
            /* the next (row, KV head) of this range, whose entries are prefetched */
            const int nb = h + 1 < n_kv ? b : b + 1, nh = h + 1 < n_kv ? h + 1 : 0;
            const float *nk = nb < b1 ? k + nb * strides[3] + nh * strides[4] : 0;
            const float *nv = nb < b1 ? v + nb * strides[6] + nh * strides[7] : 0;
            head(G, t, q + b * strides[0] + h * strides[1], strides[2],
                 k + b * strides[3] + h * strides[4], strides[5],
                 v + b * strides[6] + h * strides[7], strides[8], scale, scratch, ld,
                 scratch + (int64_t)G * ld, o_pre ? o_pre + b * strides[9] + h * strides[10] : 0,
                 strides[11], o_pre ? lse_pre + b * strides[12] + h * strides[13] : 0,
                 strides[14], o, l, nk, nv);
        }
    return 0;
}
