/* CPU decode kernels for hsd-opt: a run of pre-norm decoder layers (Llama / Mistral / Qwen2) and the LM head at
 * batch 1, for passes over a few positions (one decode step, or a verify pass over a block of drafts).
 *
 * Why: at batch 1 a decode step reads every weight once, so it is bound by memory bandwidth, not arithmetic; the
 * stock float32 matrix-vector products and the per-operation overhead of an eager framework take several times
 * the time the weights take to read. This file streams each weight row once per pass, for every position of the
 * pass, in one parallel region per run of layers (OpenMP: the library links libgomp.so.1 by that name, and the
 * loader resolves it to the copy torch has already loaded, so the kernels run on torch's own OpenMP runtime).
 *
 * Weights stay where the caller keeps them (no copies): float32 or bfloat16 matrices as the model stores them,
 * or quantized copies (int8 per output row; int4 in groups of 32 input columns with a scale and a minimum per
 * group, like GGUF Q4_1). Activations, keys and values are float32.
 *
 * Batch invariance: every output element (position t, output row r) is computed by the same sequence of
 * operations whatever the number of positions in the pass and whatever tile it falls in: one 8-lane accumulator
 * over the input columns in order, one fixed horizontal sum, then the bias. Attention of a position depends only
 * on its own query and the cached keys and values. So a pass over t positions gives bit for bit the same hidden
 * states and logits as t one-position steps: speculative verification sees exactly the numbers a plain decode
 * loop would.
 *
 * Interface: plain C structs (mirrored with ctypes in kernels.py), no allocation (the caller passes a work
 * buffer of hsd_work_floats() floats). Build: cc -O3 -march=native -fopenmp -ffp-contract=off -shared -fPIC.
 */
#define _GNU_SOURCE /* syscall(SYS_gettid) */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#if defined(__has_include)
#if __has_include(<omp.h>)
#include <omp.h>
#else /* an OpenMP runtime without its header (torch's own copy of libomp, e.g.): the two functions used here */
int omp_get_thread_num(void);
int omp_get_num_threads(void);
#endif
#else
#include <omp.h>
#endif
#else /* built without OpenMP (a compiler that cannot, or HSD_OPENMP=0): every parallel region runs on the calling
       * thread */
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
#ifdef __linux__
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(HSD_PORTABLE)
#include <immintrin.h>
#define HSD_AVX2 1
#else
#define HSD_AVX2 0
#endif
#if HSD_AVX2 && defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(HSD_NO_AVX512)
#define HSD_AVX512 1 /* 16-lane registers: two rows' 8-lane accumulators in one (the same operations) */
#else
#define HSD_AVX512 0
#endif
#if defined(__aarch64__) && defined(__ARM_NEON) && !defined(HSD_PORTABLE)
#include <arm_neon.h>
#define HSD_NEON 1 /* Arm: an 8-lane accumulator as two 4-lane registers (the same operations, lane for lane) */
#else
#define HSD_NEON 0
#endif

/* HSD_Q4F: float32 weights that are exactly fma(code, scale, minimum) of int4 codes (GGUF Q4_1's de-quantized
 * values, e.g.); the float path multiplies those float32 values, so every element is what the float32 matrix
 * gives, from an eighth of its bytes. Codes paired (see hsd_mat), scales and minimums as HSD_Q4's.
 * HSD_Q8F: the same for float32 weights that are exactly code * scale of int8 codes in groups of 32 columns (GGUF
 * Q8_0's de-quantized values, e.g. the embedded model's LM head; the product is exact in float32): a quarter of
 * the bytes. Codes paired by rows (see hsd_mat), scales float16 per group. */
enum { HSD_F32 = 0, HSD_BF16 = 1, HSD_Q8 = 2, HSD_Q4 = 3, HSD_Q4F = 4, HSD_Q8F = 5 };
#define HSD_GROUP 32
#define HSD_PREFETCH 2048 /* bytes ahead in a weight row (an int8 row, a block of int4 rows) that the integer path
                           * asks the cache for */
#define HSD_MAX_TILE_T 64 /* positions per call of dots4 (its output block) */
#define HSD_LONG_PASS 16  /* passes over this many positions or more use the register tile (prefill chunks) */
#define HSD_SCRATCH_ROWS 8 /* rows of a matrix expanded at a time into a thread's scratch (two blocks of 4) */
/* Most groups per row of a paired matrix whose scales the paired tiles convert on the stack (wider: the float
 * path's generic tiles). */
#define HSD_PAIRED_MAX_GROUPS 512
/* Positions at most this many are read by the 8-lane in-register q4f tiles (AVX2: one tile of each size; NEON:
 * tiles of 3, then 1 or 2); longer passes de-quantize each block of rows into the first-level cache once for all
 * positions. */
#if HSD_AVX2 && !HSD_AVX512
#define HSD_Q4F_REG_MAX 8
#else
#define HSD_Q4F_REG_MAX 6
#endif

typedef struct {
    int32_t type, rows, cols, pad;
    const void *w;       /* f32 / bf16 [rows, cols]; q8: int8 [rows, cols]; q4: uint8 [rows / 16, groups / 2
                          * (both rounded up), 512]: per block of 16 rows and pair of groups, 64 bytes per 4
                          * columns 4q .. 4q + 3 of the group (4 bytes per row: row i's at 4i), each byte the code
                          * of the first group (low nibble) | of the second (high nibble); q4f: uint8 [rows / 4,
                          * groups / 2 (both rounded up), 2, 64]: per block of 4 rows and pair of groups, per pair of
                          * rows of the block, 16 bytes per 8 columns k of the group (8 of the first row, then the
                          * second's), each byte the code of the first group (low nibble) | of the second (high
                          * nibble); q8f: int8 [rows / 2 (rounded up), cols / 8, 16]: per pair of rows, 16 bytes
                          * per 8 columns (8 of the first row, then the same 8 of the second) */
    const void *scale;   /* q8: float32 [rows]; q4f, q8f: float16 bits [rows, cols / 32]; q4: float16 bits
                          * [rows / 16 (rounded up), cols / 32, 16] (per block of 16 rows, group by group) */
    const void *zero;    /* q4f: float16 bits [rows, cols / 32], q4: as its scale; the group minimum:
                          * w = code * scale + zero */
    const float *bias;   /* [rows] or NULL */
} hsd_mat;

typedef struct {
    hsd_mat q, k, v, o, gate, up, down;
    const float *ln1, *ln2; /* [hidden] norm weights */
} hsd_layer;

typedef struct {
    int32_t n_heads, n_kv, head_dim, hidden, inter, pad;
    float eps1, eps2;
    const hsd_layer *layers;
} hsd_model;

/* The layout version of the structs above; kernels.py's ABI_VERSION holds the same number. */
int hsd_version(void) { return 17; }
/* 0: portable C; 1: 8-lane tiles (AVX2, or NEON's pairs of 4-lane registers); 2: AVX2 with 16-lane float32 tiles
 * (AVX-512). */
int hsd_simd(void) { return HSD_AVX2 + HSD_AVX512 + HSD_NEON; }

/* What this build holds, as bits: 1 AVX2 (with FMA and F16C), 2 AVX-512 (F/DQ/BW/VL), 4 VNNI (AVX-512 VNNI or
 * AVX-VNNI), 8 NEON, 16 the Arm dot product (dotprod), 32 OpenMP threads. kernels.py's VARIANTS name the bits each
 * variant must report. */
int hsd_features(void) {
    int f = 0;
#if HSD_AVX2
    f |= 1;
#endif
#if HSD_AVX512
    f |= 2;
#endif
#if HSD_AVX2 && (defined(__AVX512VNNI__) || defined(__AVXVNNI__))
    f |= 4;
#endif
#if HSD_NEON
    f |= 8;
#endif
#if HSD_NEON && defined(__ARM_FEATURE_DOTPROD)
    f |= 16;
#endif
#ifdef _OPENMP
    f |= 32;
#endif
    return f;
}

/* The layout the Python side checks at load: version, struct sizes, and the offsets of the last fields. */
void hsd_layout(long *out) {
    out[0] = hsd_version();
    out[1] = (long)sizeof(hsd_mat);
    out[2] = (long)sizeof(hsd_layer);
    out[3] = (long)sizeof(hsd_model);
    out[4] = (long)offsetof(hsd_mat, bias);
    out[5] = (long)offsetof(hsd_model, layers);
}

/* The team a kernel call with nthreads threads runs on: its size, and each member's OS thread id (Linux; the
 * member number elsewhere) in ids[member]. Every kernel below opens its parallel region this way. */
int hsd_team(int nthreads, long *ids) {
    int n = 0;
#pragma omp parallel num_threads(nthreads)
    {
#ifdef __linux__
        ids[omp_get_thread_num()] = (long)syscall(SYS_gettid);
#else
        ids[omp_get_thread_num()] = omp_get_thread_num();
#endif
#pragma omp single
        n = omp_get_num_threads();
    }
    return n;
}

/* ------------------------------------------------------------------------------------------------ dot products */

/* Every output element is W[r] . x[t] computed as: one 8-lane accumulator over the columns in order (lane j
 * takes columns j, j + 8, ...; acc = fma(w, x, acc)), a fixed horizontal sum, then the tail columns (cols % 8) in
 * order. The weights enter as float32 values: stored float32, widened bfloat16, int8 codes (the row scale is
 * applied to the sum), or int4 de-quantized as fma(code, scale, minimum). The tiles below only choose which
 * elements are computed together, never the operations of one element. */

#if HSD_AVX2
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#define ACC(a, w, x) a = _mm256_fmadd_ps(w, x, a)
/* Keep v in a register: the compiler may not fold its load into every instruction that uses it. */
#define REG(v) __asm__("" : "+x"(v))
#else
static inline float hsum_lanes(const float *l) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}
#endif
#if HSD_NEON
/* An 8-lane accumulator on Arm: lanes 0..3 and 4..7 in two registers; vfmaq_f32 is fmaf lane for lane. */
typedef struct {
    float32x4_t lo, hi;
} f8_t;
static inline f8_t f8_zero(void) { return (f8_t){vdupq_n_f32(0.f), vdupq_n_f32(0.f)}; }
static inline f8_t f8_load(const float *p) { return (f8_t){vld1q_f32(p), vld1q_f32(p + 4)}; }
static inline f8_t f8_fma(f8_t a, f8_t w, f8_t x) { return (f8_t){vfmaq_f32(a.lo, w.lo, x.lo), vfmaq_f32(a.hi, w.hi, x.hi)}; }
/* hsum8's tree: u_j = l_j + l_{j+4}, then (u_0 + u_2) + (u_1 + u_3). */
static inline float hsum8n(f8_t a) {
    const float32x4_t u = vaddq_f32(a.lo, a.hi);
    const float32x2_t v = vadd_f32(vget_low_f32(u), vget_high_f32(u));
    return vget_lane_f32(v, 0) + vget_lane_f32(v, 1);
}
#endif

/* An IEEE half (float16 bits) as float32, exactly (int4 scales and minimums are stored in half precision, as
 * GGUF's Q4_1 stores them). */
static inline float half_to_float(uint16_t h) {
#if HSD_AVX2
    return _cvtsh_ss(h);
#elif HSD_NEON
    return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, f = h & 0x3FF;
    uint32_t bits;
    if (e == 0) {
        if (f == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int sh = 0;
            uint32_t m = f;
            while (!(m & 0x400)) {
                m <<= 1;
                sh++;
            }
            bits = sign | ((uint32_t)(127 - 15 - sh + 1) << 23) | ((m & 0x3FF) << 13);
        }
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (f << 13);
    } else {
        bits = sign | ((e - 15 + 127) << 23) | (f << 13);
    }
    float out;
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* A range of weight bytes to pull into the cache while the current rows compute (a few rows ahead): without it,
 * a tile that has its rows in L1 computes while nothing is read from memory, and memory and arithmetic take
 * turns instead of overlapping. */
typedef struct {
    const char *p, *end;
} prefetch_t;

static inline void prefetch_line(prefetch_t *pf) {
    if (pf->p < pf->end) {
#if HSD_AVX2
        _mm_prefetch(pf->p, _MM_HINT_T0);
#endif
        pf->p += 64;
    }
}

/* Bytes of one row of A's weights (f32, bf16, q8; not q4, q4f, q8f, whose rows are in blocks or pairs). */
static inline size_t row_bytes(const hsd_mat *A) {
    return (size_t)A->cols * (A->type == HSD_F32 ? 4 : A->type == HSD_BF16 ? 2 : 1);
}

/* The 64 code bytes of q4f rows 2 * pair, 2 * pair + 1 and groups 2 * gp, 2 * gp + 1; those of the next pair of
 * groups of the same rows follow HSD_Q4F_STEP bytes later (a block of 4 rows is one run of bytes). */
#define HSD_Q4F_STEP 128
static inline const uint8_t *q4f_codes(const hsd_mat *A, int pair, int gp) {
    const int GP = ((A->cols + HSD_GROUP - 1) / HSD_GROUP + 1) / 2;
    return (const uint8_t *)A->w + (((size_t)(pair / 2) * GP + gp) * 2 + (pair & 1)) * 64;
}

/* The 16 code bytes of q8f rows 2 * pair, 2 * pair + 1 at columns 8 * c8 .. 8 * c8 + 7. */
static inline const int8_t *q8f_codes(const hsd_mat *A, int pair, int c8) {
    return (const int8_t *)A->w + ((size_t)pair * (A->cols / 8) + c8) * 16;
}

/* Whether A's rows are stored in pairs (the exact forms), read a block of 4 rows at a time by prefetch_block. */
static inline int paired(const hsd_mat *A) { return A->type == HSD_Q4F || A->type == HSD_Q8F; }

/* Rows [r, r + 4) of A, HSD_AHEAD blocks of 4 rows ahead of the block at row r0 (empty past the matrix end). */
#define HSD_AHEAD 2
static inline prefetch_t prefetch_ahead(const hsd_mat *A, int r0) {
    const int r = r0 + 4 * HSD_AHEAD, n = A->rows - r < 4 ? A->rows - r : 4;
    prefetch_t pf = {NULL, NULL};
    if (n > 0 && !paired(A)) {
        pf.p = (const char *)A->w + (size_t)r * row_bytes(A);
        pf.end = pf.p + (size_t)n * row_bytes(A);
    }
    return pf;
}

static inline float tail(const float *w, const float *x, int c0, int K, float s) {
    for (int c = c0; c < K; c++) s = fmaf(w[c], x[c], s);
    return s;
}

#if HSD_AVX2
/* o[i] = w_i . x for the 4 rows from their 8-lane accumulators: the fixed horizontal sum, then the tail columns. */
static inline void finish4(float *o, const float *const *w, const float *x, int K8, int K, __m256 a0, __m256 a1,
                           __m256 a2, __m256 a3) {
    o[0] = tail(w[0], x, K8, K, hsum8(a0));
    o[1] = tail(w[1], x, K8, K, hsum8(a1));
    o[2] = tail(w[2], x, K8, K, hsum8(a2));
    o[3] = tail(w[3], x, K8, K, hsum8(a3));
}

/* s[t * 4 + i] = w_i . x_t for the 4 rows and positions t .. t+2: 12 accumulators. Over the rows' first use, when
 * they stream from memory, its 12 FMAs per 4 weight loads keep arithmetic and memory overlapped. */
static inline void tile4x3(const float *const *w, int K, const float *x, int xs, int t, float *s, prefetch_t *pf) {
    const int K8 = K & ~7;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *xa = x + (size_t)t * xs, *xb = xa + xs, *xc = xb + xs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    for (int c = 0; c < K8; c += 8) {
        prefetch_line(pf);
        __m256 u = _mm256_loadu_ps(xa + c), v = _mm256_loadu_ps(xb + c), z = _mm256_loadu_ps(xc + c), q;
        q = _mm256_loadu_ps(w0 + c); ACC(a0, q, u); ACC(b0, q, v); ACC(c0, q, z);
        q = _mm256_loadu_ps(w1 + c); ACC(a1, q, u); ACC(b1, q, v); ACC(c1, q, z);
        q = _mm256_loadu_ps(w2 + c); ACC(a2, q, u); ACC(b2, q, v); ACC(c2, q, z);
        q = _mm256_loadu_ps(w3 + c); ACC(a3, q, u); ACC(b3, q, v); ACC(c3, q, z);
    }
    float *o = s + (size_t)t * 4;
    finish4(o, w, xa, K8, K, a0, a1, a2, a3);
    finish4(o + 4, w, xb, K8, K, b0, b1, b2, b3);
    finish4(o + 8, w, xc, K8, K, c0, c1, c2, c3);
}

/* The same for positions t, t+1 with the 2 inputs and 4 weight vectors held in registers (REG: loads the
 * compiler would otherwise fold into every FMA, re-reading them from L1): 6 loads per 8 FMAs, where the tile
 * above is bound by the 16 loads it issues per 12 FMAs. About 20% more arithmetic per second once the rows are in
 * cache; slower than the tile above while they stream from memory. */
static inline void tile4x2(const float *const *w, int K, const float *x, int xs, int t, float *s, prefetch_t *pf) {
    const int K8 = K & ~7;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *xa = x + (size_t)t * xs, *xb = xa + xs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int c = 0; c < K8; c += 8) {
        prefetch_line(pf);
        __m256 u = _mm256_loadu_ps(xa + c), v = _mm256_loadu_ps(xb + c);
        __m256 q0 = _mm256_loadu_ps(w0 + c), q1 = _mm256_loadu_ps(w1 + c), q2 = _mm256_loadu_ps(w2 + c);
        __m256 q3 = _mm256_loadu_ps(w3 + c);
        REG(u); REG(v); REG(q0); REG(q1); REG(q2); REG(q3);
        ACC(a0, q0, u); ACC(a1, q1, u); ACC(a2, q2, u); ACC(a3, q3, u);
        ACC(b0, q0, v); ACC(b1, q1, v); ACC(b2, q2, v); ACC(b3, q3, v);
    }
    float *o = s + (size_t)t * 4;
    finish4(o, w, xa, K8, K, a0, a1, a2, a3);
    finish4(o + 4, w, xb, K8, K, b0, b1, b2, b3);
}

/* One position (a decode step is memory-bound: two cache lines of the rows ahead are asked for per 8 columns). */
static inline void tile4x1(const float *const *w, int K, const float *x, int xs, int t, float *s, prefetch_t *pf) {
    const int K8 = K & ~7;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *xa = x + (size_t)t * xs;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int c = 0; c < K8; c += 8) {
        prefetch_line(pf);
        prefetch_line(pf);
        __m256 u = _mm256_loadu_ps(xa + c);
        ACC(a0, _mm256_loadu_ps(w0 + c), u); ACC(a1, _mm256_loadu_ps(w1 + c), u);
        ACC(a2, _mm256_loadu_ps(w2 + c), u); ACC(a3, _mm256_loadu_ps(w3 + c), u);
    }
    finish4(s + (size_t)t * 4, w, xa, K8, K, a0, a1, a2, a3);
}
#endif

#if HSD_AVX512
/* The fixed horizontal sums (hsum8: lane j + lane j+4, then (0+2) + (1+3)) of the 8-lane accumulators of positions
 * p .. p+3 (fewer past P) of a 4-row tile, a[q] holding rows 0|1 and b[q] rows 2|3 of position q: v[4i + j] is row
 * i's sum at position p + j. The same additions on every 8-lane accumulator at once, in 3 x 3 instructions per 4
 * positions instead of 6 per accumulator. */
static inline __attribute__((always_inline)) void hsum4x4(const __m512 *a, const __m512 *b, int p, int P,
                                                          float *v) {
    __m512 h[4], u[2];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) { /* [row 0 | 1 | 2 | 3] of position p + j: lanes l0+l4 .. l3+l7 */
        const __m512 aj = p + j < P ? a[p + j] : _mm512_setzero_ps(), bj = p + j < P ? b[p + j] : aj;
        h[j] = _mm512_add_ps(_mm512_shuffle_f32x4(aj, bj, 0x88), _mm512_shuffle_f32x4(aj, bj, 0xDD));
    }
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) /* per row: [m0+m2, m1+m3] of positions p + 2j, p + 2j + 1 */
        u[j] = _mm512_add_ps(_mm512_shuffle_ps(h[2 * j], h[2 * j + 1], 0x44),
                             _mm512_shuffle_ps(h[2 * j], h[2 * j + 1], 0xEE));
    /* per row i (128-bit lane i): the sums of positions p .. p+3 */
    _mm512_storeu_ps(v, _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD)));
}

/* One column step of a 4 x P tile: a[p] += w01 * x_p, b[p] += w23 * x_p for the P positions, x_p their 8 inputs
 * at columns c .. c+7 (row stride xs) in both halves. */
static inline __attribute__((always_inline)) void fma4xP(__m512 *a, __m512 *b, __m512 w01, __m512 w23,
                                                         const float *x, int xs, int c, int P) {
#pragma GCC unroll 8
    for (int p = 0; p < P; p++) {
        const __m512 u = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + (size_t)p * xs + c));
        a[p] = _mm512_fmadd_ps(w01, u, a[p]);
        b[p] = _mm512_fmadd_ps(w23, u, b[p]);
    }
}

/* s[(t + p) * 4 + i] = row i's sum at position p < P (hsum4x4 of a 4 x P tile without tail columns). */
static inline __attribute__((always_inline)) void sums4xP(const __m512 *a, const __m512 *b, int P, float *s, int t) {
#pragma GCC unroll 2
    for (int p = 0; p < P; p += 4) {
        float v[16];
        hsum4x4(a, b, p, P, v);
        for (int j = 0; j < 4 && p + j < P; j++) {
            float *o = s + (size_t)(t + p + j) * 4;
            o[0] = v[j], o[1] = v[4 + j], o[2] = v[8 + j], o[3] = v[12 + j];
        }
    }
}

/* s[t * 4 + i] = w_i . x_t for the 4 rows and the P positions t .. t+P-1 (P <= 8): the 8-lane accumulators of rows
 * 0 and 1 side by side in one 16-lane register, of rows 2 and 3 in another, each position's 8 inputs in both
 * halves. One 16-lane FMA does two rows' 8-lane FMAs, the same operations (lane j of each half takes columns j,
 * j + 8, ...), so every element is bit for bit the 8-lane tiles'; it does them in one instruction. The rows are
 * read once for all P positions (two cache lines of the rows ahead asked for per 8 columns). With `paired` (rows
 * already paired, see expand4_pairs) w[0] and w[2] hold rows 0|1 and 2|3 as 16 floats per 8 columns, read in one
 * load each, and K is a multiple of 8. */
static inline __attribute__((always_inline)) void tile4xP_any(const float *const *w, int K, const float *x, int xs,
                                                              int t, int P, float *s, prefetch_t *pf, int paired) {
    const int K8 = K & ~7;
    const float *w0 = w[0], *w1 = w[1], *w2 = w[2], *w3 = w[3];
    const float *xt = x + (size_t)t * xs;
    __m512 a[8], b[8];
#pragma GCC unroll 8
    for (int p = 0; p < P; p++) a[p] = b[p] = _mm512_setzero_ps();
    for (int c = 0; c < K8; c += 8) {
        __m512 q01, q23;
        if (paired) {
            q01 = _mm512_loadu_ps(w0 + 2 * c);
            q23 = _mm512_loadu_ps(w2 + 2 * c);
        } else {
            prefetch_line(pf);
            prefetch_line(pf);
            q01 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w0 + c)), _mm256_loadu_ps(w1 + c), 1);
            q23 = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(w2 + c)), _mm256_loadu_ps(w3 + c), 1);
        }
        fma4xP(a, b, q01, q23, xt, xs, c, P);
    }
    if (paired) { /* no tail columns */
        sums4xP(a, b, P, s, t);
        return;
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; p += 4) {
        float v[16];
        hsum4x4(a, b, p, P, v);
        for (int j = 0; j < 4 && p + j < P; j++) {
            const float *xp = xt + (size_t)(p + j) * xs;
            float *o = s + (size_t)(t + p + j) * 4;
            o[0] = tail(w0, xp, K8, K, v[j]);
            o[1] = tail(w1, xp, K8, K, v[4 + j]);
            o[2] = tail(w2, xp, K8, K, v[8 + j]);
            o[3] = tail(w3, xp, K8, K, v[12 + j]);
        }
    }
}

/* m >= 1 positions in tiles of 8, then one of the 1..7 left: paired rows (expand4_pairs) take the 16-lane tile for
 * any count; rows in place (dots4_wide, m >= 2) the 8-lane tile for one position left. Constant `paired` lets the
 * compiler keep one variant per caller. */
static inline __attribute__((always_inline)) void tiles4(const float *const *w, int K, const float *x, int xs, int m,
                                                         float *s, prefetch_t *pf, int paired) {
    int t = 0;
    for (; t + 8 <= m; t += 8) tile4xP_any(w, K, x, xs, t, 8, s, pf, paired);
    switch (m - t) {
    case 7: tile4xP_any(w, K, x, xs, t, 7, s, pf, paired); break;
    case 6: tile4xP_any(w, K, x, xs, t, 6, s, pf, paired); break;
    case 5: tile4xP_any(w, K, x, xs, t, 5, s, pf, paired); break;
    case 4: tile4xP_any(w, K, x, xs, t, 4, s, pf, paired); break;
    case 3: tile4xP_any(w, K, x, xs, t, 3, s, pf, paired); break;
    case 2: tile4xP_any(w, K, x, xs, t, 2, s, pf, paired); break;
    case 1:
        if (paired)
            tile4xP_any(w, K, x, xs, t, 1, s, pf, paired);
        else
            tile4x1(w, K, x, xs, t, s, pf);
        break;
    default: break;
    }
}

/* dots4 of 4 paired rows (expand4_pairs) for m >= 1 positions. */
static void dots4_pairs(const float *const *w, int K, const float *x, int xs, int m, float *s) {
    tiles4(w, K, x, xs, m, s, NULL, 1);
}

/* dots4 for m >= 2 positions of rows read in place. */
static void dots4_wide(const float *const *w, int K, const float *x, int xs, int m, float *s, prefetch_t *pf) {
    tiles4(w, K, x, xs, m, s, pf, 0);
}
#endif

/* s[t * 4 + i] = w_i . x_t for 4 rows (float32, K columns) and m positions (x row stride xs). The tiles differ in
 * which elements they compute together, never in the operations of one element. */
static void dots4(const float *const *w, int K, const float *x, int xs, int m, float *s, prefetch_t *pf) {
    int t = 0;
#if HSD_AVX512
    if (m >= 2) {
        dots4_wide(w, K, x, xs, m, s, pf);
        return;
    }
#endif
#if HSD_AVX2
    if (m >= HSD_LONG_PASS) { /* the first 3 positions read the rows, the rest find them in cache */
        tile4x3(w, K, x, xs, 0, s, pf);
        for (t = 3; t + 2 <= m; t += 2) tile4x2(w, K, x, xs, t, s, pf);
    } else { /* measured: over fewer positions the register tile gains nothing (or loses a few percent) */
        for (; t + 3 <= m; t += 3) tile4x3(w, K, x, xs, t, s, pf);
        if (t > 0 && t + 2 == m) { /* the last 2 of 5, 8, 11, 14 positions: rows in cache, one tile not two */
            tile4x2(w, K, x, xs, t, s, pf);
            t += 2;
        }
    }
    for (; t < m; t++) tile4x1(w, K, x, xs, t, s, pf);
#elif HSD_NEON
    (void)pf;
    const int K8 = K & ~7;
    for (; t + 2 <= m; t += 2) { /* two positions: each row read once for both */
        const float *xa = x + (size_t)t * xs, *xb = xa + xs;
        f8_t a[4], b[4];
        for (int i = 0; i < 4; i++) a[i] = b[i] = f8_zero();
        for (int c = 0; c < K8; c += 8) {
            const f8_t u = f8_load(xa + c), v = f8_load(xb + c);
            for (int i = 0; i < 4; i++) {
                const f8_t q = f8_load(w[i] + c);
                a[i] = f8_fma(a[i], q, u);
                b[i] = f8_fma(b[i], q, v);
            }
        }
        for (int i = 0; i < 4; i++) {
            s[(size_t)t * 4 + i] = tail(w[i], xa, K8, K, hsum8n(a[i]));
            s[(size_t)(t + 1) * 4 + i] = tail(w[i], xb, K8, K, hsum8n(b[i]));
        }
    }
    for (; t < m; t++) {
        const float *xa = x + (size_t)t * xs;
        f8_t a[4];
        for (int i = 0; i < 4; i++) a[i] = f8_zero();
        for (int c = 0; c < K8; c += 8) {
            const f8_t u = f8_load(xa + c);
            for (int i = 0; i < 4; i++) a[i] = f8_fma(a[i], f8_load(w[i] + c), u);
        }
        for (int i = 0; i < 4; i++) s[(size_t)t * 4 + i] = tail(w[i], xa, K8, K, hsum8n(a[i]));
    }
#else
    (void)pf;
    const int K8 = K & ~7;
    for (; t < m; t++) {
        const float *xa = x + (size_t)t * xs;
        for (int i = 0; i < 4; i++) {
            float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int c = 0; c < K8; c += 8)
                for (int j = 0; j < 8; j++) l[j] = fmaf(w[i][c + j], xa[c + j], l[j]);
            s[(size_t)t * 4 + i] = tail(w[i], xa, K8, K, hsum_lanes(l));
        }
    }
#endif
}

/* Weight (r, c) of a bf16 / int8 matrix as float32. */
static inline float wval(const hsd_mat *A, int r, int c) {
    size_t i = (size_t)r * A->cols + c;
    if (A->type == HSD_BF16) {
        uint32_t u = (uint32_t)((const uint16_t *)A->w)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return (float)((const int8_t *)A->w)[i];
}

/* Row r of A as float32 values into buf[K] (the values every kernel computes with). */
static void expand_row(const hsd_mat *A, int r, float *buf) {
    const int K = A->cols;
    if (A->type == HSD_BF16) {
        const uint16_t *p = (const uint16_t *)A->w + (size_t)r * K;
        for (int c = 0; c < K; c++) {
            uint32_t u = (uint32_t)p[c] << 16;
            memcpy(buf + c, &u, 4);
        }
    } else if (A->type == HSD_Q8) {
        const int8_t *p = (const int8_t *)A->w + (size_t)r * K;
        for (int c = 0; c < K; c++) buf[c] = (float)p[c];
    } else if (A->type == HSD_Q4F) { /* w = fma(code, scale, minimum) */
        const int G = (K + HSD_GROUP - 1) / HSD_GROUP;
        const uint16_t *sc = (const uint16_t *)A->scale + (size_t)r * G, *z = (const uint16_t *)A->zero + (size_t)r * G;
        int c = 0;
#if HSD_AVX2
        for (; c + HSD_GROUP <= K; c += HSD_GROUP) { /* 8 at a time, the same fma */
            const int g = c / HSD_GROUP;
            const uint8_t *q = q4f_codes(A, r / 2, g / 2) + 8 * (r % 2);
            const __m256 a = _mm256_set1_ps(half_to_float(sc[g])), b = _mm256_set1_ps(half_to_float(z[g]));
            for (int k = 0; k < 4; k++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 16 * k)));
                if (g & 1) v = _mm256_srli_epi32(v, 4);
                v = _mm256_and_si256(v, _mm256_set1_epi32(15));
                _mm256_storeu_ps(buf + c + 8 * k, _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), a, b));
            }
        }
#endif
        for (; c < K; c++) {
            const int g = c / HSD_GROUP, k = (c % HSD_GROUP) / 8, j = c % 8;
            const uint8_t b = q4f_codes(A, r / 2, g / 2)[16 * k + 8 * (r % 2) + j];
            buf[c] = fmaf((float)((b >> (4 * (g % 2))) & 15), half_to_float(sc[g]), half_to_float(z[g]));
        }
    } else if (A->type == HSD_Q8F) { /* w = code * scale (cols a multiple of 32) */
        const uint16_t *sc = (const uint16_t *)A->scale + (size_t)r * (K / HSD_GROUP);
        int c = 0;
#if HSD_AVX2
        for (; c + 8 <= K; c += 8) { /* 8 at a time, the same product */
            const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q8f_codes(A, r / 2, c / 8) + 8 * (r % 2))));
            _mm256_storeu_ps(buf + c, _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(half_to_float(sc[c / HSD_GROUP]))));
        }
#endif
        for (; c < K; c++)
            buf[c] = (float)q8f_codes(A, r / 2, c / 8)[8 * (r % 2) + c % 8] * half_to_float(sc[c / HSD_GROUP]);
    }
}

#if HSD_AVX2
/* 8 weights of a bf16 / int8 row at column c, converted in registers to the values expand_row stores. */
static inline __m256 conv8(const hsd_mat *A, size_t off) {
    if (A->type == HSD_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)A->w + off));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)A->w + off))));
}

/* s[t * 4 + i] = W[r + i] . x_t for 4 rows of a bf16 / int8 matrix and m <= 2 positions, converting the
 * weights in registers: the same values and operations as expand_row followed by dots4, without the buffer. */
static void direct4(const hsd_mat *A, int r, const float *x, int xs, int m, float *s, prefetch_t *pf) {
    const int K = A->cols;
    const float *xb = x + (m > 1 ? xs : 0);
    __m256 a[4], b[4];
    for (int i = 0; i < 4; i++) a[i] = b[i] = _mm256_setzero_ps();
    const int K8 = K & ~7;
    for (int c = 0; c < K8; c += 8) {
        prefetch_line(pf);
        const __m256 u = _mm256_loadu_ps(x + c), v = _mm256_loadu_ps(xb + c);
        for (int i = 0; i < 4; i++) {
            __m256 w = conv8(A, (size_t)(r + i) * K + c);
            a[i] = _mm256_fmadd_ps(w, u, a[i]);
            if (m > 1) b[i] = _mm256_fmadd_ps(w, v, b[i]);
        }
    }
    for (int i = 0; i < 4; i++) {
        float ta = hsum8(a[i]), tb = hsum8(b[i]);
        for (int c = K8; c < K; c++) {
            float w = wval(A, r + i, c);
            ta = fmaf(w, x[c], ta);
            tb = fmaf(w, xb[c], tb);
        }
        s[i] = ta;
        if (m > 1) s[4 + i] = tb;
    }
}
#endif

/* ------------------------------------------------------------------------------------------------ integer path */

/* int4 and int8 weights (with whole groups of 32 columns) multiply int8 activations, as llama.cpp's Q4_1 x Q8_1
 * and Q8_0 x Q8_0 dot products do: each position's input is quantized per group of 32 columns to
 * q = round(x * 127 / max|x|) with scale d = max|x| / 127, and the exact float sum s of the group is kept.
 * For an int4 row (codes c, group scale a, minimum z) and an int8 row (codes c, row scale a):
 *     int4: W[r] . x ~ sum_g (a_g d_g) (c_g . q_g) + sum_g z_g s_g
 *     int8: W[r] . x ~ a * sum_g d_g (c_g . q_g)
 * The integer dot products are exact. int8: the float part accumulates 8 lanes (lane i: columns 4i..4i+3 of each
 * group) over the groups in order, then one fixed horizontal sum; int4: one float sum per row (see q4_rows).
 * The same operations for every position whatever the tile, so the path stays batch-invariant. */

typedef struct {
    const int8_t *q; /* [m, cols] */
    const float *d;  /* [m, cols / 32] */
    const float *s;  /* [m, cols / 32] */
    int cols;
} qx_t;

static inline int int_path(const hsd_mat *A) {
    return (A->type == HSD_Q4 || A->type == HSD_Q8) && A->cols % HSD_GROUP == 0;
}

/* Quantize x [m, K] (row stride xs) for the integer path into q [m, K], d and s [m, K / 32]. A group with a
 * value that is not finite gets codes 0 and d = s = NaN: every product over it is NaN, as the float product's
 * (int8 codes cannot hold it; the int8 path reads d alone, so a NaN skipped by the maximum was lost). */
static void quantize_x(const float *x, int xs, int m, int K, int8_t *q, float *d, float *s) {
    const int G = K / HSD_GROUP;
    for (int t = 0; t < m; t++)
        for (int g = 0; g < G; g++) {
            const float *p = x + (size_t)t * xs + g * HSD_GROUP;
            int8_t *o = q + (size_t)t * K + g * HSD_GROUP;
            float amax = 0.f, sum = 0.f;
            int finite = 1;
            for (int j = 0; j < HSD_GROUP; j++) {
                float a = fabsf(p[j]);
                finite &= a <= FLT_MAX;
                amax = a > amax ? a : amax;
                sum += p[j];
            }
            if (!finite) {
                memset(o, 0, HSD_GROUP);
                d[(size_t)t * G + g] = s[(size_t)t * G + g] = NAN;
                continue;
            }
            const float inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int j = 0; j < HSD_GROUP; j++) o[j] = (int8_t)nearbyintf(p[j] * inv);
            d[(size_t)t * G + g] = amax / 127.f;
            s[(size_t)t * G + g] = sum;
        }
}

#if HSD_AVX2

/* 8 lanes of exact integer sums (lane i: columns 4i..4i+3) as float: unsigned u times signed y. With VNNI one
 * instruction sums the four products; without, pairs are summed in 16 bits first (never saturating here: the
 * unsigned side is at most 127, the signed one at most 127 in magnitude), so both give the same integers. */
static inline __m256 idot(__m256i u, __m256i y) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u, y));
#elif defined(__AVXVNNI__)
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, y));
#else
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, y), _mm256_set1_epi16(1)));
#endif
}
#elif HSD_NEON
/* Lane i of the 8: the exact integer sum of codes 4i..4i+3 times y (the AVX2 lanes), as float. */
static inline void idot_lanes(const int *c, const int8_t *y, float *out) { /* c: 32 codes, -128..127 */
    int8_t cb[32];
    for (int j = 0; j < 32; j++) cb[j] = (int8_t)c[j];
    for (int h = 0; h < 2; h++) {
        const int8x16_t u = vld1q_s8(cb + 16 * h), v = vld1q_s8(y + 16 * h);
#if defined(__ARM_FEATURE_DOTPROD)
        const int32x4_t d = vdotq_s32(vdupq_n_s32(0), u, v);
#else
        const int16x8_t p0 = vmull_s8(vget_low_s8(u), vget_low_s8(v)), p1 = vmull_high_s8(u, v);
        const int32x4_t d = vpaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1));
#endif
        vst1q_f32(out + 4 * h, vcvtq_f32_s32(d));
    }
}
#else
static inline void idot_lanes(const int *c, const int8_t *y, float *out) { /* c: 32 signed codes */
    for (int i = 0; i < 8; i++)
        out[i] = (float)(c[4 * i] * y[4 * i] + c[4 * i + 1] * y[4 * i + 1] + c[4 * i + 2] * y[4 * i + 2]
                         + c[4 * i + 3] * y[4 * i + 3]);
}
#endif

#if HSD_AVX2
/* int8 rows wp[0..3] (G groups of 32 columns) against one or two positions (MT): s[t * 4 + i] = sum over g of
 * the 8-lane integer dot of group g (|w| times sign(w) y, for the unsigned-by-signed multiply) times d_g, in group
 * order, then hsum8 (the row scale is applied by the caller). Named accumulators (not an array the compiler would
 * keep in memory). */
static inline __attribute__((always_inline)) void q8_dots4(const uint8_t *const *wp, int G, const int8_t *xq0,
                                                          const int8_t *xq1, const float *d0, const float *d1,
                                                          const int MT, float *s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    const int8_t *w0 = (const int8_t *)wp[0], *w1 = (const int8_t *)wp[1], *w2 = (const int8_t *)wp[2],
                 *w3 = (const int8_t *)wp[3];
#define Q8_ROW(w, a, b)                                                                                         \
    do {                                                                                                        \
        const int8_t *blk = w + g * HSD_GROUP;                                                                  \
        _mm_prefetch((const char *)(blk + HSD_PREFETCH), _MM_HINT_T0);                                          \
        const __m256i wv = _mm256_loadu_si256((const __m256i *)blk);                                            \
        const __m256i aw = _mm256_sign_epi8(wv, wv);                                                            \
        a = _mm256_fmadd_ps(idot(aw, _mm256_sign_epi8(y0, wv)), e0, a);                                         \
        if (MT > 1) b = _mm256_fmadd_ps(idot(aw, _mm256_sign_epi8(y1, wv)), e1, b);                             \
    } while (0)
    for (int g = 0; g < G; g++) {
        const __m256i y0 = _mm256_loadu_si256((const __m256i *)(xq0 + g * HSD_GROUP));
        const __m256i y1 = MT > 1 ? _mm256_loadu_si256((const __m256i *)(xq1 + g * HSD_GROUP)) : y0;
        const __m256 e0 = _mm256_broadcast_ss(d0 + g), e1 = MT > 1 ? _mm256_broadcast_ss(d1 + g) : e0;
        Q8_ROW(w0, a0, b0);
        Q8_ROW(w1, a1, b1);
        Q8_ROW(w2, a2, b2);
        Q8_ROW(w3, a3, b3);
    }
#undef Q8_ROW
    s[0] = hsum8(a0), s[1] = hsum8(a1), s[2] = hsum8(a2), s[3] = hsum8(a3);
    if (MT > 1) s[4] = hsum8(b0), s[5] = hsum8(b1), s[6] = hsum8(b2), s[7] = hsum8(b3);
}

/* The AVX2 body of int_dots4 for exactly MT (1 or 2) positions: constant MT lets the compiler drop the second. */
static inline __attribute__((always_inline)) void int_dots4_avx2(const hsd_mat *A, const int *rr, const qx_t *X,
                                                                 int t0, const int MT, float *s) {
    const int K = A->cols, G = K / HSD_GROUP;
    const int8_t *xq0 = X->q + (size_t)t0 * K, *xq1 = xq0 + (MT > 1 ? K : 0);
    const float *d0 = X->d + (size_t)t0 * G, *d1 = d0 + (MT > 1 ? G : 0);
    const uint8_t *wp[4];
    for (int i = 0; i < 4; i++) wp[i] = (const uint8_t *)A->w + (size_t)rr[i] * K;
    q8_dots4(wp, G, xq0, xq1, d0, d1, MT, s);
}
#endif

/* s[t * 4 + i] for int8 rows r .. r+3 (rows past n repeat row n-1) and positions t < mt <= 2 of X: the float part
 * of the dot products above, before the row scale and the bias. */
static void int_dots4(const hsd_mat *A, int r, int n, const qx_t *X, int t0, int mt, float *s) {
    int rr[4];
    for (int i = 0; i < 4; i++) rr[i] = r + (i < n ? i : n - 1);
#if HSD_AVX2
    if (mt > 1)
        int_dots4_avx2(A, rr, X, t0, 2, s);
    else
        int_dots4_avx2(A, rr, X, t0, 1, s);
#else
    const int K = A->cols, G = K / HSD_GROUP;
    for (int t = 0; t < mt; t++) {
        const int8_t *xq = X->q + (size_t)(t0 + t) * K;
        const float *dd = X->d + (size_t)(t0 + t) * G;
        for (int i = 0; i < 4; i++) {
            float l[8] = {0, 0, 0, 0, 0, 0, 0, 0}, f[8];
            int c[32];
            for (int g = 0; g < G; g++) {
                const int8_t *w = (const int8_t *)A->w + (size_t)rr[i] * K + g * HSD_GROUP;
                for (int j = 0; j < 32; j++) c[j] = w[j];
                const float sc = dd[g];
                idot_lanes(c, xq + g * HSD_GROUP, f);
                for (int j = 0; j < 8; j++) l[j] = fmaf(f[j], sc, l[j]);
            }
            s[t * 4 + i] = hsum_lanes(l);
        }
    }
#endif
}

/* Rows [r0, r1) of an int8 integer-path matrix: y[t * ys + r] (+)= W[r] . x_t for the m positions of X. */
static void int_rows(const hsd_mat *A, const qx_t *X, int m, float *y, int ys, int r0, int r1, int acc) {
    float s[8];
    for (int r = r0; r < r1; r += 4) {
        const int n = r1 - r < 4 ? r1 - r : 4;
        for (int t0 = 0; t0 < m; t0 += 2) {
            const int mt = m - t0 < 2 ? m - t0 : 2;
            int_dots4(A, r, n, X, t0, mt, s);
            for (int t = 0; t < mt; t++)
                for (int i = 0; i < n; i++) {
                    float v = s[t * 4 + i] * ((const float *)A->scale)[r + i];
                    if (A->bias) v += A->bias[r + i];
                    float *out = y + (size_t)(t0 + t) * ys + r + i;
                    *out = acc ? *out + v : v;
                }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ int4 blocks */

/* An int4 matrix (HSD_Q4) is stored in blocks of 16 rows (see hsd_mat), so that one vector holds the same four
 * columns of 16 rows (AVX-512), 8 (AVX2) or 4 (NEON), and a row's dot product needs no horizontal sum: each lane is
 * a row. For row r and position t (q, d, s: the position's int8 codes, group scales and group sums), in group order:
 *     a = fma((float)(c_g . q_g), scale_g * d_g, a)        the exact integer dot of group g, its factor one product
 *     b = fma(zero_g, s_g, b)                              the minimum term
 * and W[r] . x_t ~ a + b. Every variant computes these operations for every element, whatever the tile, so the
 * path is batch-invariant and every variant gives the same bits. */

/* Bytes of one block of 16 int4 rows of G groups: 512 per pair of groups (an odd last group takes a whole pair's). */
static inline size_t q4_block_bytes(int G) { return (size_t)256 * (G + (G & 1)); }

/* Four bytes of x as one 32-bit integer (memory order). */
static inline int32_t load4b(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

#if HSD_AVX512
/* acc + the exact sums of four unsigned-by-signed byte products per 32-bit lane. Without VNNI the caller sums
 * maddubs results in 16 bits first (at most 8 x 2 x 15 x 127 = 30480: never saturating). */
static inline __m512i q4_dot16(__m512i acc, __m512i u, __m512i y) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, u, y);
#else
    return _mm512_add_epi16(acc, _mm512_maddubs_epi16(u, y));
#endif
}
static inline __m512i q4_lanes16(__m512i acc) {
#if defined(__AVX512VNNI__)
    return acc;
#else
    return _mm512_madd_epi16(acc, _mm512_set1_epi16(1));
#endif
}

/* out[t * 16 + i] for the 16 rows of block w (codes), sc, zc (scales, minimums) and MT (1 or 2) positions. */
static inline __attribute__((always_inline)) void q4_block16(const uint8_t *w, const uint16_t *sc, const uint16_t *zc,
                                                            int G, const qx_t *X, int t0, const int MT, float *out) {
    const int K = X->cols;
    const int8_t *x0 = X->q + (size_t)t0 * K, *x1 = x0 + (MT > 1 ? K : 0);
    const float *d0 = X->d + (size_t)t0 * G, *d1 = d0 + (MT > 1 ? G : 0);
    const float *s0 = X->s + (size_t)t0 * G, *s1 = s0 + (MT > 1 ? G : 0);
    const __m512i mask = _mm512_set1_epi8(0xF);
    __m512 a0 = _mm512_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;
    for (int g = 0; g < G; g += 2) {
        const int two = g + 1 < G;
        const uint8_t *blk = w + (size_t)256 * g;
        for (int k = 0; k < 512; k += 64) _mm_prefetch((const char *)(blk + HSD_PREFETCH + k), _MM_HINT_T0);
        /* MT 1: i/j the even and odd quads of group g, k/l of group g + 1 (four chains); MT 2: i/k position 0 */
        __m512i i = _mm512_setzero_si512(), j = i, k = i, l = i;
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const __m512i v = _mm512_loadu_si512((const void *)(blk + 64 * q));
            const __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
            const int c = g * HSD_GROUP + 4 * q;
            if (MT == 1 && (q & 1)) {
                j = q4_dot16(j, lo, _mm512_set1_epi32(load4b(x0 + c)));
                if (two) l = q4_dot16(l, hi, _mm512_set1_epi32(load4b(x0 + c + HSD_GROUP)));
            } else {
                i = q4_dot16(i, lo, _mm512_set1_epi32(load4b(x0 + c)));
                if (two) k = q4_dot16(k, hi, _mm512_set1_epi32(load4b(x0 + c + HSD_GROUP)));
                if (MT > 1) {
                    j = q4_dot16(j, lo, _mm512_set1_epi32(load4b(x1 + c)));
                    if (two) l = q4_dot16(l, hi, _mm512_set1_epi32(load4b(x1 + c + HSD_GROUP)));
                }
            }
        }
        __m512i e0, f0, e1 = j, f1 = l;
        if (MT == 1) {
            e0 = _mm512_add_epi32(q4_lanes16(i), q4_lanes16(j)), f0 = _mm512_add_epi32(q4_lanes16(k), q4_lanes16(l));
        } else {
            e0 = q4_lanes16(i), f0 = q4_lanes16(k), e1 = q4_lanes16(j), f1 = q4_lanes16(l);
        }
        const __m512 sa = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * g)));
        const __m512 za = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zc + 16 * g)));
        a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e0), _mm512_mul_ps(sa, _mm512_set1_ps(d0[g])), a0);
        b0 = _mm512_fmadd_ps(za, _mm512_set1_ps(s0[g]), b0);
        if (MT > 1) {
            a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e1), _mm512_mul_ps(sa, _mm512_set1_ps(d1[g])), a1);
            b1 = _mm512_fmadd_ps(za, _mm512_set1_ps(s1[g]), b1);
        }
        if (two) {
            const __m512 sb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16 * (g + 1))));
            const __m512 zb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(zc + 16 * (g + 1))));
            a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f0), _mm512_mul_ps(sb, _mm512_set1_ps(d0[g + 1])), a0);
            b0 = _mm512_fmadd_ps(zb, _mm512_set1_ps(s0[g + 1]), b0);
            if (MT > 1) {
                a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(f1), _mm512_mul_ps(sb, _mm512_set1_ps(d1[g + 1])), a1);
                b1 = _mm512_fmadd_ps(zb, _mm512_set1_ps(s1[g + 1]), b1);
            }
        }
    }
    _mm512_storeu_ps(out, _mm512_add_ps(a0, b0));
    if (MT > 1) _mm512_storeu_ps(out + 16, _mm512_add_ps(a1, b1));
}
#elif HSD_AVX2
static inline __m256i q4_dot8(__m256i acc, __m256i u, __m256i y) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, y);
#else
    return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, y)); /* summed in 16 bits: see q4_dot16 */
#endif
}
static inline __m256i q4_lanes8(__m256i acc) {
#if defined(__AVXVNNI__)
    return acc;
#else
    return _mm256_madd_epi16(acc, _mm256_set1_epi16(1));
#endif
}

/* q4_block16 for rows 8h .. 8h + 7 of the block (h 0 or 1): out[t * 16 + 8h + i]. */
static inline __attribute__((always_inline)) void q4_block8(const uint8_t *w, const uint16_t *sc, const uint16_t *zc,
                                                           int G, const qx_t *X, int t0, const int MT, int h,
                                                           float *out) {
    const int K = X->cols;
    const int8_t *x0 = X->q + (size_t)t0 * K, *x1 = x0 + (MT > 1 ? K : 0);
    const float *d0 = X->d + (size_t)t0 * G, *d1 = d0 + (MT > 1 ? G : 0);
    const float *s0 = X->s + (size_t)t0 * G, *s1 = s0 + (MT > 1 ? G : 0);
    const __m256i mask = _mm256_set1_epi8(0xF);
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0;
    for (int g = 0; g < G; g += 2) {
        const int two = g + 1 < G;
        const uint8_t *blk = w + (size_t)256 * g + 32 * h;
        if (h == 0) /* the second half reads the same lines, cached by the first's pass */
            for (int k = 0; k < 512; k += 64) _mm_prefetch((const char *)(blk + HSD_PREFETCH + k), _MM_HINT_T0);
        __m256i i = _mm256_setzero_si256(), j = i, k = i, l = i;
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * q));
            const __m256i lo = _mm256_and_si256(v, mask), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            const int c = g * HSD_GROUP + 4 * q;
            if (MT == 1 && (q & 1)) {
                j = q4_dot8(j, lo, _mm256_set1_epi32(load4b(x0 + c)));
                if (two) l = q4_dot8(l, hi, _mm256_set1_epi32(load4b(x0 + c + HSD_GROUP)));
            } else {
                i = q4_dot8(i, lo, _mm256_set1_epi32(load4b(x0 + c)));
                if (two) k = q4_dot8(k, hi, _mm256_set1_epi32(load4b(x0 + c + HSD_GROUP)));
                if (MT > 1) {
                    j = q4_dot8(j, lo, _mm256_set1_epi32(load4b(x1 + c)));
                    if (two) l = q4_dot8(l, hi, _mm256_set1_epi32(load4b(x1 + c + HSD_GROUP)));
                }
            }
        }
        __m256i e0, f0, e1 = j, f1 = l;
        if (MT == 1) {
            e0 = _mm256_add_epi32(q4_lanes8(i), q4_lanes8(j)), f0 = _mm256_add_epi32(q4_lanes8(k), q4_lanes8(l));
        } else {
            e0 = q4_lanes8(i), f0 = q4_lanes8(k), e1 = q4_lanes8(j), f1 = q4_lanes8(l);
        }
        const __m256 sa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * g + 8 * h)));
        const __m256 za = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zc + 16 * g + 8 * h)));
        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e0), _mm256_mul_ps(sa, _mm256_set1_ps(d0[g])), a0);
        b0 = _mm256_fmadd_ps(za, _mm256_set1_ps(s0[g]), b0);
        if (MT > 1) {
            a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(e1), _mm256_mul_ps(sa, _mm256_set1_ps(d1[g])), a1);
            b1 = _mm256_fmadd_ps(za, _mm256_set1_ps(s1[g]), b1);
        }
        if (two) {
            const __m256 sb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * (g + 1) + 8 * h)));
            const __m256 zb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zc + 16 * (g + 1) + 8 * h)));
            a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(f0), _mm256_mul_ps(sb, _mm256_set1_ps(d0[g + 1])), a0);
            b0 = _mm256_fmadd_ps(zb, _mm256_set1_ps(s0[g + 1]), b0);
            if (MT > 1) {
                a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(f1), _mm256_mul_ps(sb, _mm256_set1_ps(d1[g + 1])), a1);
                b1 = _mm256_fmadd_ps(zb, _mm256_set1_ps(s1[g + 1]), b1);
            }
        }
    }
    _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(a0, b0));
    if (MT > 1) _mm256_storeu_ps(out + 16 + 8 * h, _mm256_add_ps(a1, b1));
}

/* q4_block8 for MT = 3 or 4 positions: the codes of each 64 bytes unpacked once for all of them (a pass's positions
 * then cost their integer products alone). Per position the same integer sums (its group g's codes in accumulator
 * lo[t], group g + 1's in hi[t], 8 quads each, summed in 16 bits as MT 2 sums them) and the same float operations in
 * the same order as q4_block8, so every element has the bits one position gives. */
static inline __attribute__((always_inline)) void q4_block8_wide(const uint8_t *w, const uint16_t *sc,
                                                                const uint16_t *zc, int G, const qx_t *X, int t0,
                                                                const int MT, int h, float *out) {
    const int K = X->cols;
    const __m256i mask = _mm256_set1_epi8(0xF);
    __m256 a[4], b[4];
#pragma GCC unroll 4
    for (int t = 0; t < MT; t++) a[t] = b[t] = _mm256_setzero_ps();
    for (int g = 0; g < G; g += 2) {
        const int two = g + 1 < G;
        const uint8_t *blk = w + (size_t)256 * g + 32 * h;
        if (h == 0)
            for (int k = 0; k < 512; k += 64) _mm_prefetch((const char *)(blk + HSD_PREFETCH + k), _MM_HINT_T0);
        __m256i lo[4], hi[4];
#pragma GCC unroll 4
        for (int t = 0; t < MT; t++) lo[t] = hi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 64 * q));
            const __m256i cl = _mm256_and_si256(v, mask), ch = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
            const int8_t *xc = X->q + (size_t)t0 * K + g * HSD_GROUP + 4 * q;
#pragma GCC unroll 4
            for (int t = 0; t < MT; t++) {
                lo[t] = q4_dot8(lo[t], cl, _mm256_set1_epi32(load4b(xc + (size_t)t * K)));
                if (two) hi[t] = q4_dot8(hi[t], ch, _mm256_set1_epi32(load4b(xc + (size_t)t * K + HSD_GROUP)));
            }
        }
        const __m256 sa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * g + 8 * h)));
        const __m256 za = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zc + 16 * g + 8 * h)));
        const __m256 sb = two ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * (g + 1) + 8 * h))) : sa;
        const __m256 zb = two ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(zc + 16 * (g + 1) + 8 * h))) : za;
#pragma GCC unroll 4
        for (int t = 0; t < MT; t++) {
            const float *d = X->d + (size_t)(t0 + t) * G, *s = X->s + (size_t)(t0 + t) * G;
            a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_lanes8(lo[t])), _mm256_mul_ps(sa, _mm256_set1_ps(d[g])), a[t]);
            b[t] = _mm256_fmadd_ps(za, _mm256_set1_ps(s[g]), b[t]);
            if (two) {
                a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q4_lanes8(hi[t])), _mm256_mul_ps(sb, _mm256_set1_ps(d[g + 1])),
                                       a[t]);
                b[t] = _mm256_fmadd_ps(zb, _mm256_set1_ps(s[g + 1]), b[t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < MT; t++) _mm256_storeu_ps(out + 16 * t + 8 * h, _mm256_add_ps(a[t], b[t]));
}
#elif HSD_NEON
/* q4_block16 for rows 4h .. 4h + 3 of the block (h 0..3) and one position: out[4h + i]. */
static void q4_block4_neon(const uint8_t *w, const uint16_t *sc, const uint16_t *zc, int G, const int8_t *x,
                           const float *d, const float *s, int h, float *out) {
    const uint8x16_t mask = vdupq_n_u8(0xF);
    float32x4_t a = vdupq_n_f32(0.f), b = a;
    for (int g = 0; g < G; g++) {
        const uint8_t *blk = w + (size_t)256 * (g - (g & 1)) + 16 * h;
        int32x4_t n = vdupq_n_s32(0);
        for (int q = 0; q < 8; q++) {
            const uint8x16_t v = vld1q_u8(blk + 64 * q);
            const int8x16_t c = vreinterpretq_s8_u8((g & 1) ? vshrq_n_u8(v, 4) : vandq_u8(v, mask));
            const int8x16_t y = vreinterpretq_s8_s32(vdupq_n_s32(load4b(x + g * HSD_GROUP + 4 * q)));
#if defined(__ARM_FEATURE_DOTPROD)
            n = vdotq_s32(n, c, y);
#else
            const int32x4_t p = vpaddq_s32(vpaddlq_s16(vmull_s8(vget_low_s8(c), vget_low_s8(y))),
                                           vpaddlq_s16(vmull_high_s8(c, y)));
            n = vaddq_s32(n, p);
#endif
        }
        const float32x4_t sg = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(sc + 16 * g + 4 * h)));
        const float32x4_t zg = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(zc + 16 * g + 4 * h)));
        a = vfmaq_f32(a, vcvtq_f32_s32(n), vmulq_f32(sg, vdupq_n_f32(d[g])));
        b = vfmaq_f32(b, zg, vdupq_n_f32(s[g]));
    }
    vst1q_f32(out + 4 * h, vaddq_f32(a, b));
}
#endif

/* Positions of X one call of q4_block computes (AVX2: the codes unpacked once for up to 4). */
#if HSD_AVX2 && !HSD_AVX512
#define HSD_Q4_MT 4
#else
#define HSD_Q4_MT 2
#endif

/* out[t * 16 + i] = W[16 * blk + i] . x_{t0 + t} for the 16 rows of block blk (rows past the matrix: zeros) and
 * mt (1 to HSD_Q4_MT) positions of X, the operations above. */
static void q4_block(const hsd_mat *A, int blk, const qx_t *X, int t0, int mt, float *out) {
    const int G = A->cols / HSD_GROUP;
    const uint8_t *w = (const uint8_t *)A->w + (size_t)blk * q4_block_bytes(G);
    const uint16_t *sc = (const uint16_t *)A->scale + (size_t)blk * 16 * G;
    const uint16_t *zc = (const uint16_t *)A->zero + (size_t)blk * 16 * G;
#if HSD_AVX512
    if (mt > 1)
        q4_block16(w, sc, zc, G, X, t0, 2, out);
    else
        q4_block16(w, sc, zc, G, X, t0, 1, out);
#elif HSD_AVX2
    for (int h = 0; h < 2; h++) {
        if (mt == 4)
            q4_block8_wide(w, sc, zc, G, X, t0, 4, h, out);
        else if (mt == 3)
            q4_block8_wide(w, sc, zc, G, X, t0, 3, h, out);
        else if (mt == 2)
            q4_block8(w, sc, zc, G, X, t0, 2, h, out);
        else
            q4_block8(w, sc, zc, G, X, t0, 1, h, out);
    }
#else
    const int K = A->cols;
    for (int t = 0; t < mt; t++) {
        const int8_t *x = X->q + (size_t)(t0 + t) * K;
        const float *d = X->d + (size_t)(t0 + t) * G, *s = X->s + (size_t)(t0 + t) * G;
#if HSD_NEON
        for (int h = 0; h < 4; h++) q4_block4_neon(w, sc, zc, G, x, d, s, h, out + 16 * t);
#else
        for (int i = 0; i < 16; i++) {
            float a = 0.f, b = 0.f;
            for (int g = 0; g < G; g++) {
                const uint8_t *p = w + (size_t)256 * (g - (g & 1)) + 4 * i;
                int32_t n = 0;
                for (int q = 0; q < 8; q++)
                    for (int c = 0; c < 4; c++)
                        n += ((p[64 * q + c] >> (4 * (g & 1))) & 15) * x[g * HSD_GROUP + 4 * q + c];
                a = fmaf((float)n, half_to_float(sc[16 * g + i]) * d[g], a);
                b = fmaf(half_to_float(zc[16 * g + i]), s[g], b);
            }
            out[16 * t + i] = a + b;
        }
#endif
    }
#endif
}

/* Rows [r0, r1) of an int4 matrix: y[t * ys + r] (+)= W[r] . x_t (+ bias) for the m positions of X, computed a block
 * of 16 rows at a time (a block that [r0, r1) cuts is computed whole; only its rows in the range are stored). */
static void q4_rows(const hsd_mat *A, const qx_t *X, int m, float *y, int ys, int r0, int r1, int acc) {
    float s[16 * HSD_Q4_MT];
    for (int blk = r0 / 16; 16 * blk < r1; blk++) {
        const int lo = 16 * blk > r0 ? 16 * blk : r0, hi = 16 * blk + 16 < r1 ? 16 * blk + 16 : r1;
        for (int t0 = 0; t0 < m; t0 += HSD_Q4_MT) {
            const int mt = m - t0 < HSD_Q4_MT ? m - t0 : HSD_Q4_MT;
            q4_block(A, blk, X, t0, mt, s);
            for (int t = 0; t < mt; t++)
                for (int r = lo; r < hi; r++) {
                    float v = s[16 * t + r - 16 * blk];
                    if (A->bias) v += A->bias[r];
                    float *out = y + (size_t)(t0 + t) * ys + r;
                    *out = acc ? *out + v : v;
                }
        }
    }
}

/* y[(t0 + t) * ys + r + i] (+)= s[t * 4 + i] (* scale[r + i] for int8) (+ bias[r + i]) for t < mt, i < n. */
static inline void store4(const hsd_mat *A, const float *s, int mt, int n, float *y, int ys, int t0, int r, int acc) {
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < n; i++) {
            float d = s[t * 4 + i];
            if (A->type == HSD_Q8) d *= ((const float *)A->scale)[r + i];
            if (A->bias) d += A->bias[r + i];
            float *out = y + (size_t)(t0 + t) * ys + r + i;
            *out = acc ? *out + d : d;
        }
}

#if HSD_AVX2
/* Ask the cache for rows [r, r + 4) of a paired matrix (codes, scales, minimums), read a few blocks later. */
static inline void prefetch_block(const hsd_mat *A, int r) {
    if (r >= A->rows) return;
    const int G = A->cols / HSD_GROUP;
    const char *p, *end;
    if (A->type == HSD_Q4F) { /* the block's codes: one run (r is a multiple of 4) */
        p = (const char *)q4f_codes(A, r / 2, 0);
        end = p + (size_t)((G + 1) / 2) * HSD_Q4F_STEP;
    } else { /* q8f: the block's two pairs of rows (one at the matrix end) */
        const int pairs = (A->rows + 1) / 2, n = pairs - r / 2 < 2 ? pairs - r / 2 : 2;
        p = (const char *)A->w + (size_t)(r / 2) * 2 * A->cols;
        end = p + (size_t)n * 2 * A->cols;
    }
    for (; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
    const size_t factor_bytes = (size_t)2 * G * (A->rows - r < 4 ? A->rows - r : 4);
    const char *sc = (const char *)((const uint16_t *)A->scale + (size_t)r * G);
    const char *zc = A->zero ? (const char *)((const uint16_t *)A->zero + (size_t)r * G) : NULL;
    for (size_t o = 0; o < factor_bytes; o += 64) { /* every line of the block's scales and minimums */
        _mm_prefetch(sc + o, _MM_HINT_T0);
        if (zc) _mm_prefetch(zc + o, _MM_HINT_T0);
    }
}

/* G float16 values as float32, 16 at a time with AVX-512, else 8 (exact). */
static inline void halves_to_floats(const uint16_t *h, int G, float *out) {
    int g = 0;
#if HSD_AVX512
    for (; g + 16 <= G; g += 16) _mm512_storeu_ps(out + g, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + g))));
#endif
    for (; g + 8 <= G; g += 8) _mm256_storeu_ps(out + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + g))));
    for (; g < G; g++) out[g] = half_to_float(h[g]);
}

/* The scales (and, with zf, the minimums) of rows r .. r+3 of a paired matrix as float32, [row][group]; a short last
 * block of n rows repeats its last row. */
static inline void block_factors(const hsd_mat *A, int r, int n, float sf[4][HSD_PAIRED_MAX_GROUPS],
                                 float zf[4][HSD_PAIRED_MAX_GROUPS]) {
    const int G = A->cols / HSD_GROUP;
    for (int i = 0; i < 4; i++) {
        const size_t ri = (size_t)r + (i < n ? i : n - 1);
        halves_to_floats((const uint16_t *)A->scale + ri * G, G, sf[i]);
        if (zf) halves_to_floats((const uint16_t *)A->zero + ri * G, G, zf[i]);
    }
}

/* The in-register q4f tiles on 8-lane registers (AVX2): s[t * 4 + i] = W[r + i] . x_t for rows r .. r+3 of a q4f
 * matrix (n of them real; a short last block repeats its last row) and the P positions of one tile. Each 8 weights
 * of a row are de-quantized in registers as the FMAs go, fma(code, scale, minimum) (expand_row's operation, so the
 * same float32 values), and multiplied into the row's one 8-lane accumulator per position, over the columns in
 * order, then hsum8: the operations of dots4 on expand_row's values, so every element is bit for bit theirs, whichever
 * tile computes it. The weights never pass through memory. A byte holds a code of each group of a pair (low nibble:
 * the first), so one widening load serves 16 weights. Per 8 weights: half a widening load, a mask or shift, a
 * conversion, one FMA to de-quantize and P to multiply. The four tiles differ only in the order they visit rows and
 * columns, chosen by the number of positions (measured on Zen 3: docs/results.md, AVX2 section, "The step"):
 * - one position (q4f_tile_interleaved): each 8 columns of the four rows in turn, so four accumulator chains overlap;
 *   the second group's codes wait in registers while the first group's columns are summed;
 * - 2 or 3 (q4f_tile_by_group): per pair of groups, each row's 64 columns in turn (4 * P accumulators, the codes of
 *   one row at a time held);
 * - 4 (q4f_tile_two_rows): two rows whole at a time, each position's inputs loaded once for both, 8 chains (one row's
 *   4 left the FMAs waiting on their latency: benchmarks/mat_rows_ab.py on Zen 3, 0.88x the time of q4f_tile_by_row);
 * - 5 to HSD_Q4F_REG_MAX (q4f_tile_by_row): each row whole in turn, its P accumulators the chains that overlap (two
 *   rows' 2 * P accumulators, 10 or more, left too few registers: slower). */
typedef struct {
    float sf[4][HSD_PAIRED_MAX_GROUPS], zf[4][HSD_PAIRED_MAX_GROUPS]; /* scales, minimums as float32 [row][group] */
    const uint8_t *q[4];                                               /* each row's codes (its half of a pair's) */
    int G;                                                             /* groups per row */
} q4f_block;

static inline __attribute__((always_inline)) void q4f_block_at(q4f_block *b, const hsd_mat *A, int r, int n) {
    b->G = A->cols / HSD_GROUP;
    block_factors(A, r, n, b->sf, b->zf);
    for (int i = 0; i < 4; i++) {
        const int ri = r + (i < n ? i : n - 1);
        b->q[i] = q4f_codes(A, ri / 2, 0) + 8 * (ri % 2);
    }
}

/* acc[p] += fma(code vector v of row i, its group g's scale, minimum) * x_p at columns c .. c+7 */
#define Q4F_COLS(b, acc, v, i, g, c)                                                                             \
    do {                                                                                                         \
        const __m256 w_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_broadcast_ss(&(b)->sf[i][g]),           \
                                          _mm256_broadcast_ss(&(b)->zf[i][g]));                                  \
        for (int p_ = 0; p_ < P; p_++)                                                                           \
            (acc)[p_] = _mm256_fmadd_ps(w_, _mm256_loadu_ps(x + (size_t)p_ * xs + (c)), (acc)[p_]);             \
    } while (0)

/* The codes of row i for columns 8k .. 8k+7 of the pair of groups from group g (both nibbles of each byte). */
static inline __m256i q4f_codes8(const q4f_block *b, int i, int g, int k) {
    const uint8_t *q = b->q[i] + (size_t)(g / 2) * HSD_Q4F_STEP + 16 * k;
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
}

/* acc[p] += row i's columns of groups g and g + 1 (g alone when it is the last), positions p < P. */
static inline __attribute__((always_inline)) void q4f_row_groups(const q4f_block *b, int i, int g, const float *x,
                                                                 int xs, int P, __m256 *acc) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256i hi[4];
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        const __m256i v = q4f_codes8(b, i, g, k);
        hi[k] = _mm256_srli_epi32(v, 4);
        Q4F_COLS(b, acc, _mm256_and_si256(v, low), i, g, HSD_GROUP * g + 8 * k);
    }
    if (g + 1 < b->G) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) Q4F_COLS(b, acc, hi[k], i, g + 1, HSD_GROUP * (g + 1) + 8 * k);
    }
}

static inline __attribute__((always_inline)) void q4f_tile_interleaved(const hsd_mat *A, int r, int n,
                                                                       const float *x, int xs, float *s) {
    enum { P = 1 };
    q4f_block b;
    q4f_block_at(&b, A, r, n);
    const __m256i low = _mm256_set1_epi32(15);
    __m256 acc[4][1];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) acc[i][0] = _mm256_setzero_ps();
    int g = 0;
    for (; g + 1 < b.G; g += 2) {
        __m256i hi[4][4]; /* the second group's codes */
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m256i v = q4f_codes8(&b, i, g, k);
                hi[i][k] = _mm256_srli_epi32(v, 4);
                Q4F_COLS(&b, acc[i], _mm256_and_si256(v, low), i, g, HSD_GROUP * g + 8 * k);
            }
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) Q4F_COLS(&b, acc[i], hi[i][k], i, g + 1, HSD_GROUP * (g + 1) + 8 * k);
    }
    if (g < b.G) { /* an odd last group: the low nibbles of its pair's bytes */
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) q4f_row_groups(&b, i, g, x, xs, P, acc[i]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) s[i] = hsum8(acc[i][0]);
}

static inline __attribute__((always_inline)) void q4f_tile_by_group(const hsd_mat *A, int r, int n, const float *x,
                                                                    int xs, int P, float *s) {
    q4f_block b;
    q4f_block_at(&b, A, r, n);
    __m256 acc[4][3];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
#pragma GCC unroll 3
        for (int p = 0; p < P; p++) acc[i][p] = _mm256_setzero_ps();
    for (int g = 0; g < b.G; g += 2)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            /* each row loads its inputs again (from L1): held across the four rows, they made the compiler spill
             * the 4 * P accumulators (benchmarks/mat_rows_ab.py on Zen 3: passes of 2 and 3 positions 1-4% faster) */
            const float *xi = x;
            __asm__("" : "+r"(xi));
            q4f_row_groups(&b, i, g, xi, xs, P, acc[i]);
        }
#pragma GCC unroll 3
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) s[(size_t)p * 4 + i] = hsum8(acc[i][p]);
}

static inline __attribute__((always_inline)) void q4f_tile_by_row(const hsd_mat *A, int r, int n, const float *x,
                                                                  int xs, int P, float *s) {
    q4f_block b;
    q4f_block_at(&b, A, r, n);
    for (int i = 0; i < 4; i++) {
        __m256 acc[HSD_Q4F_REG_MAX];
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) acc[p] = _mm256_setzero_ps();
        for (int g = 0; g < b.G; g += 2) q4f_row_groups(&b, i, g, x, xs, P, acc);
#pragma GCC unroll 8
        for (int p = 0; p < P; p++) s[(size_t)p * 4 + i] = hsum8(acc[p]);
    }
}
/* Two rows' columns c .. c+7 for positions p < P: each row's 8 codes v0, v1 de-quantized with its group g's factors,
 * then, per position, the inputs read once for both rows' FMAs. */
#define Q4F_COLS2(b, acc, v0, v1, i, g, c)                                                                       \
    do {                                                                                                         \
        const __m256 w0_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v0), _mm256_broadcast_ss(&(b)->sf[i][g]),          \
                                           _mm256_broadcast_ss(&(b)->zf[i][g]));                                 \
        const __m256 w1_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v1), _mm256_broadcast_ss(&(b)->sf[(i) + 1][g]),    \
                                           _mm256_broadcast_ss(&(b)->zf[(i) + 1][g]));                           \
        for (int p_ = 0; p_ < P; p_++) {                                                                         \
            const __m256 x_ = _mm256_loadu_ps(x + (size_t)p_ * xs + (c));                                        \
            (acc)[0][p_] = _mm256_fmadd_ps(w0_, x_, (acc)[0][p_]);                                               \
            (acc)[1][p_] = _mm256_fmadd_ps(w1_, x_, (acc)[1][p_]);                                               \
        }                                                                                                        \
    } while (0)

static inline __attribute__((always_inline)) void q4f_tile_two_rows(const hsd_mat *A, int r, int n, const float *x,
                                                                    int xs, int P, float *s) {
    q4f_block b;
    q4f_block_at(&b, A, r, n);
    const __m256i low = _mm256_set1_epi32(15);
    for (int i = 0; i < 4; i += 2) {
        __m256 acc[2][4];
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) acc[0][p] = acc[1][p] = _mm256_setzero_ps();
        for (int g = 0; g < b.G; g += 2) {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++)
                Q4F_COLS2(&b, acc, _mm256_and_si256(q4f_codes8(&b, i, g, k), low),
                          _mm256_and_si256(q4f_codes8(&b, i + 1, g, k), low), i, g, HSD_GROUP * g + 8 * k);
            if (g + 1 < b.G) { /* the second group: the same bytes' high nibbles, loaded again from L1 */
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++)
                    Q4F_COLS2(&b, acc, _mm256_srli_epi32(q4f_codes8(&b, i, g, k), 4),
                              _mm256_srli_epi32(q4f_codes8(&b, i + 1, g, k), 4), i, g + 1,
                              HSD_GROUP * (g + 1) + 8 * k);
            }
        }
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) {
            s[(size_t)p * 4 + i] = hsum8(acc[0][p]);
            s[(size_t)p * 4 + i + 1] = hsum8(acc[1][p]);
        }
    }
}
#undef Q4F_COLS2
#undef Q4F_COLS

/* s[t * 4 + i] for rows r .. r+3 and 1 <= m <= HSD_Q4F_REG_MAX positions: the tile for m, its P a constant. */
static inline void q4f_tiles_avx2(const hsd_mat *A, int r, int n, const float *x, int xs, int m, float *s) {
    switch (m) {
    case 1: q4f_tile_interleaved(A, r, n, x, xs, s); break;
    case 2: q4f_tile_by_group(A, r, n, x, xs, 2, s); break;
    case 3: q4f_tile_by_group(A, r, n, x, xs, 3, s); break;
    case 4: q4f_tile_two_rows(A, r, n, x, xs, 4, s); break;
    case 5: q4f_tile_by_row(A, r, n, x, xs, 5, s); break;
    case 6: q4f_tile_by_row(A, r, n, x, xs, 6, s); break;
    case 7: q4f_tile_by_row(A, r, n, x, xs, 7, s); break;
    default: q4f_tile_by_row(A, r, n, x, xs, 8, s); break;
    }
}

/* The in-register q8f tiles on 8-lane registers (AVX2): s[t * 4 + i] = W[r + i] . x_t for rows r .. r+3 of a q8f
 * matrix (n of them real; a short last block repeats its last row) and P <= HSD_Q8F_REG_MAX positions. Each 8
 * weights of a row are converted in registers, code * scale (expand_row's product, exact), and multiplied into the
 * row's 8-lane accumulator of each position, over the columns in order, then hsum8: the operations of dots4 on
 * expand_row's values, so every element is bit for bit theirs. Per 8 weights: a widening load, a conversion, a
 * product and P FMAs, where expand_row then dots4 also store and load them again. Each 8 columns of the four rows
 * in turn, so four (or 4 * P) accumulator chains overlap. */
#define HSD_Q8F_REG_MAX 4
static inline __attribute__((always_inline)) void q8f_tile(const hsd_mat *A, int r, int n, const float *x, int xs,
                                                           int P, float *s) {
    const int G = A->cols / HSD_GROUP;
    float sf[4][HSD_PAIRED_MAX_GROUPS];
    block_factors(A, r, n, sf, NULL);
    const int8_t *q[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        const int ri = r + (i < n ? i : n - 1);
        q[i] = q8f_codes(A, ri / 2, 0) + 8 * (ri % 2);
    }
    __m256 acc[4][HSD_Q8F_REG_MAX];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
#pragma GCC unroll 4
        for (int p = 0; p < P; p++) acc[i][p] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            const int c = HSD_GROUP * g + 8 * k;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q[i] + 2 * c)));
                const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_broadcast_ss(&sf[i][g]));
#pragma GCC unroll 4
                for (int p = 0; p < P; p++)
                    acc[i][p] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + (size_t)p * xs + c), acc[i][p]);
            }
        }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; p++)
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) s[(size_t)p * 4 + i] = hsum8(acc[i][p]);
}

/* s[t * 4 + i] for rows r .. r+3 and 1 <= m <= HSD_Q8F_REG_MAX positions: the tile for m, its P a constant. */
static inline void q8f_tiles_avx2(const hsd_mat *A, int r, int n, const float *x, int xs, int m, float *s) {
    switch (m) {
    case 1: q8f_tile(A, r, n, x, xs, 1, s); break;
    case 2: q8f_tile(A, r, n, x, xs, 2, s); break;
    case 3: q8f_tile(A, r, n, x, xs, 3, s); break;
    default: q8f_tile(A, r, n, x, xs, 4, s); break;
    }
}

#endif

#if HSD_AVX512

/* Rows 2h, 2h+1 of a block of n rows from row r: their pair of stored rows (r/2 + h, or with n <= 2h the first
 * pair again, its values unused) and the block's rows whose factors they take (*a, *c; block_factors' indices). */
static inline int block_pair(int r, int n, int h, int *a, int *c) {
    *a = 2 * h < n ? 2 * h : 0;
    *c = 2 * h + 1 < n ? 2 * h + 1 : n - 1;
    return r / 2 + (2 * h < n ? h : 0);
}

/* Rows r .. r+3 of a paired matrix (cols a multiple of 32, at most HSD_PAIRED_MAX_GROUPS groups; a short last block
 * of n rows repeats its last row) as float32, paired for tile4xP_any: buf[0, 2K) holds rows 0|1 and buf[2K, 4K)
 * rows 2|3, 16 floats per 8 columns (8 of the first row, then 8 of the second). The values are expand_row's,
 * fma(code, scale, minimum) for q4f and code * scale for q8f: 16 codes widened, converted and scaled at once, as
 * the codes are stored. Constant `q8` lets the compiler keep one variant per kind. */
static inline __attribute__((always_inline)) void expand4_any(const hsd_mat *A, int r, int n, float *buf, int q8) {
    const int K = A->cols, G = K / HSD_GROUP;
    float sf[4][HSD_PAIRED_MAX_GROUPS], zf[4][HSD_PAIRED_MAX_GROUPS];
    block_factors(A, r, n, sf, q8 ? NULL : zf);
    const __m128i low = _mm_set1_epi8(15);
    for (int h = 0; h < 2; h++) {
        int a, c;
        const int pair = block_pair(r, n, h, &a, &c);
        float *o = buf + (size_t)h * 2 * K;
        for (int g = 0; g < G; g++) {
            const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(sf[a][g]), _mm256_set1_ps(sf[c][g]), 1);
            float *og = o + (size_t)2 * g * HSD_GROUP;
            if (q8) {
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    const __m128i b = _mm_loadu_si128((const __m128i *)q8f_codes(A, pair, 4 * g + k));
                    _mm512_storeu_ps(og + 16 * k, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), sv));
                }
                continue;
            }
            const uint8_t *q = q4f_codes(A, pair, g / 2);
            const __m512 zv = _mm512_insertf32x8(_mm512_set1_ps(zf[a][g]), _mm256_set1_ps(zf[c][g]), 1);
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m128i b = _mm_loadu_si128((const __m128i *)(q + 16 * k));
                if (g & 1) b = _mm_srli_epi16(b, 4);
                b = _mm_and_si128(b, low);
                _mm512_storeu_ps(og + 16 * k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), sv, zv));
            }
        }
    }
}

/* expand4_any for a q4f or q8f matrix. */
static void expand4_pairs(const hsd_mat *A, int r, int n, float *buf) {
    if (A->type == HSD_Q8F)
        expand4_any(A, r, n, buf, 1);
    else
        expand4_any(A, r, n, buf, 0);
}

/* s[t * 4 + i] = W[r + i] . x_t for rows r .. r+3 of a q4f matrix (n of them real; a short last block repeats its
 * last row, as expand4_any does) and the P <= 8 positions of one tile, the codes de-quantized in registers as the
 * FMAs go: per group and row the 16 values fma(code, scale, minimum) a code can take (expand4_any's operation on
 * the same numbers), each weight then picked from its row's 16 by its code (vpermt2ps: one instruction for 16
 * weights of two rows, on other execution ports than the FMAs'). The FMAs and horizontal sums are tile4xP_any's
 * (paired) on the same values, so every element is bit for bit what expand4_pairs followed by dots4_pairs gives;
 * the weights never pass through memory, and the codes' loads overlap the arithmetic instead of preceding it. */
static inline __attribute__((always_inline)) void q4f_tile4xP(const hsd_mat *A, int r, int n, const float *x, int xs,
                                                              int P, float *s) {
    const int G = A->cols / HSD_GROUP;
    float sf[4][HSD_PAIRED_MAX_GROUPS], zf[4][HSD_PAIRED_MAX_GROUPS];
    block_factors(A, r, n, sf, zf);
    int a0, c0, a1, c1;
    const uint8_t *q01 = q4f_codes(A, block_pair(r, n, 0, &a0, &c0), 0);
    const uint8_t *q23 = q4f_codes(A, block_pair(r, n, 1, &a1, &c1), 0);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i second = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16);
    const __m512i low = _mm512_set1_epi32(15);
    __m512 acc01[8], acc23[8];
#pragma GCC unroll 8
    for (int p = 0; p < P; p++) acc01[p] = acc23[p] = _mm512_setzero_ps();
    for (int g = 0; g < G; g++) {
        /* the 16 values of each row's group: table lane k = fma(k, scale, minimum) */
        const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sf[a0][g]), _mm512_set1_ps(zf[a0][g]));
        const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sf[c0][g]), _mm512_set1_ps(zf[c0][g]));
        const __m512 t2 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sf[a1][g]), _mm512_set1_ps(zf[a1][g]));
        const __m512 t3 = _mm512_fmadd_ps(iota, _mm512_set1_ps(sf[c1][g]), _mm512_set1_ps(zf[c1][g]));
        const uint8_t *b01 = q01 + (size_t)(g / 2) * HSD_Q4F_STEP, *b23 = q23 + (size_t)(g / 2) * HSD_Q4F_STEP;
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) { /* 8 columns: 16 codes of each pair, a byte each (a nibble of this group) */
            __m512i i01 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b01 + 16 * k)));
            __m512i i23 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b23 + 16 * k)));
            if (g & 1) { /* the high nibble; the upper 8 lanes (the pair's second row) pick from its table */
                i01 = _mm512_or_si512(_mm512_srli_epi32(i01, 4), second);
                i23 = _mm512_or_si512(_mm512_srli_epi32(i23, 4), second);
            } else { /* (code & 15) | second, in one instruction */
                i01 = _mm512_ternarylogic_epi32(i01, low, second, 0xEA);
                i23 = _mm512_ternarylogic_epi32(i23, low, second, 0xEA);
            }
            const __m512 w01 = _mm512_permutex2var_ps(t0, i01, t1), w23 = _mm512_permutex2var_ps(t2, i23, t3);
            fma4xP(acc01, acc23, w01, w23, x, xs, HSD_GROUP * g + 8 * k, P);
        }
    }
    sums4xP(acc01, acc23, P, s, 0);
}

/* q4f_tile4xP for 1 <= m <= 8 positions (a constant count per copy, so that the accumulators stay in registers). */
static void q4f_tile4(const hsd_mat *A, int r, int n, const float *x, int xs, int m, float *s) {
    switch (m) {
    case 8: q4f_tile4xP(A, r, n, x, xs, 8, s); break;
    case 7: q4f_tile4xP(A, r, n, x, xs, 7, s); break;
    case 6: q4f_tile4xP(A, r, n, x, xs, 6, s); break;
    case 5: q4f_tile4xP(A, r, n, x, xs, 5, s); break;
    case 4: q4f_tile4xP(A, r, n, x, xs, 4, s); break;
    case 3: q4f_tile4xP(A, r, n, x, xs, 3, s); break;
    case 2: q4f_tile4xP(A, r, n, x, xs, 2, s); break;
    default: q4f_tile4xP(A, r, n, x, xs, 1, s); break;
    }
}
#endif

#if HSD_NEON

/* The q4f tile on Arm, in the order of the AVX2 one-position tile (each 8 columns of the four rows in turn): rows
 * r .. r+3 of a q4f matrix (a short last block repeats its last row) and P <= 3 positions, each 8 weights
 * de-quantized in registers as fma(code, scale, minimum) (vfmaq_f32: one rounding, as expand_row's fmaf) and
 * multiplied into the row's 8-lane accumulator, over the columns in order, then hsum8's tree: every element bit for
 * bit what the other builds give. */
static inline __attribute__((always_inline)) void q4f_tile4xP_neon(const hsd_mat *A, int r, int n, const float *x,
                                                                   int xs, int P, float *s) {
    const int G = A->cols / HSD_GROUP;
    const uint8_t *q[4];
    const uint16_t *sc[4], *zc[4];
    for (int i = 0; i < 4; i++) {
        const int ri = r + (i < n ? i : n - 1);
        q[i] = q4f_codes(A, ri / 2, 0) + 8 * (ri % 2);
        sc[i] = (const uint16_t *)A->scale + (size_t)ri * G;
        zc[i] = (const uint16_t *)A->zero + (size_t)ri * G;
    }
    const uint16x8_t low = vdupq_n_u16(15);
    f8_t acc[4][3];
    for (int i = 0; i < 4; i++)
        for (int p = 0; p < P; p++) acc[i][p] = f8_zero();
    for (int g = 0; g < G; g++) {
        const size_t off = (size_t)(g / 2) * HSD_Q4F_STEP;
        const int odd = g & 1;
        float32x4_t sv[4], zv[4];
        for (int i = 0; i < 4; i++) {
            sv[i] = vdupq_n_f32(half_to_float(sc[i][g]));
            zv[i] = vdupq_n_f32(half_to_float(zc[i][g]));
        }
        for (int k = 0; k < 4; k++) { /* 8 columns of the group */
            const int c = HSD_GROUP * g + 8 * k;
            f8_t u[3];
            for (int p = 0; p < P; p++) u[p] = f8_load(x + (size_t)p * xs + c);
            for (int i = 0; i < 4; i++) {
                uint16x8_t v = vmovl_u8(vld1_u8(q[i] + off + 16 * k));
                v = odd ? vshrq_n_u16(v, 4) : vandq_u16(v, low);
                const f8_t w = {vfmaq_f32(zv[i], vcvtq_f32_u32(vmovl_u16(vget_low_u16(v))), sv[i]),
                                vfmaq_f32(zv[i], vcvtq_f32_u32(vmovl_high_u16(v)), sv[i])};
                for (int p = 0; p < P; p++) acc[i][p] = f8_fma(acc[i][p], w, u[p]);
            }
        }
    }
    for (int p = 0; p < P; p++)
        for (int i = 0; i < 4; i++) s[(size_t)p * 4 + i] = hsum8n(acc[i][p]);
}

#endif

/* The 8-lane in-register q4f tiles of this build (AVX2 without AVX-512, or NEON), if it has them: s[t * 4 + i] over
 * 1 <= m <= HSD_Q4F_REG_MAX positions. */
#if HSD_AVX2 && !HSD_AVX512
#define HSD_Q4F_TILES q4f_tiles_avx2
#elif HSD_NEON
/* tiles of 3 positions, then 1 or 2 */
static void q4f_tiles_neon(const hsd_mat *A, int r, int n, const float *x, int xs, int m, float *s) {
    int t = 0;
    for (; t + 3 <= m; t += 3) q4f_tile4xP_neon(A, r, n, x + (size_t)t * xs, xs, 3, s + (size_t)t * 4);
    if (m - t == 2) q4f_tile4xP_neon(A, r, n, x + (size_t)t * xs, xs, 2, s + (size_t)t * 4);
    if (m - t == 1) q4f_tile4xP_neon(A, r, n, x + (size_t)t * xs, xs, 1, s + (size_t)t * 4);
}
#define HSD_Q4F_TILES q4f_tiles_neon
#endif

/* Rows [r0, r1) of y[t * ys + r] (+)= W[r] . x[t * xs] (* scale[r] for int8) (+ bias[r]); acc: add to y.
 * X: x quantized for the integer path (used when int_path(A)). buf: HSD_SCRATCH_ROWS * cols floats of scratch for
 * expanded rows (bfloat16, int8 without whole groups, the exact forms). */
static void mat_rows(const hsd_mat *A, const float *x, int xs, const qx_t *X, int m, float *y, int ys, int r0, int r1,
                     int acc, float *buf) {
    if (int_path(A)) {
        if (A->type == HSD_Q4)
            q4_rows(A, X, m, y, ys, r0, r1, acc);
        else
            int_rows(A, X, m, y, ys, r0, r1, acc);
        return;
    }
    const int K = A->cols;
    float s[4 * HSD_MAX_TILE_T];
    for (int r = r0; r < r1; r += 4) {
        const int n = r1 - r < 4 ? r1 - r : 4;
        const float *w[4];
        int mt;
#if HSD_AVX2
        if ((A->type == HSD_BF16 || A->type == HSD_Q8) && m <= 2 && n == 4) { /* convert in registers: the values
                                                                                 * expand_row stores */
            prefetch_t pf = prefetch_ahead(A, r);
            direct4(A, r, x, xs, m, s, &pf);
            store4(A, s, m, n, y, ys, 0, r, acc);
            continue;
        }
#endif
#ifdef HSD_Q4F_TILES
        if (A->type == HSD_Q4F && K % HSD_GROUP == 0 && K / HSD_GROUP <= HSD_PAIRED_MAX_GROUPS &&
            m <= HSD_Q4F_REG_MAX) { /* a decode step or a short verification: de-quantized in registers */
#if HSD_AVX2
            prefetch_block(A, r + 4 * HSD_AHEAD);
#endif
            HSD_Q4F_TILES(A, r, n, x, xs, m, s);
            store4(A, s, m, n, y, ys, 0, r, acc);
            continue;
        }
#endif
#if HSD_AVX2 && !HSD_AVX512
        if (A->type == HSD_Q8F && K % HSD_GROUP == 0 && K / HSD_GROUP <= HSD_PAIRED_MAX_GROUPS &&
            m <= HSD_Q8F_REG_MAX) { /* a step or a short pass over an exact int8 head: converted in registers */
            prefetch_block(A, r + 4 * HSD_AHEAD);
            q8f_tiles_avx2(A, r, n, x, xs, m, s);
            store4(A, s, m, n, y, ys, 0, r, acc);
            continue;
        }
#endif
#if HSD_AVX512
        if (paired(A) && K % HSD_GROUP == 0 && K / HSD_GROUP <= HSD_PAIRED_MAX_GROUPS) {
            if (A->type == HSD_Q4F && m <= 8) {
                /* one tile of positions (a decode step, a verification): de-quantized in registers, not into L1
                 * (measured: over two tiles or more, expanding once for all of them is as fast or faster) */
                prefetch_block(A, r + 4 * HSD_AHEAD);
                q4f_tile4(A, r, n, x, xs, m, s);
                store4(A, s, m, n, y, ys, 0, r, acc);
                continue;
            }
            /* de-quantized into L1; over more than one tile of 8 positions, two blocks of 4 rows at a time, then
             * each tile for both: each tile's inputs are read into the first-level cache once for 8 rows, not once
             * for 4 */
            const int nb = m > 8 && r1 - r > 4 ? 2 : 1;
            for (int b = 0; b < nb; b++) {
                const int rb = r + 4 * b, nr = r1 - rb < 4 ? r1 - rb : 4;
                prefetch_block(A, rb + 4 * HSD_AHEAD);
                expand4_pairs(A, rb, nr, buf + (size_t)b * 4 * K);
            }
            for (int t0 = 0; t0 < m; t0 += mt) {
                mt = m - t0 < 8 ? m - t0 : 8;
                for (int b = 0; b < nb; b++) {
                    const int rb = r + 4 * b, nr = r1 - rb < 4 ? r1 - rb : 4;
                    w[0] = w[1] = buf + (size_t)b * 4 * K;
                    w[2] = w[3] = buf + (size_t)b * 4 * K + (size_t)2 * K;
                    dots4_pairs(w, K, x + (size_t)t0 * xs, xs, mt, s);
                    store4(A, s, mt, nr, y, ys, t0, rb, acc);
                }
            }
            r += 4 * (nb - 1);
            continue;
        }
#endif
        for (int i = 0; i < 4; i++) {
            int ri = r + (i < n ? i : n - 1); /* a short last block repeats its last row */
            if (A->type == HSD_F32) {
                w[i] = (const float *)A->w + (size_t)ri * K;
            } else {
                if (i < n) expand_row(A, ri, buf + (size_t)i * K);
                w[i] = buf + (size_t)(i < n ? i : n - 1) * K;
            }
        }
        prefetch_t pf = prefetch_ahead(A, r);
        for (int t0 = 0; t0 < m; t0 += mt) {
            mt = m - t0 < HSD_MAX_TILE_T ? m - t0 : HSD_MAX_TILE_T;
            dots4(w, K, x + (size_t)t0 * xs, xs, mt, s, &pf);
            store4(A, s, mt, n, y, ys, t0, r, acc);
        }
    }
}

/* Rows per share of a matrix's rows between threads: int4 matrices are computed in whole blocks of 16 rows. */
static inline int rows_align(const hsd_mat *A) { return A->type == HSD_Q4 ? 16 : 4; }

/* This thread's share [*a, *b) of n items, in blocks of `align` items (static, contiguous). */
static inline void share(int n, int align, int *a, int *b) {
    int nt = omp_get_num_threads(), id = omp_get_thread_num();
    int blocks = (n + align - 1) / align;
    int lo = (int)((long)blocks * id / nt), hi = (int)((long)blocks * (id + 1) / nt);
    *a = lo * align < n ? lo * align : n;
    *b = hi * align < n ? hi * align : n;
}

/* Rows of several matrices that read the same input, as if stacked: this thread's share of the stacked rows. */
static void stacked_rows(const hsd_mat *const *mats, float *const *outs, const int *ys, int n, const float *x, int xs,
                         const qx_t *X, int m, float *buf) {
    int total = 0;
    for (int i = 0; i < n; i++) total += mats[i]->rows;
    int a, b;
    share(total, rows_align(mats[0]), &a, &b);
    int base = 0;
    for (int i = 0; i < n; i++) {
        int lo = a - base, hi = b - base, R = mats[i]->rows;
        if (lo < 0) lo = 0;
        if (hi > R) hi = R;
        if (lo < hi) mat_rows(mats[i], x, xs, X, m, outs[i], ys[i], lo, hi, 0, buf);
        base += R;
    }
}

/* ------------------------------------------------------------------------------------------------ small ops */

static void rms_norm_rows(const float *x, int m, int d, const float *w, float eps, float *out) {
    for (int t = 0; t < m; t++) {
        const float *p = x + (size_t)t * d;
        float s = 0.f;
        for (int c = 0; c < d; c++) s += p[c] * p[c];
        float r = 1.0f / sqrtf(s / (float)d + eps);
        for (int c = 0; c < d; c++) out[(size_t)t * d + c] = w[c] * (p[c] * r);
    }
}

/* HF's rotate_half rotation of one head vector: v * cos + rotate_half(v) * sin, rotate_half([a, b]) = [-b, a]. */
static inline void rope(float *v, const float *cs, const float *sn, int hd) {
    const int h = hd / 2;
    for (int i = 0; i < h; i++) {
        float a = v[i], b = v[i + h];
        v[i] = a * cs[i] - b * sn[i];
        v[i + h] = b * cs[i + h] + a * sn[i + h];
    }
}

static inline float dot_hd(const float *a, const float *b, int n) {
#if HSD_AVX2
    if ((n & 7) == 0) {
        __m256 s = _mm256_setzero_ps();
        for (int i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
        return hsum8(s);
    }
#elif HSD_NEON
    if ((n & 7) == 0) {
        f8_t s = f8_zero();
        for (int i = 0; i < n; i += 8) s = f8_fma(s, f8_load(a + i), f8_load(b + i));
        return hsum8n(s);
    }
#else
    if ((n & 7) == 0) { /* the 8-lane accumulator and horizontal sum of the AVX2 code, lane for lane */
        float l[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int i = 0; i < n; i += 8)
            for (int j = 0; j < 8; j++) l[j] = fmaf(a[i + j], b[i + j], l[j]);
        return hsum_lanes(l);
    }
#endif
    float s = 0.f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* sc[j] = (q . K[j]) * scale for j < n, each dot_hd's value: four keys at a time (four independent accumulator
 * chains instead of one: one key's 8 dependent FMAs and its horizontal sum left the FMA units idle). */
static void attention_scores(const float *q, const float *K, int n, int hd, float scale, float *sc) {
    int j = 0;
#if HSD_AVX2
    if ((hd & 7) == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = K + (size_t)j * hd, *k1 = k0 + hd, *k2 = k1 + hd, *k3 = k2 + hd;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int i = 0; i < hd; i += 8) {
                const __m256 u = _mm256_loadu_ps(q + i);
                a0 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k0 + i), a0);
                a1 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k1 + i), a1);
                a2 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k2 + i), a2);
                a3 = _mm256_fmadd_ps(u, _mm256_loadu_ps(k3 + i), a3);
            }
            sc[j] = hsum8(a0) * scale;
            sc[j + 1] = hsum8(a1) * scale;
            sc[j + 2] = hsum8(a2) * scale;
            sc[j + 3] = hsum8(a3) * scale;
        }
    }
#endif
    for (; j < n; j++) sc[j] = dot_hd(q, K + (size_t)j * hd, hd) * scale;
}

/* out[i] = sum_j e[j] * V[j][i] over j < n in order, one multiply then one add per term (no FMA: the values of
 * the plain loop), 32 output lanes at a time held in registers over every key. acc: add to the sums in out (the
 * same values as one call over all the keys). */
static void attention_values(const float *e, const float *V, int n, int hd, float *out, int acc) {
    int i0 = 0;
#if HSD_AVX2
    for (; i0 + 32 <= hd; i0 += 32) {
        __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;
        if (acc) { /* carry on the sums of earlier keys (stored exactly) */
            o0 = _mm256_loadu_ps(out + i0);
            o1 = _mm256_loadu_ps(out + i0 + 8);
            o2 = _mm256_loadu_ps(out + i0 + 16);
            o3 = _mm256_loadu_ps(out + i0 + 24);
        }
        for (int j = 0; j < n; j++) {
            const float *vj = V + (size_t)j * hd + i0;
            const __m256 w = _mm256_set1_ps(e[j]);
            o0 = _mm256_add_ps(o0, _mm256_mul_ps(w, _mm256_loadu_ps(vj)));
            o1 = _mm256_add_ps(o1, _mm256_mul_ps(w, _mm256_loadu_ps(vj + 8)));
            o2 = _mm256_add_ps(o2, _mm256_mul_ps(w, _mm256_loadu_ps(vj + 16)));
            o3 = _mm256_add_ps(o3, _mm256_mul_ps(w, _mm256_loadu_ps(vj + 24)));
        }
        _mm256_storeu_ps(out + i0, o0);
        _mm256_storeu_ps(out + i0 + 8, o1);
        _mm256_storeu_ps(out + i0 + 16, o2);
        _mm256_storeu_ps(out + i0 + 24, o3);
    }
#endif
    if (!acc)
        for (int i = i0; i < hd; i++) out[i] = 0.f;
    for (int j = 0; j < n; j++) {
        const float *vj = V + (size_t)j * hd;
        for (int i = i0; i < hd; i++) out[i] += e[j] * vj[i];
    }
}

/* e^x to within about 1 ulp (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times 2^n), from rounded
 * multiplications, FMAs and integer bits alone, so a loop of them vectorizes and every lane computes what the
 * scalar code computes: the same value for an element whichever loop or build it falls in. x is clamped to
 * [-87.3, 88.3] (e^-87.3 ~ 1.2e-38: a softmax or SiLU term that small counts as nothing either way). */
static inline float hsd_exp(float x) {
    x = x < -87.3f ? -87.3f : x > 88.3f ? 88.3f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float y = 1.9875691500e-4f;
    y = fmaf(y, r, 1.3981999507e-3f);
    y = fmaf(y, r, 8.3334519073e-3f);
    y = fmaf(y, r, 4.1665795894e-2f);
    y = fmaf(y, r, 1.6666665459e-1f);
    y = fmaf(y, r, 5.0000001201e-1f);
    y = fmaf(y, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

/* y[i] = hsd_exp(x[i]) for n values (what the softmax and SiLU compute; for tests). */
void hsd_exp_rows(const float *x, int n, float *y) {
    for (int i = 0; i < n; i++) y[i] = hsd_exp(x[i]);
}

/* The natural logarithm of a positive normal float to within about 1 ulp (Cephes' logf: x = m 2^e with m in
 * [sqrt(1/2), sqrt(2)), a degree-9 polynomial in m - 1, e ln 2 added in two parts), from integer bits, selections,
 * rounded multiplications and FMAs alone: a loop of them vectorizes, and every lane and build computes what the
 * scalar code computes. Not for 0, negative, subnormal or infinite x (the noise below never gives one). */
static inline float hsd_log(float x) {
    int32_t ix;
    memcpy(&ix, &x, 4);
    int32_t e = (ix >> 23) - 126;
    const int32_t mb = (ix & 0x007fffff) | 0x3f000000; /* the mantissa as m in [0.5, 1) */
    float m;
    memcpy(&m, &mb, 4);
    const int32_t low = -(int32_t)(m < 0.707106781186547524f); /* all ones below sqrt(1/2): m 2^e = (2m) 2^(e-1) */
    e += low;
    const int32_t ab = mb & low;
    float add;
    memcpy(&add, &ab, 4);
    const float f = (m - 1.0f) + add; /* m - 1 or 2m - 1, both exact, in (-0.293, 0.415) */
    const float z = f * f;
    float y = 7.0376836292e-2f;
    y = fmaf(y, f, -1.1514610310e-1f);
    y = fmaf(y, f, 1.1676998740e-1f);
    y = fmaf(y, f, -1.2420140846e-1f);
    y = fmaf(y, f, 1.4249322787e-1f);
    y = fmaf(y, f, -1.6668057665e-1f);
    y = fmaf(y, f, 2.0000714765e-1f);
    y = fmaf(y, f, -2.4999993993e-1f);
    y = fmaf(y, f, 3.3333331174e-1f);
    y = y * f * z;
    const float fe = (float)e;
    y = fmaf(fe, -2.12194440e-4f, y);
    y = fmaf(z, -0.5f, y);
    return fmaf(fe, 0.693359375f, f + y);
}

/* y[i] = hsd_log(x[i]) for n positive values (for tests). */
void hsd_log_rows(const float *x, int n, float *y) {
    for (int i = 0; i < n; i++) y[i] = hsd_log(x[i]);
}

/* splitmix64's output number j + 1 from the state `key` (Steele, Lea and Flood, "Fast splittable pseudorandom
 * number generators", OOPSLA 2014): the state advanced j + 1 times by the golden gamma, then mixed. A counter-based
 * generator: any output is computed without the ones before it. */
static inline uint64_t splitmix64_at(uint64_t key, uint64_t j) {
    uint64_t z = key + (j + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* u = k 2^-24 for 24 random bits k, 2^-25 for k = 0: (2k, or 1) 2^-25, an integer float32 holds exactly. */
static inline float uniform_of(uint32_t k) { return (float)(int32_t)(2 * k + (k == 0)) * 0x1p-25f; }

/* Gumbel noise for one draw by the largest of the logits plus noise: out[i] = -log(-log u_i) * temperature for i
 * < n, u_i uniform on the 24-bit grid {k 2^-24} (2^-25 where k is 0, so every offset is finite), taken from
 * splitmix64's outputs from `key`: with h = n - n/2, output j gives u_j (its bits 63..40) and, for j < n/2,
 * u_h+j (bits 31..8). The same values for a key whichever build or thread count computes them (each element
 * depends on its index alone; hsd_log's operations), on nthreads threads. */
void hsd_gumbel(uint64_t key, int n, float temperature, float *out, int nthreads) {
    const int lows = n / 2, h = n - lows;
    float *second = out + h;
#pragma omp parallel num_threads(nthreads > 0 ? nthreads : 1)
    {
#pragma omp for schedule(static)
        for (int j = 0; j < lows; j++) { /* the uniforms first (the logarithms' loop apart vectorizes) */
            const uint64_t z = splitmix64_at(key, (uint64_t)j);
            out[j] = uniform_of((uint32_t)(z >> 40));
            second[j] = uniform_of((uint32_t)(z >> 8) & 0xffffff);
        }
#pragma omp single
        if (h > lows) out[h - 1] = uniform_of((uint32_t)(splitmix64_at(key, (uint64_t)(h - 1)) >> 40));
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) out[i] = -hsd_log(-hsd_log(out[i])) * temperature;
    }
}

/* A column of a row ranked for the sampling filters: its value and its column. */
typedef struct {
    float v;
    int i;
} ranked_t;

/* qsort's order for ranked_t: the larger value first, the lower column first among equal values. */
static int ranked_desc(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    if (x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->i - y->i;
}

/* p[0 .. k-1] /= their sum (added in order, in double precision, then rounded). */
static void renormalise(ranked_t *r, int k) {
    double s = 0.0;
    for (int j = 0; j < k; j++) s += r[j].v;
    const float sf = (float)s;
    for (int j = 0; j < k; j++) r[j].v /= sf;
}

/* Sampling's filters over the columns of a window (runtime/sampling.py's window_probs; process_logits' operations,
 * to float32 rounding): for each of the m rows of x [m, n] (logits, -INFINITY at a column outside the row's
 * window), p [m, n] its probabilities: the top_k (0: no such filter) largest of x / temperature (among equal values
 * the lower column first), their softmax (hsd_exp; sums added in order, most probable first, in double precision; a
 * term under e^-87.3 of the largest counts as 0), then top-p's nucleus (top_p < 1: the most probable tokens until
 * the mass before one, in double precision, reaches top_p; at least one), then min-p's (min_p > 0: those at least
 * min_p times as probable as the most probable), each renormalising; 0 at every other column. Returns 0; 1 when a
 * row holds a value that is not a number, no finite value, or +INFINITY after the division (the caller computes it:
 * an error, or softmax's limit); -1 on bad arguments. */
int hsd_filter_probs(const float *x, int m, int n, double temperature, double top_p, int top_k, double min_p,
                     float *p) {
    if (m < 1 || n < 1 || !(temperature > 0.0) || !(top_p > 0.0) || top_k < 0 || !(min_p >= 0.0)) return -1;
    ranked_t *r = malloc(sizeof(ranked_t) * (size_t)n);
    if (!r) return -1;
    int rc = 0;
    for (int t = 0; t < m && !rc; t++) {
        const float *xt = x + (size_t)t * n;
        float *pt = p + (size_t)t * n;
        int k = 0;
        for (int j = 0; j < n; j++) {
            const float y = (float)(xt[j] / temperature);
            if (isnan(y)) rc = 1;
            else if (y > -INFINITY) r[k].v = y, r[k++].i = j;
        }
        if (rc || k == 0) {
            rc = 1;
            break;
        }
        qsort(r, (size_t)k, sizeof(ranked_t), ranked_desc);
        if (isinf(r[0].v)) {
            rc = 1;
            break;
        }
        if (top_k > 0 && top_k < k) k = top_k;
        const float mx = r[0].v;
        for (int j = 0; j < k; j++) r[j].v = r[j].v - mx < -87.3f ? 0.f : hsd_exp(r[j].v - mx);
        renormalise(r, k);
        if (top_p < 1.0) {
            double before = r[0].v; /* the mass before token j, added in double precision */
            int j = 1;
            for (; j < k && before < top_p; j++) before += r[j].v;
            k = j;
            renormalise(r, k);
        }
        if (min_p > 0.0) {
            const float least = (float)(min_p * r[0].v);
            for (int j = 0; j < k; j++)
                if (r[j].v < least) r[j].v = 0.f;
            renormalise(r, k);
        }
        memset(pt, 0, sizeof(float) * (size_t)n);
        for (int j = 0; j < k; j++) pt[r[j].i] = r[j].v;
    }
    free(r);
    return rc;
}

/* e[j] = e^(e[j] - max e) for the n scores; returns their sum, added in order: a softmax's numerators and
 * denominator, computed alike for one query head and for heads attended together. */
static inline float exp_shifted(float *e, int n) {
    float mx = -INFINITY, sum = 0.f;
    for (int j = 0; j < n; j++) mx = e[j] > mx ? e[j] : mx;
    for (int j = 0; j < n; j++) e[j] = hsd_exp(e[j] - mx);
    for (int j = 0; j < n; j++) sum += e[j];
    return sum;
}

/* Causal attention of one query head over positions 0..p of its key/value head: out[hd]. sc: scratch [p + 1]. */
static void attend_one(const float *q, const float *K, const float *V, int p, int hd, float *sc, float *out) {
    attention_scores(q, K, p + 1, hd, 1.0f / sqrtf((float)hd), sc);
    const float sum = exp_shifted(sc, p + 1);
    attention_values(sc, V, p + 1, hd, out, 0);
    const float inv = 1.0f / sum;
    for (int i = 0; i < hd; i++) out[i] *= inv;
}

/* Keys per block of attend_rows: a block of keys (then of values) stays in L1 while every query reads it. */
#define HSD_KEY_BLOCK 64
/* From this many cached positions on, a decode step attends the query heads of one key/value head together. */
#define HSD_SHARED_ATTENTION 256

/* Rows of one sequence attended together (a prompt's or a verify pass's consecutive positions): the keys and values
 * of a block are read once for all of them. */
#define HSD_ATTENTION_ROWS 4

/* attend_one for the nr consecutive rows p0 .. p0+nr-1 of one sequence and the nq query heads of one key/value
 * head (row r's query head h at q + r * qstride + h * hd, its output at out + r * ostride + h * hd), operation for
 * operation, so the same values: each block of keys and of values is read once for all nr * nq queries, each
 * query over its own causal length (nr = 1: a decode step's query heads of one key/value head together).
 * sc: scratch [nr * nq][p0 + nr]. */
static void attend_rows(const float *q, size_t qstride, int nr, int nq, const float *K, const float *V, int p0,
                        int hd, float *sc, float *out, size_t ostride) {
    const int n_all = p0 + nr, nqr = nr * nq;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int j0 = 0; j0 < n_all; j0 += HSD_KEY_BLOCK) { /* blocks of a multiple of 4 keys: attention_scores' groups */
        for (int a = 0; a < nqr; a++) {
            const int r = a / nq, n = p0 + r + 1;
            if (j0 >= n) continue;
            const int nb = n - j0 < HSD_KEY_BLOCK ? n - j0 : HSD_KEY_BLOCK;
            attention_scores(q + (size_t)r * qstride + (size_t)(a % nq) * hd, K + (size_t)j0 * hd, nb, hd, scale,
                             sc + (size_t)a * n_all + j0);
        }
    }
    float inv[256];
    for (int a0 = 0; a0 < nqr; a0 += 256) {
        const int na = nqr - a0 < 256 ? nqr - a0 : 256;
        for (int a = a0; a < a0 + na; a++) inv[a - a0] = 1.0f / exp_shifted(sc + (size_t)a * n_all, p0 + a / nq + 1);
        for (int j0 = 0; j0 < n_all; j0 += HSD_KEY_BLOCK) {
            for (int a = a0; a < a0 + na; a++) {
                const int r = a / nq, n = p0 + r + 1;
                if (j0 >= n) continue;
                const int nb = n - j0 < HSD_KEY_BLOCK ? n - j0 : HSD_KEY_BLOCK;
                attention_values(sc + (size_t)a * n_all + j0, V + (size_t)j0 * hd, nb, hd,
                                 out + (size_t)r * ostride + (size_t)(a % nq) * hd, j0 > 0);
            }
        }
        for (int a = a0; a < a0 + na; a++) {
            float *o = out + (size_t)(a / nq) * ostride + (size_t)(a % nq) * hd;
            for (int i = 0; i < hd; i++) o[i] *= inv[a - a0];
        }
    }
}

static inline float silu(float g) { return g / (1.0f + hsd_exp(-g)); }

/* ------------------------------------------------------------------------------------------------ the pass */

static int max_cols(const hsd_model *M) {
    int k = M->hidden > M->inter ? M->hidden : M->inter;
    return M->n_heads * M->head_dim > k ? M->n_heads * M->head_dim : k;
}

/* Floats of work buffer hsd_layers needs for m positions with keys up to cache_len and nthreads threads. */
long hsd_work_floats(const hsd_model *M, int m, int cache_len, int nthreads) {
    const long H = M->n_heads, KV = M->n_kv, hd = M->head_dim, d = M->hidden, I = M->inter;
    const long mk = max_cols(M);
    return (long)m * (d + (H + 2 * KV) * hd + H * hd + 2 * I + (mk + 3) / 4 + 2 * (mk / HSD_GROUP) + 16)
        + (long)nthreads * ((long)HSD_ATTENTION_ROWS * (H / KV) * (cache_len + 16) + (long)HSD_SCRATCH_ROWS * mk + 16);
}

/* Decoder layers l0 .. l1-1 on x [m, hidden] (in place). Row t is position pos[t] of sequence seq[t]; the rows of
 * one sequence are consecutive positions in order, so the sequences of a batch share every matrix product (each
 * weight row read once for all their rows) and each row attends over its own sequence's cache.
 * cos, sin: [m, head_dim] rotary tables of the rows' positions. kc[s][l], vc[s][l]: sequence s's layer-l cache
 * [n_kv, cache_len[s], head_dim] (its positions before its first row already filled; this pass writes the rows'
 * positions). work: hsd_work_floats(M, m, the largest cache_len, nthreads) floats. Returns 0, or -1 on bad
 * arguments. */
int hsd_layers(const hsd_model *M, int l0, int l1, float *x, int m, const int32_t *pos, const int32_t *seq,
               const float *cos, const float *sin, float *const *const *kc, float *const *const *vc,
               const int32_t *cache_len, float *work, int nthreads) {
    const int H = M->n_heads, KV = M->n_kv, hd = M->head_dim, d = M->hidden, I = M->inter;
    if (m < 1 || KV < 1 || H % KV || hd % 2) return -1;
    int max_len = 0;
    for (int t = 0; t < m; t++) {
        if (seq[t] < 0 || pos[t] < 0 || pos[t] >= cache_len[seq[t]]) return -1;
        max_len = cache_len[seq[t]] > max_len ? cache_len[seq[t]] : max_len;
    }
    const int QW = H * hd, KW = KV * hd, QKVW = QW + 2 * KW;
    float *h = work;                     /* [m, d] normed input */
    float *qkv = h + (size_t)m * d;      /* [m, QKVW] */
    float *att = qkv + (size_t)m * QKVW; /* [m, QW] */
    float *gu = att + (size_t)m * QW;    /* [m, 2I]: gate | up, then silu(gate) * up in the gate half */
    const int mk = max_cols(M);
    float *xd = gu + (size_t)m * 2 * I;                  /* [m, mk / 32] quantized inputs: scales */
    float *xsum = xd + (size_t)m * (mk / HSD_GROUP);      /* [m, mk / 32] group sums */
    int8_t *xq = (int8_t *)(xsum + (size_t)m * (mk / HSD_GROUP)); /* [m, mk] */
    /* per thread: attention scores, expanded weight rows; after xq rounded up to whole floats (aligned for any mk) */
    float *scr = (float *)xq + ((size_t)m * mk + 3) / 4 + 16;
    const int rep = H / KV;
    const size_t att_scratch = (size_t)HSD_ATTENTION_ROWS * rep * (max_len + 16);
    const size_t per_thread = att_scratch + HSD_SCRATCH_ROWS * (size_t)mk + 16;
#pragma omp parallel num_threads(nthreads)
    {
        const int tid = omp_get_thread_num();
        float *sc = scr + (size_t)tid * per_thread;
        float *buf = sc + att_scratch;
        qx_t X = {xq, xd, xsum, 0};
        for (int l = l0; l < l1; l++) {
            const hsd_layer *L = &M->layers[l];
            /* 1. input norm */
#pragma omp single
            {
                rms_norm_rows(x, m, d, L->ln1, M->eps1, h);
                if (int_path(&L->q) || int_path(&L->k) || int_path(&L->v)) quantize_x(h, d, m, d, xq, xd, xsum);
            }
            /* 2. q, k, v (implicit barrier above) */
            {
                const hsd_mat *mats[3] = {&L->q, &L->k, &L->v};
                float *outs[3] = {qkv, qkv + QW, qkv + QW + KW};
                int ys[3] = {QKVW, QKVW, QKVW};
                X.cols = d;
                stacked_rows(mats, outs, ys, 3, h, d, &X, m, buf);
            }
#pragma omp barrier
            /* 3. rotate q and k; write k and v into the cache */
#pragma omp for schedule(static)
            for (int task = 0; task < m * (H + KV); task++) {
                int t = task / (H + KV), hh = task % (H + KV);
                float *row = qkv + (size_t)t * QKVW;
                const float *cs = cos + (size_t)t * hd, *sn = sin + (size_t)t * hd;
                if (hh < H) {
                    rope(row + hh * hd, cs, sn, hd);
                } else {
                    int g = hh - H;
                    float *kv = row + QW + g * hd;
                    rope(kv, cs, sn, hd);
                    size_t at = ((size_t)g * cache_len[seq[t]] + pos[t]) * hd;
                    memcpy(kc[seq[t]][l] + at, kv, hd * sizeof(float));
                    memcpy(vc[seq[t]][l] + at, row + QW + KW + g * hd, hd * sizeof(float));
                }
            }
            /* 4. attention (implicit barrier above). One row (a decode step): one task per query head; with a long
             * cache the query heads of a key/value head are attended together in the task of the group's first
             * head (its keys and values read once, not rep times), the group's other tasks idle. Several rows: one
             * task per block of HSD_ATTENTION_ROWS rows and key/value head, its consecutive rows of one sequence
             * attended together (attend_rows). The same values every way. */
            if (m > 1) {
#pragma omp for schedule(static, 1)
                for (int task = 0; task < ((m + HSD_ATTENTION_ROWS - 1) / HSD_ATTENTION_ROWS) * KV; task++) {
                    const int b = task / KV, g = task % KV, end = (b + 1) * HSD_ATTENTION_ROWS < m
                                                                  ? (b + 1) * HSD_ATTENTION_ROWS : m;
                    for (int t0 = b * HSD_ATTENTION_ROWS, t1; t0 < end; t0 = t1) {
                        for (t1 = t0 + 1; t1 < end && seq[t1] == seq[t0] && pos[t1] == pos[t1 - 1] + 1; t1++) {}
                        const int n = cache_len[seq[t0]];
                        attend_rows(qkv + (size_t)t0 * QKVW + (size_t)g * rep * hd, QKVW, t1 - t0, rep,
                                    kc[seq[t0]][l] + (size_t)g * n * hd, vc[seq[t0]][l] + (size_t)g * n * hd, pos[t0],
                                    hd, sc, att + (size_t)t0 * QW + (size_t)g * rep * hd, QW);
                    }
                }
            } else {
#pragma omp for schedule(static)
                for (int task = 0; task < m * H; task++) {
                    const int t = task / H, hh = task % H, g = hh / rep, p = pos[t], n = cache_len[seq[t]];
                    const float *K = kc[seq[t]][l] + (size_t)g * n * hd, *V = vc[seq[t]][l] + (size_t)g * n * hd;
                    if (rep > 1 && p + 1 >= HSD_SHARED_ATTENTION) {
                        if (hh % rep == 0)
                            attend_rows(qkv + (size_t)t * QKVW + hh * hd, 0, 1, rep, K, V, p, hd, sc,
                                        att + (size_t)t * QW + hh * hd, 0);
                    } else {
                        attend_one(qkv + (size_t)t * QKVW + hh * hd, K, V, p, hd, sc,
                                   att + (size_t)t * QW + hh * hd);
                    }
                }
            }
            /* 5. x += o(att) (implicit barrier above) */
            if (int_path(&L->o)) {
#pragma omp single
                quantize_x(att, QW, m, QW, xq, xd, xsum);
            }
            {
                int a, b;
                share(d, rows_align(&L->o), &a, &b);
                X.cols = QW;
                mat_rows(&L->o, att, QW, &X, m, x, d, a, b, 1, buf);
            }
#pragma omp barrier
            /* 6. post-attention norm */
#pragma omp single
            {
                rms_norm_rows(x, m, d, L->ln2, M->eps2, h);
                if (int_path(&L->gate) || int_path(&L->up)) quantize_x(h, d, m, d, xq, xd, xsum);
            }
            /* 7. gate and up for this thread's rows, then silu(gate) * up */
            {
                int a, b;
                share(I, rows_align(&L->gate), &a, &b);
                X.cols = d;
                mat_rows(&L->gate, h, d, &X, m, gu, 2 * I, a, b, 0, buf);
                mat_rows(&L->up, h, d, &X, m, gu + I, 2 * I, a, b, 0, buf);
                for (int t = 0; t < m; t++) {
                    float *row = gu + (size_t)t * 2 * I;
                    for (int r = a; r < b; r++) row[r] = silu(row[r]) * row[I + r];
                }
            }
#pragma omp barrier
            /* 8. x += down(act) */
            if (int_path(&L->down)) {
#pragma omp single
                quantize_x(gu, 2 * I, m, I, xq, xd, xsum);
            }
            {
                int a, b;
                share(d, rows_align(&L->down), &a, &b);
                X.cols = I;
                mat_rows(&L->down, gu, 2 * I, &X, m, x, d, a, b, 1, buf);
            }
#pragma omp barrier
        }
    }
    return 0;
}

/* y [m, rows] = A x for x [m, cols] (e.g. the LM head on normed hidden states), rows split over threads.
 * work: nthreads * HSD_SCRATCH_ROWS * cols floats (expanded rows; unused for float32 weights). */
int hsd_linear(const hsd_mat *A, const float *x, int m, float *y, float *work, int nthreads) {
    if (m < 1 || (A->type != HSD_F32 && !work)) return -1;
    qx_t X = {NULL, NULL, NULL, A->cols};
    int8_t *xq = NULL;
    float *xd = NULL;
    if (int_path(A)) {
        const int G = A->cols / HSD_GROUP;
        xq = malloc((size_t)m * A->cols);
        xd = malloc(sizeof(float) * 2 * (size_t)m * G);
        if (!xq || !xd) {
            free(xq);
            free(xd);
            return -1;
        }
        quantize_x(x, A->cols, m, A->cols, xq, xd, xd + (size_t)m * G);
        X.q = xq;
        X.d = xd;
        X.s = xd + (size_t)m * G;
    }
#pragma omp parallel num_threads(nthreads)
    {
        int a, b;
        share(A->rows, rows_align(A), &a, &b);
        float *buf = work ? work + (size_t)omp_get_thread_num() * HSD_SCRATCH_ROWS * A->cols : NULL;
        mat_rows(A, x, A->cols, &X, m, y, A->rows, a, b, 0, buf);
    }
    free(xq);
    free(xd);
    return 0;
}

/* s[i] = A[row[i]] . x for k <= 4 rows of a float32 matrix at one position x [cols] (no bias). */
static void rows4_f32(const hsd_mat *A, const long *row, int k, const float *x, float *s, prefetch_t *pf) {
    const float *w[4];
    for (int i = 0; i < 4; i++) w[i] = (const float *)A->w + (size_t)row[i < k ? i : k - 1] * A->cols;
    dots4(w, A->cols, x, A->cols, 1, s, pf);
}

/* y[j] = A[row[j]] . x[pos[j]] (+ bias) for n (row, position) pairs of a float32 matrix, x [m, cols]: each value
 * exactly what hsd_linear gives for that row and position (the same operations per element, whatever rows are
 * computed together). Pairs of one position must be adjacent. Single-threaded (a few rows). Returns 0, or -1 on
 * a bad row. */
int hsd_rows_f32(const hsd_mat *A, const long *row, const long *pos, int n, const float *x, float *y) {
    if (A->type != HSD_F32 || n < 0) return -1;
    for (int j = 0; j < n; j++)
        if (row[j] < 0 || row[j] >= A->rows || pos[j] < 0) return -1;
    float s[4];
    prefetch_t pf = {NULL, NULL};
    for (int j = 0; j < n;) {
        int k = 1;
        while (k < 4 && j + k < n && pos[j + k] == pos[j]) k++;
        rows4_f32(A, row + j, k, x + (size_t)pos[j] * A->cols, s, &pf);
        for (int i = 0; i < k; i++) y[j + i] = A->bias ? s[i] + A->bias[row[j + i]] : s[i];
        j += k;
    }
    return 0;
}

/* ------------------------------------------------------------------------------- the greedy head's screen */

/* The greedy screen reads its int8 head copy against the activation in int16 with one scale per position
 * (hsd_screen_i16: codes xq = nearbyint(x / s) with s = max|x| / q16, so |xq| <= q16). */

/* The largest q16 that keeps every int32 sum of K products of int8 codes (|code| <= 127) and int16 codes (|xq| <=
 * q16) exact: K * 127 * (q16 + 1) < 2^31; at most 16383. */
int hsd_screen_q16(int K) {
    const long q = (long)(2147483647L / (127L * (K > 0 ? K : 1))) - 2;
    return (int)(q < 16383 ? (q > 0 ? q : 0) : 16383);
}

/* The int16 scale of position x [d]: max|x| / q16 (0 for a zero row). */
static inline float q16_scale(const float *x, int d, int q16) {
    float amax = 0.f;
    for (int k = 0; k < d; k++) amax = fabsf(x[k]) > amax ? fabsf(x[k]) : amax;
    return amax / (float)q16;
}

/* For row x [d] of normed hidden states: its norm *hn and *dl, the bound on the norm of its quantization's error,
 * as engine/screen.py states them. In int16 with step s = q16_scale (q16 >= 1), x / s rounds once (relative 2^-24
 * of at most q16 + 1), so each element errs by at most s (1/2 + (q16 + 1) 2^-24): dl = sqrt(d) s (1/2 + (q16 + 1)
 * 2^-24) (1 + 1e-4) + 1e-6 |x|. In double, rounded up to float. Returns 0, or 1 when x holds a value that is not
 * finite. */
static int screen_norms(const float *x, int d, int q16, float *hn, float *dl) {
    double ss = 0.0;
    for (int k = 0; k < d; k++) {
        const double v = x[k];
        if (!isfinite(x[k])) return 1;
        ss += v * v;
    }
    const double n = sqrt(ss);
    const double err = sqrt((double)d) * (double)q16_scale(x, d, q16) * (0.5 + (q16 + 1.0) * 0x1p-24);
    *hn = nextafterf((float)n, INFINITY);
    *dl = nextafterf((float)(err * (1 + 1e-4) + 1e-6 * n), INFINITY);
    return 0;
}

/* The bound e_r = c_r (|x| + dl) + |W_r| dl on |screen logit - float32 logit| of row r (engine/screen.py). */
static inline float screen_bound(float c, float wn, float hn, float dl) { return c * (hn + dl) + wn * dl; }

/* e [m, V]: the screen's bound at every row for each position of x [m, d] (c, wn [V]: the head's constants; q16:
 * the activation's int16 range, hsd_screen_q16(d)).
 * Returns 0, 1 when x holds a value that is not finite, -1 on bad arguments. */
int hsd_screen_bounds(const float *x, int m, int d, int q16, const float *c, const float *wn, int V,
                      float *e) {
    if (q16 < 1) return -1;
    for (int t = 0; t < m; t++) {
        float hn, dl;
        if (screen_norms(x + (size_t)t * d, d, q16, &hn, &dl)) return 1;
        for (int r = 0; r < V; r++) e[(size_t)t * V + r] = screen_bound(c[r], wn[r], hn, dl);
    }
    return 0;
}

/* Positions of x read per pass over a block of 16 rows of hsd_screen_i16 (the int32 accumulators held). */
#if HSD_AVX512
#define I16_TILE 8
#else
#define I16_TILE 4
#endif

/* The int32 sums of one block of 16 rows (codes: K / 2 pairs of columns, 32 bytes each: rows 0..15's two codes)
 * against positions xq [mt <= I16_TILE][K / 2] (each int32 two int16 codes, column 2j low): acc[t * 16 + i]. Exact
 * integers (hsd_screen_q16), so every instruction set gives the same. */
static inline void i16_block(const int8_t *codes, const int32_t *xq, int pairs, int mt, int32_t *acc) {
#if HSD_AVX512
    __m512i a[I16_TILE];
    for (int t = 0; t < I16_TILE; t++) a[t] = _mm512_setzero_si512();
#if defined(__AVX512VNNI__)
#define I16_DOT(acc, w, y) _mm512_dpwssd_epi32(acc, w, y)
#else
#define I16_DOT(acc, w, y) _mm512_add_epi32(acc, _mm512_madd_epi16(w, y))
#endif
    int j = 0;
    for (; j + 2 <= pairs; j += 2) { /* two pairs of columns from one 64-byte line */
        _mm_prefetch((const char *)(codes + 32 * (size_t)j + HSD_PREFETCH), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void *)(codes + 32 * (size_t)j));
        const __m512i w0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(v));
        const __m512i w1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(v, 1));
        for (int t = 0; t < I16_TILE; t++)
            if (t < mt) {
                a[t] = I16_DOT(a[t], w0, _mm512_set1_epi32(xq[(size_t)t * pairs + j]));
                a[t] = I16_DOT(a[t], w1, _mm512_set1_epi32(xq[(size_t)t * pairs + j + 1]));
            }
    }
    for (; j < pairs; j++) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(codes + 32 * (size_t)j)));
        for (int t = 0; t < I16_TILE; t++)
            if (t < mt) a[t] = I16_DOT(a[t], w, _mm512_set1_epi32(xq[(size_t)t * pairs + j]));
    }
#undef I16_DOT
    for (int t = 0; t < mt; t++) _mm512_storeu_si512((void *)(acc + 16 * t), a[t]);
#elif HSD_AVX2
    __m256i lo[I16_TILE], hi[I16_TILE];
    for (int t = 0; t < I16_TILE; t++) lo[t] = hi[t] = _mm256_setzero_si256();
    for (int j = 0; j < pairs; j++) {
        const int8_t *b = codes + 32 * (size_t)j;
        _mm_prefetch((const char *)(b + HSD_PREFETCH), _MM_HINT_T0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b));
        const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 16)));
        for (int t = 0; t < I16_TILE; t++)
            if (t < mt) {
                const __m256i y = _mm256_set1_epi32(xq[(size_t)t * pairs + j]);
                lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(w0, y));
                hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(w1, y));
            }
    }
    for (int t = 0; t < mt; t++) {
        _mm256_storeu_si256((__m256i *)(acc + 16 * t), lo[t]);
        _mm256_storeu_si256((__m256i *)(acc + 16 * t + 8), hi[t]);
    }
#elif HSD_NEON
    int32x4_t a[I16_TILE][4]; /* rows 0..3, 4..7, 8..11, 12..15 */
    for (int t = 0; t < I16_TILE; t++)
        for (int q = 0; q < 4; q++) a[t][q] = vdupq_n_s32(0);
    for (int j = 0; j < pairs; j++) {
        const int8_t *b = codes + 32 * (size_t)j;
        const int8x16_t c0 = vld1q_s8(b), c1 = vld1q_s8(b + 16);
        /* per register 4 rows' two codes, widened: [r0 c0, r0 c1, r1 c0, ...] */
        const int16x8_t w[4] = {vmovl_s8(vget_low_s8(c0)), vmovl_high_s8(c0), vmovl_s8(vget_low_s8(c1)),
                                vmovl_high_s8(c1)};
        for (int t = 0; t < I16_TILE; t++)
            if (t < mt) {
                const int16x8_t y = vreinterpretq_s16_s32(vdupq_n_s32(xq[(size_t)t * pairs + j]));
                for (int q = 0; q < 4; q++) { /* products, then each row's pair added: exact int32 sums */
                    const int32x4_t lo = vmull_s16(vget_low_s16(w[q]), vget_low_s16(y));
                    const int32x4_t hi = vmull_high_s16(w[q], y);
                    a[t][q] = vaddq_s32(a[t][q], vpaddq_s32(lo, hi));
                }
            }
    }
    for (int t = 0; t < mt; t++)
        for (int q = 0; q < 4; q++) vst1q_s32(acc + 16 * t + 4 * q, a[t][q]);
#else
    for (int t = 0; t < mt; t++)
        for (int i = 0; i < 16; i++) {
            int32_t v = 0;
            for (int j = 0; j < pairs; j++) {
                const int32_t y = xq[(size_t)t * pairs + j];
                v += codes[32 * (size_t)j + 2 * i] * (int32_t)(int16_t)(y & 0xFFFF)
                     + codes[32 * (size_t)j + 2 * i + 1] * (int32_t)(int16_t)((uint32_t)y >> 16);
            }
            acc[16 * t + i] = v;
        }
#endif
}

/* The screen's logits with the activation in int16 (one scale per position): a[t, r] = (float)(sum_k code[r, k]
 * xq[t, k]) * (scale[r] * s_t), the sum exact in int32, xq = nearbyint(x / s_t), s_t = q16_scale (q16 from
 * hsd_screen_q16(K)). codes: int8 [ceil(V / 16), K / 2, 32], per block of 16 rows and pair of columns the two codes of
 * each row (rows past V zero); scale: float32 [V]; x [m, K] float32, K even; a [m, V]. Returns 0, 1 when x holds a
 * value that is not finite, -1 on bad arguments. */
int hsd_screen_i16(const int8_t *codes, const float *scale, int V, int K, const float *x, int m, float *a,
                   int nthreads) {
    const int q16 = hsd_screen_q16(K), pairs = K / 2, blocks = (V + 15) / 16;
    if (m < 1 || V < 1 || K < 2 || K % 2 || q16 < 1) return -1;
    int32_t *xq = malloc(sizeof(int32_t) * (size_t)m * pairs);
    float *st = malloc(sizeof(float) * (size_t)m);
    if (!xq || !st) {
        free(xq);
        free(st);
        return -1;
    }
    for (int t = 0; t < m; t++) {
        const float *xt = x + (size_t)t * K;
        for (int k = 0; k < K; k++)
            if (!isfinite(xt[k])) {
                free(xq);
                free(st);
                return 1;
            }
        const float sc = q16_scale(xt, K, q16);
        st[t] = sc;
        for (int j = 0; j < pairs; j++) {
            const int32_t lo = sc > 0.f ? (int32_t)nearbyintf(xt[2 * j] / sc) : 0;
            const int32_t hi = sc > 0.f ? (int32_t)nearbyintf(xt[2 * j + 1] / sc) : 0;
            xq[(size_t)t * pairs + j] = (int32_t)(((uint32_t)(uint16_t)(int16_t)hi << 16) | (uint16_t)(int16_t)lo);
        }
    }
#pragma omp parallel num_threads(nthreads)
    {
        int b0, b1;
        share(blocks, 1, &b0, &b1);
        int32_t acc[16 * I16_TILE];
        for (int b = b0; b < b1; b++) {
            const int8_t *blk = codes + (size_t)b * pairs * 32;
            for (int t0 = 0; t0 < m; t0 += I16_TILE) {
                const int mt = m - t0 < I16_TILE ? m - t0 : I16_TILE;
                i16_block(blk, xq + (size_t)t0 * pairs, pairs, mt, acc);
                for (int t = 0; t < mt; t++) {
                    float *out = a + (size_t)(t0 + t) * V;
                    for (int i = 0; i < 16 && 16 * b + i < V; i++)
                        out[16 * b + i] = (float)acc[16 * t + i] * (scale[16 * b + i] * st[t0 + t]);
                }
            }
        }
    }
    free(xq);
    free(st);
    return 0;
}

/* With offsets o [V] added to the logits (a pick of argmax_r fl(l_r + o_r); NULL: none) the screen works on the sums
 * b_r = a_r + o_r, its bound widened for the float rounding of both sums and of this arithmetic: E_r = e_r + 2^-20
 * (|b_r| + e_r) (each rounding errs by at most 2^-24 of its result). Without offsets b_r = a_r and E_r = e_r. */
#define SCREEN_OFFSET_SLACK 9.5367431640625e-07f

/* Row r's b_r and E_r (o NULL: a_r and e_r = screen_bound); the vector forms below, 8 or 16 rows at a time. */
static inline void screen_row(const float *a, const float *o, const float *c, const float *wn, int r, float hn,
                              float dl, float *b, float *e) {
    *e = screen_bound(c[r], wn[r], hn, dl);
    *b = a[r];
    if (o) {
        *b += o[r];
        *e += SCREEN_OFFSET_SLACK * (fabsf(*b) + *e);
    }
}
#if HSD_AVX512
static inline void screen_row16(const float *a, const float *o, const float *c, const float *wn, int r, __m512 vh,
                                __m512 vd, __m512 *b, __m512 *e) {
    *e = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(c + r), vh), _mm512_mul_ps(_mm512_loadu_ps(wn + r), vd));
    *b = _mm512_loadu_ps(a + r);
    if (o) {
        *b = _mm512_add_ps(*b, _mm512_loadu_ps(o + r));
        *e = _mm512_add_ps(*e, _mm512_mul_ps(_mm512_set1_ps(SCREEN_OFFSET_SLACK),
                                             _mm512_add_ps(_mm512_abs_ps(*b), *e)));
    }
}
#elif HSD_AVX2
static inline void screen_row8(const float *a, const float *o, const float *c, const float *wn, int r, __m256 vh,
                               __m256 vd, __m256 *b, __m256 *e) {
    *e = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(c + r), vh), _mm256_mul_ps(_mm256_loadu_ps(wn + r), vd));
    *b = _mm256_loadu_ps(a + r);
    if (o) {
        *b = _mm256_add_ps(*b, _mm256_loadu_ps(o + r));
        *e = _mm256_add_ps(*e, _mm256_mul_ps(_mm256_set1_ps(SCREEN_OFFSET_SLACK),
                                             _mm256_add_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), *b), *e)));
    }
}
#endif

/* The highest lower bound max_r (b_r - E_r) of one position's screen logits a [V] (offsets o [V] or NULL); *bad set
 * when a or o holds a value that is not finite. lo, hi [V] (or NULL): each row's b_r - E_r and b_r + E_r stored. */
static float screen_spans(const float *a, const float *o, const float *c, const float *wn, int V, float hn, float dl,
                          float *lo, float *hi, int *bad) {
    float floor = -INFINITY;
    int r = 0;
#if HSD_AVX512
    __m512 mx = _mm512_set1_ps(-INFINITY), b, e;
    const __m512 vh = _mm512_set1_ps(hn + dl), vd = _mm512_set1_ps(dl), zero = _mm512_setzero_ps();
    __mmask16 nf = 0;
    for (; r + 16 <= V; r += 16) {
        screen_row16(a, o, c, wn, r, vh, vd, &b, &e);
        nf |= _mm512_cmp_ps_mask(_mm512_sub_ps(b, b), zero, _CMP_NEQ_UQ);   /* inf - inf, NaN: not 0 */
        const __m512 l = _mm512_sub_ps(b, e);
        if (lo) {
            _mm512_storeu_ps(lo + r, l);
            _mm512_storeu_ps(hi + r, _mm512_add_ps(b, e));
        }
        mx = _mm512_max_ps(mx, l);
    }
    if (nf) *bad = 1;
    floor = _mm512_reduce_max_ps(mx);
#elif HSD_AVX2
    __m256 mx = _mm256_set1_ps(-INFINITY), nf = _mm256_setzero_ps(), b, e;
    const __m256 vh = _mm256_set1_ps(hn + dl), vd = _mm256_set1_ps(dl), zero = _mm256_setzero_ps();
    for (; r + 8 <= V; r += 8) {
        screen_row8(a, o, c, wn, r, vh, vd, &b, &e);
        nf = _mm256_or_ps(nf, _mm256_cmp_ps(_mm256_sub_ps(b, b), zero, _CMP_NEQ_UQ));
        const __m256 l = _mm256_sub_ps(b, e);
        if (lo) {
            _mm256_storeu_ps(lo + r, l);
            _mm256_storeu_ps(hi + r, _mm256_add_ps(b, e));
        }
        mx = _mm256_max_ps(mx, l);
    }
    if (_mm256_movemask_ps(nf)) *bad = 1;
    float l[8];
    _mm256_storeu_ps(l, mx);
    for (int i = 0; i < 8; i++) floor = l[i] > floor ? l[i] : floor;
#endif
    for (; r < V; r++) {
        float b1, e1;
        screen_row(a, o, c, wn, r, hn, dl, &b1, &e1);
        if (!isfinite(b1)) *bad = 1;
        const float l1 = b1 - e1;
        if (lo) {
            lo[r] = l1;
            hi[r] = b1 + e1;
        }
        floor = l1 > floor ? l1 : floor;
    }
    return floor;
}

/* The rows r (in order) whose b_r + E_r reaches floor, into cand; their number, or -1 past cap. */
static int screen_collect(const float *a, const float *o, const float *c, const float *wn, int V, float hn, float dl,
                          float floor, int cap, long *cand) {
    int n = 0, r = 0;
#if HSD_AVX512
    __m512 b, e;
    const __m512 vh = _mm512_set1_ps(hn + dl), vd = _mm512_set1_ps(dl), vf = _mm512_set1_ps(floor);
    for (; r + 16 <= V; r += 16) {
        screen_row16(a, o, c, wn, r, vh, vd, &b, &e);
        unsigned k = _mm512_cmp_ps_mask(_mm512_add_ps(b, e), vf, _CMP_GE_OQ);
        for (; k; k &= k - 1) {
            if (n == cap) return -1;
            cand[n++] = r + __builtin_ctz(k);
        }
    }
#elif HSD_AVX2
    __m256 b, e;
    const __m256 vh = _mm256_set1_ps(hn + dl), vd = _mm256_set1_ps(dl), vf = _mm256_set1_ps(floor);
    for (; r + 8 <= V; r += 8) {
        screen_row8(a, o, c, wn, r, vh, vd, &b, &e);
        unsigned k = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_add_ps(b, e), vf, _CMP_GE_OQ));
        for (; k; k &= k - 1) {
            if (n == cap) return -1;
            cand[n++] = r + __builtin_ctz(k);
        }
    }
#endif
    for (; r < V; r++) {
        float b1, e1;
        screen_row(a, o, c, wn, r, hn, dl, &b1, &e1);
        if (b1 + e1 >= floor) {
            if (n == cap) return -1;
            cand[n++] = r;
        }
    }
    return n;
}

/* The greedy ids of the float32 head A at each position of normed hidden x [m, A->cols], from the screen's
 * logits a [m, V] (the int8 copy's, the activation in int16 of range q16): the rows whose interval [a_r - e_r,
 * a_r + e_r] reaches the highest lower bound are the candidates, computed as hsd_rows_f32 computes them
 * (rows4_f32), and out[t] is the first of the largest. With offsets o [m, V] (NULL: none), out[t] is the first
 * largest of the sums l_r + o_r (float32) instead, the screen on a_r + o_r with its bound widened (screen_row).
 * Positions shared among nthreads threads (two vector passes over V and a few rows each). Returns 0; 1 when x or a
 * holds a value that is not finite or a position has more than cap candidates (the caller computes the logits);
 * -1 on bad arguments. */
int hsd_screen_pick(const hsd_mat *A, const float *x, int m, int q16, const float *a, const float *o,
                    const float *c, const float *wn, int cap, long *out, int nthreads) {
    if (A->type != HSD_F32 || A->bias || m < 1 || cap < 1 || q16 < 1) return -1;
    const int K = A->cols, V = A->rows;
    int rc = 0;
#pragma omp parallel num_threads(m > 1 ? nthreads : 1) reduction(| : rc)
    {
        long *cand = malloc(sizeof(long) * (size_t)cap);
        prefetch_t pf = {NULL, NULL};
        int t0, t1;
        share(m, 1, &t0, &t1);
        if (!cand) rc |= 2;
        for (int t = t0; t < t1 && !rc; t++) {
            const float *at = a + (size_t)t * V, *xt = x + (size_t)t * K, *ot = o ? o + (size_t)t * V : NULL;
            float hn, dl;
            if (screen_norms(xt, K, q16, &hn, &dl)) {
                rc |= 1;
                break;
            }
            int bad = 0;
            const float floor = screen_spans(at, ot, c, wn, V, hn, dl, NULL, NULL, &bad);
            const int n = bad ? -1 : screen_collect(at, ot, c, wn, V, hn, dl, floor, cap, cand);
            if (n < 0) {
                rc |= 1;
                break;
            }
            float best = -INFINITY;
            long arg = -1;
            for (int j = 0; j < n; j += 4) {
                const int k = n - j < 4 ? n - j : 4;
                float sc[4];
                rows4_f32(A, cand + j, k, xt, sc, &pf);
                for (int i = 0; i < k; i++) {
                    const float v = ot ? sc[i] + ot[cand[j + i]] : sc[i];
                    if (arg < 0 || v > best) best = v, arg = cand[j + i];
                }
            }
            out[t] = arg;
        }
        free(cand);
    }
    return rc & 2 ? -1 : rc;
}

/* The k-th largest (1 <= k <= n) of v [n], reordering v (quickselect, Hoare's partition about the middle value). */
static float kth_largest(float *v, int n, int k) {
    int lo = 0, hi = n - 1;
    const int want = k - 1; /* its index in descending order */
    while (lo < hi) {
        const float p = v[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) {
            while (v[i] > p) i++;
            while (v[j] < p) j--;
            if (i <= j) {
                const float t = v[i];
                v[i++] = v[j];
                v[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break; /* v[j + 1 .. i - 1] all equal p */
    }
    return v[want];
}

/* One position's window (hsd_screen_window) at normed hidden x [K]: lo, hi [V] the bounds b_r -+ E_r (screen_spans),
 * the pinned tokens' exact moved values in place of theirs; returns the largest lower bound, *bad set for a value
 * of x, a, o or the pins that is not finite. */
static float window_bounds(const float *x, int K, int q16, const float *a, const float *o, const float *c,
                           const float *wn, int V, const long *pin_ids, const float *pin_vals, int npin, float *lo,
                           float *hi, int *bad) {
    float hn, dl;
    if (screen_norms(x, K, q16, &hn, &dl)) {
        *bad = 1;
        return 0.f;
    }
    float most = screen_spans(a, o, c, wn, V, hn, dl, lo, hi, bad);
    if (npin) { /* a pinned token may have held the largest: the maximum again, over the values as they now are */
        for (int j = 0; j < npin; j++) {
            if (!isfinite(pin_vals[j])) *bad = 1;
            lo[pin_ids[j]] = hi[pin_ids[j]] = pin_vals[j];
        }
        most = -INFINITY;
        for (int r = 0; r < V; r++) most = lo[r] > most ? lo[r] : most;
    }
    return most;
}

/* The logits of a window of each position's largest: out [m, V] (float32) holds, at each position t of normed
 * hidden x [m, A->cols], the float32 head A's logits (computed as hsd_rows_f32 computes them; offsets not added)
 * of the tokens that may be among the top_k (> 0; 0 or >= V: no such filter) largest of the logits plus offsets o
 * [m, V] (NULL: none) and no more than `below` (logit units; INFINITY: no such limit) under the largest, and
 * -INFINITY at every other token (engine/screen.py's HeadScreen.window). From the screen's logits a [m, V] (the
 * int8 copy's, the activation in int16 of range q16): each token's interval [b_r - E_r, b_r + E_r] (screen_row);
 * the npin pinned tokens (position pin_pos[j], token pin_ids[j], pin_pos ascending) have the exact value
 * pin_vals[j] instead. The floor is the largest lower bound less `below`, raised to the top_k-th largest lower
 * bound (sought among those within `reach` of the largest, or within `below` where it is finite; the whole row
 * where fewer than top_k are there and `below` is infinite), then lowered by slack (1 + |floor|); the window is
 * every token whose upper bound reaches it. work: nthreads * 3 * V floats (scratch); ids: m * cap longs and counts:
 * m ints, out: position t's window, its counts[t] token ids ascending at ids + t * cap. Positions shared among
 * nthreads threads. Returns 0; 1 when x, a or o holds a value that is not finite or a
 * position has more than cap tokens in its window (the caller computes the logits); -1 on bad arguments. */
int hsd_screen_window(const hsd_mat *A, const float *x, int m, int q16, const float *a, const float *o,
                      const float *c, const float *wn, int top_k, float below, float reach, float slack,
                      const long *pin_pos, const long *pin_ids, const float *pin_vals, int npin, int cap,
                      float *out, float *work, long *ids, int *counts, int nthreads) {
    if (A->type != HSD_F32 || A->bias || m < 1 || cap < 1 || q16 < 1 || top_k < 0 || npin < 0 || !(below >= 0.f)
        || !(reach >= 0.f) || !(slack >= 0.f))
        return -1;
    const int K = A->cols, V = A->rows;
    for (int j = 0; j < npin; j++)
        if (pin_pos[j] < 0 || pin_pos[j] >= m || (j && pin_pos[j] < pin_pos[j - 1]) || pin_ids[j] < 0
            || pin_ids[j] >= V)
            return -1;
    const int k = top_k < V ? top_k : 0;
    int rc = 0;
#pragma omp parallel num_threads(m > 1 ? nthreads : 1) reduction(| : rc)
    {
        const int id = omp_get_thread_num();
        float *lo = work + (size_t)id * 3 * V, *hi = lo + V, *sel = hi + V;
        prefetch_t pf = {NULL, NULL};
        int t0, t1;
        share(m, 1, &t0, &t1);
        for (int t = t0; t < t1 && !rc; t++) {
            const float *xt = x + (size_t)t * K, *ot = o ? o + (size_t)t * V : NULL;
            int p0 = 0, bad = 0;
            while (p0 < npin && pin_pos[p0] < t) p0++;
            int p1 = p0;
            while (p1 < npin && pin_pos[p1] == t) p1++;
            const float most = window_bounds(xt, K, q16, a + (size_t)t * V, ot, c, wn, V, pin_ids + p0, pin_vals + p0,
                                             p1 - p0, lo, hi, &bad);
            if (bad) {
                rc |= 1;
                break;
            }
            float floor = most - below;
            if (k > 0) {
                const float near = most - (isinf(below) ? reach : below);
                int n = 0;
                for (int r = 0; r < V; r++)
                    if (lo[r] >= near) sel[n++] = lo[r];
                if (n < k && isinf(below)) {
                    memcpy(sel, lo, sizeof(float) * (size_t)V);
                    n = V;
                }
                if (n >= k) {
                    const float kth = kth_largest(sel, n, k);
                    floor = kth > floor ? kth : floor;
                }
            }
            floor -= slack * (1.f + fabsf(floor));
            if (!isfinite(floor)) {
                rc |= 1;
                break;
            }
            long *cd = ids + (size_t)t * cap;
            int n = 0;
            for (int r = 0; r < V && n <= cap; r++)
                if (hi[r] >= floor) {
                    if (n == cap) n = cap + 1;
                    else cd[n++] = r;
                }
            if (n > cap) {
                rc |= 1;
                break;
            }
            counts[t] = n;
            float *yt = out + (size_t)t * V;
            for (int r = 0; r < V; r++) yt[r] = -INFINITY;
            for (int j = 0; j < n; j += 4) {
                const int kk = n - j < 4 ? n - j : 4;
                float sc[4];
                rows4_f32(A, cd + j, kk, xt, sc, &pf);
                for (int i = 0; i < kk; i++) yt[cd[j + i]] = sc[i];
            }
        }
    }
    return rc;
}

/* ------------------------------------------------------------------------------------------ the exact forms */

/* float32 -> float16 bits, rounded to nearest, ties to even, as torch's .half() (overflow to infinity, half
 * subnormals rounded too; F. Giesen's float_to_half_fast3_rtne). The same code on every build. */
static uint16_t float_to_half(float f) {
    const uint32_t f32_inf = 255u << 23, f16_max = (127u + 16) << 23, magic = ((127u - 15) + (23 - 10) + 1) << 23;
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = u & 0x80000000u;
    u ^= sign;
    uint16_t o;
    if (u >= f16_max) { /* past the largest half: infinity, or a NaN */
        o = u > f32_inf ? 0x7E00 : 0x7C00;
    } else if (u < (113u << 23)) { /* a half subnormal or zero: the float addition rounds it (to nearest, even) */
        float fu, fm;
        memcpy(&fu, &u, 4);
        memcpy(&fm, &magic, 4);
        fu += fm;
        memcpy(&u, &fu, 4);
        o = (uint16_t)(u - magic);
    } else { /* a normal half: rebias, round the 13 bits dropped to nearest, even */
        const uint32_t odd = (u >> 13) & 1;
        u += ((uint32_t)(15 - 127) << 23) + 0xFFF + odd;
        o = (uint16_t)(u >> 13);
    }
    return o | (uint16_t)(sign >> 16);
}

/* The first column at which row r of the exact form A (HSD_Q4F or HSD_Q8F), as the kernels compute it
 * (expand_row: fma(code, scale, minimum), code * scale), differs in its bits from the float32 row wr [cols]; -1 when
 * the row is the same, bit for bit. buf: cols floats. */
static int row_mismatch(const hsd_mat *A, int r, const float *wr, float *buf) {
    expand_row(A, r, buf);
    if (!memcmp(buf, wr, sizeof(float) * (size_t)A->cols)) return -1;
    int c = 0;
    while (!memcmp(buf + c, wr + c, sizeof(float))) c++;
    return c;
}

/* Rows [r0, r1) of A checked against w [rows, cols] (row_mismatch) until the first that differs: r * cols + c of
 * its first differing weight, or -1. */
static long rows_mismatch(const hsd_mat *A, int r0, int r1, const float *w, float *buf) {
    for (int r = r0; r < r1; r++) {
        const int c = row_mismatch(A, r, w + (size_t)r * A->cols, buf);
        if (c >= 0) return (long)r * A->cols + c;
    }
    return -1;
}

/* The exact-form builders and check below share rows among the threads in chunks taken in order (schedule(dynamic):
 * a thread's chunks come in increasing order, so its first mismatch is its least, and the least over the threads
 * the matrix's first). Each thread: HSD_EXACT_BEGIN, its chunks, HSD_EXACT_END; then `first` holds the index of the
 * first mismatch (-1: none), `failed` whether a thread had no memory for its row buffer. */
#define HSD_EXACT_BEGIN(cols)                                                                                    \
    float *buf = malloc(sizeof(float) * (size_t)(cols));                                                         \
    long mine = -1;                                                                                              \
    failed = buf == NULL;
#define HSD_EXACT_END                                                                                            \
    free(buf);                                                                                                   \
    _Pragma("omp critical") if (mine >= 0 && (first < 0 || mine < first)) first = mine;

/* The exact int4 form (HSD_Q4F) of float32 weights w [rows, cols] (cols a multiple of 32), made by weights.py's
 * quantize_q4 per group of 32 columns, the same float32 operations: scale = half(max((max - min) / 15, 6.1e-5)),
 * minimum = half(min), code = round((w - minimum) / scale) (to nearest, even) clamped to 0..15. Written in the q4f
 * layout (hsd_mat; weights.py's pair_codes: a short last block repeats its last row, an odd last group is
 * repeated): codes uint8 [ceil(rows / 4), ceil(G / 2), 128], scale and zero float16 bits [rows, G], G = cols / 32.
 * Then every row written is read back as the kernels read it and compared with w, bit for bit (row_mismatch, the
 * block's rows while they are in cache). Returns the index r * cols + c of the first weight the form does not give
 * exactly (the form is then not to be used), -1 when it gives every one, -2 for a bad call. */
long hsd_exact_q4f(const float *w, int rows, int cols, uint8_t *codes, uint16_t *scale, uint16_t *zero, int nthreads) {
    if (rows < 1 || cols < HSD_GROUP || cols % HSD_GROUP) return -2;
    const int G = cols / HSD_GROUP, GP = (G + 1) / 2, blocks = (rows + 3) / 4;
    const hsd_mat A = {HSD_Q4F, rows, cols, 0, codes, scale, zero, NULL};
    long first = -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        HSD_EXACT_BEGIN(cols)
#pragma omp for schedule(dynamic, 8)
        for (int b = 0; b < blocks; b++) {
            for (int i = 0; i < 4; i++) {
                const int r = 4 * b + i < rows ? 4 * b + i : rows - 1;
                for (int g = 0; g < 2 * GP; g++) {
                    const int gs = g < G ? g : G - 1;
                    const float *x = w + (size_t)r * cols + (size_t)gs * HSD_GROUP;
                    float lo8[8], hi8[8], lo, hi; /* 8 columns at a time, then across them (vectorized) */
                    memcpy(lo8, x, sizeof lo8);
                    memcpy(hi8, x, sizeof hi8);
                    for (int k = 8; k < HSD_GROUP; k += 8)
                        for (int j = 0; j < 8; j++) {
                            lo8[j] = x[k + j] < lo8[j] ? x[k + j] : lo8[j];
                            hi8[j] = x[k + j] > hi8[j] ? x[k + j] : hi8[j];
                        }
                    lo = lo8[0], hi = hi8[0];
                    for (int j = 1; j < 8; j++) {
                        lo = lo8[j] < lo ? lo8[j] : lo;
                        hi = hi8[j] > hi ? hi8[j] : hi;
                    }
                    float step = (hi - lo) / 15.0f;
                    step = step < 6.1e-5f ? 6.1e-5f : step;
                    const uint16_t sh = float_to_half(step), lh = float_to_half(lo);
                    if (r == 4 * b + i && g < G) scale[(size_t)r * G + g] = sh, zero[(size_t)r * G + g] = lh;
                    const float sf = half_to_float(sh), lf = half_to_float(lh);
                    uint8_t q[HSD_GROUP], *out = codes + ((size_t)b * GP + g / 2) * 128 + 64 * (i / 2) + 8 * (i % 2);
                    for (int c = 0; c < HSD_GROUP; c++) { /* (vectorized by the compiler) */
                        const float v = nearbyintf((x[c] - lf) / sf);
                        q[c] = (uint8_t)(int)(v >= 0.f ? (v <= 15.f ? v : 15.f) : 0.f); /* (a NaN to 0) */
                    }
                    for (int k = 0; k < 4; k++) /* columns 8k .. 8k + 7 at bytes 16k ..; an odd group's high */
                        if (g % 2 == 0)
                            memcpy(out + 16 * k, q + 8 * k, 8);
                        else
                            for (int j = 0; j < 8; j++) out[16 * k + j] |= (uint8_t)(q[8 * k + j] << 4);
                }
            }
            if (mine < 0 && buf) mine = rows_mismatch(&A, 4 * b, 4 * b + 4 < rows ? 4 * b + 4 : rows, w, buf);
        }
        HSD_EXACT_END
    }
    return failed ? -2 : first;
}

/* The exact int8 form (HSD_Q8F) of float32 weights w [rows, cols] (cols a multiple of 32), made by weights.py's
 * exact_int8 per group of 32 columns, the same float32 operations: scale = half(max |w| / 127), code = round(w /
 * scale) (to nearest, even; w itself for a zero scale) clamped to -127..127. Written in the q8f layout (hsd_mat;
 * weights.py's pair_rows_int8: an odd last row repeated): codes int8 [ceil(rows / 2), cols / 8, 16], scale float16
 * bits [rows, G]. Then checked as hsd_exact_q4f checks its form; returns as it does. */
long hsd_exact_q8f(const float *w, int rows, int cols, int8_t *codes, uint16_t *scale, int nthreads) {
    if (rows < 1 || cols < HSD_GROUP || cols % HSD_GROUP) return -2;
    const int G = cols / HSD_GROUP, pairs = (rows + 1) / 2;
    const hsd_mat A = {HSD_Q8F, rows, cols, 0, codes, scale, NULL, NULL};
    long first = -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        HSD_EXACT_BEGIN(cols)
#pragma omp for schedule(dynamic, 16)
        for (int p = 0; p < pairs; p++) {
            for (int h = 0; h < 2; h++) {
                const int r = 2 * p + h < rows ? 2 * p + h : rows - 1;
                for (int g = 0; g < G; g++) {
                    const float *x = w + (size_t)r * cols + (size_t)g * HSD_GROUP;
                    float amax = 0.f;
                    for (int j = 0; j < HSD_GROUP; j++) amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
                    const uint16_t dh = float_to_half(amax / 127.0f);
                    if (r == 2 * p + h) scale[(size_t)r * G + g] = dh;
                    float d = half_to_float(dh);
                    d = d > 0.f ? d : 1.f;
                    int8_t q[HSD_GROUP], *out = codes + ((size_t)p * (cols / 8) + g * 4) * 16 + 8 * h;
                    for (int c = 0; c < HSD_GROUP; c++) { /* (vectorized by the compiler) */
                        const float v = nearbyintf(x[c] / d);
                        q[c] = (int8_t)(int)(v >= -127.f ? (v <= 127.f ? v : 127.f) : -127.f); /* (a NaN to -127) */
                    }
                    for (int k = 0; k < 4; k++) memcpy(out + 16 * k, q + 8 * k, 8);
                }
            }
            if (mine < 0 && buf) mine = rows_mismatch(&A, 2 * p, 2 * p + 2 < rows ? 2 * p + 2 : rows, w, buf);
        }
        HSD_EXACT_END
    }
    return failed ? -2 : first;
}

/* The check of hsd_exact_q4f and hsd_exact_q8f alone, for an exact form A made elsewhere (HSD_Q4F or HSD_Q8F, cols a
 * multiple of 32): the index r * cols + c of the first weight of w [rows, cols] whose value as the kernels compute
 * it differs in its bits, -1 when every weight is the same, -2 for a bad call. */
long hsd_exact_mismatch(const hsd_mat *A, const float *w, int nthreads) {
    if (!paired(A) || A->rows < 1 || A->cols < HSD_GROUP || A->cols % HSD_GROUP) return -2;
    const int blocks = (A->rows + 3) / 4;
    long first = -1;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        HSD_EXACT_BEGIN(A->cols)
#pragma omp for schedule(dynamic, 8)
        for (int b = 0; b < blocks; b++)
            if (mine < 0 && buf) mine = rows_mismatch(A, 4 * b, 4 * b + 4 < A->rows ? 4 * b + 4 : A->rows, w, buf);
        HSD_EXACT_END
    }
    return failed ? -2 : first;
}

/* The greedy screen's int8 copy of a float32 head w [V, K] (K even), by weights.py's quantize_q8, the same float32
 * operations: per row scale = max(max |w| / 127, 1e-12), code = round(w / scale) (to nearest, even) clamped to
 * -127..127. Writes the codes in hsd_screen_i16's layout (kernels.py's pack_screen_codes: int8 [ceil(V / 16), K / 2,
 * 32], rows past V zero), the row scales [V] and per row the Euclidean norms rho = |code * scale - w| and wnorm = |w|
 * [V] (double, from terms and sums in double: they err far less than the float32 allowance screen.py adds).
 * Returns 0, or -1 for a bad call. */
int hsd_screen_codes(const float *w, int V, int K, int8_t *codes, float *scale, double *rho, double *wnorm,
                     int nthreads) {
    if (V < 1 || K < 2 || K % 2) return -1;
    const int blocks = (V + 15) / 16, pairs = K / 2;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 16)
    for (int b = 0; b < blocks; b++)
        for (int i = 0; i < 16; i++) {
            const int r = 16 * b + i;
            int8_t *out = codes + (size_t)b * pairs * 32 + 2 * i;
            if (r >= V) {
                for (int j = 0; j < pairs; j++) out[32 * j] = out[32 * j + 1] = 0;
                continue;
            }
            const float *x = w + (size_t)r * K;
            const int K8 = K / 8 * 8;
            float am[8] = {0}, amax = 0.f; /* 8 columns at a time, then across them (vectorized) */
            for (int k = 0; k < K8; k += 8)
                for (int j = 0; j < 8; j++) am[j] = fabsf(x[k + j]) > am[j] ? fabsf(x[k + j]) : am[j];
            for (int k = K8; k < K; k++) am[0] = fabsf(x[k]) > am[0] ? fabsf(x[k]) : am[0];
            for (int j = 0; j < 8; j++) amax = am[j] > amax ? am[j] : amax;
            float s = amax / 127.0f;
            s = s >= 1e-12f ? s : 1e-12f;
            double e2[8] = {0}, w2[8] = {0}; /* sums of squares in 8 lanes, then across them */
            for (int k = 0; k < K; k += 8) {
                const int n = K - k < 8 ? K - k : 8;
                float q[8];
                for (int j = 0; j < n; j++) {
                    const float v = nearbyintf(x[k + j] / s);
                    q[j] = v >= -127.f ? (v <= 127.f ? v : 127.f) : -127.f; /* (a NaN to -127) */
                    const double e = (double)q[j] * s - x[k + j];
                    e2[j] += e * e;
                    w2[j] += (double)x[k + j] * x[k + j];
                }
                for (int j = 0; j < n; j++) out[32 * ((k + j) / 2) + j % 2] = (int8_t)(int)q[j];
            }
            for (int j = 1; j < 8; j++) e2[0] += e2[j], w2[0] += w2[j];
            scale[r] = s;
            rho[r] = sqrt(e2[0]);
            wnorm[r] = sqrt(w2[0]);
        }
    return 0;
}

/* out [m, d] = RMSNorm(x) with weight w (float32 statistics). */
void hsd_rms_norm(const float *x, int m, int d, const float *w, float eps, float *out) {
    rms_norm_rows(x, m, d, w, eps, out);
}
