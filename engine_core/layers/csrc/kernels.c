/* CPU kernels for engine_core/lm_head.py, linear.py, fused.py and attention.py, compiled on
 * first use by engine_core/native.py.
 *
 * The weights are pre-packed in 16-column panels ([panels][hidden][16], contiguous), so a GEMM
 * streams them sequentially, prefetching ahead; each panel (8 KB at hidden 128, 56 KB at 896)
 * stays in L1/L2 while every row tile uses it. A register tile is MR rows x 16 columns: with
 * AVX-512 one 16-float register per row and MR = 16 (16 of its 32 registers: a decode step's
 * 16 rows read the panel once); otherwise two 8-float registers per row and MR = 6, the shape
 * that fills AVX2's 16. The vector type is GCC's generic one, so the same source builds for
 * whatever -march=native offers. The sum over the hidden dimension runs in index order with
 * one accumulator per output, as a plain GEMM does, so both tile shapes give the same bits.
 *
 * panel_matmul: columns of x @ W (the decoder's linear layers, for the few rows of a decode
 * step, where streaming the weight from memory is the cost: docs/benchmarks.md).
 * head_scan: the LM head's logits for a range of vocabulary columns, a 256-column block at a
 * time, each block reduced while it is still in L1/L2: its maximum and, for the rows that ask,
 * the sum of exp((logit - block max) * scale).
 * count_above: how many logits of each picked row exceed its threshold (rank - 1 of a token).
 * cache_write: a step's K and V rows into the float32 paged cache.
 * decode_attention (at the end): decode rows' attention, reading the paged KV cache in place.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define NR 16 /* columns per packed panel and per register tile */
#define AHEAD 64 /* hidden rows of a panel prefetched ahead of the one in use (4 KB) */
#if defined(__AVX512F__)
#define VW 16 /* floats per vector register */
#define MR 16 /* rows per register tile */
#else
#define VW 8
#define MR 6
#endif
#define NV (NR / VW) /* registers per tile row */
typedef float vec __attribute__((vector_size(VW * 4)));
static inline vec loadv(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void storev(float *p, vec v) { memcpy(p, &v, sizeof v); }

typedef int32_t ivec __attribute__((vector_size(VW * 4)));

/* e^x for x <= 0, a vector at a time (e^-87, ~1.6e-38, below -87): 2^n by the exponent bits
 * times e^g, |g| <= ln 2 / 2, by its Taylor series to degree 7 (relative error below 1e-8;
 * glibc's own vector expf is 8 floats wide here, a call per vector, and was a third of a
 * chunk's attention). silu_mul and the prefill softmax use it. */
static inline vec exp_nonpositive(vec x) {
    ivec low = x < (vec){0} - 87.0f;
    x = (vec)(((ivec)x & ~low) | ((ivec)((vec){0} - 87.0f) & low));
    ivec n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, ivec); /* round */
    vec nf = __builtin_convertvector(n, vec);
    vec g = x - nf * 0.693145751953125f - nf * 1.428606765330187e-06f;
    vec p = 1.0f + g * (1.0f + g * (0.5f + g * (1.0f / 6 + g * (1.0f / 24 + g * (
        1.0f / 120 + g * (1.0f / 720 + g * (1.0f / 5040)))))));
    return (vec)((ivec)p + (n << 23));
}

/* c[r, 0:16] = a[r, :] @ panel for mr rows; mr is a constant wherever this is inlined */
static inline __attribute__((always_inline)) void tile(const int mr, const float *a, int64_t lda,
                                                       const float *panel, int64_t hidden,
                                                       float *c, int64_t ldc) {
    vec acc[MR][NV];
    for (int r = 0; r < mr; r++) for (int v = 0; v < NV; v++) acc[r][v] = (vec){0};
    for (int64_t k = 0; k < hidden; k++) {
        __builtin_prefetch(panel + (k + AHEAD) * NR); /* a hint: past the end is harmless */
        vec b[NV];
        for (int v = 0; v < NV; v++) b[v] = loadv(panel + k * NR + v * VW);
        for (int r = 0; r < mr; r++) {
            vec av = (vec){0} + a[r * lda + k];
            for (int v = 0; v < NV; v++) acc[r][v] += av * b[v];
        }
    }
    for (int r = 0; r < mr; r++)
        for (int v = 0; v < NV; v++) storev(c + r * ldc + v * VW, acc[r][v]);
}

#define TAIL(n) case n: tile(n, ar, lda, panel, hidden, cr, ldc); break;
static void panel_gemm(const float *a, int64_t lda, int64_t rows, const float *panel,
                       int64_t hidden, float *c, int64_t ldc) {
    int64_t r = 0;
    for (; r + MR <= rows; r += MR) tile(MR, a + r * lda, lda, panel, hidden, c + r * ldc, ldc);
    const float *ar = a + r * lda;
    float *cr = c + r * ldc;
    switch (rows - r) {
        TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5)
#if MR > 6
        TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11) TAIL(12) TAIL(13) TAIL(14) TAIL(15)
#endif
        default: break;
    }
}

/* Columns [16 * p0, 16 * p1) of a @ W: c[r, j] for rows r < rows, W packed in panels. */
void panel_matmul(const float *a, int64_t lda, int64_t rows, int64_t hidden, const float *packed,
                  int64_t p0, int64_t p1, float *c, int64_t ldc) {
    for (int64_t p = p0; p < p1; p++)
        panel_gemm(a, lda, rows, packed + p * NR * hidden, hidden, c + p * NR, ldc);
}

static float sum_exp(const float *x, int64_t n, float max, float scale) {
    float acc = 0.0f, shift = max * scale;
    for (int64_t i = 0; i < n; i++) acc += expf(x[i] * scale - shift);
    return acc;
}

/* Columns [col0, col1) of the logits a @ W (col0 a multiple of `block`, block of NR), written
 * into logits (leading dimension ldc; columns up to col1 rounded up to NR are written, so the
 * caller pads its buffer). For every row r and block b in the range: bmax[r * ldb + b] is the
 * block's maximum; where scale_x[r] > 0, sum_x[r * ldb + b] = sum exp((logit - bmax) * scale_x[r])
 * (two such sums, so a row can have both its logsumexp's and its temperature's). */
void head_scan(const float *a, int64_t lda, int64_t rows, int64_t hidden, const float *packed,
               int64_t col0, int64_t col1, float *logits, int64_t ldc, int64_t block,
               float *bmax, int64_t ldb, const float *scale_a, float *sum_a,
               const float *scale_b, float *sum_b) {
    for (int64_t j = col0; j < col1; j += block) {
        int64_t end = j + block < col1 ? j + block : col1;
        for (int64_t p = j; p < end; p += NR)
            panel_gemm(a, lda, rows, packed + p * hidden, hidden, logits + p, ldc);
        int64_t b = j / block, n = end - j;
        for (int64_t r = 0; r < rows; r++) {
            const float *x = logits + r * ldc + j;
            float m = x[0];
            for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
            bmax[r * ldb + b] = m;
            if (scale_a && scale_a[r] > 0) sum_a[r * ldb + b] = sum_exp(x, n, m, scale_a[r]);
            if (scale_b && scale_b[r] > 0) sum_b[r * ldb + b] = sum_exp(x, n, m, scale_b[r]);
        }
    }
}

/* out[i] += how many of logits[rows[i], col0:col1] exceed thresholds[i] */
void count_above(const float *logits, int64_t ldc, const int64_t *rows, int64_t n,
                 const float *thresholds, int64_t col0, int64_t col1, int64_t *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *x = logits + rows[i] * ldc;
        float t = thresholds[i];
        int32_t c = 0;
        for (int64_t j = col0; j < col1; j++) c += x[j] > t;
        out[i] += c;
    }
}

/* The decoder layer's elementwise work, one pass over each row (engine_core/fused.py): the
 * sums and products in the order Hugging Face's modules take them, float32 throughout. */

/* out[r] = w * (h * 1/sqrt(mean(h^2) + eps)) for rows r < rows of n floats, h being x[r];
 * where res is given, x[r] += res[r] first (in place: x becomes the residual stream, the sum
 * of a sublayer's output and its input) and h is that sum. */
void rms_norm(float *x, const float *res, const float *w, float eps, int64_t rows, int64_t n,
              float *out) {
    for (int64_t r = 0; r < rows; r++) {
        float *h = x + r * n, *o = out + r * n;
        if (res)
            for (int64_t i = 0; i < n; i++) h[i] += res[r * n + i];
        float ss = 0.0f;
        for (int64_t i = 0; i < n; i++) ss += h[i] * h[i];
        float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (h[i] * inv);
    }
}

/* silu(g) * u a vector at a time. With e = e^-|g|, which cannot overflow, silu(g) is g / (1 + e)
 * for g >= 0 and g * e / (1 + e) below, both within a few ulp of g / (1 + e^-g); below -87,
 * where exp_nonpositive stops, -0 (torch's own result is -0 from -88.7 on, a few 1e-37 above). */
static inline vec silu_times(vec g, vec u) {
    ivec negative = g < (vec){0}, vanishing = g < (vec){0} - 87.0f;
    vec e = exp_nonpositive((vec)((ivec)g | ((ivec){0} + INT32_MIN))); /* the sign bit set */
    vec num = (vec)(((ivec)e & negative & ~vanishing) | ((ivec)((vec){0} + 1.0f) & ~negative));
    return g * num / (1.0f + e) * u;
}

/* out[r] = silu(gate) * up for rows r < rows, where x[r] ([2 * width]) is gate then up side
 * by side (the merged gate-up projection's output) and out[r] is [width] */
void silu_mul(const float *x, int64_t rows, int64_t width, float *out) {
    int64_t whole = width - width % VW;
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * width, *up = gate + width;
        float *o = out + r * width;
        for (int64_t i = 0; i < whole; i += VW)
            storev(o + i, silu_times(loadv(gate + i), loadv(up + i)));
        if (whole < width) { /* the last width % VW columns, through a zero-padded vector */
            size_t rest = (size_t)(width - whole) * sizeof(float);
            vec g = (vec){0}, u = (vec){0};
            memcpy(&g, gate + whole, rest);
            memcpy(&u, up + whole, rest);
            vec y = silu_times(g, u);
            memcpy(o + whole, &y, rest);
        }
    }
}

/* Rotary embedding in place, for rows r < rows of x ([rows][heads][dim], row stride ldx):
 * each head's halves (a, b) become (a * cos - b * sin, b * cos + a * sin), cos and sin being
 * the row's [dim] vectors (row stride ldc), as transformers' rotate_half form computes it. */
void rotary(float *x, int64_t ldx, int64_t rows, int64_t heads, int64_t dim, const float *cos,
            const float *sin, int64_t ldc) {
    int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * ldc, *s = sin + r * ldc;
        for (int64_t h = 0; h < heads; h++) {
            float *a = x + r * ldx + h * dim, *b = a + half;
            for (int64_t i = 0; i < half; i++) {
                float ai = a[i], bi = b[i];
                a[i] = ai * c[i] + (-bi) * s[i];
                b[i] = bi * c[half + i] + ai * s[half + i];
            }
        }
    }
}

/* The step's K and V rows into the float32 caches ([slots][width], contiguous): row t of k
 * (row stride ldk) and of v (ldv), width floats each, into slot slots[t]. Returns rows, or
 * -1 - t for the first row t whose slot is not in [0, num_slots) (nothing written from it). */
int64_t cache_write(const float *k, int64_t ldk, const float *v, int64_t ldv, int64_t rows,
                    int64_t width, const int64_t *slots, int64_t num_slots, float *k_cache,
                    float *v_cache) {
    for (int64_t t = 0; t < rows; t++) {
        int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) return -1 - t;
        memcpy(k_cache + slot * width, k + t * ldk, width * sizeof(float));
        memcpy(v_cache + slot * width, v + t * ldv, width * sizeof(float));
    }
    return rows;
}

/* Attention of decode rows r < rows (one query each) over their contexts in the paged KV cache,
 * read in place (engine_core/attention.py). q[r] is [heads][dim] (row stride ldq); the caches
 * are [slots][kv_heads][dim]; row r's positions t < context[r] lie in slots
 * table[r * ldt + t / block] * block + t % block. Heads share a KV head in groups of
 * heads / kv_heads, so each key and value is read once per group. Per head: the scores
 * q . k * scale, then softmax (max subtracted, float32 sums) and the weighted sum of the
 * values, written to out[r] ([heads][dim], row stride ldo). scratch: at least
 * (heads / kv_heads) * max(context) floats. The common head sizes (64, 128) are compiled as
 * constants, which lets the compiler vectorise the dot products and sums whole. */
static inline __attribute__((always_inline)) void attend(
        const int64_t dim, const float *q, int64_t ldq, int64_t rows, const float *k_cache,
        const float *v_cache, const int64_t *table, int64_t ldt, const int64_t *context,
        int64_t block, int64_t heads, int64_t kv_heads, float scale, float *out, int64_t ldo,
        float *scratch) {
    int64_t group = heads / kv_heads, stride = kv_heads * dim;
    for (int64_t r = 0; r < rows; r++) {
        int64_t n = context[r];
        const int64_t *blocks = table + r * ldt;
        for (int64_t g = 0; g < kv_heads; g++) {
            const float *qg = q + r * ldq + g * group * dim;
            float *og = out + r * ldo + g * group * dim;
            for (int64_t t = 0; t < n; t++) {
                const float *k = k_cache + (blocks[t / block] * block + t % block) * stride
                                 + g * dim;
                for (int64_t j = 0; j < group; j++) {
                    const float *qj = qg + j * dim;
                    float s = 0.0f;
                    for (int64_t i = 0; i < dim; i++) s += qj[i] * k[i];
                    scratch[j * n + t] = s * scale;
                }
            }
            for (int64_t j = 0; j < group; j++) {
                float *p = scratch + j * n, m = p[0], sum = 0.0f;
                for (int64_t t = 1; t < n; t++) m = p[t] > m ? p[t] : m;
                for (int64_t t = 0; t < n; t++) {
                    p[t] = expf(p[t] - m);
                    sum += p[t];
                }
                float inv = 1.0f / sum;
                for (int64_t t = 0; t < n; t++) p[t] *= inv;
                memset(og + j * dim, 0, dim * sizeof(float));
            }
            for (int64_t t = 0; t < n; t++) {
                const float *v = v_cache + (blocks[t / block] * block + t % block) * stride
                                 + g * dim;
                for (int64_t j = 0; j < group; j++) {
                    float w = scratch[j * n + t], *o = og + j * dim;
                    for (int64_t i = 0; i < dim; i++) o[i] += w * v[i];
                }
            }
        }
    }
}

void decode_attention(const float *q, int64_t ldq, int64_t rows, const float *k_cache,
                      const float *v_cache, const int64_t *table, int64_t ldt,
                      const int64_t *context, int64_t block, int64_t heads, int64_t kv_heads,
                      int64_t dim, float scale, float *out, int64_t ldo, float *scratch) {
#define ATTEND(d) attend(d, q, ldq, rows, k_cache, v_cache, table, ldt, context, block, heads, \
                         kv_heads, scale, out, ldo, scratch)
    switch (dim) {
        case 64: ATTEND(64); break;
        case 128: ATTEND(128); break;
        default: ATTEND(dim); break;
    }
}

/* Causal attention of one prefill chunk's n query rows over a contiguous context of ctx keys
 * whose last n are the chunk's own (engine_core/attention.py): row i sees keys
 * t <= ctx - n + i. q[i] is [heads][dim] (row stride ldq); k and v are [ctx][kv_heads][dim]
 * (row strides ldk, ldv); out[i] is [heads][dim] (row stride ldo). dim: a multiple of 2 * VW.
 * Per KV head, its keys are transposed once into scratch ([dim][ctxp], ctxp = ctx rounded up to
 * 2 * VW), so that a tile of PT query vectors (row, head of the group) scores 2 * VW keys per
 * step with one broadcast FMA per query vector and key vector; a tile stops at its last row's
 * causal limit, so the masked half of the square is never computed. Softmax per query vector
 * (max subtracted, float32 sums), then the weighted sum of the values, 2 * VW of the head's
 * dims at a time. scratch: at least (dim + PT) * ctxp + dim * PT floats. */
#define PT 8 /* query vectors per tile */
#define KW (2 * VW) /* keys scored per step; dims summed per step */
static void prefill_scores(const float *qt, const float *kt, int64_t ctxp, int64_t dim,
                           int64_t limit, float scale, float *s) {
    for (int64_t t = 0; t < limit; t += KW) {
        vec acc[PT][2];
        for (int r = 0; r < PT; r++) acc[r][0] = acc[r][1] = (vec){0};
        for (int64_t d = 0; d < dim; d++) {
            vec k0 = loadv(kt + d * ctxp + t), k1 = loadv(kt + d * ctxp + t + VW);
            for (int r = 0; r < PT; r++) {
                vec qd = (vec){0} + qt[d * PT + r];
                acc[r][0] += qd * k0;
                acc[r][1] += qd * k1;
            }
        }
        for (int r = 0; r < PT; r++) {
            storev(s + r * ctxp + t, acc[r][0] * scale);
            storev(s + r * ctxp + t + VW, acc[r][1] * scale);
        }
    }
}

/* Each row r < PT of the tile's scores (s + r * ctxp) replaced by its softmax weights,
 * unnormalized, up to its causal limit lim[r], and by zeros from there to limit (the tile's);
 * inv[r] = 1 / their sum. The rows take turns a vector at a time, so that their exps (a
 * dependent chain each) overlap: the kernel took 1.04-1.16x as long with a row after row
 * (AVX-512; 1.02-1.04x with AVX2). A row has room for lim[r] rounded up to VW. */
static void softmax_tile(float *s, int64_t ctxp, const int64_t *lim, int64_t limit,
                         float *inv) {
    vec m[PT], sum[PT], lane;
    for (int i = 0; i < VW; i++) lane[i] = (float)i;
    for (int r = 0; r < PT; r++) {
        const float *p = s + r * ctxp;
        float mr = p[0];
        for (int64_t t = 1; t < lim[r]; t++) mr = p[t] > mr ? p[t] : mr;
        m[r] = (vec){0} + mr;
        sum[r] = (vec){0};
    }
    for (int64_t t = 0; t < limit; t += VW) {
        for (int r = 0; r < PT; r++) {
            if (t >= lim[r]) continue;
            float *p = s + r * ctxp + t;
            vec e = exp_nonpositive(loadv(p) - m[r]);
            ivec inside = lane + (float)t < (vec){0} + (float)lim[r];
            e = (vec)((ivec)e & inside);
            storev(p, e);
            sum[r] += e;
        }
    }
    for (int r = 0; r < PT; r++) {
        float *p = s + r * ctxp, total = 0.0f;
        for (int64_t t = (lim[r] + VW - 1) / VW * VW; t < limit; t++) p[t] = 0.0f;
        for (int i = 0; i < VW; i++) total += sum[r][i];
        inv[r] = 1.0f / total;
    }
}

static void prefill_values(const float *s, int64_t ctxp, const float *v, int64_t ldv,
                           int64_t limit, const float *inv, float *const *ov) {
    vec acc[PT][2];
    for (int r = 0; r < PT; r++) acc[r][0] = acc[r][1] = (vec){0};
    for (int64_t t = 0; t < limit; t++) {
        vec v0 = loadv(v + t * ldv), v1 = loadv(v + t * ldv + VW);
        for (int r = 0; r < PT; r++) {
            vec w = (vec){0} + s[r * ctxp + t];
            acc[r][0] += w * v0;
            acc[r][1] += w * v1;
        }
    }
    for (int r = 0; r < PT; r++) {
        if (!ov[r]) continue;
        storev(ov[r], acc[r][0] * inv[r]);
        storev(ov[r] + VW, acc[r][1] * inv[r]);
    }
}

void prefill_attention(const float *q, int64_t ldq, int64_t n, const float *k, int64_t ldk,
                       const float *v, int64_t ldv, int64_t ctx, int64_t heads,
                       int64_t kv_heads, int64_t dim, float scale, float *out, int64_t ldo,
                       float *scratch) {
    int64_t group = heads / kv_heads, ctxp = (ctx + KW - 1) / KW * KW, past = ctx - n;
    float *kt = scratch, *s = scratch + dim * ctxp, *qt = s + PT * ctxp;
    for (int64_t g = 0; g < kv_heads; g++) {
        for (int64_t d = 0; d < dim; d++) {
            float *row = kt + d * ctxp;
            for (int64_t t = 0; t < ctx; t++) row[t] = k[t * ldk + g * dim + d];
            for (int64_t t = ctx; t < ctxp; t++) row[t] = 0.0f;
        }
        for (int64_t u0 = 0; u0 < n * group; u0 += PT) {
            const float *qv[PT];
            float *ov[PT], inv[PT];
            int64_t lim[PT];
            for (int r = 0; r < PT; r++) {
                int64_t u = u0 + r < n * group ? u0 + r : n * group - 1; /* spare: a repeat */
                int64_t i = u / group, h = g * group + u % group;
                qv[r] = q + i * ldq + h * dim;
                ov[r] = u0 + r < n * group ? out + i * ldo + h * dim : 0;
                lim[r] = past + i + 1;
            }
            int64_t limit = lim[PT - 1], padded = (limit + KW - 1) / KW * KW;
            for (int64_t d = 0; d < dim; d++)
                for (int r = 0; r < PT; r++) qt[d * PT + r] = qv[r][d];
            prefill_scores(qt, kt, ctxp, dim, padded, scale, s);
            softmax_tile(s, ctxp, lim, limit, inv);
            for (int64_t d = 0; d < dim; d += KW) {
                float *od[PT];
                for (int r = 0; r < PT; r++) od[r] = ov[r] ? ov[r] + d : 0;
                prefill_values(s, ctxp, v + g * dim + d, ldv, limit, inv, od);
            }
        }
    }
}
