/* Hybrid attention's native CPU kernels, fp32, plain C99 (no torch headers), loaded through ctypes
 * (ops/native/build.py builds and loads them; the other modules of ops/native call them). Their
 * interface is declared once, in cpu_kernels.h.
 *
 * hybrid_step_f32: one decode step, in place: the whole of ops/hybrid/step.py's in-place path (fold the
 * key leaving the window into S and z, write the new key and value into the ring, window softmax,
 * feature map, linear readout, mix) as one call. The torch step issues about 20 small ops per layer
 * and token, and inside a model each of them runs cold (the other layers evicted its code and data),
 * so the step costs its op count, not its arithmetic. Its KV heads' folds, then its query heads'
 * readouts, are split over ``threads``.
 *
 * hybrid_sparse_step_f32: the same for the sparse cache's step (ops/sparse/step.py), on the steps
 * that close no block. Both steps take the token's RoPE tables (cos, sin; NULL where q and k arrive
 * rotated), so a model's step needs no torch op between its projections and the kernel.
 *
 * hybrid_prefill_f32: the parallel op over a range of positions, as the recurrence: per position,
 * fold the key leaving the window into S and z, then each query head's window softmax (the keys
 * read in place) and linear readout. Every intermediate is one position's (the scores, S and z of
 * one KV head stay in L1), where the chunked torch backend streams block-sized tensors through
 * memory for each of its ~30 ops; and it does only the op's own FLOPs (no masked half-blocks).
 *
 * hybrid_step_f32 and hybrid_prefill_f32 take a decaying linear state (log_decay, log gamma per KV
 * head): S and z are scaled by gamma before each fold, as ops/hybrid/step.py does (the prefill applies
 * a block's powers of gamma at once). NULL: no decay, the arithmetic exactly as without the argument.
 *
 * softmax_decode_f32: a softmax layer's decode step, one query over its whole KV cache, the keys split
 * into chunks that the threads share (ops/native/softmax_decode.py).
 *
 * Step preconditions (checked by the caller): every tensor contiguous fp32 on the CPU, the new key
 * real, and every key already in the window real. Layouts, per batch row b:
 *   q [B, H, D]; k, v [B, Hk, D]; k_win, v_win [B, Hk, w, D]; valid [B, w] (bytes);
 *   S [B, Hk, F, D]; z [B, Hk, F]; window and linear logits [H]; out [B, H, D];
 *   Hedgehog maps: wq [H, D, F/2], bq [H, F/2], wk [Hk, D, F/2], bk [Hk, F/2].
 * Query head h reads KV head h / (H / Hk).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_kernels.h"  /* the entry points and constants, declared once */

#define HYBRID_DESCRIBE(ret, name, params) #ret " " #name #params "\n"
const char *hybrid_interface(void) { return HYBRID_KERNELS(HYBRID_DESCRIBE); }
#undef HYBRID_DESCRIBE

/* exp(x) for x <= 0 (every argument here is shifted by its maximum): 2^n * p(r) with
 * x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial (relative error about 2e-7). Branch-free, so
 * the loops that call it vectorize; below -87 the result is 0 (fp32 underflow). */
static inline float exp_nonpos(float x) {
    const float ln2_hi = 0.693359375f, ln2_lo = -2.12194440e-4f;
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * ln2_hi - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { uint32_t i; float f; } two_n;
    two_n.i = (uint32_t)((int32_t)n + 127) << 23;
    return p * two_n.f;
}

enum { QB = 16 };  /* positions per block (TILE: the key/value tile, in cpu_kernels.h) */
/* A TILE-wide accumulator as four GCC/Clang vectors of 16 floats: kept in registers (arrays were
 * spilled to the stack around every FMA); the compiler splits them for narrower SIMD. */
typedef float vec16 __attribute__((vector_size(64), aligned(4), may_alias));  /* unaligned loads of float rows */
typedef struct { vec16 x[4]; } tile_t;

static inline vec16 splat(float a) { return (vec16){a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a}; }

/* acc += a * row[0 .. TILE) */
static inline void tile_fma(tile_t *acc, float a, const float *row) {
    const vec16 s = splat(a);
    const vec16 *r = (const vec16 *)row;
    acc->x[0] += s * r[0];
    acc->x[1] += s * r[1];
    acc->x[2] += s * r[2];
    acc->x[3] += s * r[3];
}

/* A row of scores: whole tiles, and 16 lanes past the window for the vector exp. */
static inline int prefill_scores_stride(int w) { return (w + TILE - 1) / TILE * TILE + 16; }

/* Columns of the transposed-key buffer: a window and a block, then room to append before sliding
 * (a slide moves the window's w columns back to the start), and a tile's reach past the last key. */
static inline int prefill_key_columns(int w) { return 4 * (w + QB) + TILE; }

static inline void tile_store(float *dst, const tile_t *acc) { memcpy(dst, acc->x, sizeof acc->x); }

static inline tile_t tile_add(tile_t a, const tile_t *b) {
    for (int i = 0; i < 4; i++) a.x[i] += b->x[i];
    return a;
}

/* dst[m][0 .. TILE) = scale * sum_i weights[m][i] * rows[i * ld .. + TILE) for G = 1 .. 4 weight
 * vectors over the same n rows: each row is loaded once for all G (the query heads of one KV head
 * share their keys, values and S). Inlined per constant G, so the G tiles stay in registers; G = 1
 * splits its sum in two for independent FMA chains. */
static inline __attribute__((always_inline)) void rows_times(const int G, int n, const float *const *weights,
                                                             const float *rows, long long ld, float scale,
                                                             float *const *dst) {
    tile_t acc[4], odd;
    memset(acc, 0, sizeof acc);
    memset(&odd, 0, sizeof odd);
    int i = 0;
    if (G == 1) {
        for (; i + 1 < n; i += 2) {
            tile_fma(&acc[0], weights[0][i] * scale, rows + i * ld);
            tile_fma(&odd, weights[0][i + 1] * scale, rows + (i + 1) * ld);
        }
        acc[0] = tile_add(acc[0], &odd);
    }
    for (; i < n; i++) {
        const vec16 *r = (const vec16 *)(rows + i * ld);
        const vec16 r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
        for (int m = 0; m < G; m++) {
            const vec16 a = splat(weights[m][i] * scale);
            acc[m].x[0] += a * r0;
            acc[m].x[1] += a * r1;
            acc[m].x[2] += a * r2;
            acc[m].x[3] += a * r3;
        }
    }
    for (int m = 0; m < G; m++) tile_store(dst[m], &acc[m]);
}

/* rows_times for any number of weight vectors, in groups of up to four. */
static void rows_times_all(int g, int n, const float *const *weights, const float *rows, long long ld, float scale,
                           float *const *dst) {
    for (int m = 0; m < g; m += 4) {
        switch (g - m < 4 ? g - m : 4) {
            case 1: rows_times(1, n, weights + m, rows, ld, scale, dst + m); break;
            case 2: rows_times(2, n, weights + m, rows, ld, scale, dst + m); break;
            case 3: rows_times(3, n, weights + m, rows, ld, scale, dst + m); break;
            default: rows_times(4, n, weights + m, rows, ld, scale, dst + m); break;
        }
    }
}

typedef int32_t vec16i __attribute__((vector_size(64)));

/* The sum of 16 lanes, pairwise (a chain of 16 scalar adds was a tenth of the prefill's time). */
static inline float lane_sum(vec16 x) {
    float l[16];
    memcpy(l, &x, sizeof l);
    for (int half = 8; half >= 1; half /= 2)
        for (int i = 0; i < half; i++) l[i] += l[i + half];
    return l[0];
}

/* The lane-wise maximum, and the largest of 16 lanes. */
static inline vec16 vmax16(vec16 a, vec16 b) {
    const vec16i take_b = b > a;
    vec16i ai, bi;
    memcpy(&ai, &a, sizeof a);
    memcpy(&bi, &b, sizeof b);
    ai = (take_b & bi) | (~take_b & ai);
    memcpy(&a, &ai, sizeof a);
    return a;
}

static inline float lane_max(vec16 x) {
    float l[16];
    memcpy(l, &x, sizeof l);
    for (int half = 8; half >= 1; half /= 2)
        for (int i = 0; i < half; i++) l[i] = l[i + half] > l[i] ? l[i + half] : l[i];
    return l[0];
}

/* exp_nonpos on 16 lanes (the scalar version's loop did not vectorize): the same range reduction
 * and polynomial, n rounded with the 1.5 * 2^23 trick. */
static inline vec16 exp_nonpos16(vec16 x) {
    const vec16 round = splat(12582912.0f);
    {  /* x = max(x, -87) by a lane mask (the vector ternary is C++ only) */
        const vec16 lo = splat(-87.0f);
        const vec16i below = x < lo;
        vec16i xi, loi;
        memcpy(&xi, &x, sizeof x);
        memcpy(&loi, &lo, sizeof lo);
        xi = (below & loi) | (~below & xi);
        memcpy(&x, &xi, sizeof x);
    }
    const vec16 n = (x * splat(1.44269504088896341f) + round) - round;
    const vec16 r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vec16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    const vec16i bits = (__builtin_convertvector(n, vec16i) + 127) << 23;
    vec16 two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* phi(x) [F] of one D-vector: elu(x) + 1 (F = D), or Hedgehog's softmax(xW + b) ++ softmax(-(xW + b))
 * with W [D, F/2] row-major (F = 2 * F/2). Sizes that are whole tiles (the usual D = 64, F/2 = 64) run
 * on register tiles; others on plain loops. */
static void feature_map(int map, int D, int F, const float *x, const float *W, const float *bias, float *phi) {
    if (map == MAP_ELU1) {
        int d = 0;
        for (; d + 16 <= D; d += 16) {
            vec16 xv;
            memcpy(&xv, x + d, sizeof xv);
            const vec16 e = exp_nonpos16(xv), one = xv + splat(1.0f);
            const vec16i pos = xv > splat(0.0f);
            vec16i ei, oi;
            memcpy(&ei, &e, sizeof e);
            memcpy(&oi, &one, sizeof one);
            ei = (pos & oi) | (~pos & ei);
            memcpy(phi + d, &ei, sizeof ei);
        }
        for (; d < D; d++) phi[d] = x[d] > 0.0f ? x[d] + 1.0f : exp_nonpos(x[d]);
        return;
    }
    const int Fh = F / 2;
    float *proj = phi;  /* xW + b in the first half, then both halves overwritten below */
    int f0 = 0;
    for (; f0 + TILE <= Fh; f0 += TILE) {
        tile_t acc;
        memcpy(acc.x, bias + f0, sizeof acc.x);
        for (int d = 0; d < D; d++) tile_fma(&acc, x[d], W + (size_t)d * Fh + f0);
        tile_store(proj + f0, &acc);
    }
    if (f0 < Fh) {
        memcpy(proj + f0, bias + f0, sizeof(float) * (Fh - f0));
        for (int d = 0; d < D; d++) {
            const float xd = x[d];
            const float *row = W + (size_t)d * Fh;
            #pragma omp simd
            for (int f = f0; f < Fh; f++) proj[f] += xd * row[f];
        }
    }
    float hi = proj[0], lo = proj[0];
    for (int f = 1; f < Fh; f++) {
        hi = proj[f] > hi ? proj[f] : hi;
        lo = proj[f] < lo ? proj[f] : lo;
    }
    float sum_pos = 0.0f, sum_neg = 0.0f;
    int f = 0;
    if (Fh % 16 == 0) {
        vec16 sp = splat(0.0f), sn = splat(0.0f);
        for (; f < Fh; f += 16) {
            vec16 pv;
            memcpy(&pv, proj + f, sizeof pv);
            const vec16 ep = exp_nonpos16(pv - splat(hi)), en = exp_nonpos16(splat(lo) - pv);
            memcpy(phi + f, &ep, sizeof ep);
            memcpy(phi + Fh + f, &en, sizeof en);
            sp += ep;
            sn += en;
        }
        sum_pos = lane_sum(sp);
        sum_neg = lane_sum(sn);
    }
    for (; f < Fh; f++) {
        const float p = proj[f];
        const float e_pos = exp_nonpos(p - hi), e_neg = exp_nonpos(lo - p);
        phi[f] = e_pos;
        phi[Fh + f] = e_neg;
        sum_pos += e_pos;
        sum_neg += e_neg;
    }
    const float inv_pos = 1.0f / sum_pos, inv_neg = 1.0f / sum_neg;
    #pragma omp simd
    for (int i = 0; i < Fh; i++) {
        phi[i] *= inv_pos;
        phi[Fh + i] *= inv_neg;
    }
}

/* The linear readout of query head h: num [D] = phi(q) S and the return value phi(q) . z, with S [F, D]
 * and z [F] of its KV head (phi [F]: scratch). */
static float linear_readout(int map, int D, int F, int h, const float *qh, const float *wq, const float *bq,
                            const float *Sh, const float *zh, float *phi, float *num) {
    feature_map(map, D, F, qh, wq + (size_t)h * D * (F / 2), bq + (size_t)h * (F / 2), phi);
    memset(num, 0, sizeof(float) * D);
    float den = 0.0f;
    for (int f = 0; f < F; f++) {
        const float pf = phi[f];
        const float *row = Sh + (size_t)f * D;
        #pragma omp simd
        for (int d = 0; d < D; d++) num[d] += pf * row[d];
        den += pf * zh[f];
    }
    return den;
}

/* RoPE as transformers' Llama applies it (x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) for the
 * halves x1, x2), for one D-vector (D even) at one position: cos and sin hold that position's D values. */
static inline void rotate(int D, const float *x, const float *cos, const float *sin, float *y) {
    const int half = D / 2;
    for (int d = 0; d < half; d++) y[d] = x[d] * cos[d] - x[d + half] * sin[d];
    for (int d = half; d < D; d++) y[d] = x[d] * cos[d] + x[d - half] * sin[d];
}

/* Returns 0, or -1 for arguments the kernel does not cover (the caller then takes the torch step).
 * cos, sin: NULL where q and k arrive rotated; else q and k arrive before RoPE and the kernel applies
 * it (the layer then skips the dozen small torch ops of apply_rotary_pos_emb). Batch row b's position
 * reads cos + b * rope_stride (0: one position for every row).
 * log_decay [Hk]: log gamma of a decaying linear state; a fold then scales the KV head's S and z by
 * gamma before it adds the leaving key (S <- gamma S + phi(k) v^T). NULL: no decay. */
int hybrid_step_f32(int B, int H, int Hk, int D, int w, int F, long long seen, int formulation, int map,
                    int threads, const float *q, const float *k, const float *v, float *k_win, float *v_win,
                    unsigned char *valid, float *S, float *z, const float *window_logit, const float *linear_logit,
                    const float *wq, const float *bq, const float *wk, const float *bk, float *out,
                    const float *cos, const float *sin, long long rope_stride, const float *log_decay) {
    if (B < 1 || Hk < 1 || H % Hk || D < 1 || D > MAX_D || w < 1 || w > MAX_W || F < 1 || F > MAX_F || threads < 1)
        return -1;
    if (cos != NULL && (sin == NULL || D % 2 || rope_stride < 0))
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2))
        return -1;
    const int g = H / Hk;
    const int slot = (int)(seen % w);
    const int folds = seen >= w;           /* position seen - w leaves the window now */
    const int n = seen + 1 < w ? (int)(seen + 1) : w; /* keys in the window after the write: slots 0..n-1 */
    const int linear = folds && formulation != FORM_WINDOW;
    const float scale = 1.0f / sqrtf((float)D);
    const int BHk = B * Hk, BH = B * H;

    for (int bi = 0; bi < B; bi++) valid[(size_t)bi * w + slot] = 1;
    /* Two passes, split over the threads: each KV head folds its leaving key and writes the new one,
     * then each query head reads its window and the linear state. Inside a model the state and the
     * maps arrive cold from memory, and two cores stream them faster than one. */
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        #pragma omp for schedule(static)
        for (int bh = 0; bh < BHk; bh++) {
            float *K = k_win + (size_t)bh * w * D, *V = v_win + (size_t)bh * w * D;
            float *Sh = S + (size_t)bh * F * D, *zh = z + (size_t)bh * F;
            if (folds) {
                const int kh = bh % Hk;
                float phi[MAX_F];
                feature_map(map, D, F, K + (size_t)slot * D, wk + (size_t)kh * D * (F / 2), bk + (size_t)kh * (F / 2),
                            phi);
                const float *vo = V + (size_t)slot * D;
                if (log_decay == NULL) {
                    for (int f = 0; f < F; f++) {
                        const float pf = phi[f];
                        float *row = Sh + (size_t)f * D;
                        #pragma omp simd
                        for (int d = 0; d < D; d++) row[d] += pf * vo[d];
                        zh[f] += pf;
                    }
                } else {
                    const float gamma = expf(log_decay[kh]);
                    for (int f = 0; f < F; f++) {
                        const float pf = phi[f];
                        float *row = Sh + (size_t)f * D;
                        #pragma omp simd
                        for (int d = 0; d < D; d++) row[d] = gamma * row[d] + pf * vo[d];
                        zh[f] = gamma * zh[f] + pf;
                    }
                }
            }
            if (cos != NULL) {
                const size_t at = (size_t)(bh / Hk) * (size_t)rope_stride;
                rotate(D, k + (size_t)bh * D, cos + at, sin + at, K + (size_t)slot * D);
            } else {
                memcpy(K + (size_t)slot * D, k + (size_t)bh * D, sizeof(float) * D);
            }
            memcpy(V + (size_t)slot * D, v + (size_t)bh * D, sizeof(float) * D);
        }
        #pragma omp for schedule(static)
        for (int row = 0; row < BH; row++) {  /* row: (batch row, query head) */
            const int h = row % H, bh = row / H * Hk + h / g;  /* query head h reads KV head h / g */
            const float *K = k_win + (size_t)bh * w * D, *V = v_win + (size_t)bh * w * D;
            float *o = out + (size_t)row * D;
            float phi[MAX_F], scores[MAX_W], acc[MAX_D], num[MAX_D], rotated[MAX_D]; /* 22 KB of stack at most */
            const float *qh = q + (size_t)row * D;
            if (cos != NULL) {
                const size_t at = (size_t)(row / H) * (size_t)rope_stride;
                rotate(D, qh, cos + at, sin + at, rotated);
                qh = rotated;
            }
            float top = -INFINITY;
            for (int i = 0; i < n; i++) {
                const float *ki = K + (size_t)i * D;
                float s = 0.0f;
                #pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; d++) s += qh[d] * ki[d];
                scores[i] = s * scale;
                top = scores[i] > top ? scores[i] : top;
            }
            float win_sum = 0.0f;
            #pragma omp simd reduction(+ : win_sum)
            for (int i = 0; i < n; i++) {
                scores[i] = exp_nonpos(scores[i] - top);
                win_sum += scores[i];
            }
            memset(acc, 0, sizeof(float) * D);  /* sum_i exp(s_i - top) v_i */
            for (int i = 0; i < n; i++) {
                const float e = scores[i];
                const float *vi = V + (size_t)i * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) acc[d] += e * vi[d];
            }
            if (!linear) {  /* softmax over the window: no key has left it, or the window-only control */
                const float inv = 1.0f / win_sum;
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
                continue;
            }
            const float den = linear_readout(map, D, F, h, qh, wq, bq, S + (size_t)bh * F * D, z + (size_t)bh * F,
                                             phi, num);
            /* lolcats: the window's unnormalised exp-scores share the normalizer with the linear
             * part; hybrid: the window enters as its softmax average with normalizer a. */
            const float wa = 1.0f / (1.0f + expf(-window_logit[h]));  /* sigmoid: the mixing weights */
            const float wb = 1.0f / (1.0f + expf(-linear_logit[h]));
            const float win_weight = formulation == FORM_LOLCATS ? wa : wa / win_sum;
            const float inv = 1.0f / (formulation == FORM_LOLCATS ? wa * win_sum + wb * den : wa + wb * den);
            #pragma omp simd
            for (int d = 0; d < D; d++) o[d] = (win_weight * acc[d] + wb * num[d]) * inv;
        }
    }
    return 0;
}

/* hybrid_sparse_step_f32: ops/sparse/step.py's step with the sparse cache, in place, for the
 * w - 1 of every w steps that close no block (the closing step evicts and folds in torch). The key
 * leaving the window moves to its sink or pending slot with its validity, the new key takes the ring
 * slot, and each query head attends the exact set (ring, sinks, cache, pending; slots not valid are
 * skipped) and the linear state under lolcats' shared normalizer. Layouts as hybrid_step_f32, plus
 * sink_k, sink_v [B, Hk, ns, D], sink_valid [B, ns]; pend_k, pend_v [B, Hk, w, D], pend_valid [B, w];
 * cache_k, cache_v [B, Hk, lam, D], cache_valid [B, Hk, lam] (bytes). Only the query's feature map
 * is needed here: keys enter S and z when a block closes. log_decay [Hk] (NULL: none), log gamma of a
 * decaying linear state: S and z are kept as of the last position consumed, so the step first
 * multiplies them by gamma in place (as the torch step's S <- gamma S), then reads them; without it
 * they are only read. cos, sin, rope_stride: as for hybrid_step_f32 (the kernel rotates q and the new
 * key; the ring keeps the rotated key). Returns -1, touching nothing, for a step that closes a block
 * or arguments it does not cover. */
int hybrid_sparse_step_f32(int B, int H, int Hk, int D, int w, int F, int ns, int lam, long long seen, int map,
                           const float *q, const float *k, const float *v, float *k_win, float *v_win,
                           unsigned char *win_valid, float *S, float *z, const float *log_decay, float *sink_k,
                           float *sink_v, unsigned char *sink_valid, float *pend_k, float *pend_v,
                           unsigned char *pend_valid, const float *cache_k, const float *cache_v,
                           const unsigned char *cache_valid,
                           const float *window_logit, const float *linear_logit, const float *wq, const float *bq,
                           float *out, const float *cos, const float *sin, long long rope_stride) {
    if (B < 1 || Hk < 1 || H % Hk || D < 1 || D > MAX_D || w < 1 || F < 1 || F > MAX_F || ns < 0 || lam < 0
        || 2 * w + ns + lam > MAX_W)
        return -1;
    if (cos != NULL && (sin == NULL || D % 2 || rope_stride < 0))
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2))
        return -1;
    const int g = H / Hk;
    const int slot = (int)(seen % w);
    int to_sink = -1, to_pend = -1;  /* where position seen - w goes as it leaves the ring */
    if (seen >= w) {
        const long long s = seen - w;
        if (s < ns) {
            to_sink = (int)s;
        } else {
            to_pend = (int)((s - ns) % w);
            if (to_pend == w - 1)
                return -1;
        }
    }
    const float scale = 1.0f / sqrtf((float)D);
    float phi[MAX_F], scores[MAX_W], acc[MAX_D], num[MAX_D], rotated[MAX_D];

    for (int bi = 0; bi < B; bi++) {
        const float *rope_cos = cos == NULL ? NULL : cos + (size_t)bi * (size_t)rope_stride;
        const float *rope_sin = cos == NULL ? NULL : sin + (size_t)bi * (size_t)rope_stride;
        unsigned char *ring_ok = win_valid + (size_t)bi * w;
        if (to_sink >= 0) sink_valid[(size_t)bi * ns + to_sink] = ring_ok[slot];
        if (to_pend >= 0) pend_valid[(size_t)bi * w + to_pend] = ring_ok[slot];
        ring_ok[slot] = 1;
        for (int kh = 0; kh < Hk; kh++) {
            const size_t head = (size_t)bi * Hk + kh;
            float *K = k_win + head * w * D, *V = v_win + head * w * D;
            float *Ks = sink_k + head * ns * D, *Vs = sink_v + head * ns * D;
            float *Kp = pend_k + head * w * D, *Vp = pend_v + head * w * D;
            if (to_sink >= 0) {
                memcpy(Ks + (size_t)to_sink * D, K + (size_t)slot * D, sizeof(float) * D);
                memcpy(Vs + (size_t)to_sink * D, V + (size_t)slot * D, sizeof(float) * D);
            }
            if (to_pend >= 0) {
                memcpy(Kp + (size_t)to_pend * D, K + (size_t)slot * D, sizeof(float) * D);
                memcpy(Vp + (size_t)to_pend * D, V + (size_t)slot * D, sizeof(float) * D);
            }
            if (rope_cos != NULL)
                rotate(D, k + head * D, rope_cos, rope_sin, K + (size_t)slot * D);
            else
                memcpy(K + (size_t)slot * D, k + head * D, sizeof(float) * D);
            memcpy(V + (size_t)slot * D, v + head * D, sizeof(float) * D);

            /* The exact set in the torch step's order: ring, sinks, cache, pending. */
            const float *seg_k[4] = {K, Ks, cache_k + head * lam * D, Kp};
            const float *seg_v[4] = {V, Vs, cache_v + head * lam * D, Vp};
            const unsigned char *seg_ok[4] = {ring_ok, sink_valid + (size_t)bi * ns, cache_valid + head * lam,
                                              pend_valid + (size_t)bi * w};
            const int seg_n[4] = {w, ns, lam, w};
            float *Sh = S + head * F * D, *zh = z + head * F;
            /* Until a block closes with a key the cache does not keep, nothing is folded and S, z are
             * zero: every feature is >= 0, so z = 0 means no fold added anything to S either. Then the
             * linear part reads exactly zero, and the step neither ages nor reads it (a short context's
             * every step; the plain step skips it the same way before its first fold). */
            int folded = 0;
            for (int f = 0; f < F && !folded; f++) folded = zh[f] != 0.0f;
            if (log_decay && folded) {  /* the sums age one position, before any query head reads them */
                const float gamma = expf(log_decay[kh]);
                #pragma omp simd
                for (int i = 0; i < F * D; i++) Sh[i] *= gamma;
                for (int f = 0; f < F; f++) zh[f] *= gamma;
            }
            for (int j = 0; j < g; j++) {
                const int h = kh * g + j;
                const float *qh = q + ((size_t)bi * H + h) * D;
                if (rope_cos != NULL) {
                    rotate(D, qh, rope_cos, rope_sin, rotated);
                    qh = rotated;
                }
                float *o = out + ((size_t)bi * H + h) * D;
                float top = -INFINITY;
                int i = 0;
                for (int sg = 0; sg < 4; sg++) {
                    for (int r = 0; r < seg_n[sg]; r++, i++) {
                        if (!seg_ok[sg][r]) continue;
                        const float *kr = seg_k[sg] + (size_t)r * D;
                        float s = 0.0f;
                        #pragma omp simd reduction(+ : s)
                        for (int d = 0; d < D; d++) s += qh[d] * kr[d];
                        scores[i] = s * scale;
                        top = scores[i] > top ? scores[i] : top;
                    }
                }
                float exact_sum = 0.0f;  /* sum_i exp(s_i - top) over the valid keys; >= 1 (the new key) */
                memset(acc, 0, sizeof(float) * D);
                i = 0;
                for (int sg = 0; sg < 4; sg++) {
                    for (int r = 0; r < seg_n[sg]; r++, i++) {
                        if (!seg_ok[sg][r]) continue;
                        const float e = exp_nonpos(scores[i] - top);
                        const float *vr = seg_v[sg] + (size_t)r * D;
                        exact_sum += e;
                        #pragma omp simd
                        for (int d = 0; d < D; d++) acc[d] += e * vr[d];
                    }
                }
                float den = 0.0f;
                if (folded)
                    den = linear_readout(map, D, F, h, qh, wq, bq, Sh, zh, phi, num);
                else
                    memset(num, 0, sizeof(float) * D);
                const float wa = 1.0f / (1.0f + expf(-window_logit[h]));
                const float wb = 1.0f / (1.0f + expf(-linear_logit[h]));
                const float inv = 1.0f / (wa * exact_sum + wb * den);
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] = (wa * acc[d] + wb * num[d]) * inv;
            }
        }
    }
    return 0;
}

/* Positions t0 .. t1-1 of the parallel op (every key real), any formulation, elu1 or Hedgehog maps
 * (weights as for hybrid_step_f32). On entry S [B, Hk, F, D] and z [B, Hk, F] hold the sums over the
 * keys 0 .. t0-w-1 (those that left the window before t0); on return over 0 .. t1-w-1. q, k, v and
 * out are strided: their strides in elements for (batch, head, position) follow each pointer, the
 * last dim contiguous (q, out [B, H, T, D]; k, v [B, Hk, T, D]). wa, wb [H]: the mixing weights
 * (sigmoids of the logits). work: hybrid_prefill_workspace(g, w, D) floats of this call's own.
 * log_decay [Hk] (NULL: none): log gamma of a decaying linear state. S and z then hold the sums as of
 * position t0-1 (key j weighted gamma^(t0-1-w-j)) on entry and as of t1-1 on return, and query t
 * reads key j at gamma^(t-w-j), as hybrid_step_f32 computes them.
 *
 * Positions go in blocks of QB, in three passes that each stream one data set that fits in L1 (the
 * keys, the values, then S): one pass over all three overflowed it. The window's keys are kept
 * transposed in a sliding buffer of the workspace, so a query's scores are D vector updates over
 * TILE consecutive keys; every inner loop runs on TILE-wide register tiles, hence D % TILE == 0.
 * The g query heads of a KV head go together (rows_times), so each key, value and S row is loaded
 * once for all of them; the keys leaving the window are folded into S once per block (pass 3).
 * Sizes are checked by hybrid_prefill_f32. */

static void prefill_segment(int B, int H, int Hk, int D, int w, int F, int formulation, int map,
                            long long t0, long long t1,
                            const float *q, long long q_b, long long q_h, long long q_t,
                            const float *k, long long k_b, long long k_h, long long k_t,
                            const float *v, long long v_b, long long v_h, long long v_t,
                            const float *wq, const float *bq, const float *wk, const float *bk,
                            const float *wa, const float *wb, const float *log_decay, float *S, float *z,
                            float *out, long long o_b, long long o_h, long long o_t, float *work) {
    const int g = H / Hk;
    const int linear = formulation != FORM_WINDOW;
    const int decays = linear && log_decay != NULL;
    float pw[QB + 1];  /* gamma^a of the KV head at hand, a = 0 .. QB: every age inside a block */
    const float scale = 1.0f / sqrtf((float)D);
    const int stride = prefill_scores_stride(w);
    const int cols = prefill_key_columns(w);
    float *scores = work;                                 /* [QB * g, stride] exp-scores */
    float *sums = scores + (size_t)QB * g * stride;       /* [QB * g] window sums */
    float *avg = sums + (size_t)QB * g;                   /* [QB * g, D] sum_i exp(s_i - top) v_i */
    float *keys = avg + (size_t)QB * g * D;               /* [D, cols] keys base .. base+filled-1, transposed */
    float *phi_q = keys + (size_t)D * cols;               /* [g, F] phi(q) of one position */
    float *phi_k = phi_q + (size_t)g * F;                 /* [QB, F] phi(k) of the keys a block folds */
    float *num = phi_k + (size_t)QB * F;                  /* [g, D] phi(q) S */
    const float *heads_in[MAX_G];                         /* per query head of the group: a weight row */
    float *heads_out[MAX_G];                              /* and where its tile goes */

    for (int bi = 0; bi < B; bi++) {
        for (int kh = 0; kh < Hk; kh++) {
            const size_t head = (size_t)bi * Hk + kh;
            const float *K = k + bi * k_b + kh * k_h;
            const float *V = v + bi * v_b + kh * v_h;
            const float *wkh = wk + (size_t)kh * D * (F / 2), *bkh = bk + (size_t)kh * (F / 2);
            float *Sh = S + head * (size_t)F * D, *zh = z + head * (size_t)F;
            long long base = t0 - w + 1 > 0 ? t0 - w + 1 : 0, filled = 0;
            if (decays)
                for (int a = 0; a <= QB; a++) pw[a] = expf(log_decay[kh] * (float)a);
            for (long long tb = t0; tb < t1; tb += QB) {
                const int nb = t1 - tb < QB ? (int)(t1 - tb) : QB;
                const long long first = tb - w + 1 > 0 ? tb - w + 1 : 0, end = tb + nb;  /* keys needed */
                if (end - base > cols - TILE) {  /* slide: keep the keys from `first` on at column 0 */
                    const long long keep = base + filled - first;
                    for (int d = 0; d < D; d++)
                        memmove(keys + (size_t)d * cols, keys + (size_t)d * cols + (first - base), sizeof(float) * keep);
                    base = first;
                    filled = keep;
                }
                for (int d = 0; d < D; d++) {  /* transpose the new keys in (row by row: contiguous stores) */
                    float *row = keys + (size_t)d * cols - base;
                    for (long long j = base + filled; j < end; j++) row[j] = K[j * k_t + d];
                }
                filled = end - base;
                for (int b = 0; b < nb; b++) {  /* 1. window scores of the g query heads, then exponents */
                    const long long t = tb + b;
                    const long long j0 = t - w + 1 > 0 ? t - w + 1 : 0;
                    const int n = (int)(t - j0 + 1);  /* keys j0 .. t */
                    for (int m = 0; m < g; m++) {
                        heads_in[m] = q + bi * q_b + (kh * g + m) * q_h + t * q_t;
                        heads_out[m] = scores + (size_t)(b * g + m) * stride;
                    }
                    for (int c = 0; c < n; c += TILE) {  /* keys j0+c .. +TILE (past t: never read) */
                        rows_times_all(g, D, heads_in, keys + (j0 - base) + c, cols, scale, heads_out);
                        for (int m = 0; m < g; m++) heads_out[m] += TILE;
                    }
                    for (int m = 0; m < g; m++) {
                        float *sc = scores + (size_t)(b * g + m) * stride;
                        float top = sc[0];
                        #pragma omp simd reduction(max : top)
                        for (int i = 1; i < n; i++) top = sc[i] > top ? sc[i] : top;
                        for (int i = n; i < n + 16; i++) sc[i] = -INFINITY;  /* lanes past n: exp ~ 0, unread */
                        vec16 acc16 = splat(0.0f);
                        for (int i = 0; i < n; i += 16) {
                            vec16 e;
                            memcpy(&e, sc + i, sizeof e);
                            e = exp_nonpos16(e - splat(top));
                            memcpy(sc + i, &e, sizeof e);
                            acc16 += e;
                        }
                        sums[b * g + m] = lane_sum(acc16);
                    }
                }
                for (int b = 0; b < nb; b++) {  /* 2. the exp-weighted sums of the window's values */
                    const long long t = tb + b;
                    const long long j0 = t - w + 1 > 0 ? t - w + 1 : 0;
                    for (int d0 = 0; d0 < D; d0 += TILE) {
                        for (int m = 0; m < g; m++) {
                            heads_in[m] = scores + (size_t)(b * g + m) * stride;
                            heads_out[m] = avg + (size_t)(b * g + m) * D + d0;
                        }
                        rows_times_all(g, (int)(t - j0 + 1), heads_in, V + j0 * v_t + d0, v_t, 1.0f, heads_out);
                    }
                }
                /* 3. the linear part. The keys leaving the window in this block are tb-w .. tb+nb-1-w;
                 * S stays as it was at the block's start (S0) until they are folded in at its end, and
                 * query t adds the ones before it itself: phi(q) S_t = phi(q) S0 + sum_j (phi(q).phi(k_j)) v_j.
                 * One rank-nb update per block instead of nb rank-1 updates, each storing all of S.
                 * With a decay S0 (as of tb-1) enters at gamma^(t-tb+1) and key j at gamma^(t-w-j):
                 * ages below QB, so no power of gamma is ever inverted. */
                const long long lo = tb - w > 0 ? tb - w : 0, hi = linear ? tb + nb - w : 0;  /* folded keys [lo, hi) */
                const int folds = hi > lo ? (int)(hi - lo) : 0;
                for (int j = 0; j < folds; j++)
                    feature_map(map, D, F, K + (lo + j) * k_t, wkh, bkh, phi_k + (size_t)j * F);
                for (int b = 0; b < nb; b++) {
                    const long long t = tb + b;
                    const int mixes = linear && t >= w;  /* else softmax: the control, or no key has left */
                    const int before = mixes ? (int)(t - w - lo + 1) : 0;  /* block keys j < before precede t */
                    if (mixes) {
                        for (int m = 0; m < g; m++) {
                            const int h = kh * g + m;
                            feature_map(map, D, F, q + bi * q_b + h * q_h + t * q_t, wq + (size_t)h * D * (F / 2),
                                        bq + (size_t)h * (F / 2), phi_q + (size_t)m * F);
                        }
                        for (int d0 = 0; d0 < D; d0 += TILE) {  /* phi(q) S0 */
                            for (int m = 0; m < g; m++) {
                                heads_in[m] = phi_q + (size_t)m * F;
                                heads_out[m] = num + (size_t)m * D + d0;
                            }
                            rows_times_all(g, F, heads_in, Sh + d0, D, 1.0f, heads_out);
                        }
                    }
                    for (int m = 0; m < g; m++) {
                        const int h = kh * g + m;
                        const float *acc = avg + (size_t)(b * g + m) * D;
                        const float win_sum = sums[b * g + m];
                        float *o = out + bi * o_b + h * o_h + t * o_t;
                        if (!mixes) {
                            const float inv = 1.0f / win_sum;
                            #pragma omp simd
                            for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
                            continue;
                        }
                        const float *pq = phi_q + (size_t)m * F;
                        float *nm = num + (size_t)m * D;
                        float den = 0.0f;  /* phi(q) . z0 */
                        #pragma omp simd reduction(+ : den)
                        for (int f = 0; f < F; f++) den += pq[f] * zh[f];
                        if (decays) {
                            const float s0 = pw[t - tb + 1];
                            den *= s0;
                            #pragma omp simd
                            for (int d = 0; d < D; d++) nm[d] *= s0;
                        }
                        for (int j = 0; j < before; j++) {  /* the block's keys that left before t */
                            const float *pk = phi_k + (size_t)j * F, *vj = V + (lo + j) * v_t;
                            float c = 0.0f;
                            #pragma omp simd reduction(+ : c)
                            for (int f = 0; f < F; f++) c += pq[f] * pk[f];
                            if (decays)
                                c *= pw[t - w - lo - j];
                            den += c;
                            #pragma omp simd
                            for (int d = 0; d < D; d++) nm[d] += c * vj[d];
                        }
                        /* as in hybrid_step_f32: lolcats shares one normalizer between the window's
                         * unnormalised exp-scores and the linear part; hybrid mixes the softmax average. */
                        const float a = wa[h], bw = wb[h];
                        const float win_weight = formulation == FORM_LOLCATS ? a : a / win_sum;
                        const float inv = 1.0f / (formulation == FORM_LOLCATS ? a * win_sum + bw * den : a + bw * den);
                        #pragma omp simd
                        for (int d = 0; d < D; d++) o[d] = (win_weight * acc[d] + bw * nm[d]) * inv;
                    }
                }
                const vec16 aged = splat(decays ? pw[nb] : 1.0f);
                if (decays) {  /* as of the block's end: S0 ages nb positions, key lo+j folds-1-j */
                    for (int j = 0; j < folds; j++) {
                        const float a = pw[folds - 1 - j];
                        float *pk = phi_k + (size_t)j * F;
                        #pragma omp simd
                        for (int f = 0; f < F; f++) pk[f] *= a;
                    }
                    for (int f = 0; f < F; f++) zh[f] *= pw[nb];
                }
                for (int f = 0; f < F; f++) {  /* fold the block's keys: S += phi(K)^T V, z += sum phi(K) */
                    for (int d0 = 0; d0 < D; d0 += TILE) {
                        tile_t row;
                        memcpy(row.x, Sh + (size_t)f * D + d0, sizeof row.x);
                        if (decays)
                            for (int i = 0; i < 4; i++) row.x[i] *= aged;
                        for (int j = 0; j < folds; j++) tile_fma(&row, phi_k[(size_t)j * F + f], V + (lo + j) * v_t + d0);
                        tile_store(Sh + (size_t)f * D + d0, &row);
                    }
                }
                for (int j = 0; j < folds; j++) {
                    const float *pk = phi_k + (size_t)j * F;
                    #pragma omp simd
                    for (int f = 0; f < F; f++) zh[f] += pk[f];
                }
            }
        }
    }
}

/* The parallel op over positions 0 .. T-1 in `segments` segments [bounds[s], bounds[s+1]), one per
 * OpenMP thread (torch's own pool: this library links the libgomp torch has loaded, so the threads
 * that just ran the layer's projections take the segments, instead of spinning beside them). Segment
 * s reads and updates S + s * B*Hk*F*D and z + s * B*Hk*F, which hold on entry the sums over the keys
 * 0 .. bounds[s]-w-1 (the caller computes them; with log_decay, as of position bounds[s]-1), and its
 * own workspace, work + s * work_stride (>= hybrid_prefill_workspace floats). Returns 0, or -1 for
 * arguments it does not cover. */
int hybrid_prefill_f32(int B, int H, int Hk, long long T, int D, int w, int F, int formulation, int map,
                       int segments, const long long *bounds,
                       const float *q, long long q_b, long long q_h, long long q_t,
                       const float *k, long long k_b, long long k_h, long long k_t,
                       const float *v, long long v_b, long long v_h, long long v_t,
                       const float *wq, const float *bq, const float *wk, const float *bk,
                       const float *wa, const float *wb, const float *log_decay, float *S, float *z,
                       float *out, long long o_b, long long o_h, long long o_t, float *work, long long work_stride) {
    if (B < 1 || Hk < 1 || H % Hk || H / Hk > MAX_G || D < TILE || D > MAX_D || D % TILE || w < 1 || w > MAX_W
        || F < 1 || F > MAX_F || formulation < FORM_HYBRID || formulation > FORM_WINDOW || segments < 1)
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2))
        return -1;
    if (bounds[0] != 0 || bounds[segments] != T || work_stride < hybrid_prefill_workspace(H / Hk, w, D))
        return -1;
    for (int s = 0; s < segments; s++)
        if (bounds[s] > bounds[s + 1])
            return -1;
    const size_t S_size = (size_t)B * Hk * F * D, z_size = (size_t)B * Hk * F;
    #pragma omp parallel for num_threads(segments) schedule(static, 1)
    for (int s = 0; s < segments; s++)
        prefill_segment(B, H, Hk, D, w, F, formulation, map, bounds[s], bounds[s + 1], q, q_b, q_h, q_t, k, k_b, k_h,
                        k_t, v, v_b, v_h, v_t, wq, bq, wk, bk, wa, wb, log_decay, S + s * S_size, z + s * z_size, out, o_b, o_h,
                        o_t, work + s * work_stride);
    return 0;
}

/* hybrid_sparse_group_f32: the outputs of one group of queries t0 .. t1-1 of the sparse op
 * (ops/sparse/chunked.py: the queries that see the same J closed blocks), for inference without
 * padding. Query t attends exactly the sinks that have left the window (positions p < ns with
 * p <= t - w), the cache (its valid slots) and the positions lo_t .. t: block J's keys that have left
 * the window, then the window, with lo_t = range_lo for J >= 1 (block J's start) and
 * max(0, min(ns, t - w + 1)) for J = 0 (range_lo = 0); plus phi(q) S and phi(q) z over the J closed
 * blocks, all under the shared normalizer. The block's closing (eviction and fold) is
 * hybrid_sparse_close_f32's, or torch's for scores other than 'sre'.
 *
 * Each (batch row, KV head) copies its group's keys once into the workspace, transposed
 * ([sinks | cache | range] as columns), so a query's scores are D vector updates over 16 keys at a
 * time for all the query heads that read it; values go through rows_times, and so does the linear
 * readout phi(q) S of the query heads together, skipped before the first fold. Layouts: q, out
 * [B, H, T, D] and k, v [B, Hk, T, D] strided as in hybrid_prefill_f32; cache_k, cache_v
 * [B, Hk, lam, D] and cache_ok [B, Hk, lam] (bytes) contiguous; S [B, Hk, F, D], z [B, Hk, F]; wa, wb
 * [H] mixing weights; Hedgehog query maps wq [H, D, F/2], bq [H, F/2]. work:
 * hybrid_sparse_group_workspace(...) floats. log_decay [Hk] (NULL: none): a decaying linear state,
 * whose S and z the caller keeps as of the group's first position t0; query t reads them at
 * gamma^(t - t0) (its linear weight wb scaled by that, numerator and denominator alike). */
/* Columns of a group's key set: the sinks, the cache and a range of at most 2w + ns positions (group 0's
 * range starts at 0), whole 16-key chunks. */
static inline int sparse_group_columns(int w, int ns, int lam) { return (2 * ns + lam + 2 * w + 15) / 16 * 16 + 16; }

long long hybrid_sparse_group_workspace(int B, int Hk, int g, int D, int F, int w, int ns, int lam, int threads) {
    const long long ld = sparse_group_columns(w, ns, lam);
    return (long long)B * Hk * ld * 2 * D + (long long)threads * (g * ld + ld + (long long)g * F + 2LL * g * D);
}

static inline __attribute__((always_inline)) void group_scores(const int G, int n, int D, const float *const *qs,
                                                               const float *KT, long long ld, float scale,
                                                               float *const *dst) {
    for (int c = 0; c < n; c += 16) {
        vec16 acc[4];
        for (int m = 0; m < G; m++) acc[m] = splat(0.0f);
        for (int d = 0; d < D; d++) {
            vec16 kv;
            memcpy(&kv, KT + (size_t)d * ld + c, sizeof kv);
            for (int m = 0; m < G; m++) acc[m] += splat(qs[m][d]) * kv;
        }
        for (int m = 0; m < G; m++) {
            acc[m] *= splat(scale);
            memcpy(dst[m] + c, &acc[m], sizeof acc[m]);
        }
    }
}

int hybrid_sparse_group_f32(int B, int H, int Hk, int D, int F, int w, int ns, int lam, long long T, long long t0,
                            long long t1, long long range_lo, int map, int threads,
                            const float *q, long long q_b, long long q_h, long long q_t,
                            const float *k, long long k_b, long long k_h, long long k_t,
                            const float *v, long long v_b, long long v_h, long long v_t,
                            const float *cache_k, const float *cache_v, const unsigned char *cache_ok,
                            const float *S, const float *z, const float *log_decay, const float *wa,
                            const float *wb, const float *wq, const float *bq,
                            float *out, long long o_b, long long o_h, long long o_t, float *work) {
    if (B < 1 || Hk < 1 || H % Hk || H / Hk > MAX_G || D < TILE || D > MAX_D || D % TILE || w < 1 || F < 1
        || F > MAX_F || ns < 0 || lam < 0 || threads < 1 || t0 < 0 || t1 > T || t0 >= t1 || range_lo < 0
        || range_lo > t0 || t1 - range_lo > 2 * w + ns)
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2))
        return -1;
    const int g = H / Hk;
    const int ld = sparse_group_columns(w, ns, lam);
    const int n_sink = ns < T ? ns : (int)T;
    const int base = n_sink + lam;  /* the range's first column */
    const int n_range = (int)(t1 - range_lo);
    const float scale = 1.0f / sqrtf((float)D);
    const int BH = B * Hk;
    float *keys = work, *thread_work = work + (size_t)BH * ld * 2 * D;
    const long long per_thread = (long long)g * ld + ld + (long long)g * F + 2LL * g * D;

    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int bh = 0; bh < BH; bh++) {
            const int bi = bh / Hk, kh = bh % Hk;
            float *KT = keys + (size_t)bh * ld * 2 * D, *V = KT + (size_t)ld * D;
            const float *kb = k + bi * k_b + kh * k_h, *vb = v + bi * v_b + kh * v_h;
            const float *ck = cache_k + (size_t)bh * lam * D, *cv = cache_v + (size_t)bh * lam * D;
            for (int i = 0; i < ld; i++) {
                const float *kr = NULL, *vr = NULL;
                if (i < n_sink) kr = kb + i * k_t, vr = vb + i * v_t;
                else if (i < base) kr = ck + (size_t)(i - n_sink) * D, vr = cv + (size_t)(i - n_sink) * D;
                else if (i < base + n_range) kr = kb + (range_lo + i - base) * k_t, vr = vb + (range_lo + i - base) * v_t;
                for (int d = 0; d < D; d++) KT[(size_t)d * ld + i] = kr ? kr[d] : 0.0f;
                if (vr) memcpy(V + (size_t)i * D, vr, sizeof(float) * D);
                else memset(V + (size_t)i * D, 0, sizeof(float) * D);
            }
        }
        #ifdef _OPENMP
        float *mine = thread_work + (size_t)omp_get_thread_num() * per_thread;
        #else
        float *mine = thread_work;
        #endif
        float *scores = mine, *keep = scores + (size_t)g * ld, *phi = keep + ld, *acc = phi + (size_t)g * F;
        float *num = acc + (size_t)g * D;
        const long long nq = t1 - t0;
        #pragma omp for schedule(static)
        for (long long item = 0; item < BH * nq; item++) {
            const int bh = (int)(item / nq), bi = bh / Hk, kh = bh % Hk;
            const long long t = t0 + item % nq;
            const float *KT = keys + (size_t)bh * ld * 2 * D, *V = KT + (size_t)ld * D;
            const unsigned char *ok = cache_ok + (size_t)bh * lam;
            const long long lo = range_lo > 0 ? range_lo : (t - w + 1 < n_sink ? (t - w + 1 > 0 ? t - w + 1 : 0) : n_sink);
            const int n = base + (int)(t - range_lo) + 1;  /* columns up to position t */
            /* keep[i]: 1 where column i is in query t's exact set */
            for (int i = 0; i < n_sink; i++) keep[i] = i <= t - w ? 1.0f : 0.0f;
            for (int i = 0; i < lam; i++) keep[n_sink + i] = ok[i] ? 1.0f : 0.0f;
            for (int i = base; i < n; i++) keep[i] = range_lo + (i - base) >= lo ? 1.0f : 0.0f;
            const int n16 = (n + 15) / 16 * 16;
            for (int i = n; i < n16; i++) keep[i] = 0.0f;
            const float *qs[MAX_G];
            float *dst[MAX_G], *accs[MAX_G];
            for (int j = 0; j < g; j++) {
                qs[j] = q + bi * q_b + (kh * g + j) * q_h + t * q_t;
                dst[j] = scores + (size_t)j * ld;
                accs[j] = acc + (size_t)j * D;
            }
            for (int m = 0; m < g; m += 4) {
                switch (g - m < 4 ? g - m : 4) {
                    case 1: group_scores(1, n, D, qs + m, KT, ld, scale, dst + m); break;
                    case 2: group_scores(2, n, D, qs + m, KT, ld, scale, dst + m); break;
                    case 3: group_scores(3, n, D, qs + m, KT, ld, scale, dst + m); break;
                    default: group_scores(4, n, D, qs + m, KT, ld, scale, dst + m); break;
                }
            }
            float sums[MAX_G];
            for (int j = 0; j < g; j++) {
                float *sj = dst[j];
                /* the largest kept score: a dropped key counts as -FLT_MAX (keep is 0 or 1, scores finite) */
                vec16 most = splat(-FLT_MAX);
                for (int c = 0; c < n16; c += 16) {
                    vec16 x, kp;
                    memcpy(&x, sj + c, sizeof x);
                    memcpy(&kp, keep + c, sizeof kp);
                    most = vmax16(most, x * kp + splat(-FLT_MAX) * (splat(1.0f) - kp));
                }
                const float top = lane_max(most);
                vec16 total = splat(0.0f);
                for (int c = 0; c < n16; c += 16) {
                    vec16 x, kp;
                    memcpy(&x, sj + c, sizeof x);
                    memcpy(&kp, keep + c, sizeof kp);
                    x = x * kp + splat(top) * (splat(1.0f) - kp);  /* a dropped key may score above top */
                    const vec16 e = exp_nonpos16(x - splat(top)) * kp;
                    memcpy(sj + c, &e, sizeof e);
                    total += e;
                }
                sums[j] = lane_sum(total);
            }
            for (int c = 0; c < D; c += TILE) {
                float *cols[MAX_G];
                for (int j = 0; j < g; j++) cols[j] = accs[j] + c;
                rows_times_all(g, n, (const float *const *)dst, V + c, D, 1.0f, cols);
            }
            const float *Sh = S + (size_t)bh * F * D, *zh = z + (size_t)bh * F;
            /* Before the first fold S and z are zero (z sums positive features), so is the readout */
            int folded = 0;
            for (int f = 0; f < F && !folded; f++) folded = zh[f] != 0.0f;
            float dens[MAX_G];
            if (folded) {
                /* phi(q) S for the g query heads at once, S's rows loaded once for all of them */
                const float *phis[MAX_G];
                float *nums[MAX_G];
                for (int j = 0; j < g; j++) {
                    float *pj = phi + (size_t)j * F;
                    const int h = kh * g + j;
                    feature_map(map, D, F, qs[j], wq + (size_t)h * D * (F / 2), bq + (size_t)h * (F / 2), pj);
                    float den = 0.0f;
                    for (int f = 0; f < F; f++) den += pj[f] * zh[f];
                    dens[j] = den;
                    phis[j] = pj;
                }
                for (int c = 0; c < D; c += TILE) {
                    for (int j = 0; j < g; j++) nums[j] = num + (size_t)j * D + c;
                    rows_times_all(g, F, phis, Sh + c, D, 1.0f, nums);
                }
            }
            /* the sums as of t0, aged to t: gamma^(t - t0) on the linear part */
            const float age = folded && log_decay ? expf(log_decay[kh] * (float)(t - t0)) : 1.0f;
            for (int j = 0; j < g; j++) {
                const int h = kh * g + j;
                float *o = out + bi * o_b + h * o_h + t * o_t;
                const float *nj = num + (size_t)j * D;
                const float lin = log_decay ? wb[h] * age : wb[h];
                const float total = wa[h] * sums[j] + (folded ? lin * dens[j] : 0.0f);
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                if (folded) {
                    #pragma omp simd
                    for (int d = 0; d < D; d++) o[d] = (wa[h] * accs[j][d] + lin * nj[d]) * inv;
                } else {
                    #pragma omp simd
                    for (int d = 0; d < D; d++) o[d] = wa[h] * accs[j][d] * inv;
                }
            }
        }
    }
    return 0;
}

/* softmax_decode_f32: one new query per batch row and head, softmax attention over a KV cache of L
 * keys: the decode step of a hybrid model's softmax layers (ops/native/softmax_decode.py). A decode step
 * reads the whole cache for a few FLOPs per key, so its cost is how fast the cache streams from
 * memory. Each (batch row, KV head)'s keys are split into chunks that the threads share: a chunk
 * loads each key and value row once for all the query heads of its KV head and leaves a partial
 * softmax (the running maximum, the sum of exponentials and the weighted sum of values, per query
 * head) in the workspace; the partials are then merged per query head.
 *
 * Layouts (strided, the last dim contiguous): q [B, H, D] (q_b, q_h); k, v [B, Hk, L, D] (k_b, k_h,
 * k_t), e.g. views of a cache buffer with spare capacity; out [B, H, D] (o_b, o_h). Query head h reads
 * KV head h / (H / Hk). work: softmax_decode_workspace(...) floats. Returns 0, or -1 for arguments it
 * does not cover (D a multiple of 16 up to MAX_D, at most DECODE_G query heads per KV head). */
enum { DECODE_KEYS = 64 };  /* keys per block of scores (DECODE_G: in cpu_kernels.h) */

static long long decode_chunks(long long L, long long chunk) { return (L + chunk - 1) / chunk; }

long long softmax_decode_workspace(int B, int H, int Hk, int D, long long L, long long chunk) {
    return (long long)B * H * decode_chunks(L, chunk) * (D + 2);
}

/* Partial softmax of G query heads over keys t0 .. t1-1 of one KV head: m[G] (the maximum score),
 * l[G] (the sum of exp(score - m)) and acc[G][D] (the sum of exp(score - m) * value). */
static void decode_chunk(int G, int D, long long t0, long long t1, const float *q, long long q_h, const float *k,
                         long long k_t, const float *v, long long v_t, float scale, float *m, float *l, float *acc) {
    const int C = D / 16;
    vec16 qs[DECODE_G][MAX_D / 16];
    float s[DECODE_G][DECODE_KEYS];
    for (int g = 0; g < G; g++) {
        for (int c = 0; c < C; c++) {
            memcpy(&qs[g][c], q + g * q_h + 16 * c, sizeof(vec16));
            qs[g][c] *= splat(scale);
        }
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc + (long long)g * D, 0, (size_t)D * sizeof(float));
    }
    for (long long t = t0; t < t1; t += DECODE_KEYS) {
        const int n = (int)(t1 - t < DECODE_KEYS ? t1 - t : DECODE_KEYS);
        for (int j = 0; j < n; j++) {
            const vec16 *kr = (const vec16 *)(k + (t + j) * k_t);
            for (int g = 0; g < G; g++) {
                vec16 a = qs[g][0] * kr[0];
                for (int c = 1; c < C; c++) a += qs[g][c] * kr[c];
                s[g][j] = lane_sum(a);
            }
        }
        for (int g = 0; g < G; g++) {
            float top = m[g];
            for (int j = 0; j < n; j++) top = s[g][j] > top ? s[g][j] : top;
            /* the block's new maximum rescales what the chunk summed so far (nothing, on its first block) */
            const float rescale = m[g] == -INFINITY ? 0.0f : exp_nonpos(m[g] - top);
            vec16 sum = splat(0.0f);
            int j = 0;
            for (; j + 16 <= n; j += 16) {
                vec16 x;
                memcpy(&x, &s[g][j], sizeof x);
                x = exp_nonpos16(x - splat(top));
                memcpy(&s[g][j], &x, sizeof x);
                sum += x;
            }
            float tail = 0.0f;
            for (; j < n; j++) {
                s[g][j] = exp_nonpos(s[g][j] - top);
                tail += s[g][j];
            }
            l[g] = l[g] * rescale + lane_sum(sum) + tail;
            m[g] = top;
            float *a = acc + (long long)g * D;
            #pragma omp simd
            for (int d = 0; d < D; d++) a[d] *= rescale;
        }
        for (int j = 0; j < n; j++) {
            const vec16 *vr = (const vec16 *)(v + (t + j) * v_t);
            for (int g = 0; g < G; g++) {
                const vec16 p = splat(s[g][j]);
                vec16 *a = (vec16 *)(acc + (long long)g * D);
                for (int c = 0; c < C; c++) a[c] += p * vr[c];
            }
        }
    }
}

int softmax_decode_f32(int B, int H, int Hk, int D, long long L, long long chunk, int threads,
                       const float *q, long long q_b, long long q_h,
                       const float *k, long long k_b, long long k_h, long long k_t,
                       const float *v, long long v_b, long long v_h, long long v_t,
                       float scale, float *out, long long o_b, long long o_h, float *work) {
    if (B < 1 || Hk < 1 || H % Hk || H / Hk > DECODE_G || D < 16 || D > MAX_D || D % 16 || L < 1 || chunk < 1
        || threads < 1)
        return -1;
    const int G = H / Hk;
    const long long chunks = decode_chunks(L, chunk), items = (long long)B * Hk * chunks, stride = (long long)G * (D + 2);
    /* item = (b, kv head, chunk); its partials at work + item * stride: m[G], l[G], acc[G][D] */
    #pragma omp parallel for num_threads(threads) schedule(static) if (items > 1 && threads > 1)
    for (long long item = 0; item < items; item++) {
        const long long c = item % chunks, bh = item / chunks;
        const int b = (int)(bh / Hk), h = (int)(bh % Hk);
        float *part = work + item * stride;
        const long long t1 = (c + 1) * chunk < L ? (c + 1) * chunk : L;
        decode_chunk(G, D, c * chunk, t1, q + b * q_b + (long long)h * G * q_h, q_h, k + b * k_b + h * k_h, k_t,
                     v + b * v_b + h * v_h, v_t, scale, part, part + G, part + 2 * G);
    }
    for (long long bh = 0; bh < (long long)B * Hk; bh++) {
        const int b = (int)(bh / Hk), h = (int)(bh % Hk);
        const float *parts = work + bh * chunks * stride;
        for (int g = 0; g < G; g++) {
            float top = -INFINITY, total = 0.0f;
            for (long long c = 0; c < chunks; c++) top = parts[c * stride + g] > top ? parts[c * stride + g] : top;
            float *o = out + b * o_b + (long long)(h * G + g) * o_h;
            memset(o, 0, (size_t)D * sizeof(float));
            for (long long c = 0; c < chunks; c++) {
                const float *part = parts + c * stride;
                const float f = exp_nonpos(part[g] - top);
                total += f * part[G + g];
                const float *a = part + 2 * G + (long long)g * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] += f * a[d];
            }
            const float inv = 1.0f / total;
            #pragma omp simd
            for (int d = 0; d < D; d++) o[d] *= inv;
        }
    }
    return 0;
}

/* The sparse cache's block close, as ops/sparse/eviction.close_block with the 'sre' score: the lam
 * cached keys and the w keys of the block at [block, block + w) compete; each valid candidate scores
 * ||v - phi(k) S / (phi(k) . z + SRE_EPS)||; the lam best stay (ties: the earlier candidate), in
 * position order with empty slots last, and the other valid ones fold into S [F, D] and z [F].
 * cache_k/v [B, Hk, lam, D], cache_pos/ok [B, Hk, lam], S, z are updated in place. log_decay [Hk]
 * (NULL: none): a decaying linear state, whose S and z the caller has aged to the close's position
 * c = block + 2w - 1 (the block's last key leaves the window there); a loser at position p folds at
 * gamma^(c - w - p), its age since it left the window (ops/sparse/eviction.fold_weights). */
enum { CLOSE_MAX_N = 2 * MAX_W };
static const float SRE_EPS = 1e-6f;

/* A candidate: its score, its index (cache slots, then the block), the position it sorts by (empty
 * slots: last) and the position its slot records. */
typedef struct { float score; int index; long long pos, slot_pos; } close_rank;

static int by_score(const void *a, const void *b) {  /* descending score, then ascending index */
    const close_rank *x = a, *y = b;
    if (x->score != y->score) return x->score > y->score ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static int by_position(const void *a, const void *b) {  /* ascending position (empty: last), then index */
    const close_rank *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static long long close_floats_per_head(int D, int F, int w, int lam) {
    const long long n = (long long)lam + w;
    /* phi and phi S of every candidate, the kept rows' k and v (rounded to 16-byte units), the ranks */
    const long long rows = (n * F + n * D + 2LL * lam * D + 3) / 4 * 4;
    return rows + n * (long long)((sizeof(close_rank) + sizeof(float) - 1) / sizeof(float));
}

/* The close's arguments that locate one head's rows, and one head's rows and scratch. */
typedef struct {
    int Hk, D, F, w, lam;
    long long block;
    const float *k;
    long long k_b, k_h, k_t;
    const float *v;
    long long v_b, v_h, v_t;
    float *cache_k, *cache_v;
    long long *cache_pos;
    unsigned char *cache_ok;
    float *S, *z, *work;
} close_args;

typedef struct {
    int kh;
    const float *k, *v;  /* the head's keys and values at position 0 */
    float *cache_k, *cache_v, *S, *z;
    long long *cache_pos;
    unsigned char *cache_ok;
    float *phi, *num, *new_k, *new_v;  /* scratch: every candidate's phi and phi S, the kept rows */
    close_rank *rank;
} close_head;

static inline close_head close_head_at(const close_args *a, int bh) {
    const int n = a->lam + a->w, bi = bh / a->Hk, kh = bh % a->Hk, D = a->D, F = a->F, lam = a->lam;
    float *phi = a->work + (size_t)bh * close_floats_per_head(D, F, a->w, lam);
    float *num = phi + (size_t)n * F, *new_k = num + (size_t)n * D;
    return (close_head){
        kh, a->k + bi * a->k_b + kh * a->k_h, a->v + bi * a->v_b + kh * a->v_h,
        a->cache_k + (size_t)bh * lam * D, a->cache_v + (size_t)bh * lam * D, a->S + (size_t)bh * F * D,
        a->z + (size_t)bh * F, a->cache_pos + (size_t)bh * lam, a->cache_ok + (size_t)bh * lam,
        phi, num, new_k, new_k + (size_t)lam * D,
        (close_rank *)(phi + ((size_t)n * F + (size_t)n * D + 2 * (size_t)lam * D + 3) / 4 * 4),
    };
}

/* Candidate j's key and value: cache slot j, or the block's key j - lam. */
static inline const float *candidate_key(const close_args *a, const close_head *h, int j) {
    return j < a->lam ? h->cache_k + (size_t)j * a->D : h->k + (a->block + j - a->lam) * a->k_t;
}

static inline const float *candidate_value(const close_args *a, const close_head *h, int j) {
    return j < a->lam ? h->cache_v + (size_t)j * a->D : h->v + (a->block + j - a->lam) * a->v_t;
}

long long hybrid_sparse_close_workspace(int B, int Hk, int D, int F, int w, int lam) {
    return (long long)B * Hk * close_floats_per_head(D, F, w, lam);
}

int hybrid_sparse_close_f32(int B, int Hk, int D, int F, int w, int lam, int map, long long block, int threads,
                            const float *k, long long k_b, long long k_h, long long k_t,
                            const float *v, long long v_b, long long v_h, long long v_t,
                            float *cache_k, float *cache_v, long long *cache_pos, unsigned char *cache_ok,
                            float *S, float *z, const float *log_decay, const float *wk, const float *bk,
                            float *work) {
    if (B < 1 || Hk < 1 || D < TILE || D > MAX_D || D % TILE || F < 1 || F > MAX_F || w < 1 || lam < 0 || block < 0
        || threads < 1 || lam + w > CLOSE_MAX_N)
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2 || !wk || !bk))
        return -1;
    const int n = lam + w, BH = B * Hk;
    const long long LONG_MAX_POS = 0x7fffffffffffffffLL;
    /* Four phases, each parallel over enough items for every thread (there are few KV heads: over
     * them alone, 3 heads on 2 threads left one idle a third of the time): the candidates' features
     * and phi S in chunks of 16, the scores and ranking per head, the fold per 16 rows of S, and the
     * kept rows' copy per head. */
    enum { CHUNK = 16 };
    const int chunks = (n + CHUNK - 1) / CHUNK, row_chunks = (F + CHUNK - 1) / CHUNK;
    const close_args args = {Hk, D, F, w, lam, block, k, k_b, k_h, k_t, v, v_b, v_h, v_t, cache_k, cache_v, cache_pos,
                             cache_ok, S, z, work};

    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int item = 0; item < BH * chunks; item++) {
            const int bh = item / chunks, j0 = item % chunks * CHUNK, j1 = j0 + CHUNK < n ? j0 + CHUNK : n;
            const close_head h = close_head_at(&args, bh);
            const float *W = map == MAP_HEDGEHOG ? wk + (size_t)h.kh * D * (F / 2) : NULL;
            const float *bias = map == MAP_HEDGEHOG ? bk + (size_t)h.kh * (F / 2) : NULL;
            for (int j = j0; j < j1; j++) feature_map(map, D, F, candidate_key(&args, &h, j), W, bias, h.phi + (size_t)j * F);
            /* num = phi S for four candidates at a time: each row of S is loaded once for the four */
            for (int a = j0; a < j1; a += 4) {
                const int m = j1 - a < 4 ? j1 - a : 4;
                const float *wts[4];
                float *dst[4];
                for (int d0 = 0; d0 < D; d0 += TILE) {
                    for (int i = 0; i < m; i++) wts[i] = h.phi + (size_t)(a + i) * F, dst[i] = h.num + (size_t)(a + i) * D + d0;
                    rows_times_all(m, F, wts, h.S + d0, D, 1.0f, dst);
                }
            }
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < BH; bh++) {
            const close_head h = close_head_at(&args, bh);
            const float *zh = h.z;
            close_rank *rank = h.rank;
            for (int j = 0; j < n; j++) {
                const int cached = j < lam;
                const int valid = cached ? h.cache_ok[j] != 0 : 1;
                const float *pj = h.phi + (size_t)j * F, *nj = h.num + (size_t)j * D, *vr = candidate_value(&args, &h, j);
                float score = -INFINITY;
                if (valid) {
                    float den = SRE_EPS, err = 0.0f;
                    for (int f = 0; f < F; f++) den += pj[f] * zh[f];
                    for (int d = 0; d < D; d++) {
                        const float diff = vr[d] - nj[d] / den;
                        err += diff * diff;
                    }
                    score = sqrtf(err);
                }
                const long long at = cached ? h.cache_pos[j] : block + j - lam;
                rank[j] = (close_rank){score, j, valid ? at : LONG_MAX_POS, at};
            }
            qsort(rank, n, sizeof *rank, by_score);
        }
        /* fold the valid candidates that lost (ranks lam..n-1) into rows f0 .. f1-1 of S, in rank order,
         * before the kept rows are rewritten */
        #pragma omp for schedule(static)
        for (int item = 0; item < BH * row_chunks; item++) {
            const int bh = item / row_chunks, f0 = item % row_chunks * CHUNK, f1 = f0 + CHUNK < F ? f0 + CHUNK : F;
            const close_head h = close_head_at(&args, bh);
            for (int r = lam; r < n; r++) {
                if (h.rank[r].pos == LONG_MAX_POS) continue;
                const int j = h.rank[r].index;
                const float *vr = candidate_value(&args, &h, j), *pj = h.phi + (size_t)j * F;
                /* its age at the close: c - w - p = block + w - 1 - p >= 0 for every valid candidate */
                const float weight = log_decay ? expf(log_decay[h.kh] * (float)(block + w - 1 - h.rank[r].pos)) : 1.0f;
                for (int f = f0; f < f1; f++) {
                    const float p = log_decay ? pj[f] * weight : pj[f];
                    float *row = h.S + (size_t)f * D;
                    h.z[f] += p;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) row[d] += p * vr[d];
                }
            }
        }
        #pragma omp for schedule(static)
        for (int bh = 0; bh < BH; bh++) {
            const close_head h = close_head_at(&args, bh);
            qsort(h.rank, lam, sizeof *h.rank, by_position);
            for (int r = 0; r < lam; r++) {
                const int j = h.rank[r].index;
                memcpy(h.new_k + (size_t)r * D, candidate_key(&args, &h, j), sizeof(float) * D);
                memcpy(h.new_v + (size_t)r * D, candidate_value(&args, &h, j), sizeof(float) * D);
            }
            for (int r = 0; r < lam; r++) {  /* an empty slot keeps the position it had, as the torch path's gather */
                h.cache_pos[r] = h.rank[r].slot_pos;
                h.cache_ok[r] = h.rank[r].pos != LONG_MAX_POS;
            }
            memcpy(h.cache_k, h.new_k, sizeof(float) * lam * D);
            memcpy(h.cache_v, h.new_v, sizeof(float) * lam * D);
        }
    }
    return 0;
}

/* How many threads a parallel call may use: OpenMP's (torch's setting), or 1 in a build without it. */
int hybrid_native_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* Floats of the workspace hybrid_prefill_f32 needs per segment for g query heads per KV head (any F up
 * to MAX_F). */
long long hybrid_prefill_workspace(int g, int w, int D) {
    return (long long)QB * g * (prefill_scores_stride(w) + 1 + D) + (long long)D * prefill_key_columns(w)
           + (long long)g * (MAX_F + D) + (long long)QB * MAX_F;
}
