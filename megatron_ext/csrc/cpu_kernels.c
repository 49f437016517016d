/* FlexFloor's CPU kernels, float32, built on first use by megatron_ext/cpu_kernels.py:
 *
 * - ff_grouped_gemm: expert GEMMs of a few rows (a decode step gives each expert a handful);
 * - ff_decode_attention: attention of one new token per request over its cached K/V.
 *
 * Both are memory-bound at decode sizes: what they save is the trip of the weights or the KV
 * cache from memory, not arithmetic. Each output element of the GEMM is one in-order sum over
 * the inner dimension, one fused multiply-add per term, so a row's result does not depend on
 * the other rows; the attention of a request does not depend on the other requests either.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
#define LOADV(p) (*(const v16 *)(p))
#define STOREV(p, v) (*(v16 *)(p) = (v))

/* ---- expert GEMMs: out = x @ w, w [K, N] row-major ----
 * The weight is walked in column panels of 48 (3 vectors of 16), up to 8 rows at a time held in
 * registers; while one expert computes, the next expert's weight is prefetched line by line,
 * so that weight is in cache when its turn comes. */
#define LINE 64
#define PREFETCH_PER_STEP 3 /* cache lines of the next weight prefetched per k step */

typedef struct {
    const char *next; /* next cache line to prefetch */
    const char *end;  /* end of the region to prefetch */
} cursor;

static inline void advance(cursor *c) {
    for (int q = 0; q < PREFETCH_PER_STEP; q++) {
        if (c->next < c->end) {
            __builtin_prefetch(c->next, 0, 2);
            c->next += LINE;
        }
    }
}

/* MB rows (a constant per instance): out[m, :] = x[m, :] @ w */
#define ROWS(MB)                                                                                   \
    static void rows_##MB(int K, int N, const float *restrict x, const float *restrict w,          \
                          float *restrict out, cursor *pf) {                                       \
        int n = 0;                                                                                 \
        for (; n + 48 <= N; n += 48) {                                                             \
            v16 a0[MB], a1[MB], a2[MB];                                                            \
            for (int m = 0; m < MB; m++) a0[m] = a1[m] = a2[m] = (v16){0};                         \
            const float *wp = w + n;                                                               \
            for (int k = 0; k < K; k++, wp += N) {                                                 \
                advance(pf);                                                                       \
                v16 w0 = LOADV(wp), w1 = LOADV(wp + 16), w2 = LOADV(wp + 32);                      \
                for (int m = 0; m < MB; m++) {                                                     \
                    float xv = x[(size_t)m * K + k];                                               \
                    a0[m] += xv * w0;                                                              \
                    a1[m] += xv * w1;                                                              \
                    a2[m] += xv * w2;                                                              \
                }                                                                                  \
            }                                                                                      \
            for (int m = 0; m < MB; m++) {                                                         \
                float *o = out + (size_t)m * N + n;                                                \
                STOREV(o, a0[m]);                                                                  \
                STOREV(o + 16, a1[m]);                                                             \
                STOREV(o + 32, a2[m]);                                                             \
            }                                                                                      \
        }                                                                                          \
        for (; n + 16 <= N; n += 16) {                                                             \
            v16 a0[MB];                                                                            \
            for (int m = 0; m < MB; m++) a0[m] = (v16){0};                                         \
            const float *wp = w + n;                                                               \
            for (int k = 0; k < K; k++, wp += N) {                                                 \
                v16 w0 = LOADV(wp);                                                                \
                for (int m = 0; m < MB; m++) a0[m] += x[(size_t)m * K + k] * w0;                   \
            }                                                                                      \
            for (int m = 0; m < MB; m++) STOREV(out + (size_t)m * N + n, a0[m]);                   \
        }                                                                                          \
        for (; n < N; n++) {                                                                       \
            for (int m = 0; m < MB; m++) {                                                         \
                float s = 0.0f;                                                                    \
                for (int k = 0; k < K; k++)                                                        \
                    s = __builtin_fmaf(x[(size_t)m * K + k], w[(size_t)k * N + n], s);             \
                out[(size_t)m * N + n] = s;                                                        \
            }                                                                                      \
        }                                                                                          \
    }

ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)

typedef void (*rows_fn)(int, int, const float *, const float *, float *, cursor *);
static const rows_fn ROWS_OF[9] = {0, rows_1, rows_2, rows_3, rows_4,
                                   rows_5, rows_6, rows_7, rows_8};

/* Expert e takes rows offs[e-1] .. offs[e]-1 of x [R, K] (offs[-1] = 0) through w[e] [K, N]
 * (experts w_stride floats apart) into the same rows of out [R, N]; rows past offs[E-1] are not
 * written. While expert e computes, expert e+1's weight is prefetched; during the last expert,
 * `after` (after_bytes of it: e.g. the next projection's first weight). Returns 0, or -1 (and
 * computes nothing) when the offsets decrease or pass row R. */
int ff_grouped_gemm(int E, int R, int K, int N, const float *x, const float *w,
                    int64_t w_stride, const int32_t *offs, float *out, const char *after,
                    int64_t after_bytes) {
    const int64_t w_bytes = (int64_t)K * N * (int64_t)sizeof(float);
    for (int e = 0, prev = 0; e < E; prev = offs[e], e++)
        if (offs[e] < prev || offs[e] > R) return -1;
    int start = 0;
    for (int e = 0; e < E; e++) {
        int stop = offs[e];
        const float *we = w + (size_t)e * (size_t)w_stride;
        cursor pf;
        if (e + 1 < E) {
            pf.next = (const char *)(we + w_stride);
            pf.end = pf.next + w_bytes;
        } else {
            pf.next = after;
            pf.end = after ? after + after_bytes : after;
        }
        for (int m0 = start; m0 < stop; m0 += 8) {
            int mb = stop - m0 < 8 ? stop - m0 : 8;
            ROWS_OF[mb](K, N, x + (size_t)m0 * K, we, out + (size_t)m0 * N, &pf);
        }
        start = stop;
    }
    return 0;
}

/* ---- decode attention ---- */
/* e^x for x <= 0 (scores minus their maximum), in place over n values: x = k ln2 + r with
 * |r| <= ln2/2, a degree-7 polynomial for e^r, 2^k put in the exponent bits; 0 below -87. */
static void exp_nonpositive(float *x, int n) {
    for (int i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float k = __builtin_floorf(v * 1.44269504088896341f + 0.5f);
        float r = v - k * 0.693359375f + k * 2.12194440e-4f;
        float p = 1.9875691500e-4f;
        p = p * r + 1.3981999507e-3f;
        p = p * r + 8.3334519073e-3f;
        p = p * r + 4.1665795894e-2f;
        p = p * r + 1.6666665459e-1f;
        p = p * r + 5.0000001201e-1f;
        p = p * r * r + r + 1.0f;
        int32_t bits = ((int32_t)k + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = x[i] < -87.0f ? 0.0f : p * scale;
    }
}

typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

/* the sum of a vector's 16 lanes, as a tree: halves, quarters, then four scalars */
static inline float hsum(v16 a) {
    union { v16 v; v8 h[2]; } u16 = {a};
    union { v8 v; v4 h[2]; } u8 = {u16.h[0] + u16.h[1]};
    v4 s = u8.h[0] + u8.h[1];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static inline float dot(const float *a, const float *b, int D) {
    v16 acc0 = (v16){0}, acc1 = (v16){0};
    int d = 0;
    for (; d + 32 <= D; d += 32) {
        acc0 += LOADV(a + d) * LOADV(b + d);
        acc1 += LOADV(a + d + 16) * LOADV(b + d + 16);
    }
    if (d + 16 <= D) {
        acc0 += LOADV(a + d) * LOADV(b + d);
        d += 16;
    }
    float s = hsum(acc0 + acc1);
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* Two regions (a request's keys, then its values) prefetched a few lines per step. */
typedef struct {
    cursor part[2];
    int per_step;
} kv_cursor;

static inline void advance_kv(kv_cursor *c) {
    for (int q = 0; q < c->per_step; q++) {
        cursor *p = c->part[0].next < c->part[0].end ? &c->part[0] : &c->part[1];
        if (p->next >= p->end) return;
        __builtin_prefetch(p->next, 0, 2);
        p->next += LINE;
    }
}

/* out[b, h, :] = softmax(scale * q[b, h] . K[row_b, g, l] over l < lens[b]) . V[row_b, g, l]
 * with g = h / (H / G); q[b, h, d] at q + b * q_sb + h * q_sh + d; K and V at
 * k + row * s_row + g * s_g + l * s_l + d (likewise v), rows 0 .. NR-1; rows NULL: row b.
 * scratch: L floats per query head of a group. While request b computes, request b+1's keys
 * and values (the span from its first to its last element read) are prefetched. Returns 0; -1
 * (nothing computed) when a length is below 1 or above L, -2 when a row is outside 0 .. NR-1. */
int ff_decode_attention(int B, int NR, int H, int G, int D, int L, const float *q,
                        int64_t q_sb, int64_t q_sh, const float *k, const float *v, int64_t s_row,
                        int64_t s_g, int64_t s_l, const int64_t *rows, const int64_t *lens,
                        float scale, float *out, float *scratch) {
    const int R = H / G;
    for (int b = 0; b < B; b++) {
        if (lens[b] < 1 || lens[b] > L) return -1;
        if ((rows ? rows[b] : b) < 0 || (rows ? rows[b] : b) >= NR) return -2;
    }
    for (int b = 0; b < B; b++) {
        const int64_t row = rows ? rows[b] : b;
        const int n = (int)lens[b];
        kv_cursor pf = {{{0, 0}, {0, 0}}, 0};
        if (b + 1 < B) {
            const int64_t next = (rows ? rows[b + 1] : b + 1) * s_row;
            const int64_t span = ((int64_t)(G - 1) * s_g + (lens[b + 1] - 1) * s_l + D) * 4;
            pf.part[0] = (cursor){(const char *)(k + next), (const char *)(k + next) + span};
            pf.part[1] = (cursor){(const char *)(v + next), (const char *)(v + next) + span};
            pf.per_step = (int)(2 * span / LINE / (2 * G * n) + 1);
        }
        for (int g = 0; g < G; g++) {
            const float *kb = k + row * s_row + g * s_g;
            const float *vb = v + row * s_row + g * s_g;
            const float *qg = q + b * q_sb + (int64_t)g * R * q_sh;
            for (int l = 0; l < n; l++) { /* each key row once for the group's R query heads */
                advance_kv(&pf);
                const float *kl = kb + l * s_l;
                for (int j = 0; j < R; j++)
                    scratch[(size_t)j * L + l] = dot(qg + j * q_sh, kl, D) * scale;
            }
            float *og = out + ((int64_t)b * H + (int64_t)g * R) * D;
            for (int j = 0; j < R; j++) {
                float *s = scratch + (size_t)j * L;
                float m = s[0];
                for (int l = 1; l < n; l++) m = s[l] > m ? s[l] : m;
                for (int l = 0; l < n; l++) s[l] -= m;
                exp_nonpositive(s, n);
                float sum = 0.0f;
                for (int l = 0; l < n; l++) sum += s[l];
                const float inv = 1.0f / sum;
                for (int l = 0; l < n; l++) s[l] *= inv;
                for (int d = 0; d < D; d++) og[(size_t)j * D + d] = 0.0f;
            }
            for (int l = 0; l < n; l++) { /* each value row once for the group's R query heads */
                advance_kv(&pf);
                const float *vl = vb + l * s_l;
                for (int j = 0; j < R; j++) {
                    const float p = scratch[(size_t)j * L + l];
                    float *o = og + (size_t)j * D;
                    for (int d = 0; d < D; d++) o[d] += p * vl[d];
                }
            }
        }
    }
    return 0;
}
