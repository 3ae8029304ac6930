/* Matrix products on GGUF quantized weight blocks times int8 activation blocks, for a CPU with AVX2. Built at first
 * use by kernels/kquant.py (gcc -O3 -march=native -fopenmp) and called through ctypes.
 *
 * Weights are kept as llama.cpp quantized them, unpacked only where that makes the inner loop simpler:
 *   Q4_K, per output row and super-block of 256 inputs: float d, dmin; 8 sub-blocks of 32 with 6-bit scale sc[j]
 *     and min mn[j] (one byte each here); 128 bytes of nibbles in ggml's order (byte i of chunk c holds input
 *     64c + i in its low nibble and 64c + 32 + i in its high one). w = d * sc[j] * q - dmin * mn[j].
 *   Q6_K, per output row and super-block: float d; 16 sub-blocks of 16 with int8 scale sc[k]; 256 values q in
 *     0..63, their low 4 bits (ql) and high 2 bits (qh) packed as ggml packs them. w = d * sc[k] * (q - 32).
 *   Q5_0 and Q8_0 (blocks of 32 inputs, for maps whose input width is not a multiple of 256): see "32-input blocks".
 * Activations, per row and super-block: float da; int8 a (round(x / da), da = max|x| / 127); the sums of a over
 * each 16 inputs (bsum16) and each 32 (bsum32).
 *
 * Row invariance: out[m][n] is computed by the same operations in the same order whatever the number of rows M
 * (rows never share accumulators; the integer sums are exact; the float sums run over super-blocks in order, then
 * one fixed horizontal sum), and threads split the output columns n only. So a k-row verify forward gives each
 * row bitwise the logits a 1-row decode gives it.
 */
#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QK 256
/* How far ahead of the super-block being read the kernels ask for its weight values (PREFETCH_AHEAD bytes of the
 * values stream; one column's values follow the previous column's, so this runs into the next columns): the
 * hardware prefetcher alone kept a 1-row decode at ~15 GB/s of weights on a 2-core Zen 3 that sums 23 GB/s. A
 * prefetch never faults, so running past a part's end is harmless. */
#define PREFETCH_AHEAD 4096
/* Output columns and rows per tile (tile()). */
#define TILE_N 16
#define TILE_M 16
/* AVX512-VNNI: 64 weight bytes times 64 activation bytes per maddubs + dpwssd; else AVX2's maddubs + madd on 32. The results are
 * the same integers either way (exact sums); a machine always runs one build. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(KQ_FORCE_AVX2)
#define KQ_AVX512 1
#else
#define KQ_AVX512 0
#endif

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#if KQ_AVX512
/* One super-block's integer sum for one row: 4 x 64 weight bytes w times the row's 256 activation bytes am; maddubs
 * adds pairs of products into int16 lanes and dpwssd adds pairs of those, each times its sub-block's scale (s),
 * into 16 int32 lanes. */
static inline __m512i block_dot(const __m512i w[4], const __m512i s[4], const int8_t *am) {
    __m512i sum = _mm512_setzero_si512();
    for (int c = 0; c < 4; c++)
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(w[c], _mm512_loadu_si512((const void *)(am + 64 * c))),
                                  s[c]);
    return sum;
}
#else
/* The same with AVX2: 8 x 32 weight bytes, madd for the scaled pairs, 8 int32 lanes. */
static inline __m256i block_dot(const __m256i w[8], const __m256i s[8], const int8_t *am) {
    __m256i sum = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i p = _mm256_maddubs_epi16(w[j], _mm256_loadu_si256((const __m256i *)(am + 32 * j)));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s[j]));
    }
    return sum;
}
#endif

/* The int8 block of n floats x (n a multiple of 32) as llama.cpp rounds it: returns da = max|x| / 127 and writes
 * a = round(x / da) (to nearest, even), in order. */
static inline float quantize_block(const float *x, int n, int8_t *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 vmax = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    /* pack 4 x 8 int32 into 32 int8 in order (packs work per 128-bit lane) */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int i = 0; i < n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), inv),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(a + i), _mm256_permutevar8x32_epi32(packed, order));
    }
    return d;
}

/* x [M, K] float32 -> a [M, K] int8, da [M, K/256], bsum16 [M, K/16], bsum32 [M, K/32] (int16). */
static void quantize_rows_q8k(const float *x, int64_t M, int64_t K, int8_t *a, float *da, int16_t *bsum16,
                              int16_t *bsum32) {
    const int64_t nb = K / QK;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = 0; b < nb; b++) {
            int8_t *as = a + m * K + b * QK;
            da[m * nb + b] = quantize_block(x + m * K + b * QK, QK, as);
            for (int k = 0; k < QK / 16; k++) {
                int s = 0;
                for (int i = 0; i < 16; i++) s += as[16 * k + i];
                bsum16[m * (K / 16) + b * 16 + k] = (int16_t)s;
            }
            for (int j = 0; j < QK / 32; j++)
                bsum32[m * (K / 32) + b * 8 + j] = (int16_t)(bsum16[m * (K / 16) + b * 16 + 2 * j] +
                                                             bsum16[m * (K / 16) + b * 16 + 2 * j + 1]);
        }
    }
}

/* --- one output column at a time ---------------------------------------------------------------------------------
 * Each kernel below computes R rows (up to TILE_M) of one output column n. For a decode or a short verify (R <= 4)
 * R is a constant where they are called (tile()), so each row's accumulators stay in registers; more rows share
 * each unpacked weight block with accumulators in L1. A row's operations never depend on R or on the other rows,
 * so where its accumulators live does not change its result. */

/* One part of a map (kernels/kquant.py KQuantLinear: consecutive row blocks, each of one kind): its output rows,
 * its first column in the output, the weight fields its kind uses, its bias slice (or NULL); and the activations'
 * blocks. */
typedef struct {
    int64_t kind, rows, column;  /* KIND_*, output rows of the part, its first column in `out` */
    const uint8_t *values, *high, *scales, *mins;
    const float *d, *dmin, *bias;
} Part;
typedef struct {
    const int8_t *a;
    const float *da;
    const int16_t *sums;  /* Q4_K: sums per 32 inputs, Q6_K: per 16; 32-blocks: none */
} Activations;

enum { KIND_Q4K, KIND_Q6K, KIND_Q5_0, KIND_Q8_0 };
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Q4_K: values [N, K/2] nibbles, scales and mins [N, K/32] uint8, d and dmin [N, K/256]. */
ALWAYS_INLINE void column_q4k(const int R, const Part *W, int64_t n, int64_t K, const Activations *A, int64_t m0,
                              float sums[TILE_M]) {
    const int64_t nb = K / QK;
#if KQ_AVX512
    __m512 facc[TILE_M];  /* one float lane per int32 lane of the products: no narrowing per super-block */
#else
    __m256 facc[TILE_M];
#endif
    __m128 macc[TILE_M];
    for (int r = 0; r < R; r++) {
#if KQ_AVX512
        facc[r] = _mm512_setzero_ps();
#else
        facc[r] = _mm256_setzero_ps();
#endif
        macc[r] = _mm_setzero_ps();
    }
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *q = W->values + n * (K / 2) + b * (QK / 2);
        const uint8_t *scb = W->scales + n * (K / 32) + b * 8;
        _mm_prefetch((const char *)(q + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(q + PREFETCH_AHEAD + 64), _MM_HINT_T0);
#if KQ_AVX512
        /* 512 bits = one 32-byte chunk: its low nibbles (sub-block 2c) then its high ones (2c + 1); maddubs sums
         * pairs of products into int16 lanes (0-15 in sub-block 2c, 16-31 in 2c + 1) and dpwssd adds each pair of
         * lanes times its sub-block's scale into an int32 lane. */
        __m512i w[4], s[4];
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            w[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(bytes, low4)),
                                      _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4), 1);
            s[c] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(scb[2 * c])),
                                      _mm256_set1_epi16(scb[2 * c + 1]), 1);
        }
#else
        __m256i w[8], s[8];
        for (int c = 0; c < 4; c++) {
            const __m256i bytes = _mm256_loadu_si256((const __m256i *)(q + 32 * c));
            w[2 * c] = _mm256_and_si256(bytes, low4);
            w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
            s[2 * c] = _mm256_set1_epi16(scb[2 * c]);
            s[2 * c + 1] = _mm256_set1_epi16(scb[2 * c + 1]);
        }
#endif
        const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(W->mins + n * (K / 32) + b * 8)));
        const float wd = W->d[n * nb + b], wdmin = W->dmin[n * nb + b];
        for (int r = 0; r < R; r++) {
            const int64_t m = m0 + r;
            const int8_t *am = A->a + m * K + b * QK;
#if KQ_AVX512
            facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot(w, s, am)), _mm512_set1_ps(wd * A->da[m * nb + b]),
                                      facc[r]);
#else
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot(w, s, am)), _mm256_set1_ps(wd * A->da[m * nb + b]),
                                      facc[r]);
#endif
            const __m128i bs = _mm_loadu_si128((const __m128i *)(A->sums + m * (K / 32) + b * 8));
            macc[r] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bs)), _mm_set1_ps(wdmin * A->da[m * nb + b]),
                                   macc[r]);
        }
    }
    for (int r = 0; r < R; r++)
#if KQ_AVX512
        sums[r] = hsum8(_mm256_add_ps(_mm512_castps512_ps256(facc[r]), _mm512_extractf32x8_ps(facc[r], 1))) -
                  hsum4(macc[r]);
#else
        sums[r] = hsum8(facc[r]) - hsum4(macc[r]);
#endif
}

/* The 256 values 0..63 of one Q6_K super-block, in input order, as 8 x 32 bytes: ql holds their low 4 bits (128
 * bytes), qh their high 2 (64 bytes), in ggml's interleaving (per half of 128: ql byte l holds values l and l + 64
 * in its low and high nibble, ql byte l + 32 values l + 32 and l + 96; qh byte l their high bits, 2 each). */
static inline void unpack_q6k(const uint8_t *ql, const uint8_t *qh, __m256i v[8]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), high2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
        v[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), high2));
        v[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), high2));
        v[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(hb, high2));
        v[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                       _mm256_and_si256(_mm256_srli_epi16(hb, 2), high2));
    }
}

/* Q6_K: values [N, K/2] (low 4 bits), high [N, K/4] (high 2), scales [N, K/16] int8, d [N, K/256]. */
ALWAYS_INLINE void column_q6k(const int R, const Part *W, int64_t n, int64_t K, const Activations *A, int64_t m0,
                              float sums[TILE_M]) {
    const int64_t nb = K / QK;
    __m256 facc[TILE_M];
    for (int r = 0; r < R; r++) facc[r] = _mm256_setzero_ps();
#if KQ_AVX512
    /* Within a 128-bit lane, bytes 0-7 take scale 0 and bytes 8-15 scale 1 of a pair of sub-blocks. */
    const __m128i spread_lo = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m128i spread_hi = _mm_setr_epi8(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
#else
    /* Within a 128-bit lane, bytes 0-7 take scale 0 and bytes 8-15 scale 1 of a pair of sub-blocks. */
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                          2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
#endif
    for (int64_t b = 0; b < nb; b++) {
        const int8_t *scb = (const int8_t *)W->scales + n * (K / 16) + b * 16;
        __m256i v[8];
        const uint8_t *ql = W->values + n * (K / 2) + b * (QK / 2), *qh = W->high + n * (K / 4) + b * (QK / 4);
        _mm_prefetch((const char *)(ql + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(ql + PREFETCH_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(qh + PREFETCH_AHEAD / 2), _MM_HINT_T0);
        unpack_q6k(ql, qh, v);
#if KQ_AVX512
        /* 64 values = 4 sub-blocks of 16; maddubs gives 8 int16 lanes per sub-block, each pair times its scale into
         * an int32 lane (dpwssd). */
        __m512i w[4], s[4];
        for (int c = 0; c < 4; c++) {
            w[c] = _mm512_inserti64x4(_mm512_castsi256_si512(v[2 * c]), v[2 * c + 1], 1);
            int32_t four;
            memcpy(&four, scb + 4 * c, 4);
            const __m128i scales4 = _mm_cvtsi32_si128(four);
            s[c] = _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_shuffle_epi8(scales4, spread_hi),
                                                         _mm_shuffle_epi8(scales4, spread_lo)));
        }
#else
        __m256i w[8], s[8];
        for (int c = 0; c < 8; c++) {
            /* 32 values = 2 sub-blocks of 16; maddubs pairs them into 16 int16 lanes, 8 per sub-block. */
            w[c] = v[c];
            int32_t four = 0;
            memcpy(&four, scb + 2 * c, 2);
            const __m128i two = _mm_shuffle_epi8(_mm_cvtsi32_si128(four), _mm256_castsi256_si128(pick));
            s[c] = _mm256_cvtepi8_epi16(two);
        }
#endif
        const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)scb));
        const float wd = W->d[n * nb + b];
        for (int r = 0; r < R; r++) {
            const int64_t m = m0 + r;
            const int8_t *am = A->a + m * K + b * QK;
#if KQ_AVX512
            const __m512i isum512 = block_dot(w, s, am);
            __m256i isum = _mm256_add_epi32(_mm512_castsi512_si256(isum512), _mm512_extracti64x4_epi64(isum512, 1));
#else
            __m256i isum = block_dot(w, s, am);
#endif
            /* minus 32 * sum_k sc[k] * bsum16[k]: the offset of q */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(A->sums + m * (K / 16) + b * 16));
            isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_madd_epi16(scales16, bs), 5));
            facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(wd * A->da[m * nb + b]), facc[r]);
        }
    }
    for (int r = 0; r < R; r++) sums[r] = hsum8(facc[r]);
}

/* --- 32-input blocks: Q5_0 and Q8_0 weights times Q8_0 activations ----------------------------------------------
 * A GGUF keeps a map whose input width is not a multiple of 256 (the 0.5B draft's 896) in blocks of 32:
 *   Q5_0, per output row and block: float d; 16 bytes of nibbles (byte j: input j low, input j + 16 high) and 4
 *     bytes of fifth bits (bit j: input j). w = d * (q - 16), q in 0..31.
 *   Q8_0, per output row and block: float d; 32 int8 q. w = d * q.
 * Activations, per row and block of 32: float da; int8 a (round(x / da), da = max|x| / 127), as llama.cpp's q8_0.
 * One block's integer sum is |w| times a with w's sign (maddubs takes unsigned times signed; |w| <= 128 and
 * |a| <= 127, so no pair saturates), then one float multiply-add per 32 inputs. Row invariance as above. */
#define QK0 32

/* x [M, K] float32 -> a [M, K] int8, da [M, K/32]. */
static void quantize_rows_q8_0(const float *x, int64_t M, int64_t K, int8_t *a, float *da) {
    const int64_t nb = K / QK0;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) da[m * nb + b] = quantize_block(x + m * K + b * QK0, QK0, a + m * K + b * QK0);
}

/* 32 bytes 0xFF where the bit of `bits` with the byte's index is set, else 0 (llama.cpp's bytes_from_bits_32). */
static inline __m256i bytes_from_bits(const uint8_t *bits) {
    uint32_t x32;
    memcpy(&x32, bits, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)x32),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0x0000000000000000));
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

/* One Q5_0 block's 32 values q - 16 as signed bytes in input order. */
static inline __m256i unpack_q5_0(const uint8_t *qs, const uint8_t *qh) {
    const __m128i nibbles = _mm_loadu_si128((const __m128i *)qs);
    const __m256i low = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(nibbles, 4), nibbles), _mm256_set1_epi8(0x0F));
    /* a clear fifth bit means q - 16 = nibble - 16: set the byte's top four bits */
    return _mm256_or_si256(low, _mm256_andnot_si256(bytes_from_bits(qh), _mm256_set1_epi8((char)0xF0)));
}

/* sum over 32 inputs of w * a as 8 int32 lanes, given w's magnitudes aw. */
static inline __m256i block_dot32(const __m256i w, const __m256i aw, const int8_t *am) {
    const __m256i signed_a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)am), w);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(KQ_FORCE_AVX2)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, signed_a);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, signed_a), _mm256_set1_epi16(1));
#endif
}

/* Block b of output column n as signed bytes: Q5_0 (values [N, K/2], high [N, K/8]) or Q8_0 (values [N, K]). */
ALWAYS_INLINE __m256i block_weights(const int kind, const Part *W, int64_t n, int64_t K, int64_t b) {
    return kind == KIND_Q5_0
        ? unpack_q5_0(W->values + n * (K / 2) + b * (QK0 / 2), W->high + n * (K / 8) + b * (QK0 / 8))
        : _mm256_loadu_si256((const __m256i *)(W->values + n * K + b * QK0));
}

/* acc[r] += (block b of column n) . (block b of row m0 + r) times their two scales, for R rows. */
ALWAYS_INLINE void add_block(const int R, const int kind, const Part *W, int64_t n, int64_t K, int64_t b,
                             const Activations *A, int64_t m0, __m256 acc[TILE_M]) {
    const int64_t nb = K / QK0;
    const __m256i w = block_weights(kind, W, n, K, b);
    const __m256i aw = _mm256_sign_epi8(w, w);
    const float wd = W->d[n * nb + b];
    for (int r = 0; r < R; r++)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot32(w, aw, A->a + (m0 + r) * K + b * QK0)),
                                 _mm256_set1_ps(wd * A->da[(m0 + r) * nb + b]), acc[r]);
}

/* Q5_0 / Q8_0 (d [N, K/32]): one multiply-add per 32 inputs, so each row sums even and odd blocks in two
 * accumulators (two independent chains), added at the end. */
ALWAYS_INLINE void column_32blocks(const int R, const int kind, const Part *W, int64_t n, int64_t K,
                                   const Activations *A, int64_t m0, float sums[TILE_M]) {
    const int64_t nb = K / QK0;
    __m256 even[TILE_M], odd[TILE_M];
    for (int r = 0; r < R; r++) even[r] = odd[r] = _mm256_setzero_ps();
    const int64_t block_bytes = kind == KIND_Q5_0 ? QK0 / 2 : QK0;
    const uint8_t *values = W->values + n * (K / QK0) * block_bytes;
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        _mm_prefetch((const char *)(values + b * block_bytes + PREFETCH_AHEAD), _MM_HINT_T0);
        add_block(R, kind, W, n, K, b, A, m0, even);
        add_block(R, kind, W, n, K, b + 1, A, m0, odd);
    }
    if (b < nb) add_block(R, kind, W, n, K, b, A, m0, even);
    for (int r = 0; r < R; r++) sums[r] = hsum8(_mm256_add_ps(even[r], odd[r]));
}

ALWAYS_INLINE void column(const int kind, const int R, const Part *W, int64_t n, int64_t K, const Activations *A,
                          int64_t m0, float sums[TILE_M]) {
    if (kind == KIND_Q4K) column_q4k(R, W, n, K, A, m0, sums);
    else if (kind == KIND_Q6K) column_q6k(R, W, n, K, A, m0, sums);
    else column_32blocks(R, kind, W, n, K, A, m0, sums);
}

/* Output columns block * TILE_N .. + TILE_N, every row: out[m, n] (row stride ldo) = sum_k W[n, k] x[m, k]
 * (+ bias[n]). Work is tiled by TILE_N output columns (their weights stay in L2 while every row tile passes) and
 * TILE_M rows (their activations stay in L1/L2 while the columns pass): a 256-row prefill chunk reads each weight
 * block from memory once, not once per row. Tiling changes which (m, n) run when, never the operations of one
 * (m, n). Threads split the blocks of columns (the callers' omp loops). */
ALWAYS_INLINE void tile(const int kind, const Part *W, int64_t K, const Activations *A, int64_t M, float *out,
                        int64_t ldo, int64_t block) {
    const int64_t N = W->rows;
    for (int64_t m0 = 0; m0 < M; m0 += TILE_M)
    for (int64_t n = block * TILE_N; n < N && n < (block + 1) * TILE_N; n++) {
        const int64_t mt = M - m0 < TILE_M ? M - m0 : TILE_M;
        const float bn = W->bias ? W->bias[n] : 0.0f;
        float sums[TILE_M];
        switch (mt) {
            case 1: column(kind, 1, W, n, K, A, m0, sums); break;
            case 2: column(kind, 2, W, n, K, A, m0, sums); break;
            case 3: column(kind, 3, W, n, K, A, m0, sums); break;
            case 4: column(kind, 4, W, n, K, A, m0, sums); break;
            default: column(kind, (int)mt, W, n, K, A, m0, sums); break;
        }
        for (int64_t r = 0; r < mt; r++) out[(m0 + r) * ldo + n] = sums[r] + bn;
    }
}

/* One part times the activations into out[:, part->column:]: an orphaned `omp for`, so the team of the caller's
 * parallel region splits the part's blocks of columns (statically: which thread computes a column never changes
 * what it computes). One function per kind, so each compiles its own kind's column code. */
#define MATMUL(name, KIND)                                                                                        \
    static void name(const Part *part, int64_t K, const Activations *A, int64_t M, float *out, int64_t ldo) {    \
        _Pragma("omp for schedule(static)")                                                                        \
        for (int64_t block = 0; block < (part->rows + TILE_N - 1) / TILE_N; block++)                              \
            tile(KIND, part, K, A, M, out + part->column, ldo, block);                                             \
    }
MATMUL(matmul_q4k, KIND_Q4K)
MATMUL(matmul_q6k, KIND_Q6K)
MATMUL(matmul_q5_0, KIND_Q5_0)
MATMUL(matmul_q8_0, KIND_Q8_0)

/* --- one call per map ------------------------------------------------------------------------------------------
 * A map's activations are quantized once for the kinds present and every part runs on them, so a decode step's
 * ~200 maps cost one ctypes call each (linear_forward), or none (layer_forward). `scratch` holds the activations:
 * scratch_bytes(M, K) bytes. */

/* The activations' regions in `scratch`, each starting on 64 bytes: Q8_K a, da (per 256), bsum16, bsum32; Q8_0 a,
 * da (per 32). */
static inline int64_t up64(int64_t bytes) { return (bytes + 63) / 64 * 64; }

static void scratch_layout(int64_t M, int64_t K, int64_t offsets[7]) {
    const int64_t sizes[6] = {M * K, 4 * M * (K / QK), 2 * M * (K / 16), 2 * M * (K / 32), M * K, 4 * M * (K / QK0)};
    offsets[0] = 0;
    for (int i = 0; i < 6; i++) offsets[i + 1] = offsets[i] + up64(sizes[i]);
}

int64_t scratch_bytes(int64_t M, int64_t K) {
    int64_t offsets[7];
    scratch_layout(M, K, offsets);
    return offsets[6];
}

/* x [M, K] times every part into out (row stride ldo), called by every thread of a parallel region (or outside one,
 * by one thread): one thread quantizes the activations, then the team splits each part's columns. */
static void linear_team(const float *x, int64_t M, int64_t K, const Part *parts, int64_t nparts, float *out,
                        int64_t ldo, uint8_t *scratch) {
    int super_blocks = 0, blocks32 = 0;
    for (int64_t p = 0; p < nparts; p++) {
        if (parts[p].kind == KIND_Q4K || parts[p].kind == KIND_Q6K) super_blocks = 1;
        else blocks32 = 1;
    }
    int64_t at[7];
    scratch_layout(M, K, at);
    int8_t *a = (int8_t *)(scratch + at[0]), *a0 = (int8_t *)(scratch + at[4]);
    float *da = (float *)(scratch + at[1]), *da0 = (float *)(scratch + at[5]);
    int16_t *bsum16 = (int16_t *)(scratch + at[2]), *bsum32 = (int16_t *)(scratch + at[3]);
#pragma omp single
    {
        if (super_blocks) quantize_rows_q8k(x, M, K, a, da, bsum16, bsum32);
        if (blocks32) quantize_rows_q8_0(x, M, K, a0, da0);
    }
    /* Q4_K takes the activations' sums per 32 inputs, Q6_K per 16, the 32-blocks none */
    const Activations q4k = {a, da, bsum32}, q6k = {a, da, bsum16}, q8_0 = {a0, da0, NULL};
    for (int64_t p = 0; p < nparts; p++) {
        const Part *part = &parts[p];
        switch (part->kind) {
            case KIND_Q4K: matmul_q4k(part, K, &q4k, M, out, ldo); break;
            case KIND_Q6K: matmul_q6k(part, K, &q6k, M, out, ldo); break;
            case KIND_Q5_0: matmul_q5_0(part, K, &q8_0, M, out, ldo); break;
            default: matmul_q8_0(part, K, &q8_0, M, out, ldo);
        }
    }
}

void linear_forward(const float *x, int64_t M, int64_t K, const Part *parts, int64_t nparts, float *out, int64_t ldo,
                    int threads, uint8_t *scratch) {
#pragma omp parallel num_threads(threads)
    linear_team(x, M, K, parts, nparts, out, ldo, scratch);
}

/* --- one decoder layer per call ----------------------------------------------------------------------------------
 * A Qwen2/Qwen3 decoder layer for rows that each attend their own slots (a decode, a verify, a tree: kernels/
 * fused_step.py), everything between its maps included: RMSNorm, q/k norm, RoPE, the K/V writes, one query's
 * attention per row and head, SiLU, the residual adds. One parallel region per layer; each row's values come from
 * the same operations in the same order whatever the number of rows, as in the maps (row invariance), and threads
 * split rows, heads or columns only. Torch's eager step did the same in ~60 small operations per layer (~8 ms per
 * token over 28 layers on a 2-core Zen 3). */

typedef struct {          /* one layer's weights; q_norm / k_norm NULL where the model has none (Qwen2) */
    const Part *qkv, *o, *gate_up, *down;  /* q, k, v (in that order) and gate, up: one table each */
    int64_t n_qkv, n_o, n_gate_up, n_down;
    const float *input_norm, *post_norm, *q_norm, *k_norm;
} Layer;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate;
    float eps;
} Dims;

typedef struct {          /* one row's cache and the slots it attends */
    float *keys, *values; /* its cache's layer 0, kv head 0, slot 0 */
    int64_t layer_stride, head_stride;  /* floats between layers and between kv heads; slots are head_dim apart */
    int64_t write_slot, count;          /* where its k/v go; how many slots it attends */
    const int64_t *slots;               /* NULL: slots 0 .. count - 1; else `count` slot ids, increasing */
} RowAttention;

/* exp(x) for 8 floats (Cephes' polynomial, as in avx_mathfun): relative error ~1e-7 over the range used here. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

static inline float dot(const float *a, const float *b, int64_t n) {  /* n a multiple of 8 */
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    return hsum8(acc);
}

/* out = weight * (x / sqrt(mean(x^2) + eps)) over n floats (n a multiple of 8); out may be x. */
static inline void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    const float scale = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = weight[i] * (x[i] * scale);
}

/* One head's vector v [hd] rotated in place ("rotate half": pairs i, i + hd/2), cos/sin [hd] of its position. */
static inline void rope(float *v, const float *cos, const float *sin, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* One query head q [hd] over the slots a row attends of one kv head (keys/values at slot * hd): softmax(q k / sqrt
 * hd) v into out [hd]; scores: `count` floats of room (+ 8). */
static void attend(const float *q, const float *keys, const float *values, const RowAttention *row, int64_t hd,
                   float *scores, float *out) {
    const int64_t count = row->count;
    const float scale = 1.0f / sqrtf((float)hd);
    float top = -INFINITY;
    for (int64_t j = 0; j < count; j++) {
        const int64_t slot = row->slots ? row->slots[j] : j;
        scores[j] = dot(q, keys + slot * hd, hd) * scale;
        top = scores[j] > top ? scores[j] : top;
    }
    for (int64_t j = count; j < ((count + 7) & ~7LL); j++) scores[j] = -INFINITY;
    __m256 total8 = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(top)));
        _mm256_storeu_ps(scores + j, e);
        total8 = _mm256_add_ps(total8, e);
    }
    const float inverse = 1.0f / hsum8(total8);
    for (int64_t i = 0; i < hd; i += 8) _mm256_storeu_ps(out + i, _mm256_setzero_ps());
    for (int64_t j = 0; j < count; j++) {
        const int64_t slot = row->slots ? row->slots[j] : j;
        const __m256 p = _mm256_set1_ps(scores[j] * inverse);
        for (int64_t i = 0; i < hd; i += 8)
            _mm256_storeu_ps(out + i, _mm256_fmadd_ps(p, _mm256_loadu_ps(values + slot * hd + i),
                                                      _mm256_loadu_ps(out + i)));
    }
}

/* Floats of `work` layer_forward needs for M rows. */
int64_t layer_work_floats(int64_t M, const Dims *D) {
    const int64_t qkv = (D->heads + 2 * D->kv_heads) * D->head_dim;
    return M * (2 * D->hidden + qkv + D->heads * D->head_dim + 3 * D->intermediate) + 64;
}

/* Layer `layer` over x [M, hidden] (the residual stream, updated in place). cos/sin [M, head_dim]: each row's
 * rotary angles. rows[M]: each row's cache and slots (its own slot included: its k/v are written first). work:
 * layer_work_floats(M, D) floats; scratch: scratch_bytes(M, the widest map input) bytes; scores: threads x
 * (max_count + 8) floats. */
void layer_forward(float *x, int64_t M, int64_t layer, const Layer *L, const Dims *D, const float *cos,
                   const float *sin, const RowAttention *rows, int threads, float *work, uint8_t *scratch,
                   float *scores, int64_t max_count) {
    const int64_t H = D->hidden, hd = D->head_dim, nh = D->heads, nkv = D->kv_heads, I = D->intermediate;
    const int64_t qkv_width = (nh + 2 * nkv) * hd, group = nh / nkv;
    float *normed = work, *qkv = normed + M * H, *attn = qkv + M * qkv_width, *gate_up = attn + M * nh * hd,
          *act = gate_up + M * 2 * I, *delta = act + M * I;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) rms_norm(x + m * H, L->input_norm, H, D->eps, normed + m * H);
        linear_team(normed, M, H, L->qkv, L->n_qkv, qkv, qkv_width, scratch);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            float *q = qkv + m * qkv_width, *k = q + nh * hd, *v = k + nkv * hd;
            const RowAttention *row = &rows[m];
            for (int64_t h = 0; h < nh; h++) {
                if (L->q_norm) rms_norm(q + h * hd, L->q_norm, hd, D->eps, q + h * hd);
                rope(q + h * hd, cos + m * hd, sin + m * hd, hd);
            }
            for (int64_t h = 0; h < nkv; h++) {
                if (L->k_norm) rms_norm(k + h * hd, L->k_norm, hd, D->eps, k + h * hd);
                rope(k + h * hd, cos + m * hd, sin + m * hd, hd);
                const int64_t at = layer * row->layer_stride + h * row->head_stride + row->write_slot * hd;
                memcpy(row->keys + at, k + h * hd, hd * sizeof(float));
                memcpy(row->values + at, v + h * hd, hd * sizeof(float));
            }
        }
        float *own_scores = scores + (int64_t)omp_get_thread_num() * (max_count + 8);
#pragma omp for collapse(2) schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t h = 0; h < nh; h++) {
                const RowAttention *row = &rows[m];
                const int64_t base = layer * row->layer_stride + (h / group) * row->head_stride;
                attend(qkv + m * qkv_width + h * hd, row->keys + base, row->values + base, row, hd, own_scores,
                       attn + m * nh * hd + h * hd);
            }
        linear_team(attn, M, nh * hd, L->o, L->n_o, delta, H, scratch);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            for (int64_t i = 0; i < H; i++) x[m * H + i] += delta[m * H + i];
            rms_norm(x + m * H, L->post_norm, H, D->eps, normed + m * H);
        }
        linear_team(normed, M, H, L->gate_up, L->n_gate_up, gate_up, 2 * I, scratch);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < I; i += 8) {
                const __m256 g = _mm256_loadu_ps(gate_up + m * 2 * I + i);
                const __m256 u = _mm256_loadu_ps(gate_up + m * 2 * I + I + i);
                const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f),
                                                                   exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
                _mm256_storeu_ps(act + m * I + i, _mm256_mul_ps(silu, u));
            }
        linear_team(act, M, I, L->down, L->n_down, delta, H, scratch);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            for (int64_t i = 0; i < H; i++) x[m * H + i] += delta[m * H + i];
    }
}
