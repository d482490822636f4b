/* CPU matmul kernels for block-quantized weights (built at first use by kernels/cpu.py).
 *
 * Weights are quantized in blocks of 32 along the input dimension, in the two schemes of the
 * default model's GGUF file, so its weights keep their stored values:
 *   q4_1: w = d * q + m, q in 0..15, d and m one float per block (stored packed, see below);
 *   q8_0: w = d * q, q in -127..127, d one float per block.
 * Activations are quantized per row in blocks of 32 to int8 with one scale per block (and the
 * block's scaled sum, for q4_1's offset term), so a row's result never depends on the other
 * rows of the batch. Integer dot products of a block are exact; each block's sum is scaled and
 * accumulated in float32.
 *
 * y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]); K is a multiple of 32. Work is split over output
 * columns across `threads` OpenMP threads.
 */
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

/* The 512-bit paths below need AVX-512 F, BW and VL (every AVX-512 server CPU has the three); the
 * bfloat16 matmul also needs AVX512-BF16. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define BATON_AVX512 1
#else
#define BATON_AVX512 0
#endif

/* AMX (Sapphire Rapids and later): TDPBF16PS multiplies a 16 x 32 bfloat16 tile by a 32 x 16 one (given as
 * 16 rows of 16 pairs) into 16 x 16 float32 sums, at several times the rate of vdpbf16ps. The bfloat16
 * matmul (every pass size) and the bfloat16 prefill attention use it where the
 * kernels are built for a CPU that has it. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && BATON_AVX512
#define BATON_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the tile state only to a process that asks (arch_prctl); -1 until asked, then 0 or 1. */
static int amx_state = -1;
static int amx_enabled = 1; /* baton_set_amx */

static int amx_ready(void) {
    if (amx_state < 0) amx_state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return amx_state;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void amx_load_config(void) { /* every tile 16 rows of 64 bytes */
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
    _tile_loadconfig(&cfg);
}

#else
#define BATON_AMX 0
#endif

/* Whether the AMX paths run here: 1 when the CPU and the OS allow them and they are not turned off
 * (baton_set_amx(0): then vdpbf16ps, as on CPUs without AMX). */
int baton_amx(void) {
#if BATON_AMX
    return amx_enabled && amx_ready();
#else
    return 0;
#endif
}

/* Turns the AMX paths on (1) or off (0), for comparing them; returns baton_amx(). */
int baton_set_amx(int on) {
#if BATON_AMX
    amx_enabled = on != 0;
#else
    (void)on;
#endif
    return baton_amx();
}

#define QK 32
#define ROWS 4     /* q8_0: rows of x per pass over a weight row */
#define COLS 16    /* q8_0: output columns per task */

int baton_kernels_version(void) { return 5; }

/* 1 in the OpenMP build, 0 in the build for calls on one thread (-fopenmp-simd). */
int baton_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* One row: q[K] int8, d[K/32] scales, s[K/32] = d * sum(q) of the block. */
static void quantize_row(const float *x, int K, int8_t *q, float *d, float *s) {
#if BATON_AVX512
    /* The portable loop (#else), 32 values at a time: the same scale, products and rounding (to nearest even),
     * so the same bytes. */
    for (int b = 0; b < K / QK; b++) {
        const __m512 lo = _mm512_loadu_ps(x + b * QK), hi = _mm512_loadu_ps(x + b * QK + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float scale = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
        _mm_storeu_si128((__m128i *)(q + b * QK), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + b * QK + 16), _mm512_cvtepi32_epi8(qhi));
        d[b] = scale;
        s[b] = scale * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
    }
#elif defined(__AVX2__)
    /* The same, 8 values at a time (the portable loop cost 5% of a 16-row decode step on an AVX2 CPU). */
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* the packs' lanes back in order */
    for (int b = 0; b < K / QK; b++) {
        __m256 v[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(x + b * QK + 8 * i);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float scale = _mm_cvtss_f32(m4) / 127.0f;
        const __m256 inv = _mm256_set1_ps(scale != 0.0f ? 1.0f / scale : 0.0f);
        __m256i qi[4];
        for (int i = 0; i < 4; i++) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(bytes, order));
        const __m256i t = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
        d[b] = scale;
        s[b] = scale * (float)_mm_cvtsi128_si32(t4);
    }
#else
    for (int b = 0; b < K / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; i++) amax = fmaxf(amax, fabsf(xb[i]));
        const float scale = amax / 127.0f;
        const float inv = scale != 0.0f ? 1.0f / scale : 0.0f;
        int sum = 0;
        for (int i = 0; i < QK; i++) {
            const int v = (int)nearbyintf(xb[i] * inv);
            q[b * QK + i] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        s[b] = scale * (float)sum;
    }
#endif
}

/* x [M, K] quantized row by row: q [M, K], d and s [M, K/32] (see quantize_row). */
typedef struct { int8_t *q; float *d, *s; } qrows;

static void qrows_free(qrows *a) { free(a->q); free(a->d); free(a->s); }

static int qrows_make(qrows *a, const float *x, int M, int K, int threads) {
    const int nb = K / QK;
    a->q = malloc((size_t)M * K);
    a->d = malloc(sizeof(float) * (size_t)M * nb);
    a->s = malloc(sizeof(float) * (size_t)M * nb);
    if (!a->q || !a->d || !a->s) { qrows_free(a); return -2; }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M > 1)
    for (int r = 0; r < M; r++)
        quantize_row(x + (size_t)r * K, K, a->q + (size_t)r * K, a->d + (size_t)r * nb, a->s + (size_t)r * nb);
    return 0;
}

/* The activations' rounding as the integer matmuls see it (for tests: every build must give the same bytes). */
int baton_quantize_rows(const float *x, int M, int K, int8_t *q, float *d, float *s) {
    if (K % QK || M < 0) return -1;
    for (int r = 0; r < M; r++)
        quantize_row(x + (size_t)r * K, K, q + (size_t)r * K, d + (size_t)r * (K / QK), s + (size_t)r * (K / QK));
    return 0;
}

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* ------------------------------------------------------------------ q4_1, packed */

/* q4_1 weights are packed in tiles of 16 output rows (kernels/cpu.py:pack_q4_1). For each block of
 * 32 inputs a tile holds 384 bytes: four 64-byte nibble groups, then d[16] and m[16] (float32).
 * In group j (0..3), byte 4c + i holds row c's weight 4j + i in its low nibble and weight 16 + 4j + i
 * in its high nibble. Masked, one 64-byte group is 16 rows x 4 consecutive unsigned weights, lane c
 * = row c: what vpdpbusd multiplies against 4 int8 activations broadcast to every lane. So one pass
 * over a block does 16 rows' integer dot products in 8 instructions, one stream of bytes is read,
 * and the unpacked weights serve every row of x in the pass. */
#define Q4_ROWS 16
#define Q4_TILE 384
#define Q4_MR 8    /* rows of x per pass over a tile */
/* Blocks ahead that a pass asks the memory for (near a tile's end, the next tile's: a thread's tiles
 * lie one after another). The hardware prefetcher alone leaves a pass of 8 rows waiting on memory:
 * measured with the default model's layer shapes streamed from memory, 1.25-1.3x faster at 8-15
 * rows with it; one row, which only streams, is left to the hardware. */
#define Q4_AHEAD 8

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
static inline __attribute__((always_inline)) void q4_tile(
        const int MR, const int nb, const int K, const int8_t *xq, const float *xd, const float *xs,
        const uint8_t *wp, const float *bias, float *y, const size_t ldy, const int nrows) {
    __m512 acc[Q4_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *t = wp + (size_t)b * Q4_TILE;
        if (MR >= 4) /* a pass of 4 rows or more computes long enough to hide the next blocks' fetch */
            for (int k = 0; k < Q4_TILE; k += 64) _mm_prefetch((const char *)t + Q4_AHEAD * Q4_TILE + k, _MM_HINT_T0);
        __m512i w[8];
        for (int j = 0; j < 4; j++) {
            const __m512i raw = _mm512_loadu_si512(t + 64 * j);
            w[j] = _mm512_and_si512(raw, low);
            w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        /* rows side by side, so the integer sums of different rows overlap in the pipeline; the
         * activations' 4-byte groups are broadcast straight from memory */
        __m512i dot[Q4_MR];
        for (int r = 0; r < MR; r++) dot[r] = _mm512_setzero_si512();
        for (int j = 0; j < 8; j++)
            for (int r = 0; r < MR; r++) {
                __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[d]" : [d] "+v"(dot[r])
                        : [w] "v"(w[j]), [x] "m"(*(const int32_t *)(xq + (size_t)r * K + b * QK + 4 * j)));
            }
        const __m512 dw = _mm512_loadu_ps(t + 256), mw = _mm512_loadu_ps(t + 320);
        for (int r = 0; r < MR; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(dw, _mm512_set1_ps(xd[r * nb + b])),
                                     acc[r]);
            acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[r * nb + b]), acc[r]);
        }
    }
    const __mmask16 mask = nrows >= Q4_ROWS ? 0xFFFF : (__mmask16)((1u << nrows) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(acc[r], bv));
}

static void q4_rows(int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const uint8_t *wp,
                    const float *bias, float *y, size_t ldy, int nrows) {
    switch (mr) {
#define Q4_CASE(n) case n: q4_tile(n, nb, K, xq, xd, xs, wp, bias, y, ldy, nrows); break;
    Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4) Q4_CASE(5) Q4_CASE(6) Q4_CASE(7) Q4_CASE(8)
#undef Q4_CASE
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* The AVX2 loop of the GGUF block types (below) on q4_1's own tiles, whose nibbles lie the same way
 * (as the format GQ_Q4_OWN). */
static void q4_rows(int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const uint8_t *wp,
                    const float *bias, float *y, size_t ldy, int nrows);
#else
/* Portable version of the same arithmetic. */
static void q4_rows(int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const uint8_t *wp,
                    const float *bias, float *y, size_t ldy, int nrows) {
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nrows; c++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const uint8_t *t = wp + (size_t)b * Q4_TILE;
                const int8_t *xb = xq + (size_t)r * K + b * QK;
                int dot = 0;
                for (int j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = t[64 * j + 4 * c + i];
                        dot += (v & 0x0F) * xb[4 * j + i] + (v >> 4) * xb[16 + 4 * j + i];
                    }
                float dw, mw;
                memcpy(&dw, t + 256 + 4 * c, 4);
                memcpy(&mw, t + 320 + 4 * c, 4);
                acc += (float)dot * (dw * xd[r * nb + b]);
                acc += mw * xs[r * nb + b];
            }
            y[r * ldy + c] = acc + (bias ? bias[c] : 0.0f);
        }
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias), W q4_1 packed as above (ceil(N / 16) tiles of K / 32 blocks). */
int baton_gemm_q4_1(const float *x, int M, int K, const uint8_t *wp, const float *bias, int N, float *y,
                    int threads) {
    if (K % QK != 0 || M < 1 || N < 1) return -1;
    const int nb = K / QK, tiles = (N + Q4_ROWS - 1) / Q4_ROWS;
    if (threads < 1) threads = 1;
    qrows a;
    if (qrows_make(&a, x, M, K, threads)) return -2;
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1 && (size_t)M * N * K > 65536)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * Q4_ROWS, nrows = N - n0 < Q4_ROWS ? N - n0 : Q4_ROWS;
        for (int r = 0; r < M; r += Q4_MR)
            q4_rows(M - r < Q4_MR ? M - r : Q4_MR, nb, K, a.q + (size_t)r * K, a.d + (size_t)r * nb,
                    a.s + (size_t)r * nb, wp + (size_t)t * nb * Q4_TILE, bias ? bias + n0 : NULL,
                    y + (size_t)r * N + n0, N, nrows);
    }
    qrows_free(&a);
    return 0;
}

/* ------------------------------------------------------------------ q8_0 */

/* Dot products of one q8_0 weight row with rn (<= ROWS) quantized rows of x. */
static void dot_q8_0(int rn, int nb, const int8_t *wq, const float *wd,
                     const int8_t *xq, const float *xd, int K, float *out, int ldo) {
#ifdef __AVX2__
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));
        const __m256i aw = _mm256_sign_epi8(w, w); /* |w|: maddubs takes one unsigned operand */
        const float d = wd[b];
        for (int r = 0; r < rn; r++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + (size_t)r * K + b * QK)), w);
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * xd[r * nb + b]), _mm256_cvtepi32_ps(p), acc[r]);
        }
    }
    for (int r = 0; r < rn; r++) out[r * ldo] = hsum(acc[r]);
#else
    for (int r = 0; r < rn; r++) {
        float acc = 0.0f;
        for (int b = 0; b < nb; b++) {
            const int8_t *wb = wq + b * QK, *xb = xq + (size_t)r * K + b * QK;
            int dot = 0;
            for (int j = 0; j < QK; j++) dot += wb[j] * xb[j];
            acc += wd[b] * xd[r * nb + b] * (float)dot;
        }
        out[r * ldo] = acc;
    }
#endif
}

/* y[M, N] = x[M, K] @ W^T (+ bias), W q8_0 (wq: int8 [N, K], wd: float [N, K/32]). */
int baton_gemm_q8_0(const float *x, int M, int K, const int8_t *wq, const float *wd,
                    const float *bias, int N, float *y, int threads) {
    if (K % QK != 0 || M < 1 || N < 1) return -1;
    const int nb = K / QK, tasks = (N + COLS - 1) / COLS;
    if (threads < 1) threads = 1;
    qrows a;
    if (qrows_make(&a, x, M, K, threads)) return -2;
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1 && (size_t)M * N * K > 65536)
    for (int t = 0; t < tasks; t++) {
        const int n0 = t * COLS, n1 = n0 + COLS < N ? n0 + COLS : N;
        for (int r0 = 0; r0 < M; r0 += ROWS) {
            const int rn = M - r0 < ROWS ? M - r0 : ROWS;
            for (int n = n0; n < n1; n++) {
                float *out = y + (size_t)r0 * N + n;
                dot_q8_0(rn, nb, wq + (size_t)n * K, wd + (size_t)n * nb, a.q + (size_t)r0 * K, a.d + (size_t)r0 * nb,
                         K, out, N);
                if (bias)
                    for (int r = 0; r < rn; r++) out[(size_t)r * N] += bias[n];
            }
        }
    }
    qrows_free(&a);
    return 0;
}

/* ------------------------------------------------------------------ GGUF block types, kept as stored */

/* The weights of a GGUF file in their own block types (llama.cpp's q8_0, q4_0, q4_1, q5_0, q5_1, q4_K,
 * q5_K, q6_K), repacked at load (kernels/cpu.py:pack_gq) without changing a value. Every type is
 *   w = scale * q + min, q an unsigned integer of 4, 5, 6 or 8 bits,
 * with one scale and min per row and sub-block of 32 inputs (of 16 for q6_K). Signed types store q plus
 * their offset (q8_0: +128, q4_0: +8, q5_0: +16, q6_K: +32), whose min is then -offset * scale.
 *
 * Layout: tiles of 16 output rows, each tile one format (a fused projection's parts may differ), found
 * through a table of (byte offset, format) per tile. A tile is K / 32 blocks; the k-quants put before each
 * run of 8 blocks (one super-block of 256 inputs) the super-block's float32 scales: d[16] (and dmin[16]).
 * A block holds, for the tile's 16 rows and 32 inputs:
 *   - 256 bytes of low nibbles, laid out as q4_1's tiles: group j (0..3), byte 4c + i: row c's bits 0-3 of
 *     weight 4j + i (low nibble) and of weight 16 + 4j + i (high nibble);
 *   - the high bits in the same lanes: 8 bits: bits 4-7 as a second 256-byte nibble plane; 5 bits: 64 bytes,
 *     byte 4c + i holding in bit j bit 4 of the weight that nibble group j (0..7: the four low, then the four
 *     high nibbles) has in that lane; 6 bits: two 64-byte planes (groups 0-3, 4-7), bits 2(j % 4) and up
 *     holding bits 4-5;
 *   - the scales: f16 d[16] (q8_0, q4_0, q5_0), f16 d[16] and m[16] (q4_1, q5_1), u8 sc[16] and m[16]
 *     (q4_K, q5_K: scale d * sc, min -dmin * m), i8 sc[2][16] (q6_K: the two halves' d * sc), or f16 s[16]
 *     and u8 z[16] (i4: AWQ's and GPTQ's int4 groups, w = s * (q - z), each block inside one group).
 * So a q4_K tile reads 4.75 bits per weight (the file: 4.5), q6_K 6.625 (6.5625), the rest what the file
 * holds. The VNNI loop is q4_1's: the nibble groups, with the high bits or-ed in, are 16 rows x 4 unsigned
 * weights against 4 int8 activations broadcast. */
enum { GQ_Q8_0, GQ_Q4_0, GQ_Q4_1, GQ_Q5_0, GQ_Q5_1, GQ_Q4_K, GQ_Q5_K, GQ_Q6_K, GQ_I4, GQ_FORMATS,
       GQ_Q4_OWN = GQ_FORMATS /* q4_1's own tiles (float32 d and m): the AVX2 loop runs them as a format */ };

typedef struct { int high, scales, super, offset, sub16; } gq_format;

/* high-bit bytes, scale bytes per block; super-block bytes; the implicit offset (0: explicit min); halves */
static const gq_format GQ[GQ_FORMATS + 1] = {
    [GQ_Q8_0] = {256, 32, 0, 128, 0}, [GQ_Q4_0] = {0, 32, 0, 8, 0},   [GQ_Q4_1] = {0, 64, 0, 0, 0},
    [GQ_Q5_0] = {64, 32, 0, 16, 0},   [GQ_Q5_1] = {64, 64, 0, 0, 0},  [GQ_Q4_K] = {0, 32, 128, 0, 0},
    [GQ_Q5_K] = {64, 32, 128, 0, 0},  [GQ_Q6_K] = {128, 32, 64, 32, 1}, [GQ_I4] = {0, 48, 0, 0, 0},
    [GQ_Q4_OWN] = {0, 128, 0, 0, 0},
};

static inline int gq_block_bytes(int f) { return 256 + GQ[f].high + GQ[f].scales; }

/* Bytes of one tile of format f with nb blocks. */
static inline size_t gq_tile_bytes(int f, int nb) {
    return (size_t)nb * gq_block_bytes(f) + (GQ[f].super ? (size_t)(nb / 8) * GQ[f].super : 0);
}

int64_t baton_gq_tile_bytes(int f, int K) {
    if (f < 0 || f >= GQ_FORMATS || K % QK || (GQ[f].super && K % 256)) return -1;
    return (int64_t)gq_tile_bytes(f, K / QK);
}

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
    uint32_t bits;
    if (e == 0) {
        if (m == 0) bits = sign;
        else { /* subnormal: m * 2^-24 */
            float f = (float)m * 5.9604644775390625e-08f;
            memcpy(&bits, &f, 4);
            bits |= sign;
        }
    } else if (e == 31) bits = sign | 0x7F800000u | (m << 13);
    else bits = sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Block b (of a tile whose blocks start at `tile`) -> its address and its super-block header's. */
static inline const uint8_t *gq_block(int f, const uint8_t *tile, int b, const uint8_t **sup) {
    if (!GQ[f].super) { *sup = NULL; return tile + (size_t)b * gq_block_bytes(f); }
    const size_t run = (size_t)GQ[f].super + 8 * (size_t)gq_block_bytes(f);
    const uint8_t *s = tile + (size_t)(b / 8) * run;
    *sup = s;
    return s + GQ[f].super + (size_t)(b % 8) * gq_block_bytes(f);
}

/* Row c of a block: q[32] and the scale and min of each half (the same twice unless q6_K). */
static inline void gq_row(int f, const uint8_t *blk, const uint8_t *sup, int c, uint8_t *q, float *sc, float *mn) {
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) {
            const uint8_t v = blk[64 * j + 4 * c + i];
            q[4 * j + i] = v & 0x0F;
            q[16 + 4 * j + i] = v >> 4;
        }
    const uint8_t *hp = blk + 256;
    for (int j = 0; j < 8; j++)
        for (int i = 0; i < 4; i++) {
            const int k = (j < 4 ? 4 * j : 16 + 4 * (j - 4)) + i, p = 4 * c + i;
            if (GQ[f].high == 256) {
                const uint8_t v = hp[64 * (j % 4) + p];
                q[k] |= (uint8_t)((j < 4 ? v & 0x0F : v >> 4) << 4);
            } else if (GQ[f].high == 64) q[k] |= (uint8_t)(((hp[p] >> j) & 1) << 4);
            else if (GQ[f].high == 128) q[k] |= (uint8_t)(((hp[64 * (j / 4) + p] >> (2 * (j % 4))) & 3) << 4);
        }
    const uint8_t *s = hp + GQ[f].high;
    uint16_t h;
    switch (f) {
    case GQ_Q4_1: case GQ_Q5_1: {
        memcpy(&h, s + 2 * c, 2); sc[0] = f16_to_f32(h);
        memcpy(&h, s + 32 + 2 * c, 2); mn[0] = f16_to_f32(h);
        break;
    }
    case GQ_I4:
        memcpy(&h, s + 2 * c, 2); sc[0] = f16_to_f32(h);
        mn[0] = -(sc[0] * (float)s[32 + c]);
        break;
    case GQ_Q4_K: case GQ_Q5_K: {
        float d, dmin;
        memcpy(&d, sup + 4 * c, 4); memcpy(&dmin, sup + 64 + 4 * c, 4);
        sc[0] = d * (float)s[c];
        mn[0] = -(dmin * (float)s[16 + c]);
        break;
    }
    case GQ_Q6_K: {
        float d;
        memcpy(&d, sup + 4 * c, 4);
        for (int half = 0; half < 2; half++) {
            sc[half] = d * (float)(int8_t)s[16 * half + c];
            mn[half] = sc[half] * -(float)GQ[f].offset;
        }
        return;
    }
    default:
        memcpy(&h, s + 2 * c, 2); sc[0] = f16_to_f32(h);
        mn[0] = sc[0] * -(float)GQ[f].offset;
    }
    sc[1] = sc[0];
    mn[1] = mn[0];
}

/* out[n, K] = the values of rows[n] (the embedding's lookup from the LM head's tiles). */
int baton_gq_rows(const uint8_t *wp, const int64_t *table, int K, const int64_t *rows, int n, float *out,
                  int threads) {
    if (K % QK) return -1;
    const int nb = K / QK;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n > 16)
    for (int r = 0; r < n; r++) {
        const int64_t row = rows[r];
        const int f = (int)table[2 * (row / 16) + 1];
        const uint8_t *tile = wp + table[2 * (row / 16)];
        for (int b = 0; b < nb; b++) {
            const uint8_t *sup, *blk = gq_block(f, tile, b, &sup);
            uint8_t q[32];
            float sc[2], mn[2];
            gq_row(f, blk, sup, (int)(row % 16), q, sc, mn);
            for (int k = 0; k < 32; k++) out[(size_t)r * K + b * QK + k] = sc[k / 16] * (float)q[k] + mn[k / 16];
        }
    }
    return 0;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* The tile's 16 rows of one block as 8 vectors of 16 lanes x 4 unsigned weights (lane c: row c). */
static inline __attribute__((always_inline)) void gq_weights(const int F, const uint8_t *blk, __m512i *w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
        w[j] = _mm512_and_si512(raw, low);
        w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
    const uint8_t *hp = blk + 256;
    if (GQ[F].high == 256) {
        for (int j = 0; j < 4; j++) {
            const __m512i raw = _mm512_loadu_si512(hp + 64 * j);
            w[j] = _mm512_or_si512(w[j], _mm512_slli_epi16(_mm512_and_si512(raw, low), 4));
            w[4 + j] = _mm512_or_si512(w[4 + j], _mm512_andnot_si512(low, raw));
        }
    } else if (GQ[F].high == 64) {
        const __m512i plane = _mm512_loadu_si512(hp), bit = _mm512_set1_epi8(0x10);
        /* bit j to bit 4: within each byte (shifts of at most 4 left or 3 right) */
        w[0] = _mm512_or_si512(w[0], _mm512_and_si512(_mm512_slli_epi16(plane, 4), bit));
        w[1] = _mm512_or_si512(w[1], _mm512_and_si512(_mm512_slli_epi16(plane, 3), bit));
        w[2] = _mm512_or_si512(w[2], _mm512_and_si512(_mm512_slli_epi16(plane, 2), bit));
        w[3] = _mm512_or_si512(w[3], _mm512_and_si512(_mm512_slli_epi16(plane, 1), bit));
        w[4] = _mm512_or_si512(w[4], _mm512_and_si512(plane, bit));
        w[5] = _mm512_or_si512(w[5], _mm512_and_si512(_mm512_srli_epi16(plane, 1), bit));
        w[6] = _mm512_or_si512(w[6], _mm512_and_si512(_mm512_srli_epi16(plane, 2), bit));
        w[7] = _mm512_or_si512(w[7], _mm512_and_si512(_mm512_srli_epi16(plane, 3), bit));
    } else if (GQ[F].high == 128) {
        const __m512i two = _mm512_set1_epi8(0x30);
        for (int h = 0; h < 2; h++) {
            const __m512i plane = _mm512_loadu_si512(hp + 64 * h);
            w[4 * h + 0] = _mm512_or_si512(w[4 * h + 0], _mm512_and_si512(_mm512_slli_epi16(plane, 4), two));
            w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(plane, 2), two));
            w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(plane, two));
            w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(plane, 2), two));
        }
    }
}

/* Scales and mins of a block's 16 rows (per half for q6_K: [0] the first 16 inputs, [1] the second). */
static inline __attribute__((always_inline)) void gq_scales(const int F, const uint8_t *blk, const uint8_t *sup,
                                                             __m512 *sc, __m512 *mn) {
    const uint8_t *s = blk + 256 + GQ[F].high;
    if (F == GQ_Q4_K || F == GQ_Q5_K) {
        const __m512 d = _mm512_loadu_ps(sup), dmin = _mm512_loadu_ps(sup + 64);
        sc[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)s))));
        mn[0] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + 16)))));
    } else if (F == GQ_Q6_K) {
        const __m512 d = _mm512_loadu_ps(sup), off = _mm512_set1_ps(-(float)GQ[F].offset);
        for (int h = 0; h < 2; h++) {
            sc[h] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(s + 16 * h)))));
            mn[h] = _mm512_mul_ps(sc[h], off);
        }
    } else if (F == GQ_I4) {
        sc[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        mn[0] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), sc[0]),
                              _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(s + 32)))));
    } else {
        sc[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)s));
        mn[0] = GQ[F].offset ? _mm512_mul_ps(sc[0], _mm512_set1_ps(-(float)GQ[F].offset))
                             : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 32)));
    }
}

/* Rows r0..r0+MR of x against one tile: xs = d * sum(q) of each block, xh of its first 16 (q6_K). */
static inline __attribute__((always_inline)) void gq_tile(
        const int F, const int MR, const int nb, const int K, const int8_t *xq, const float *xd, const float *xs,
        const float *xh, const uint8_t *tile, const float *bias, float *y, const size_t ldy, const int nrows) {
    __m512 acc[Q4_MR];
    for (int r = 0; r < MR; r++) acc[r] = _mm512_setzero_ps();
    const int bb = gq_block_bytes(F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *sup, *blk = gq_block(F, tile, b, &sup);
        if (MR >= 4)
            for (int k = 0; k < bb; k += 64) _mm_prefetch((const char *)blk + 4 * bb + k, _MM_HINT_T0);
        __m512i w[8];
        gq_weights(F, blk, w);
        __m512 sc[2], mn[2];
        gq_scales(F, blk, sup, sc, mn);
        if (!GQ[F].sub16) {
            __m512i dot[Q4_MR];
            for (int r = 0; r < MR; r++) dot[r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; j++)
                for (int r = 0; r < MR; r++)
                    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[d]" : [d] "+v"(dot[r])
                            : [w] "v"(w[j]), [x] "m"(*(const int32_t *)(xq + (size_t)r * K + b * QK + 4 * j)));
            for (int r = 0; r < MR; r++) {
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_mul_ps(sc[0], _mm512_set1_ps(xd[r * nb + b])),
                                         acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[0], _mm512_set1_ps(xs[r * nb + b]), acc[r]);
            }
        } else {
            __m512i lo[Q4_MR], hi[Q4_MR];
            for (int r = 0; r < MR; r++) lo[r] = hi[r] = _mm512_setzero_si512();
            for (int j = 0; j < 4; j++)
                for (int r = 0; r < MR; r++) {
                    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[d]" : [d] "+v"(lo[r])
                            : [w] "v"(w[j]), [x] "m"(*(const int32_t *)(xq + (size_t)r * K + b * QK + 4 * j)));
                    __asm__("vpdpbusd %[x]%{1to16%}, %[w], %[d]" : [d] "+v"(hi[r])
                            : [w] "v"(w[4 + j]), [x] "m"(*(const int32_t *)(xq + (size_t)r * K + b * QK + 16 + 4 * j)));
                }
            for (int r = 0; r < MR; r++) {
                const __m512 dx = _mm512_set1_ps(xd[r * nb + b]);
                const float h = xh[r * nb + b];
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(sc[0], dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(sc[1], dx), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[0], _mm512_set1_ps(h), acc[r]);
                acc[r] = _mm512_fmadd_ps(mn[1], _mm512_set1_ps(xs[r * nb + b] - h), acc[r]);
            }
        }
    }
    const __mmask16 mask = nrows >= Q4_ROWS ? 0xFFFF : (__mmask16)((1u << nrows) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    for (int r = 0; r < MR; r++) _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_add_ps(acc[r], bv));
}

static void gq_rows(int f, int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const float *xh,
                    const uint8_t *tile, const float *bias, float *y, size_t ldy, int nrows) {
#define GQ_CASE(F, n) case n: gq_tile(F, n, nb, K, xq, xd, xs, xh, tile, bias, y, ldy, nrows); break;
#define GQ_FMT(F) case F: switch (mr) { GQ_CASE(F, 1) GQ_CASE(F, 2) GQ_CASE(F, 3) GQ_CASE(F, 4) GQ_CASE(F, 5) \
                                        GQ_CASE(F, 6) GQ_CASE(F, 7) GQ_CASE(F, 8) } break;
    switch (f) {
    GQ_FMT(GQ_Q8_0) GQ_FMT(GQ_Q4_0) GQ_FMT(GQ_Q4_1) GQ_FMT(GQ_Q5_0) GQ_FMT(GQ_Q5_1) GQ_FMT(GQ_Q4_K) GQ_FMT(GQ_Q5_K)
    GQ_FMT(GQ_Q6_K) GQ_FMT(GQ_I4)
    }
#undef GQ_FMT
#undef GQ_CASE
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (CPUs without AVX-512 VNNI): a tile's 16 rows as two halves of 8, each nibble group's 32 bytes per half
 * (8 rows x 4 weights) against 4 activations broadcast; each broadcast serves both halves, and each group,
 * unpacked, serves the GQ_MR rows of x of a pass (1.15x a half at a time on the default model's shapes at 16
 * rows on a Zen 3 core, with the loops unrolled; 6 rows a pass measured 0.96x of 4). vpmaddubsw multiplies
 * unsigned weights by int8 activations into 16-bit sums of pairs, which are added in 16 bits while they cannot
 * overflow (|x| <= 127: eight groups of 4-bit weights, four of 5-bit, two of 6-bit), then widened (vpmaddwd by
 * ones). q8_0's 8-bit weights would overflow a pair: its two nibble planes are two 4-bit dot products, the high
 * one times 16. So every sum is the exact integer the VNNI loop computes, and the float arithmetic after it is
 * the same. */
#define GQ_HALF 8
#define GQ_MR 4 /* rows of x per pass over a tile */

static inline __m256 cvt_u8x8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* Scales and mins of half h's 8 rows (per 16-input half for q6_K). */
static inline __attribute__((always_inline)) void gq_scales8(const int F, const uint8_t *blk, const uint8_t *sup,
                                                              const int h, __m256 *sc, __m256 *mn) {
    const uint8_t *s = blk + 256 + GQ[F].high;
    const int c = GQ_HALF * h;
    if (F == GQ_Q4_K || F == GQ_Q5_K) {
        const __m256 d = _mm256_loadu_ps((const float *)sup + c), dmin = _mm256_loadu_ps((const float *)(sup + 64) + c);
        sc[0] = _mm256_mul_ps(d, cvt_u8x8(s + c));
        mn[0] = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), dmin), cvt_u8x8(s + 16 + c));
    } else if (F == GQ_Q6_K) {
        const __m256 d = _mm256_loadu_ps((const float *)sup + c), off = _mm256_set1_ps(-(float)GQ[F].offset);
        for (int p = 0; p < 2; p++) {
            sc[p] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + 16 * p + c)))));
            mn[p] = _mm256_mul_ps(sc[p], off);
        }
    } else if (F == GQ_Q4_OWN) {
        sc[0] = _mm256_loadu_ps((const float *)s + c);
        mn[0] = _mm256_loadu_ps((const float *)(s + 64) + c);
    } else if (F == GQ_I4) {
        sc[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * c)));
        mn[0] = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), sc[0]), cvt_u8x8(s + 32 + c));
    } else {
        sc[0] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 2 * c)));
        mn[0] = GQ[F].offset ? _mm256_mul_ps(sc[0], _mm256_set1_ps(-(float)GQ[F].offset))
                             : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 32 + 2 * c)));
    }
}

/* Half h's sums (+ bias) into y's columns 8h.. (those of the tile's nrows that exist). */
static inline __attribute__((always_inline)) void gq_store8(const int MR, const int h, const __m256 *acc,
                                                            const float *bias, float *y, const size_t ldy,
                                                            const int nrows) {
    const int n = nrows - GQ_HALF * h;
    float out[GQ_HALF];
    for (int r = 0; r < MR; r++) {
        _mm256_storeu_ps(out, acc[r]);
        for (int c = 0; c < n && c < GQ_HALF; c++)
            y[r * ldy + GQ_HALF * h + c] = out[c] + (bias ? bias[GQ_HALF * h + c] : 0.0f);
    }
}

/* Group i (0..7: the low nibbles of the block's four 64-byte groups, then their high nibbles) of half h: 8 rows
 * x 4 unsigned weights, the high bits or-ed in (q8_0: `plane` 1 gives the high nibble plane's group instead). */
static inline __attribute__((always_inline)) __m256i gq_group8(const int F, const uint8_t *blk, const int i,
                                                              const int h, const int plane) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 256 * plane + 64 * (i % 4) + 32 * h));
    __m256i w = _mm256_and_si256(i < 4 ? raw : _mm256_srli_epi16(raw, 4), low);
    if (GQ[F].high == 64) { /* bit i of each byte -> bit 4 */
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(blk + 256 + 32 * h));
        const __m256i moved = i <= 4 ? _mm256_slli_epi16(bits, 4 - i) : _mm256_srli_epi16(bits, i - 4);
        w = _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
    } else if (GQ[F].high == 128) { /* bits 2(i % 4) and up of plane i / 4 -> bits 4-5 */
        const __m256i bits = _mm256_loadu_si256((const __m256i *)(blk + 256 + 64 * (i / 4) + 32 * h));
        const int s = 2 * (i % 4);
        const __m256i moved = s <= 4 ? _mm256_slli_epi16(bits, 4 - s) : _mm256_srli_epi16(bits, s - 4);
        w = _mm256_or_si256(w, _mm256_and_si256(moved, _mm256_set1_epi8(0x30)));
    }
    return w;
}

/* Exact integer sums, for MR rows of x and both halves of one block, of groups i0 .. i0 + n of `plane`: each
 * group's 4 activations are broadcast once for the tile's 16 rows. */
static inline __attribute__((always_inline)) void gq_sums(const int F, const int MR, const uint8_t *blk,
                                                          const int8_t *x, const size_t ldx, const int plane,
                                                          const int i0, const int n, __m256i s[][2]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p16[MR][2];
    _Pragma("GCC unroll 16")
    for (int i = i0; i < i0 + n; i++) {
        const __m256i w0 = gq_group8(F, blk, i, 0, plane), w1 = gq_group8(F, blk, i, 1, plane);
        const int k = i < 4 ? 4 * i : 16 + 4 * (i - 4);
        _Pragma("GCC unroll 16")
        for (int r = 0; r < MR; r++) {
            const __m256i xv = _mm256_set1_epi32(*(const int32_t *)(x + r * ldx + k));
            const __m256i m0 = _mm256_maddubs_epi16(w0, xv), m1 = _mm256_maddubs_epi16(w1, xv);
            p16[r][0] = i == i0 ? m0 : _mm256_add_epi16(p16[r][0], m0);
            p16[r][1] = i == i0 ? m1 : _mm256_add_epi16(p16[r][1], m1);
        }
    }
    _Pragma("GCC unroll 16")
    for (int r = 0; r < MR; r++)
        _Pragma("GCC unroll 16")
        for (int h = 0; h < 2; h++) s[r][h] = _mm256_madd_epi16(p16[r][h], ones);
}

/* Rows r0..r0+MR of x against one whole tile (both halves of 8 rows; a tile always holds 16, the missing ones
 * zero). Per row and half: the exact integer sums of gq_sums, then the VNNI loop's float steps. */
static inline __attribute__((always_inline)) void gq_tile(
        const int F, const int MR, const int nb, const int K, const int8_t *xq, const float *xd, const float *xs,
        const float *xh, const uint8_t *tile, const float *bias, float *y, const size_t ldy, const int nrows) {
    const int run = GQ[F].high == 128 ? 2 : GQ[F].high == 64 ? 4 : 8;
    __m256 acc[MR][2];
    _Pragma("GCC unroll 16")
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *sup, *blk = gq_block(F, tile, b, &sup);
        const int8_t *x = xq + b * QK;
        __m256i dot[2][MR][2]; /* [part: q6_K's 16-input halves][row][half] */
        _Pragma("GCC unroll 16")
        for (int i0 = 0; i0 < 8; i0 += run) {
            __m256i s[MR][2];
            gq_sums(F, MR, blk, x, K, 0, i0, run, s);
            const int part = GQ[F].sub16 && i0 >= 4;
            _Pragma("GCC unroll 16")
            for (int r = 0; r < MR; r++)
                _Pragma("GCC unroll 16")
                for (int h = 0; h < 2; h++)
                    dot[part][r][h] = i0 == 0 || (GQ[F].sub16 && i0 == 4) ? s[r][h] : _mm256_add_epi32(dot[part][r][h], s[r][h]);
        }
        if (GQ[F].high == 256) {
            __m256i s[MR][2];
            gq_sums(F, MR, blk, x, K, 1, 0, 8, s);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < MR; r++)
                _Pragma("GCC unroll 16")
                for (int h = 0; h < 2; h++) dot[0][r][h] = _mm256_add_epi32(dot[0][r][h], _mm256_slli_epi32(s[r][h], 4));
        }
        _Pragma("GCC unroll 16")
        for (int h = 0; h < 2; h++) {
            __m256 sc[2], mn[2];
            gq_scales8(F, blk, sup, h, sc, mn);
            _Pragma("GCC unroll 16")
            for (int r = 0; r < MR; r++) {
                const __m256 dx = _mm256_set1_ps(xd[r * nb + b]);
                if (!GQ[F].sub16) {
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r][h]), _mm256_mul_ps(sc[0], dx), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(xs[r * nb + b]), acc[r][h]);
                } else {
                    const float hx = xh[r * nb + b];
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[0][r][h]), _mm256_mul_ps(sc[0], dx), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[1][r][h]), _mm256_mul_ps(sc[1], dx), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(mn[0], _mm256_set1_ps(hx), acc[r][h]);
                    acc[r][h] = _mm256_fmadd_ps(mn[1], _mm256_set1_ps(xs[r * nb + b] - hx), acc[r][h]);
                }
            }
        }
    }
    for (int h = 0; h < (nrows > GQ_HALF ? 2 : 1); h++) {
        __m256 a[MR];
        _Pragma("GCC unroll 16")
        for (int r = 0; r < MR; r++) a[r] = acc[r][h];
        gq_store8(MR, h, a, bias, y, ldy, nrows);
    }
}

static void q4_rows(int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const uint8_t *wp,
                    const float *bias, float *y, size_t ldy, int nrows) {
    for (int r0 = 0; r0 < mr; r0 += GQ_MR) {
        const int8_t *x = xq + (size_t)r0 * K;
        const float *d = xd + (size_t)r0 * nb, *s = xs + (size_t)r0 * nb;
        float *out = y + (size_t)r0 * ldy;
        switch (mr - r0 < GQ_MR ? mr - r0 : GQ_MR) {
#define Q4_CASE(n) case n: gq_tile(GQ_Q4_OWN, n, nb, K, x, d, s, NULL, wp, bias, out, ldy, nrows); break;
        Q4_CASE(1) Q4_CASE(2) Q4_CASE(3) Q4_CASE(4)
#undef Q4_CASE
        }
    }
}

static void gq_rows(int f, int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const float *xh,
                    const uint8_t *tile, const float *bias, float *y, size_t ldy, int nrows) {
    for (int r0 = 0; r0 < mr; r0 += GQ_MR) {
        const int n = mr - r0 < GQ_MR ? mr - r0 : GQ_MR;
        const int8_t *x = xq + (size_t)r0 * K;
        const float *d = xd + (size_t)r0 * nb, *s = xs + (size_t)r0 * nb, *hh = xh + (size_t)r0 * nb;
        float *out = y + (size_t)r0 * ldy;
#define GQ_CASE(F, n) case n: gq_tile(F, n, nb, K, x, d, s, hh, tile, bias, out, ldy, nrows); break;
#define GQ_FMT(F) case F: switch (n) { GQ_CASE(F, 1) GQ_CASE(F, 2) GQ_CASE(F, 3) GQ_CASE(F, 4) } break;
        switch (f) {
        GQ_FMT(GQ_Q8_0) GQ_FMT(GQ_Q4_0) GQ_FMT(GQ_Q4_1) GQ_FMT(GQ_Q5_0) GQ_FMT(GQ_Q5_1) GQ_FMT(GQ_Q4_K)
        GQ_FMT(GQ_Q5_K) GQ_FMT(GQ_Q6_K) GQ_FMT(GQ_I4)
        }
#undef GQ_FMT
#undef GQ_CASE
    }
}
#else
/* Portable version of the same arithmetic. */
static void gq_rows(int f, int mr, int nb, int K, const int8_t *xq, const float *xd, const float *xs, const float *xh,
                    const uint8_t *tile, const float *bias, float *y, size_t ldy, int nrows) {
    float acc[Q4_MR][Q4_ROWS] = {{0}};
    for (int b = 0; b < nb; b++) {
        const uint8_t *sup, *blk = gq_block(f, tile, b, &sup);
        for (int c = 0; c < nrows; c++) {
            uint8_t q[32];
            float sc[2], mn[2];
            gq_row(f, blk, sup, c, q, sc, mn);
            for (int r = 0; r < mr; r++) {
                const int8_t *xb = xq + (size_t)r * K + b * QK;
                int lo = 0, hi = 0;
                for (int k = 0; k < 16; k++) { lo += q[k] * xb[k]; hi += q[16 + k] * xb[16 + k]; }
                const float d = xd[r * nb + b], s = xs[r * nb + b], h = xh[r * nb + b];
                acc[r][c] += (float)lo * (sc[0] * d) + (float)hi * (sc[1] * d) + mn[0] * h + mn[1] * (s - h);
            }
        }
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nrows; c++) y[r * ldy + c] = acc[r][c] + (bias ? bias[c] : 0.0f);
}
#endif

/* y[M, N] = x[M, K] @ W^T (+ bias), W in tiles of 16 rows (table: byte offset and format per tile).
 * The integer matmuls hand out their tiles `guided`: a thread on a core that another process shares (a
 * borrowed core, services/cores.py) takes fewer of them instead of holding the others up at the end. A
 * tile's output is the same whichever thread computes it. */
int baton_gemm_gq(const float *x, int M, int K, const uint8_t *wp, const int64_t *table, const float *bias, int N,
                  float *y, int threads) {
    if (K % QK != 0 || M < 1 || N < 1) return -1;
    const int nb = K / QK, tiles = (N + Q4_ROWS - 1) / Q4_ROWS;
    if (threads < 1) threads = 1;
    qrows a;
    if (qrows_make(&a, x, M, K, threads)) return -2;
    float *xh = malloc(sizeof(float) * (size_t)M * nb); /* d * sum of each block's first 16 */
    if (!xh) { qrows_free(&a); return -2; }
    for (size_t i = 0; i < (size_t)M * nb; i++) {
        int sum = 0;
        for (int k = 0; k < 16; k++) sum += a.q[i * QK + k];
        xh[i] = a.d[i] * (float)sum;
    }
#pragma omp parallel for schedule(guided) num_threads(threads) if (threads > 1 && (size_t)M * N * K > 65536)
    for (int t = 0; t < tiles; t++) {
        const int n0 = t * Q4_ROWS, nrows = N - n0 < Q4_ROWS ? N - n0 : Q4_ROWS;
        const int f = (int)table[2 * t + 1];
        for (int r = 0; r < M; r += Q4_MR)
            gq_rows(f, M - r < Q4_MR ? M - r : Q4_MR, nb, K, a.q + (size_t)r * K, a.d + (size_t)r * nb,
                    a.s + (size_t)r * nb, xh + (size_t)r * nb, wp + table[2 * t], bias ? bias + n0 : NULL,
                    y + (size_t)r * N + n0, N, nrows);
    }
    free(xh);
    qrows_free(&a);
    return 0;
}

/* ------------------------------------------------------------------ bfloat16 */

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

#if BATON_AVX512
static inline __m512 bf16x16_to_f32(__m256i v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* f32_to_bf16 on 16 lanes (integer arithmetic, so no AVX512-BF16 needed; denormals kept, as torch). */
static inline __m256i f32x16_to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q); /* quiet NaN */
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    return _mm512_cvtepi32_epi16(r);
}
#endif

/* Which loop the integer block matmuls (q4_1's and the GGUF block types') run: 2 AVX-512 VNNI, 1 AVX2, 0 portable
 * (fast only for a few rows). */
int baton_gq_loop(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

int baton_has_bf16_gemm(void) {
#if defined(__AVX512BF16__) && BATON_AVX512
    return 1;
#else
    return 0;
#endif
}

/* Packed bfloat16 weights: W [N, K] is stored in tiles of 32 output columns; within a tile, for each
 * pair of inputs p (K / 2 of them), 32 columns x 2 inputs: packed[t][p][c][j] = W[32t + c][2p + j]
 * (columns past N are zero). One 64-byte load then holds the pair for 16 columns, which is what
 * vdpbf16ps multiplies against a broadcast pair of x: each instruction does 32 multiply-adds, and
 * each weight load serves up to PACK_MR rows of x, so the kernel runs at the chip's bfloat16 rate
 * for batches and at memory speed for one row. (kernels/cpu.py:pack_bf16 builds this layout.) */
#define PACK_NT 32
#define PACK_MR 12     /* rows of x per pass over a weight tile: 24 accumulators of the 32 registers */
#define PACK_MB 256    /* rows of x per block: keeps a block of x in the core's L2 */

#if defined(__AVX512BF16__) && BATON_AVX512

/* A column tile's output: its masks (ncols of 32 columns) and bias, added to each row's two float32 sums
 * before the one rounding to bfloat16 (nearest even); y_f32 stores the bfloat16 values widened. The
 * vdpbf16ps and the AMX tiles both end here, so they round and store alike. */
typedef struct { __mmask16 m0, m1; __m512 b0, b1; } bf16_out;

static inline bf16_out bf16_out_of(const uint16_t *bias, const int ncols) {
    bf16_out e;
    e.m0 = ncols >= 16 ? 0xFFFF : (__mmask16)((1u << ncols) - 1);
    e.m1 = ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : (__mmask16)((1u << (ncols - 16)) - 1);
    e.b0 = bias ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(e.m0, bias)) : _mm512_setzero_ps();
    e.b1 = bias ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(e.m1, bias + 16)) : _mm512_setzero_ps();
    return e;
}

static inline __attribute__((always_inline)) void bf16_store_row(const bf16_out *e, const __m512 s0, const __m512 s1,
                                                                 void *y, const size_t at, const int y_f32) {
    const __m256i lo = f32x16_to_bf16(_mm512_add_ps(s0, e->b0));
    const __m256i hi = f32x16_to_bf16(_mm512_add_ps(s1, e->b1));
    if (y_f32) {
        float *yr = (float *)y + at;
        _mm512_mask_storeu_ps(yr, e->m0, bf16x16_to_f32(lo));
        _mm512_mask_storeu_ps(yr + 16, e->m1, bf16x16_to_f32(hi));
    } else {
        uint16_t *yr = (uint16_t *)y + at;
        _mm256_mask_storeu_epi16(yr, e->m0, lo);
        _mm256_mask_storeu_epi16(yr + 16, e->m1, hi);
    }
}

/* y[MR, ncols] = x[MR, K] @ tile^T (+ bias): MR is a constant at each call site, so the accumulators
 * stay in registers. */
static inline __attribute__((always_inline)) void bf16_tile(
        const int MR, const int K, const uint16_t *x, const size_t ldx, const uint16_t *wp, const uint16_t *bias,
        void *y, const size_t ldy, const int ncols, const int y_f32) {
    __m512 acc[PACK_MR][2];
    for (int r = 0; r < MR; r++) { acc[r][0] = _mm512_setzero_ps(); acc[r][1] = _mm512_setzero_ps(); }
    for (int p = 0; p < K / 2; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wp + (size_t)p * 2 * PACK_NT);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(wp + (size_t)p * 2 * PACK_NT + PACK_NT);
        for (int r = 0; r < MR; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x + r * ldx))[p]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, xb);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, xb);
        }
    }
    const bf16_out e = bf16_out_of(bias, ncols);
    for (int r = 0; r < MR; r++) bf16_store_row(&e, acc[r][0], acc[r][1], y, r * ldy, y_f32);
}

static void bf16_rows(int mr, int K, const uint16_t *x, size_t ldx, const uint16_t *wp, const uint16_t *bias,
                      void *y, size_t ldy, int ncols, int y_f32) {
    switch (mr) {
#define BF16_ROWS(n) case n: bf16_tile(n, K, x, ldx, wp, bias, y, ldy, ncols, y_f32); break;
    BF16_ROWS(1) BF16_ROWS(2) BF16_ROWS(3) BF16_ROWS(4) BF16_ROWS(5) BF16_ROWS(6)
    BF16_ROWS(7) BF16_ROWS(8) BF16_ROWS(9) BF16_ROWS(10) BF16_ROWS(11) BF16_ROWS(12)
#undef BF16_ROWS
    }
}
#endif

#if BATON_AMX
/* The bfloat16 matmul on AMX, for every pass size (K a multiple of 32). Each output's sums depend on its
 * own row of x only, so a row gets the same bits in a pass of 1 row or of 300 (a prompt's output is the
 * same with and without a prefix-cache hit, which changes the pass sizes); and on the cores measured it
 * was as fast as the vdpbf16ps tiles at 1 row and 3-5x faster from 4 rows up, where those are bound by
 * arithmetic. A packed weight tile is already two B operands: its 16 input pairs x 16 columns halves,
 * 128 bytes a pair. A step of 32 inputs multiplies 32 rows of x (tiles 4, 5) by 32 columns (tiles 6, 7)
 * into tiles 0-3; the sums go through cb ([32][32] float32) to the same bias, rounding and stores as
 * bf16_tile. x has a multiple of 16 rows (the caller pads it). */

static void bf16_block_amx(const int rows, const int K, const uint16_t *x, const uint16_t *wp,
                           const uint16_t *bias, void *y, const size_t ldy, const int ncols, const int y_f32,
                           float *cb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int k = 0; k < K; k += 32) {
        const uint16_t *w = wp + (size_t)k * PACK_NT;
        _tile_loadd(4, x + k, 2 * K);
        _tile_loadd(6, w, 4 * PACK_NT);
        _tile_loadd(7, w + 16 * 2, 4 * PACK_NT);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows > 16) {
            _tile_loadd(5, x + (size_t)16 * K + k, 2 * K);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, cb, 128);
    _tile_stored(1, cb + 16, 128);
    if (rows > 16) {
        _tile_stored(2, cb + 16 * 32, 128);
        _tile_stored(3, cb + 16 * 32 + 16, 128);
    }
    const bf16_out e = bf16_out_of(bias, ncols);
    for (int r = 0; r < rows; r++)
        bf16_store_row(&e, _mm512_loadu_ps(cb + 32 * r), _mm512_loadu_ps(cb + 32 * r + 16), y, r * ldy, y_f32);
}
#endif

static void *scratch(int slot, size_t bytes);

/* y[M, N] (bf16) = x[M, K] (bf16) @ W^T (+ bias[N], bf16), W packed as above, accumulated in float32
 * and rounded once. K even. Threads split the column tiles. y_f32: y is float32 (the same bfloat16
 * values, widened: what the LM head's logits become anyway). */
static int gemm_bf16(const uint16_t *x, int M, int K, const uint16_t *wp, const uint16_t *bias, int N, void *y,
                     int y_f32, int threads) {
#if defined(__AVX512BF16__) && BATON_AVX512
    if (K % 2 != 0 || M < 1 || N < 1) return -1;
    if (threads < 1) threads = 1;
    const int tiles = (N + PACK_NT - 1) / PACK_NT;
    const size_t ys = y_f32 ? 4 : 2;
#if BATON_AMX
    if (K % 32 == 0 && baton_amx()) {
        const int Mp = (M + 15) / 16 * 16;
        const uint16_t *xp = x;
        if (Mp != M) { /* the last tile's rows past M read zeros */
            uint16_t *pad = scratch(14, (size_t)Mp * K * 2);
            if (!pad) return -2;
            memcpy(pad, x, (size_t)M * K * 2);
            memset(pad + (size_t)M * K, 0, (size_t)(Mp - M) * K * 2);
            xp = pad;
        }
        int err = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && (size_t)M * N * K > 65536)
        {
            float *cb = scratch(15, 32 * 32 * sizeof(float));
            if (!cb) err = -2;
            amx_load_config();
            for (int m0 = 0; m0 < M; m0 += PACK_MB) {
                const int m1 = m0 + PACK_MB < M ? m0 + PACK_MB : M;
#pragma omp for schedule(static) nowait
                for (int t = 0; t < tiles; t++) {
                    const int n0 = t * PACK_NT, nc = N - n0 < PACK_NT ? N - n0 : PACK_NT;
                    if (cb)
                        for (int r = m0; r < m1; r += 32)
                            bf16_block_amx(m1 - r < 32 ? m1 - r : 32, K, xp + (size_t)r * K, wp + (size_t)t * PACK_NT * K,
                                           bias ? bias + n0 : NULL, (char *)y + ((size_t)r * N + n0) * ys, N, nc, y_f32, cb);
                }
            }
            _tile_release();
        }
        return err;
    }
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && (size_t)M * N * K > 65536)
    for (int m0 = 0; m0 < M; m0 += PACK_MB) {
        const int m1 = m0 + PACK_MB < M ? m0 + PACK_MB : M;
#pragma omp for schedule(static) nowait
        for (int t = 0; t < tiles; t++) {
            const int n0 = t * PACK_NT, nc = N - n0 < PACK_NT ? N - n0 : PACK_NT;
            for (int r = m0; r < m1; r += PACK_MR)
                bf16_rows(m1 - r < PACK_MR ? m1 - r : PACK_MR, K, x + (size_t)r * K, K, wp + (size_t)t * PACK_NT * K,
                          bias ? bias + n0 : NULL, (char *)y + ((size_t)r * N + n0) * ys, N, nc, y_f32);
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)wp; (void)bias; (void)N; (void)y; (void)y_f32; (void)threads;
    return -3;
#endif
}

int baton_gemm_bf16(const uint16_t *x, int M, int K, const uint16_t *wp, const uint16_t *bias, int N,
                    uint16_t *y, int threads) {
    return gemm_bf16(x, M, K, wp, bias, N, y, 0, threads);
}

int baton_gemm_bf16_f32(const uint16_t *x, int M, int K, const uint16_t *wp, const uint16_t *bias, int N,
                        float *y, int threads) {
    return gemm_bf16(x, M, K, wp, bias, N, y, 1, threads);
}

/* The sum of every byte of n buffers, read once, each buffer split between the threads in contiguous
 * parts as the matmuls split their weights: how long reading a model's weights takes where they lie
 * (on a shared host, read speed differs between allocations, so another buffer is no stand-in). */
int64_t baton_read_bytes(const void *const *ptrs, const int64_t *sizes, int n, int threads) {
    int64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+:total)
    {
        for (int b = 0; b < n; b++) {
            const uint8_t *p = ptrs[b];
            const int64_t lines = sizes[b] / 64;
#if BATON_AVX512
            __m512i acc = _mm512_setzero_si512();
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < lines; i++) /* eight 8-byte sums per line */
                acc = _mm512_add_epi64(acc, _mm512_sad_epu8(_mm512_loadu_si512(p + 64 * i), _mm512_setzero_si512()));
            total += _mm512_reduce_add_epi64(acc);
#else
#pragma omp for schedule(static) nowait
            for (int64_t i = 0; i < lines * 64; i++) total += p[i];
#endif
#pragma omp single nowait
            for (int64_t i = lines * 64; i < sizes[b]; i++) total += p[i];
        }
    }
    return total;
}

/* Structured output: x[rows[k], t] = -inf for every token t that row k's bitmask (llguidance's layout: bit
 * j of word w is token 32 w + j; `words` int32 words per row) does not allow, and for every t past the
 * mask. In place on x (float32 [*, n]). Whole words are the common case (inside a JSON structure few
 * tokens are allowed, inside a string most): a word of zeros or of ones costs one test. */
void baton_mask_rows(float *x, int n, const int64_t *rows, int nrows, const int32_t *bitmask, int words) {
    for (int k = 0; k < nrows; k++) {
        float *row = x + (size_t)rows[k] * n;
        const uint32_t *mask = (const uint32_t *)bitmask + (size_t)k * words;
        for (int w = 0; w < words; w++) {
            const int base = w * 32;
            if (base >= n) break;
            const uint32_t word = mask[w];
            if (word == 0xFFFFFFFFu) continue;
            const int end = base + 32 < n ? base + 32 : n;
            for (int t = base; t < end; t++)
                if (!((word >> (t - base)) & 1u)) row[t] = -INFINITY;
        }
        for (int t = words * 32; t < n; t++) row[t] = -INFINITY;
    }
}

/* out[r] = the index of the largest of x[r, 0..n) (float32), the first one among equals; a NaN counts
 * as the largest (torch.argmax's rules). */
int baton_argmax_rows(const float *x, int M, int n, int64_t *out, int threads) {
    if (n < 1) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (size_t)M * n >= 65536)
    for (int r = 0; r < M; r++) {
        const float *row = x + (size_t)r * n;
        int i = 0;
        int64_t at = 0;
        float best = -INFINITY;
#if BATON_AVX512
        __m512 top = _mm512_set1_ps(-INFINITY);
        __mmask16 nan = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_loadu_ps(row + i);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            top = _mm512_max_ps(top, v);
        }
        if (nan) {
            i = 0; /* the loop below finds the first NaN */
        } else if (i > 0) { /* the largest of the vector part, at its first position */
            best = _mm512_reduce_max_ps(top);
            for (int j = 0; j < i; j += 16) {
                const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), _mm512_set1_ps(best), _CMP_EQ_OQ);
                if (hit) { at = j + __builtin_ctz(hit); break; }
            }
        }
#endif
        if (i == 0) best = row[0];
        for (; i < n; i++) {
            const float v = row[i];
            if (v != v) { at = i; break; }
            if (v > best) { best = v; at = i; }
        }
        out[r] = at;
    }
    return 0;
}

/* ------------------------------------------------------------------ attention */

static inline float load_elem(const void *p, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline float round_act(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

static inline void store(void *p, size_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Row [i, i + n) of a float32 or bfloat16 array as float32: in place, or widened into buf. */
static inline const float *load_row(const void *p, size_t i, int bf16, float *restrict buf, int n) {
    if (!bf16) return (const float *)p + i;
    const uint16_t *src = (const uint16_t *)p + i;
#pragma omp simd
    for (int d = 0; d < n; d++) buf[d] = bf16_to_f32(src[d]);
    return buf;
}

/* One query token per sequence against its paged context, grouped-query attention.
 * q: [batch, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
 * block_tables: [batch, max_blocks]; seq_lens: [batch] (context including the query token).
 * q, caches and out are float32 or bfloat16 (flags); arithmetic in float32, softmax in two passes.
 * Tasks are (sequence, KV head) pairs; each KV head's keys are read once for its query group. */
/* A sliding window that starts inside the walk's first block: its first o0 keys lie before the window.
 * Their scores become -inf and each query's max is taken again over the keys in the window (a key
 * outside the window, an attention sink at position 0 say, may score far above every key inside). */
static void window_mask(float *scores, int group, int64_t len, int o0, float *mx) {
    for (int g = 0; g < group; g++) {
        float *sc = scores + (size_t)g * len, m = -INFINITY;
        for (int i = 0; i < o0; i++) sc[i] = -INFINITY;
        for (int64_t i = o0; i < len; i++) m = sc[i] > m ? sc[i] : m;
        mx[g] = m;
    }
}

/* One (sequence, KV head) task: scores of the group's queries against every context token, softmax,
 * weighted sum of values. Walks the block table block by block (no division per token). D is the head
 * dimension; always inlined so that the common sizes get loops of constant length. */
static inline __attribute__((always_inline)) void attend(
        const int D, const int group, const float *restrict qf, float *restrict acc, float *restrict scores,
        const int64_t len, const int64_t *table, const int block_size, const int num_kv_heads, const int h,
        const void *k_cache, const void *v_cache, const int cache_bf16, const int o0) {
    float mx[16], sum[16];
    for (int g = 0; g < group; g++) { mx[g] = -INFINITY; sum[g] = 0.0f; }
    for (int i = 0; i < group * D; i++) acc[i] = 0.0f;
    const size_t tok_stride = (size_t)num_kv_heads * D;
    int64_t t = 0;
    for (int64_t blk = 0; t < len; blk++) {
        const size_t first = ((size_t)table[blk] * block_size * num_kv_heads + h) * D;
        const int n = len - t < block_size ? (int)(len - t) : block_size;
        for (int o = 0; o < n; o++, t++) {
            float kbuf[256];
            const float *kf = load_row(k_cache, first + o * tok_stride, cache_bf16, kbuf, D);
            for (int g = 0; g < group; g++) {
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qf[g * D + d] * kf[d];
                scores[(size_t)g * len + t] = s;
                mx[g] = s > mx[g] ? s : mx[g];
            }
        }
    }
    if (o0) window_mask(scores, group, len, o0, mx);
    for (int g = 0; g < group; g++) {
        float *sc = scores + (size_t)g * len, total = 0.0f;
        const float m = mx[g];
#pragma omp simd reduction(+ : total)
        for (int64_t i = 0; i < len; i++) { sc[i] = expf(sc[i] - m); total += sc[i]; }
        sum[g] = total;
    }
    t = 0;
    for (int64_t blk = 0; t < len; blk++) {
        const size_t first = ((size_t)table[blk] * block_size * num_kv_heads + h) * D;
        const int n = len - t < block_size ? (int)(len - t) : block_size;
        for (int o = 0; o < n; o++, t++) {
            float vbuf[256];
            const float *vf = load_row(v_cache, first + o * tok_stride, cache_bf16, vbuf, D);
            for (int g = 0; g < group; g++) {
                const float p = scores[(size_t)g * len + t];
#pragma omp simd
                for (int d = 0; d < D; d++) acc[g * D + d] += p * vf[d];
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const float inv = 1.0f / sum[g];
        for (int d = 0; d < D; d++) acc[g * D + d] *= inv;
    }
}

#if BATON_AVX512
/* e^x to about 2 ulp: x = n ln2 + r, e^r by the degree-7 polynomial of Cephes' expf, times 2^n.
 * (A scalar expf per element cost more than the arithmetic around it.) */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); /* e^-104 is below float32's smallest: 0 after scaling */
    x = _mm512_min_ps(x, _mm512_set1_ps(88.8f));   /* and e^88.8 above its largest: inf */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x); /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* 16 (live) elements of a float32 or bfloat16 array at p + i as float32, and back (rounded to nearest even). */
static inline __m512 load16(const void *p, size_t i, int bf16, __mmask16 live) {
    return bf16 ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(live, (const uint16_t *)p + i))
                : _mm512_maskz_loadu_ps(live, (const float *)p + i);
}

static inline __m512 round16(__m512 v) { return bf16x16_to_f32(f32x16_to_bf16(v)); } /* to bfloat16 and back */

static inline void store16(void *p, size_t i, __m512 v, int bf16, __mmask16 live) {
    if (bf16) _mm256_mask_storeu_epi16((uint16_t *)p + i, live, f32x16_to_bf16(v));
    else _mm512_mask_storeu_ps((float *)p + i, live, v);
}

/* D / 16 vectors of a float32 or bfloat16 row as float32. */
static inline __attribute__((always_inline)) void load_vecs(const void *p, size_t i, int bf16, __m512 *v, int n) {
    for (int j = 0; j < n; j++) v[j] = load16(p, i + 16 * (size_t)j, bf16, 0xFFFF);
}

/* Lane t of the result = the sum of the 16 lanes of s[t]: a transposing tree of additions, about 3
 * instructions per sum instead of 8 for a reduction of each vector alone. */
static inline __m512 sum16(const __m512 *s) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* 128-bit lanes 0-1: s[i]'s halves added; lanes 2-3: s[i + 8]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[i], s[i + 8], 0x44), _mm512_shuffle_f32x4(s[i], s[i + 8], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit lane l: the 4 partial sums of token {i, i + 8, i + 4, i + 12}[l] */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[i], b[i + 2]), _mm512_unpackhi_ps(b[i], b[i + 2]));
    const __m512 d = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(c[0]), _mm512_castps_pd(c[1]))));
    /* d holds tokens 0 2 1 3 | 8 10 9 11 | 4 6 5 7 | 12 14 13 15: put them in order */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15), d);
}

/* A walk that asks for the K/V rows of one KV head PF_AHEAD tokens ahead of the one being read
 * (into L2: locality 1): keys first, then values. Blocks lie anywhere in the pool, so the hardware
 * prefetcher cannot follow a sequence from one block to the next, and a decode step's K/V (70 MB at
 * batch 16, context 190) do not stay in cache from one step to the next: without this the walk
 * waited on memory at every block (one thread, 30 layers of that step: 15-16 -> 8.5-9.2 ms; 96 ahead
 * measured best of 16-256). The cursor moves block by block: no division per token. */
#define PF_AHEAD 96
typedef struct {
    const char *cache[2];  /* keys, values */
    const int64_t *table;
    int64_t len, tok, blk; /* tok: position in the current walk (keys or values), in block blk */
    int o, which, block_size;
    size_t head_off, tok_bytes, row_bytes;
} prefetcher;

static inline void pf_next(prefetcher *p) { /* issue the row under the cursor, then move on one token */
    if (p->which > 1) return;
    const char *row = p->cache[p->which] + ((size_t)p->table[p->blk] * p->block_size + p->o) * p->tok_bytes + p->head_off;
    for (size_t off = 0; off < p->row_bytes; off += 64) __builtin_prefetch(row + off, 0, 1);
    if (++p->o == p->block_size) { p->o = 0; p->blk++; }
    if (++p->tok == p->len) { p->tok = p->blk = 0; p->o = 0; p->which++; }
}

/* Starts the walk at token 0 of the keys, issues its first PF_AHEAD rows. */
static inline void pf_start(prefetcher *p, const void *k_cache, const void *v_cache, const int64_t *table,
                            int64_t len, int block_size, int num_kv_heads, int h, int D, int bf16) {
    const size_t esz = bf16 ? 2 : 4;
    *p = (prefetcher){{k_cache, v_cache}, table, len, 0, 0, 0, 0, block_size,
                      (size_t)h * D * esz, (size_t)num_kv_heads * D * esz, (size_t)D * esz};
    for (int i = 0; i < PF_AHEAD; i++) pf_next(p);
}

/* For queries g0 .. g0 + GN of the group: acc = (their softmax numerators in scores) x (value rows) /
 * sum, in one walk over the values (each row widened once for GN queries), the sums in registers.
 * D is 64 or 128, GN at most 3: up to 24 accumulators. The first walk prefetches ahead. */
static inline __attribute__((always_inline)) void sum_values(
        const int D, const int GN, const int BF, const int g0, const float *restrict scores, const int64_t len,
        const float *sum, float *restrict acc, const int64_t *table, const int block_size, const int num_kv_heads,
        const int h, const void *v_cache, const int cache_bf16, prefetcher *pf) {
    const int V = D / 16;
    const size_t tok_stride = (size_t)num_kv_heads * D;
    __m512 o[3][8];
    for (int g = 0; g < GN; g++)
        for (int j = 0; j < V; j++) o[g][j] = _mm512_setzero_ps();
    int64_t t = 0;
    for (int64_t blk = 0; t < len; blk++) {
        const size_t first = ((size_t)table[blk] * block_size * num_kv_heads + h) * D;
        const int n = len - t < block_size ? (int)(len - t) : block_size;
        for (int i = 0; i < n; i++, t++) {
            if (g0 == 0) pf_next(pf);
            __m512 v[8];
            if (BF) /* bfloat16 cache: 32 values a load, the even dims in v[2j] and the odd in v[2j + 1] */
                for (int j = 0; j < V / 2; j++) {
                    const __m512i raw = _mm512_loadu_si512((const uint16_t *)v_cache + first + i * tok_stride + 32 * j);
                    v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
                    v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000)));
                }
            else
                load_vecs(v_cache, first + i * tok_stride, cache_bf16, v, V);
            for (int g = 0; g < GN; g++) {
                const __m512 w = _mm512_set1_ps(scores[(size_t)(g0 + g) * len + t]);
                for (int j = 0; j < V; j++) o[g][j] = _mm512_fmadd_ps(w, v[j], o[g][j]);
            }
        }
    }
    for (int g = 0; g < GN; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / sum[g0 + g]);
        if (BF) /* even and odd dims back in order */
            for (int j = 0; j < V / 2; j++) {
                const __m512 e = o[g][2 * j], od = o[g][2 * j + 1];
                const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
                _mm512_storeu_ps(acc + (g0 + g) * D + 32 * j, _mm512_mul_ps(inv, _mm512_permutex2var_ps(e, lo, od)));
                _mm512_storeu_ps(acc + (g0 + g) * D + 32 * j + 16,
                                 _mm512_mul_ps(inv, _mm512_permutex2var_ps(e, hi, od)));
            }
        else
            for (int j = 0; j < V; j++) _mm512_storeu_ps(acc + (g0 + g) * D + 16 * j, _mm512_mul_ps(inv, o[g][j]));
    }
}

/* attend() with AVX-512 for D a multiple of 16 (a constant at each call site, so a K or V row stays in
 * registers): each score's dot product is summed as a tree, not one lane after another (a chain of 16
 * dependent additions per score made the scalar version latency-bound), the softmax's exponentials
 * are vectorized, and the weighted sum of V rows uses fused multiply-adds. Same two-pass softmax. */
static inline __attribute__((always_inline)) void attend16(
        const int D, const int BF, const int group, const float *restrict qf, const uint16_t *restrict qb,
        const float scale, float *restrict acc, float *restrict scores, const int64_t len, const int64_t *table,
        const int block_size, const int num_kv_heads, const int h, const void *k_cache, const void *v_cache,
        const int cache_bf16, const int o0) {
    const int V = D / 16;
    float mx[16];
    for (int g = 0; g < group; g++) mx[g] = -INFINITY;
    const size_t tok_stride = (size_t)num_kv_heads * D;
    int64_t t = 0;
    __m512 part[16][16]; /* [query][token of the current 16]: products summed to 16 lanes */
    __m512 top[16];
    for (int g = 0; g < group; g++) top[g] = _mm512_set1_ps(-INFINITY);
    int fill = 0;
    prefetcher pf;
    pf_start(&pf, k_cache, v_cache, table, len, block_size, num_kv_heads, h, D, cache_bf16);
    for (int64_t blk = 0; t < len; blk++) {
        const size_t first = ((size_t)table[blk] * block_size * num_kv_heads + h) * D;
        const int n = len - t < block_size ? (int)(len - t) : block_size;
        for (int o = 0; o < n; o++, t++) {
            pf_next(&pf);
            if (BF) { /* bfloat16 query and keys: pairs of products in one vdpbf16ps, no widening */
#ifdef __AVX512BF16__
                __m512i k[4];
                for (int j = 0; j < V / 2; j++)
                    k[j] = _mm512_loadu_si512((const uint16_t *)k_cache + first + o * tok_stride + 32 * j);
                for (int g = 0; g < group; g++) {
                    __m512 s = _mm512_setzero_ps();
                    for (int j = 0; j < V / 2; j++)
                        s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(qb + g * D + 32 * j), (__m512bh)k[j]);
                    part[g][fill] = s;
                }
#endif
            } else {
                __m512 k[16];
                load_vecs(k_cache, first + o * tok_stride, cache_bf16, k, V);
                for (int g = 0; g < group; g++) {
                    __m512 s = _mm512_mul_ps(_mm512_loadu_ps(qf + g * D), k[0]);
                    for (int j = 1; j < V; j++) s = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * D + 16 * j), k[j], s);
                    part[g][fill] = s;
                }
            }
            if (++fill == 16 || t + 1 == len) { /* scores of tokens t - fill + 1 .. t */
                const __mmask16 live = fill == 16 ? 0xFFFF : (__mmask16)((1u << fill) - 1);
                for (int g = 0; g < group; g++) {
                    for (int i = fill; i < 16; i++) part[g][i] = _mm512_setzero_ps();
                    const __m512 sc = BF ? _mm512_mul_ps(sum16(part[g]), _mm512_set1_ps(scale)) : sum16(part[g]);
                    _mm512_mask_storeu_ps(scores + (size_t)g * len + t + 1 - fill, live, sc);
                    top[g] = _mm512_mask_max_ps(top[g], live, top[g], sc);
                }
                fill = 0;
            }
        }
    }
    for (int g = 0; g < group; g++) mx[g] = _mm512_reduce_max_ps(top[g]);
    if (o0) window_mask(scores, group, len, o0, mx);
    float sum[16];
    for (int g = 0; g < group; g++) {
        float *sc = scores + (size_t)g * len;
        const __m512 m = _mm512_set1_ps(mx[g]);
        __m512 total = _mm512_setzero_ps();
        for (int64_t i = 0; i < len; i += 16) {
            const __mmask16 live = len - i >= 16 ? 0xFFFF : (__mmask16)((1u << (len - i)) - 1);
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, sc + i), m));
            _mm512_mask_storeu_ps(sc + i, live, e);
            total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
        }
        sum[g] = _mm512_reduce_add_ps(total);
    }
    for (int g = 0; g < group; g += 3) { /* up to 3 queries per walk over the values, sums in registers */
        const int gn = group - g < 3 ? group - g : 3;
        if (gn == 3)
            sum_values(D, 3, BF, g, scores, len, sum, acc, table, block_size, num_kv_heads, h, v_cache, cache_bf16,
                       &pf);
        else if (gn == 2)
            sum_values(D, 2, BF, g, scores, len, sum, acc, table, block_size, num_kv_heads, h, v_cache, cache_bf16,
                       &pf);
        else
            sum_values(D, 1, BF, g, scores, len, sum, acc, table, block_size, num_kv_heads, h, v_cache, cache_bf16,
                       &pf);
    }
}
#endif

static int paged_decode(const void *q, size_t q_stride, int q_bf16, int batch, int num_heads, int head_dim,
                        const void *k_cache, const void *v_cache, int cache_bf16, int block_size, int num_kv_heads,
                        const int64_t *block_tables, int max_blocks, const int64_t *seq_lens, float scale,
                        int window, void *out, int threads) {
    if (head_dim > 256 || num_heads % num_kv_heads != 0 || window < 0) return -1;
    const int group = num_heads / num_kv_heads;
    if (group > 16) return -1;
    if (threads < 1) threads = 1;
    int err = 0;
#if defined(__AVX512BF16__) && BATON_AVX512
    /* bfloat16 query and cache: scores by vdpbf16ps on the unscaled query (exact products, float32
     * sums; the scale after), values widened 32 at a time */
    const int bf = q_bf16 && cache_bf16 && (head_dim == 64 || head_dim == 128);
#else
    const int bf = 0;
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && batch * num_kv_heads > 1)
    for (int task = 0; task < batch * num_kv_heads; task++) {
        const int b = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t ctx = seq_lens[b];
        if (ctx < 1 || ctx > (int64_t)max_blocks * block_size) { err = -2; continue; }
        /* a sliding window reads keys ctx - window .. ctx - 1: the walk starts at the block holding the
         * first of them, whose o0 keys before it are masked */
        const int64_t lo = window > 0 && ctx > window ? ctx - window : 0, skip = lo / block_size;
        const int o0 = (int)(lo - skip * block_size);
        const int64_t len = ctx - skip * block_size;
        float *scores = malloc(sizeof(float) * (size_t)group * len);
        if (!scores) { err = -3; continue; }
        float qf[16 * 256], acc[16 * 256];
        uint16_t qb[16 * 256];
        for (int g = 0; g < group; g++) {
            const size_t base = (size_t)b * q_stride + ((size_t)h * group + g) * head_dim;
            if (bf)
                for (int d = 0; d < head_dim; d++) qb[g * head_dim + d] = ((const uint16_t *)q)[base + d];
            else
                for (int d = 0; d < head_dim; d++) qf[g * head_dim + d] = load_elem(q, base + d, q_bf16) * scale;
        }
        const int64_t *table = block_tables + (size_t)b * max_blocks + skip;
#if BATON_AVX512
        if (head_dim == 64 && bf)
            attend16(64, 1, group, qf, qb, scale, acc, scores, len, table, block_size, num_kv_heads, h, k_cache,
                     v_cache, 1, o0);
        else if (head_dim == 128 && bf)
            attend16(128, 1, group, qf, qb, scale, acc, scores, len, table, block_size, num_kv_heads, h, k_cache,
                     v_cache, 1, o0);
        else if (head_dim == 64)
            attend16(64, 0, group, qf, qb, scale, acc, scores, len, table, block_size, num_kv_heads, h, k_cache,
                     v_cache, cache_bf16, o0);
        else if (head_dim == 128)
            attend16(128, 0, group, qf, qb, scale, acc, scores, len, table, block_size, num_kv_heads, h, k_cache,
                     v_cache, cache_bf16, o0);
#else
        if (head_dim == 64)
            attend(64, group, qf, acc, scores, len, table, block_size, num_kv_heads, h, k_cache, v_cache, cache_bf16,
                   o0);
        else if (head_dim == 128)
            attend(128, group, qf, acc, scores, len, table, block_size, num_kv_heads, h, k_cache, v_cache, cache_bf16,
                   o0);
#endif
        else
            attend(head_dim, group, qf, acc, scores, len, table, block_size, num_kv_heads, h, k_cache, v_cache,
                   cache_bf16, o0);
        for (int g = 0; g < group; g++) {
            const size_t base = ((size_t)b * num_heads + (size_t)h * group + g) * head_dim;
            for (int d = 0; d < head_dim; d++) store(out, base + d, acc[g * head_dim + d], q_bf16);
        }
        free(scores);
    }
    return err;
}

/* ------------------------------------------------------------------ RMSNorm */

/* For each of M rows of width n: if delta, x += delta (rounded to x's dtype, in place); then
 * out = weight * normalize(x), with normalize in float32 and, for bfloat16, rounded to bfloat16
 * before the weight multiply (the order transformers uses). x, delta, weight, out share one dtype. */
int baton_add_rms_norm(void *x, const void *delta, const void *weight, void *out, int M, int n, float eps,
                       int bf16, int threads) {
    if (n > 8192) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int r = 0; r < M; r++) {
        float row[8192];
        const size_t off = (size_t)r * n;
        if (bf16) {
            uint16_t *xr = (uint16_t *)x + off;
            const uint16_t *dr = delta ? (const uint16_t *)delta + off : NULL;
            for (int i = 0; i < n; i++) {
                if (dr) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(dr[i]));
                row[i] = bf16_to_f32(xr[i]);
            }
        } else {
            float *xr = (float *)x + off;
            const float *dr = delta ? (const float *)delta + off : NULL;
            for (int i = 0; i < n; i++) {
                if (dr) xr[i] += dr[i];
                row[i] = xr[i];
            }
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < n; i++) ss += row[i] * row[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        if (bf16) {
            const uint16_t *w = (const uint16_t *)weight;
            uint16_t *o = (uint16_t *)out + off;
            for (int i = 0; i < n; i++)
                o[i] = f32_to_bf16(bf16_to_f32(w[i]) * bf16_to_f32(f32_to_bf16(row[i] * inv)));
        } else {
            const float *w = (const float *)weight;
            float *o = (float *)out + off;
            for (int i = 0; i < n; i++) o[i] = row[i] * inv * w[i];
        }
    }
    return 0;
}

int baton_paged_decode(const void *q, int q_bf16, int batch, int num_heads, int head_dim,
                       const void *k_cache, const void *v_cache, int cache_bf16, int block_size, int num_kv_heads,
                       const int64_t *block_tables, int max_blocks, const int64_t *seq_lens, float scale,
                       int window, void *out, int threads) {
    return paged_decode(q, (size_t)num_heads * head_dim, q_bf16, batch, num_heads, head_dim, k_cache, v_cache,
                        cache_bf16, block_size, num_kv_heads, block_tables, max_blocks, seq_lens, scale, window, out,
                        threads);
}


/* A decode-only pass of one layer's attention, from the QKV projection to the attention output:
 * qkv [batch, (num_heads + 2 * num_kv_heads) * head_dim] (q heads, k heads, v heads) gets its q and k
 * heads rotated in place (rotate-half; cos and signed sin tables [positions, head_dim], with the
 * roundings of the torch path: x * cos, then + roll(x) * sin), k and v are written into the cache at
 * slots, and each row attends over its paged context (seq_lens include the new token).
 * out: [batch, num_heads * head_dim]. Activations, tables and out share one dtype (act_bf16). */
int baton_decode_attention(void *qkv, int act_bf16, int batch, int num_heads, int num_kv_heads, int head_dim,
                           const void *cos, const void *sin, const int64_t *positions, void *k_cache,
                           void *v_cache, int cache_bf16, int block_size, const int64_t *slots,
                           const int64_t *block_tables, int max_blocks, const int64_t *seq_lens, float scale,
                           int window, void *out, int threads) {
    if (head_dim > 256 || head_dim % 2) return -1;
    const int half = head_dim / 2, rotated = num_heads + num_kv_heads;
    const size_t stride = (size_t)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && batch >= 4)
    for (int b = 0; b < batch; b++) {
        const size_t tab = (size_t)positions[b] * head_dim;
#if BATON_AVX512
        if (head_dim % 32 == 0) { /* rotate-half moves whole 16-lane vectors: vector j takes j + V/2 */
            const int V = head_dim / 16;
            __m512 c[16], sn[16];
            for (int j = 0; j < V; j++) {
                c[j] = load16(cos, tab + 16 * j, act_bf16, 0xFFFF);
                sn[j] = load16(sin, tab + 16 * j, act_bf16, 0xFFFF);
            }
            for (int hh = 0; hh < rotated; hh++) {
                const size_t base = (size_t)b * stride + (size_t)hh * head_dim;
                __m512 x[16];
                for (int j = 0; j < V; j++) x[j] = load16(qkv, base + 16 * j, act_bf16, 0xFFFF);
                for (int j = 0; j < V; j++) {
                    __m512 a = _mm512_mul_ps(x[j], c[j]);
                    if (act_bf16) a = round16(a);
                    store16(qkv, base + 16 * j, _mm512_add_ps(a, _mm512_mul_ps(x[(j + V / 2) % V], sn[j])), act_bf16, 0xFFFF);
                }
            }
        } else
#endif
        for (int hh = 0; hh < rotated; hh++) {
            const size_t base = (size_t)b * stride + (size_t)hh * head_dim;
            float x[256];
            for (int d = 0; d < head_dim; d++) x[d] = load_elem(qkv, base + d, act_bf16);
            for (int d = 0; d < head_dim; d++) {
                const float a = round_act(x[d] * load_elem(cos, tab + d, act_bf16), act_bf16);
                const float r = x[(d + half) % head_dim] * load_elem(sin, tab + d, act_bf16);
                store(qkv, base + d, a + r, act_bf16);
            }
        }
        for (int hh = 0; hh < num_kv_heads; hh++) {
            const size_t src_k = (size_t)b * stride + (size_t)(num_heads + hh) * head_dim;
            const size_t src_v = src_k + (size_t)num_kv_heads * head_dim;
            const size_t dst = ((size_t)slots[b] * num_kv_heads + hh) * head_dim;
#if BATON_AVX512
            if (head_dim % 16 == 0) {
                for (int d = 0; d < head_dim; d += 16) {
                    store16(k_cache, dst + d, load16(qkv, src_k + d, act_bf16, 0xFFFF), cache_bf16, 0xFFFF);
                    store16(v_cache, dst + d, load16(qkv, src_v + d, act_bf16, 0xFFFF), cache_bf16, 0xFFFF);
                }
                continue;
            }
#endif
            for (int d = 0; d < head_dim; d++) {
                store(k_cache, dst + d, load_elem(qkv, src_k + d, act_bf16), cache_bf16);
                store(v_cache, dst + d, load_elem(qkv, src_v + d, act_bf16), cache_bf16);
            }
        }
    }
    return paged_decode(qkv, stride, act_bf16, batch, num_heads, head_dim, k_cache, v_cache, cache_bf16, block_size,
                        num_kv_heads, block_tables, max_blocks, seq_lens, scale, window, out, threads);
}

/* out[M, n] = silu(gu[:, :n]) * gu[:, n:], rounded as torch rounds each of the two ops. */

int baton_silu_mul(const void *gu, void *out, int M, int n, int bf16, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && (size_t)M * n >= 16384)
    for (int r = 0; r < M; r++) {
        const size_t src = (size_t)r * 2 * n, dst = (size_t)r * n;
#if BATON_AVX512
        for (int i = 0; i < n; i += 16) {
            const __mmask16 live = n - i >= 16 ? 0xFFFF : (__mmask16)((1u << (n - i)) - 1);
            const __m512 g = load16(gu, src + i, bf16, live), u = load16(gu, src + n + i, bf16, live);
            __m512 a = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
            if (bf16) a = round16(a);
            store16(out, dst + i, _mm512_mul_ps(a, u), bf16, live);
        }
#else
        for (int i = 0; i < n; i++) {
            const float g = load_elem(gu, src + i, bf16), u = load_elem(gu, src + n + i, bf16);
            store(out, dst + i, round_act(g / (1.0f + expf(-g)), bf16) * u, bf16);
        }
#endif
    }
    return 0;
}

/* ------------------------------------------------------------------ whole decode layers */

/* One linear layer of a plan: kind 0 = packed bfloat16 weight [n, k] (bias bfloat16), kind 1 = packed
 * q4_1 weight (bias float) for passes of up to `rows` rows, and for larger ones `dense`, the same
 * values as packed bfloat16 (bias dense_bias, bfloat16), or NULL; kind 2 = GGUF block types in tiles
 * (w, table; bias float), every pass. */
typedef struct {
    int kind, n, k;
    const void *w;
    const void *bias;
    int rows;
    const void *dense, *dense_bias;
    const int64_t *table; /* kind 2: the tile table of the GGUF block types' layout */
} baton_linear;

/* A projection's LoRA adapters, every model slot at once (baton/model/lora.py LoraSlots): shrink = the
 * stacked A [slots * width, in] packed bfloat16 (n = slots * width; width = parts * rank, each slot's rows
 * part by part), expand[p] = part p's stacked B^T [out_p, slots * rank] packed bfloat16, written to the
 * output's columns from col[p]; shrink.w NULL: no adapter targets this projection. */
#define LORA_PARTS 3
typedef struct {
    baton_linear shrink, expand[LORA_PARTS];
    int parts, col[LORA_PARTS];
} baton_lora;

typedef struct {
    const void *input_norm, *post_norm;
    baton_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
    baton_lora lora[4]; /* qkv, o, gate_up, down */
    int window;         /* sliding window in tokens, 0 for full attention */
} baton_layer;

static void widen(const void *src, float *dst, size_t n, int bf16) {
    if (!bf16) { for (size_t i = 0; i < n; i++) dst[i] = ((const float *)src)[i]; return; }
    for (size_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
}

static void narrow(const float *src, void *dst, size_t n, int bf16) {
    if (!bf16) { for (size_t i = 0; i < n; i++) ((float *)dst)[i] = src[i]; return; }
    for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
}

/* Buffer `slot` of the calling thread, kept between calls and grown on demand (bounded by the largest
 * pass the thread has run), freed when the thread ends: a decode pass's buffers are large enough that
 * malloc would map and unmap them on every call, a page fault per 4 KiB touched, every step. */
#define SCRATCH_SLOTS 16
typedef struct { void *buf[SCRATCH_SLOTS]; size_t cap[SCRATCH_SLOTS]; } scratch_set;

static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;

static void scratch_free(void *p) {
    scratch_set *set = p;
    for (int i = 0; i < SCRATCH_SLOTS; i++) free(set->buf[i]);
    free(set);
}

static void scratch_init(void) { pthread_key_create(&scratch_key, scratch_free); }

static void *scratch(int slot, size_t bytes) {
    pthread_once(&scratch_once, scratch_init);
    scratch_set *set = pthread_getspecific(scratch_key);
    if (!set) {
        if (!(set = calloc(1, sizeof *set))) return NULL;
        pthread_setspecific(scratch_key, set);
    }
    if (set->cap[slot] < bytes) {
        free(set->buf[slot]);
        set->buf[slot] = malloc(bytes);
        set->cap[slot] = set->buf[slot] ? bytes : 0;
    }
    return set->buf[slot];
}

/* out[M, n] = in[M, k] @ W^T (+ bias), activations in the model dtype, as Linear computes it. */
static int run_linear(const baton_linear *l, const void *in, void *out, int M, int act_bf16, float *xf, float *yf,
                      int threads) {
    if (l->kind == 0 || (M > l->rows && l->dense)) {
        if (!act_bf16) return -4;
        return gemm_bf16(in, M, l->k, l->kind == 0 ? l->w : l->dense, l->kind == 0 ? l->bias : l->dense_bias,
                         l->n, out, 0, threads);
    }
    if (M > l->rows) return -5;
    const float *x = in;
    if (act_bf16) { widen(in, xf, (size_t)M * l->k, 1); x = xf; }
    float *y = act_bf16 ? yf : out;
    const int rc = l->kind == 2 ? baton_gemm_gq(x, M, l->k, l->w, l->table, l->bias, l->n, y, threads)
                                : baton_gemm_q4_1(x, M, l->k, l->w, l->bias, l->n, y, threads);
    if (act_bf16) narrow(yf, out, (size_t)M * l->n, 1);
    return rc;
}

/* out[M, out_n] (bfloat16) += each row's LoRA delta of in[M, k]: z = in @ A^T over every slot; for each part
 * p, the row's own slot's rank values of that part (other slots zero; rows[t] = -1: the base model, all
 * zero), times part p's B, added to its columns. The same products and roundings as LoraSlots.add on its
 * packed path: z and each part's delta rounded to bfloat16, the sum rounded once. */
static int lora_add(const baton_lora *lo, const void *in, void *out, int out_n, int M, const int64_t *rows,
                    int num_slots, int threads) {
    if (!lo->shrink.w) return 0;
    const int zn = lo->shrink.n, width = zn / num_slots, rank = width / lo->parts, pn = num_slots * rank;
    uint16_t *z = scratch(12, sizeof(uint16_t) * M * zn), *zp = scratch(13, sizeof(uint16_t) * M * pn);
    uint16_t *e = scratch(11, sizeof(uint16_t) * M * out_n);
    if (!z || !zp || !e) return -3;
    int rc = gemm_bf16(in, M, lo->shrink.k, lo->shrink.w, NULL, zn, z, 0, threads);
    uint16_t *o = out;
    for (int p = 0; p < lo->parts && !rc; p++) {
        const baton_linear *b = &lo->expand[p];
        if (!b->w) continue; /* no adapter in a slot targets this part */
        memset(zp, 0, sizeof(uint16_t) * M * pn);
        for (int t = 0; t < M; t++) {
            const int64_t s = rows[t];
            if (s >= 0 && s < num_slots)
                memcpy(zp + (size_t)t * pn + s * rank, z + (size_t)t * zn + s * width + p * rank,
                       sizeof(uint16_t) * rank);
        }
        rc = gemm_bf16(zp, M, pn, b->w, NULL, b->n, e, 0, threads);
        for (int t = 0; t < M && !rc; t++) {
            uint16_t *row = o + (size_t)t * out_n + lo->col[p];
            const uint16_t *d = e + (size_t)t * b->n;
            for (int j = 0; j < b->n; j++) row[j] = f32_to_bf16(bf16_to_f32(row[j]) + bf16_to_f32(d[j]));
        }
    }
    return rc;
}

/* Every layer of a decode-only pass, in one call: the same kernels in the same
 * order as the model's Python loop (so the same results), without returning to Python between them.
 * x [M, hidden] is the residual stream (embeddings in, the last layer's output out). */
int baton_decode_layers(const baton_layer *layers, int num_layers, void *x, int act_bf16, int M, int hidden,
                        int num_heads, int num_kv_heads, int head_dim, int inter, float eps, const void *cos,
                        const void *sin, const int64_t *positions, int cache_bf16, int block_size,
                        const int64_t *slots, const int64_t *block_tables, int max_blocks, const int64_t *seq_lens,
                        float scale, const int64_t *lora_rows, int lora_slots, int threads) {
    const size_t es = act_bf16 ? 2 : 4;
    const int qkv_n = (num_heads + 2 * num_kv_heads) * head_dim, attn_n = num_heads * head_dim;
    int widest = hidden > 2 * inter ? hidden : 2 * inter;
    if (qkv_n > widest) widest = qkv_n;
    char *h = scratch(0, es * M * hidden), *qkv = scratch(1, es * M * qkv_n), *attn = scratch(2, es * M * attn_n);
    char *tmp = scratch(3, es * M * hidden), *gu = scratch(4, es * M * 2 * inter), *act = scratch(5, es * M * inter);
    float *xf = scratch(6, sizeof(float) * M * widest), *yf = scratch(7, sizeof(float) * M * widest);
    int rc = (h && qkv && attn && tmp && gu && act && xf && yf) ? 0 : -3;
    if (!rc) rc = baton_add_rms_norm(x, NULL, layers[0].input_norm, h, M, hidden, eps, act_bf16, threads);
    if (lora_rows && !act_bf16) rc = -4; /* LoRA rows: bfloat16 activations only */
    for (int i = 0; i < num_layers && !rc; i++) {
        const baton_layer *l = &layers[i];
        const baton_lora *lo = lora_rows ? l->lora : NULL;
        rc = run_linear(&l->qkv, h, qkv, M, act_bf16, xf, yf, threads);
        if (!rc && lo) rc = lora_add(&lo[0], h, qkv, qkv_n, M, lora_rows, lora_slots, threads);
        if (!rc) rc = baton_decode_attention(qkv, act_bf16, M, num_heads, num_kv_heads, head_dim, cos, sin, positions,
                                             l->k_cache, l->v_cache, cache_bf16, block_size, slots, block_tables,
                                             max_blocks, seq_lens, scale, l->window, attn, threads);
        if (!rc) rc = run_linear(&l->o, attn, tmp, M, act_bf16, xf, yf, threads);
        if (!rc && lo) rc = lora_add(&lo[1], attn, tmp, hidden, M, lora_rows, lora_slots, threads);
        if (!rc) rc = baton_add_rms_norm(x, tmp, l->post_norm, h, M, hidden, eps, act_bf16, threads);
        if (!rc) rc = run_linear(&l->gate_up, h, gu, M, act_bf16, xf, yf, threads);
        if (!rc && lo) rc = lora_add(&lo[2], h, gu, 2 * inter, M, lora_rows, lora_slots, threads);
        if (!rc) rc = baton_silu_mul(gu, act, M, inter, act_bf16, threads);
        if (!rc) rc = run_linear(&l->down, act, tmp, M, act_bf16, xf, yf, threads);
        if (!rc && lo) rc = lora_add(&lo[3], act, tmp, hidden, M, lora_rows, lora_slots, threads);
        if (rc) break;
        if (i + 1 < num_layers) {
            rc = baton_add_rms_norm(x, tmp, layers[i + 1].input_norm, h, M, hidden, eps, act_bf16, threads);
        } else {
            for (size_t j = 0; j < (size_t)M * hidden; j++)
                store(x, j, load_elem(x, j, act_bf16) + load_elem(tmp, j, act_bf16), act_bf16);
        }
    }
    return rc;
}

/* ------------------------------------------------------------------ prefill attention */

/* Causal attention of prompt chunks over their paged context in the shape of a matrix product
 * (flash attention on CPU): a task is one query tile (PF_TQ tokens x the GQA group's heads: every row
 * of it shares one KV head) of one chunk; it walks the chunk's context in tiles of 16 keys, computes
 * the tile's scores for 4 rows at a time (one vector of 16 scores per row), folds them into each
 * row's running max and sum (online softmax), and adds the tile's probabilities times its values to
 * the row's float32 accumulator. Only the tiles on the diagonal are masked. The decode kernel read
 * the context once per query row (a matrix-vector shape); here one read of a key tile serves every
 * row of the query tile from L1.
 *
 * The context of each (chunk, KV head) is first packed, once per call, into the tiles' layouts:
 *   bfloat16 (bfloat16 queries; vdpbf16ps, float32 sums): keys [tile][D/2][16 tokens] as pairs of
 *   dims (lane t holds dims 2j, 2j+1 of token t: one broadcast pair of the query times 16 tokens),
 *   values [tile][8][D] as pairs of tokens (lane d holds dim d of tokens 2u, 2u+1: a broadcast pair
 *   of probabilities, rounded to bfloat16 as torch's own CPU flash attention does, times 16 dims);
 *   float32 (float32 queries; fused multiply-adds): keys [tile][D][16], values [tile][16][D].
 * int8 caches are dequantized while packing (int8 x its token's scale, then rounded to the compute
 * type, as gather_kv does), so every cache type runs the same loops. Tokens past the context are
 * zeros (their scores are masked). */
#define PF_TQ 32  /* query tokens per task */

typedef struct { /* where one (chunk, KV head)'s context is read from */
    const void *k, *v;
    const float *ks, *vs; /* int8 scales, else NULL */
    int kind;             /* 0 float32, 1 bfloat16, 2 int8 */
    const int64_t *table;
    int64_t ctx;
    int block_size, num_kv_heads, h, D;
} pf_ctx;

static inline float cache_at(const void *c, int kind, size_t i) {
    return kind == 2 ? (float)((const int8_t *)c)[i] : load_elem(c, i, kind == 1);
}

#if BATON_AVX512
static void pack_context(const pf_ctx *c, int bf, void *kp, void *vp) {
    const int D = c->D;
    const int64_t tiles = (c->ctx + 63) / 64 * 4; /* whole blocks of 64 keys */
    const size_t tok_stride = (size_t)c->num_kv_heads * D;
#if defined(__AVX512BF16__)
    if (bf && c->kind == 1) { /* bfloat16 cache: pairs moved as 32-bit words, no conversion */
        uint32_t *K = kp, *V = vp;
        const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                            39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
        for (int64_t tile = 0; tile < tiles; tile++) {
            size_t row[16]; /* each token's first element for head h; SIZE_MAX past the context */
            for (int l = 0; l < 16; l++) {
                const int64_t t = tile * 16 + l;
                row[l] = t < c->ctx ? ((size_t)c->table[t / c->block_size] * c->block_size + t % c->block_size) *
                                              tok_stride + (size_t)c->h * D
                                    : SIZE_MAX;
            }
            /* keys: for each pair of dims, the 16 tokens' pairs gathered into one vector (8 + 8 lanes, 64-bit
             * offsets: a cache can pass 2^31 elements); tokens past the context read as zeros */
            int64_t at[16];
            unsigned live = 0;
            for (int l = 0; l < 16; l++) {
                at[l] = row[l] == SIZE_MAX ? 0 : (int64_t)(row[l] / 2);
                if (row[l] != SIZE_MAX) live |= 1u << l;
            }
            const __m512i lo8 = _mm512_loadu_si512(at), hi8 = _mm512_loadu_si512(at + 8);
            const __mmask8 klo = (__mmask8)(live & 0xFF), khi = (__mmask8)(live >> 8);
            const int *kb = (const int *)c->k;
            for (int j = 0; j < D / 2; j++) {
                const __m512i dj = _mm512_set1_epi64(j);
                const __m256i a = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), klo, _mm512_add_epi64(lo8, dj), kb, 4);
                const __m256i b = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), khi, _mm512_add_epi64(hi8, dj), kb, 4);
                _mm512_storeu_si512(K + ((size_t)tile * (D / 2) + j) * 16,
                                    _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
            }
            for (int u = 0; u < 8; u++) {
                const size_t a = row[2 * u], b = row[2 * u + 1];
                for (int j = 0; j < D / 32; j++) {
                    const uint16_t *vc = c->v;
                    const __m512i va = a == SIZE_MAX ? _mm512_setzero_si512() : _mm512_loadu_si512(vc + a + 32 * j);
                    const __m512i vb = b == SIZE_MAX ? _mm512_setzero_si512() : _mm512_loadu_si512(vc + b + 32 * j);
                    uint32_t *dst = V + ((size_t)tile * 8 + u) * D + 32 * j;
                    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(va, lo, vb));
                    _mm512_storeu_si512(dst + 16, _mm512_permutex2var_epi16(va, hi, vb));
                }
            }
        }
        return;
    }
#endif
    for (int64_t tile = 0; tile < tiles; tile++)
        for (int l = 0; l < 16; l++) {
            const int64_t t = tile * 16 + l;
            size_t first = 0;
            float sk = 1.0f, sv = 1.0f;
            if (t < c->ctx) {
                const size_t slot = (size_t)c->table[t / c->block_size] * c->block_size + t % c->block_size;
                first = slot * tok_stride + (size_t)c->h * D;
                if (c->kind == 2) { sk = c->ks[slot * c->num_kv_heads + c->h]; sv = c->vs[slot * c->num_kv_heads + c->h]; }
            }
            for (int d = 0; d < D; d++) {
                const float x = t < c->ctx ? cache_at(c->k, c->kind, first + d) * sk : 0.0f;
                const float y = t < c->ctx ? cache_at(c->v, c->kind, first + d) * sv : 0.0f;
                if (bf) {
                    ((uint16_t *)kp)[(((size_t)tile * (D / 2) + d / 2) * 16 + l) * 2 + (d & 1)] = f32_to_bf16(x);
                    ((uint16_t *)vp)[(((size_t)tile * 8 + l / 2) * D + d) * 2 + (l & 1)] = f32_to_bf16(y);
                } else {
                    ((float *)kp)[((size_t)tile * D + d) * 16 + l] = x;
                    ((float *)vp)[((size_t)tile * 16 + l) * D + d] = y;
                }
            }
        }
}

/* One query tile: rows r = token i x group + g (query head h * group + g at position pos0 + i), R of
 * them (a multiple of 4; padded rows repeat the last token and are not stored). q rows are in the
 * compute layout: bfloat16 pairs (unscaled: the scale multiplies the float32 sums) or float32 (scaled).
 * o [R][D], m and l [R] are the task's accumulators. Keys are read in blocks of 64 (4 tiles of 16):
 * 4 rows x 4 tiles of scores are 16 independent chains of multiply-adds in registers (4 were bound by
 * the instruction's latency), and each block's softmax update and accumulator rescale are paid once
 * per 64 keys. Keys 0 .. pos0 + ntok - 1 are read; the packed context is zero past its end (those
 * keys lie after every query's position, so they are masked). With a sliding window of W keys (W > 0),
 * a row at position p sees keys p - W + 1 .. p: blocks wholly before every row's window are skipped
 * and the window's first block is masked as the diagonal is. */
static inline __attribute__((always_inline)) void prefill_tile(
        const int D, const int BF, const int R, const int group, const int64_t pos0, const int ntok,
        const void *restrict qrows, const void *restrict kp, const void *restrict vp, const float scale,
        const int64_t W, float *restrict o, float *restrict m, float *restrict l) {
    for (int r = 0; r < R; r++) { m[r] = -INFINITY; l[r] = 0.0f; }
    memset(o, 0, sizeof(float) * (size_t)R * D);
    const int64_t last = pos0 + ntok - 1; /* the last query's position: keys past it are never read */
    const int C = D / 16;
    for (int64_t key0 = W > 0 && pos0 - W + 1 > 0 ? (pos0 - W + 1) / 64 * 64 : 0; key0 <= last; key0 += 64) {
        const int64_t kt = key0 / 16;
        for (int r0 = 0; r0 < R; r0 += 4) {
            int64_t pos[4], lo[4]; /* each row's position and first key */
            for (int i = 0; i < 4; i++) {
                pos[i] = pos0 + ((r0 + i) / group < ntok ? (r0 + i) / group : ntok - 1);
                lo[i] = W > 0 ? pos[i] - W + 1 : 0;
            }
            if (key0 > pos[3]) continue; /* the block lies after all four rows' positions */
            if (key0 + 63 < lo[0]) continue; /* or before all four rows' windows */
            __m512 s[4][4]; /* [row][tile of 16 keys] */
            for (int i = 0; i < 4; i++)
                for (int t = 0; t < 4; t++) s[i][t] = _mm512_setzero_ps();
            if (BF) {
#if defined(__AVX512BF16__)
                const uint32_t *K = (const uint32_t *)kp + (size_t)kt * (D / 2) * 16;
                const uint32_t *Q = (const uint32_t *)qrows + (size_t)r0 * (D / 2);
                for (int j = 0; j < D / 2; j++) {
                    __m512bh k[4];
                    for (int t = 0; t < 4; t++) k[t] = (__m512bh)_mm512_loadu_si512(K + ((size_t)t * (D / 2) + j) * 16);
                    for (int i = 0; i < 4; i++) {
                        const __m512bh qj = (__m512bh)_mm512_set1_epi32((int)Q[i * (D / 2) + j]);
                        for (int t = 0; t < 4; t++) s[i][t] = _mm512_dpbf16_ps(s[i][t], qj, k[t]);
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) s[i][t] = _mm512_mul_ps(s[i][t], _mm512_set1_ps(scale));
#endif
            } else {
                const float *K = (const float *)kp + (size_t)kt * D * 16;
                const float *Q = (const float *)qrows + (size_t)r0 * D;
                for (int d = 0; d < D; d++) {
                    __m512 k[4];
                    for (int t = 0; t < 4; t++) k[t] = _mm512_loadu_ps(K + ((size_t)t * D + d) * 16);
                    for (int i = 0; i < 4; i++) {
                        const __m512 qd = _mm512_set1_ps(Q[i * D + d]);
                        for (int t = 0; t < 4; t++) s[i][t] = _mm512_fmadd_ps(qd, k[t], s[i][t]);
                    }
                }
            }
            /* online softmax: each row's new max, the factor for what it has summed so far, p = e^(s - max) */
            float alpha[4];
            int live[4];
            for (int i = 0; i < 4; i++) {
                const int r = r0 + i;
                live[i] = key0 <= pos[i] && key0 + 63 >= lo[i];
                alpha[i] = 1.0f;
                if (!live[i]) continue;
                /* on the diagonal, keys after the row's own position are masked; on the window's edge, keys
                 * before its first */
                if (key0 + 63 > pos[i] || key0 < lo[i])
                    for (int t = 0; t < 4; t++) {
                        const int64_t n = pos[i] - key0 - 16 * t + 1; /* keys of tile t up to the row */
                        const int64_t before = lo[i] - key0 - 16 * t; /* keys of tile t before its window */
                        __mmask16 keep = n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                        if (before > 0) keep &= before >= 16 ? 0 : (__mmask16)(0xFFFFu << before);
                        if (keep != 0xFFFF) s[i][t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), keep, s[i][t]);
                    }
                const float mt = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[i][0], s[i][1]),
                                                                    _mm512_max_ps(s[i][2], s[i][3])));
                const float mn = mt > m[r] ? mt : m[r];
                alpha[i] = m[r] == -INFINITY ? 0.0f : expf(m[r] - mn);
                m[r] = mn;
                __m512 sum = _mm512_setzero_ps();
                for (int t = 0; t < 4; t++) {
                    s[i][t] = exp_ps(_mm512_sub_ps(s[i][t], _mm512_set1_ps(mn)));
                    sum = _mm512_add_ps(sum, s[i][t]);
                }
                l[r] = l[r] * alpha[i] + _mm512_reduce_add_ps(sum);
            }
            /* o = o * alpha + p x values, 4 rows at a time: each value load serves 4 rows */
#if defined(__AVX512BF16__)
            uint32_t pb[4][32]; /* p as bfloat16 pairs of keys */
            if (BF)
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++)
                        _mm256_storeu_si256((__m256i *)(pb[i] + 8 * t), (__m256i)_mm512_cvtneps_pbh(s[i][t]));
#endif
            float pf[4][64];
            if (!BF)
                for (int i = 0; i < 4; i++)
                    for (int t = 0; t < 4; t++) _mm512_storeu_ps(pf[i] + 16 * t, s[i][t]);
            for (int c0 = 0; c0 < C; c0 += 4) {
                const int cn = C - c0 < 4 ? C - c0 : 4;
                __m512 acc[4][4];
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < cn; c++)
                        acc[i][c] = _mm512_mul_ps(_mm512_loadu_ps(o + (size_t)(r0 + i) * D + 16 * (c0 + c)),
                                                  _mm512_set1_ps(alpha[i]));
                if (BF) {
#if defined(__AVX512BF16__)
                    const uint32_t *V = (const uint32_t *)vp + (size_t)kt * 8 * D;
                    const int pairs = key0 + 64 > last + 1 ? (int)((last + 1 - key0 + 1) / 2) : 32;
                    for (int u = 0; u < pairs; u++) {
                        __m512bh w[4];
                        for (int i = 0; i < 4; i++) w[i] = (__m512bh)_mm512_set1_epi32(live[i] ? (int)pb[i][u] : 0);
                        for (int c = 0; c < cn; c++) {
                            const __m512bh v = (__m512bh)_mm512_loadu_si512(V + (size_t)u * D + 16 * (c0 + c));
                            for (int i = 0; i < 4; i++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], w[i], v);
                        }
                    }
#endif
                } else {
                    const float *V = (const float *)vp + (size_t)kt * 16 * D;
                    const int keys = key0 + 64 > last + 1 ? (int)(last + 1 - key0) : 64;
                    for (int t = 0; t < keys; t++) {
                        __m512 w[4];
                        for (int i = 0; i < 4; i++) w[i] = _mm512_set1_ps(live[i] ? pf[i][t] : 0.0f);
                        for (int c = 0; c < cn; c++) {
                            const __m512 v = _mm512_loadu_ps(V + (size_t)t * D + 16 * (c0 + c));
                            for (int i = 0; i < 4; i++) acc[i][c] = _mm512_fmadd_ps(w[i], v, acc[i][c]);
                        }
                    }
                }
                for (int i = 0; i < 4; i++)
                    for (int c = 0; c < cn; c++)
                        _mm512_storeu_ps(o + (size_t)(r0 + i) * D + 16 * (c0 + c), acc[i][c]);
            }
        }
    }
}

#if BATON_AMX
/* 2^x to about 3e-6 relative (x = n + f, |f| <= 1/2, 2^f by a degree-4 fit, times 2^n): the probabilities
 * it makes are rounded to bfloat16 (2^-9) before the value products. 0 for x below -150, so the
 * masked scores (-FLT_MAX) give exactly 0; no clamp needed, as the argument is never above 0. Fewer
 * instructions than exp_ps: the softmax, not the tile unit, is what bounds the AMX prefill. */
static inline __m512 exp2_ps(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(9.5605105162e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5917039514e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024981260e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312196970e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999916553e-1f));
    return _mm512_scalef_ps(p, n);
}

/* The AMX softmax keeps each row's reference max until a score passes it by this many powers of 2 (as
 * FlashAttention-4 does): most blocks then skip the max's reduction and the accumulator's rescale, and
 * the probabilities stay at most 2^8, far inside float32 and bfloat16. */
#define PF_SLACK 8.0f

/* prefill_tile on the tile unit, 16 rows at a time (R a multiple of 16). Tiles 0-3 hold a block's
 * 16 x 64 scores, then 16 x 64 of its probabilities times values; tile 4 the A operand (16 rows of 32
 * query dims, then of 32 probabilities); tiles 5-7 B operands. The online softmax and the
 * accumulator's rescale stay in AVX-512 on the stored tiles (sb, pb, vb: the task's 16 x 64 scores,
 * their bfloat16 probabilities, and the 16 x D products). */
static void prefill_tile_amx(const int D, const int R, const int group, const int64_t pos0, const int ntok,
                             const uint16_t *restrict qrows, const uint32_t *restrict kp,
                             const uint32_t *restrict vp, const float scale, const int64_t W, float *restrict o,
                             float *restrict m, float *restrict l, float *restrict sb, uint16_t *restrict pb,
                             float *restrict vb) {
    memset(o, 0, sizeof(float) * (size_t)R * D);
    const float c = scale * 1.44269504088896341f; /* scores in log2 units: p = 2^(s c - m) */
    const __m512 vc = _mm512_set1_ps(c);
    for (int r0 = 0; r0 < R; r0 += 16) {
        int64_t pos[16], lo[16]; /* each row's position and first key */
        __m512 lsum[16];         /* each row's running sum, 16 partial sums (added up once, at the end) */
        for (int i = 0; i < 16; i++) {
            pos[i] = pos0 + ((r0 + i) / group < ntok ? (r0 + i) / group : ntok - 1);
            lo[i] = W > 0 ? pos[i] - W + 1 : 0;
            m[r0 + i] = -INFINITY;
            lsum[i] = _mm512_setzero_ps();
        }
        const uint16_t *Q = qrows + (size_t)r0 * D;
        for (int64_t key0 = lo[0] > 0 ? lo[0] / 64 * 64 : 0; key0 <= pos[15]; key0 += 64) {
            const int64_t kt = key0 / 16;
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int c = 0; c < D / 32; c++) { /* scores: Q[16][D] x K[64 keys][D]^T, 32 dims a step */
                const uint32_t *K = kp + ((size_t)kt * (D / 2) + 16 * c) * 16;
                _tile_loadd(4, Q + 32 * c, 2 * D);
                _tile_loadd(5, K, 64);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(6, K + (size_t)(D / 2) * 16, 64);
                _tile_dpbf16ps(1, 4, 6);
                _tile_loadd(7, K + (size_t)2 * (D / 2) * 16, 64);
                _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, K + (size_t)3 * (D / 2) * 16, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, sb, 256);
            _tile_stored(1, sb + 16, 256);
            _tile_stored(2, sb + 32, 256);
            _tile_stored(3, sb + 48, 256);
            float alpha[16];
            int rescale = 0; /* whether any row's reference moved */
            for (int i = 0; i < 16; i++) { /* online softmax, row by row */
                const int r = r0 + i;
                alpha[i] = 1.0f;
                uint16_t *p = pb + 64 * i;
                if (key0 > pos[i] || key0 + 63 < lo[i]) { memset(p, 0, 128); continue; }
                __m512 s[4];
                for (int t = 0; t < 4; t++) s[t] = _mm512_loadu_ps(sb + 64 * i + 16 * t);
                if (key0 + 63 > pos[i] || key0 < lo[i])
                    for (int t = 0; t < 4; t++) {
                        const int64_t n = pos[i] - key0 - 16 * t + 1, before = lo[i] - key0 - 16 * t;
                        __mmask16 keep = n >= 16 ? 0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1);
                        if (before > 0) keep &= before >= 16 ? 0 : (__mmask16)(0xFFFFu << before);
                        if (keep != 0xFFFF) s[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), keep, s[t]);
                    }
                /* the row's reference moves only when a score passes it by PF_SLACK (then to the block's max) */
                const __m512 top = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
                if (_mm512_cmp_ps_mask(top, _mm512_set1_ps((m[r] + PF_SLACK) / c), _CMP_GT_OQ)) {
                    const float mt = c * _mm512_reduce_max_ps(top);
                    alpha[i] = m[r] == -INFINITY ? 0.0f : exp2f(m[r] - mt);
                    m[r] = mt;
                    rescale = 1;
                }
                const __m512 mn = _mm512_set1_ps(m[r]);
                __m512 sum = _mm512_setzero_ps();
                for (int t = 0; t < 4; t++) {
                    s[t] = exp2_ps(_mm512_fmsub_ps(s[t], vc, mn));
                    sum = _mm512_add_ps(sum, s[t]);
                }
                _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(s[1], s[0]));
                _mm512_storeu_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(s[3], s[2]));
                lsum[i] = alpha[i] == 1.0f ? _mm512_add_ps(lsum[i], sum) : _mm512_fmadd_ps(lsum[i], _mm512_set1_ps(alpha[i]), sum);
            }
            /* probabilities x values: P[16][64 keys] x V[64 keys][D], 32 keys a step, 4 tiles of 16 dims at a
             * time; then o = o * alpha + that */
            const uint32_t *V = vp + (size_t)kt * 8 * D;
            for (int c0 = 0; c0 < D / 16; c0 += 4) {
                const int cn = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int h = 0; h < 2; h++) {
                    const uint32_t *Vh = V + (size_t)h * 16 * D + 16 * c0;
                    _tile_loadd(4, pb + 32 * h, 128);
                    _tile_loadd(5, Vh, 4 * D);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_loadd(6, Vh + 16, 4 * D);
                    _tile_dpbf16ps(1, 4, 6);
                    if (cn > 2) {
                        _tile_loadd(7, Vh + 32, 4 * D);
                        _tile_dpbf16ps(2, 4, 7);
                        _tile_loadd(5, Vh + 48, 4 * D);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, vb + 16 * c0, 4 * D);
                _tile_stored(1, vb + 16 * c0 + 16, 4 * D);
                if (cn > 2) {
                    _tile_stored(2, vb + 16 * c0 + 32, 4 * D);
                    _tile_stored(3, vb + 16 * c0 + 48, 4 * D);
                }
            }
            for (int i = 0; i < 16; i++) {
                float *oi = o + (size_t)(r0 + i) * D;
                const float *pv = vb + (size_t)i * D;
                if (rescale && alpha[i] != 1.0f) {
                    const __m512 a = _mm512_set1_ps(alpha[i]);
                    for (int d = 0; d < D; d += 16)
                        _mm512_storeu_ps(oi + d, _mm512_fmadd_ps(_mm512_loadu_ps(oi + d), a, _mm512_loadu_ps(pv + d)));
                } else {
                    for (int d = 0; d < D; d += 16)
                        _mm512_storeu_ps(oi + d, _mm512_add_ps(_mm512_loadu_ps(oi + d), _mm512_loadu_ps(pv + d)));
                }
            }
        }
        for (int i = 0; i < 16; i++) l[r0 + i] = _mm512_reduce_add_ps(lsum[i]);
    }
}
#endif /* AMX */
#endif /* BATON_AVX512 */

/* Returns 1 when baton_prefill_attention runs here for this head size and query type (AVX-512; bfloat16
 * queries also need AVX512-BF16), else 0 (the caller uses the decode kernel row by row). */
int baton_has_prefill_attention(int head_dim, int q_bf16) {
#if BATON_AVX512
    if (head_dim % 32 || head_dim > 256) return 0;
#if !defined(__AVX512BF16__)
    if (q_bf16) return 0;
#endif
    (void)q_bf16;
    return 1;
#else
    (void)head_dim; (void)q_bf16;
    return 0;
#endif
}

/* q, out: [num_rows, num_heads, head_dim] (float32 or bfloat16: q_bf16); chunk s is rows
 * starts[s] .. starts[s] + lens[s] - 1, the last lens[s] positions of a sequence whose ctxs[s] tokens
 * (the chunk's own K/V already written) sit in the blocks of block_tables[s] ([num_chunks, max_blocks]).
 * Caches [num_blocks, block_size, num_kv_heads, head_dim] of kind 0 float32, 1 bfloat16, 2 int8 (with
 * scales [num_blocks, block_size, num_kv_heads]). Only the chunks' rows of out are written. */
int baton_prefill_attention(const void *q, int q_bf16, int num_heads, int head_dim, const void *k_cache,
                            const void *v_cache, int kind, const float *k_scale, const float *v_scale, int block_size,
                            int num_kv_heads, int num_chunks, const int64_t *starts, const int64_t *lens,
                            const int64_t *ctxs, const int64_t *block_tables, int max_blocks, float scale, int window,
                            void *out, int threads) {
#if BATON_AVX512
    const int D = head_dim;
    if (!baton_has_prefill_attention(D, q_bf16) || num_heads % num_kv_heads || num_heads / num_kv_heads > 16)
        return -1;
    if (kind < 0 || kind > 2 || (kind == 2 && (!k_scale || !v_scale)) || window < 0) return -1;
    const int group = num_heads / num_kv_heads, bf = q_bf16;
    const size_t esz = bf ? 2 : 4;
    if (threads < 1) threads = 1;
    /* packed contexts: one per (chunk, KV head), each (ctx rounded up to 16) x D x esz for keys and values */
    size_t *off = malloc(sizeof(size_t) * ((size_t)num_chunks * num_kv_heads + 1));
    if (!off) return -3;
    size_t total = 0;
    int ntasks = 0;
    for (int s = 0; s < num_chunks; s++) {
        if (lens[s] < 1 || lens[s] > ctxs[s] || ctxs[s] > (int64_t)max_blocks * block_size) { free(off); return -2; }
        for (int h = 0; h < num_kv_heads; h++) {
            off[s * num_kv_heads + h] = total;
            total += (size_t)((ctxs[s] + 63) / 64) * 64 * D * esz;
        }
        ntasks += (int)((lens[s] + PF_TQ - 1) / PF_TQ) * num_kv_heads;
    }
    char *kp = scratch(8, total), *vp = scratch(9, total);
    if (!kp || !vp) { free(off); return -3; }
    int err = 0;
    const int use_amx = bf && baton_amx();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_chunks * num_kv_heads; task++) {
            const int s = task / num_kv_heads, h = task % num_kv_heads;
            const pf_ctx c = {k_cache, v_cache, k_scale, v_scale, kind, block_tables + (size_t)s * max_blocks,
                              ctxs[s], block_size, num_kv_heads, h, D};
            pack_context(&c, bf, kp + off[task], vp + off[task]);
        }
        const int amx = use_amx, rq = amx ? 16 : 4; /* rows a tile step takes */
        const int rmax = (PF_TQ * group + rq - 1) / rq * rq;
        char *buf = scratch(10, (size_t)rmax * D * (4 + esz) + sizeof(float) * 2 * rmax +
                                    (amx ? 16 * 64 * (4 + 2) + 16 * (size_t)D * 4 : 0));
        float *o = (float *)buf, *m = o + (size_t)rmax * D, *l = m + rmax;
        void *qr = l + rmax;
#if BATON_AMX
        float *sb = (float *)((char *)qr + (size_t)rmax * D * esz), *vb = sb + 16 * 64;
        uint16_t *pb = (uint16_t *)(vb + 16 * (size_t)D);
        if (amx) amx_load_config();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int task = ntasks - 1; task >= 0; task--) { /* the longest tiles (last in the chunk) first */
            if (!buf) { err = -3; continue; }
            int s = 0, t = task;
            while (t >= (int)((lens[s] + PF_TQ - 1) / PF_TQ) * num_kv_heads) {
                t -= (int)((lens[s] + PF_TQ - 1) / PF_TQ) * num_kv_heads;
                s++;
            }
            const int h = t % num_kv_heads, qt = t / num_kv_heads;
            const int64_t first_tok = (int64_t)qt * PF_TQ;
            const int ntok = lens[s] - first_tok < PF_TQ ? (int)(lens[s] - first_tok) : PF_TQ;
            const int64_t pos0 = ctxs[s] - lens[s] + first_tok;
            const int R = (ntok * group + rq - 1) / rq * rq;
            for (int r = 0; r < R; r++) { /* query rows in the compute layout */
                const int i = r / group < ntok ? r / group : ntok - 1, g = r < ntok * group ? r % group : group - 1;
                const size_t base = ((size_t)(starts[s] + first_tok + i) * num_heads + (size_t)h * group + g) * D;
                if (bf)
                    memcpy((uint16_t *)qr + (size_t)r * D, (const uint16_t *)q + base, 2 * (size_t)D);
                else
                    for (int d = 0; d < D; d++) ((float *)qr)[(size_t)r * D + d] = load_elem(q, base + d, 0) * scale;
            }
            const char *kt = kp + off[s * num_kv_heads + h], *vt = vp + off[s * num_kv_heads + h];
#if BATON_AMX
            if (amx && D == 64) prefill_tile_amx(64, R, group, pos0, ntok, qr, (const uint32_t *)kt, (const uint32_t *)vt, scale, window, o, m, l, sb, pb, vb);
            else if (amx) prefill_tile_amx(D, R, group, pos0, ntok, qr, (const uint32_t *)kt, (const uint32_t *)vt, scale, window, o, m, l, sb, pb, vb);
            else
#endif
            if (D == 64 && bf) prefill_tile(64, 1, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            else if (D == 64) prefill_tile(64, 0, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            else if (D == 128 && bf) prefill_tile(128, 1, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            else if (D == 128) prefill_tile(128, 0, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            else if (bf) prefill_tile(D, 1, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            else prefill_tile(D, 0, R, group, pos0, ntok, qr, kt, vt, scale, window, o, m, l);
            for (int r = 0; r < ntok * group; r++) {
                const int i = r / group, g = r % group;
                const size_t base = ((size_t)(starts[s] + first_tok + i) * num_heads + (size_t)h * group + g) * D;
                const float inv = 1.0f / l[r];
                for (int d = 0; d < D; d++) store(out, base + d, o[(size_t)r * D + d] * inv, bf);
            }
        }
#if BATON_AMX
        if (amx) _tile_release();
#endif
    }
    free(off);
    return err;
#else
    (void)q; (void)q_bf16; (void)num_heads; (void)head_dim; (void)k_cache; (void)v_cache; (void)kind; (void)k_scale;
    (void)v_scale; (void)block_size; (void)num_kv_heads; (void)num_chunks; (void)starts; (void)lens; (void)ctxs;
    (void)block_tables; (void)max_blocks; (void)scale; (void)window; (void)out; (void)threads;
    return -1;
#endif
}
