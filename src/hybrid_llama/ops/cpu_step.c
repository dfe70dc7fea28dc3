/* One decode step of hybrid attention on the CPU, fp32, in place: the whole step of
 * ops/decode.py's in-place path (fold the key leaving the window into S and z, write the new key and
 * value into the ring, window softmax, feature map, linear readout, mix) as one call.
 *
 * Why C: the torch step issues about 20 small ops per layer and token, and inside a model each of
 * them runs cold (the other layers evicted its code and data), so the step costs its op count, not
 * its arithmetic. Loaded through ctypes (ops/cpu_step.py); plain C99, no torch headers.
 *
 * Preconditions (checked by the caller): every tensor contiguous fp32 on the CPU, the new key real,
 * and every key already in the window real. Layouts, per batch row b:
 *   q [B, H, D]; k, v [B, Hk, D]; k_win, v_win [B, Hk, w, D]; valid [B, w] (bytes);
 *   S [B, Hk, F, D]; z [B, Hk, F]; window and linear logits [H]; out [B, H, D];
 *   Hedgehog maps: wq [H, D, F/2], bq [H, F/2], wk [Hk, D, F/2], bk [Hk, F/2].
 * Query head h reads KV head h / (H / Hk).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { FORM_HYBRID = 0, FORM_LOLCATS = 1, FORM_WINDOW = 2 };
enum { MAP_ELU1 = 0, MAP_HEDGEHOG = 1 };
/* Scratch lives on the stack (no allocation per step); these bound it for any thread's stack. */
enum { MAX_D = 256, MAX_F = 1024, MAX_W = 4096 };

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

/* phi(x) [F] of one D-vector: elu(x) + 1 (F = D), or Hedgehog's softmax(xW + b) ++ softmax(-(xW + b))
 * with W [D, F/2] row-major (F = 2 * F/2). */
static void feature_map(int map, int D, int F, const float *x, const float *W, const float *bias, float *phi) {
    if (map == MAP_ELU1) {
        #pragma omp simd
        for (int d = 0; d < D; d++) phi[d] = x[d] > 0.0f ? x[d] + 1.0f : exp_nonpos(x[d]);
        return;
    }
    const int Fh = F / 2;
    float *proj = phi;  /* xW + b in the first half, then both halves overwritten below */
    memcpy(proj, bias, sizeof(float) * Fh);
    for (int d = 0; d < D; d++) {
        const float xd = x[d];
        const float *row = W + (size_t)d * Fh;
        #pragma omp simd
        for (int f = 0; f < Fh; f++) proj[f] += xd * row[f];
    }
    float hi = proj[0], lo = proj[0];
    for (int f = 1; f < Fh; f++) {
        hi = proj[f] > hi ? proj[f] : hi;
        lo = proj[f] < lo ? proj[f] : lo;
    }
    float sum_pos = 0.0f, sum_neg = 0.0f;
    #pragma omp simd reduction(+ : sum_pos, sum_neg)
    for (int f = 0; f < Fh; f++) {
        const float p = proj[f];
        const float e_pos = exp_nonpos(p - hi), e_neg = exp_nonpos(lo - p);
        phi[f] = e_pos;
        phi[Fh + f] = e_neg;
        sum_pos += e_pos;
        sum_neg += e_neg;
    }
    const float inv_pos = 1.0f / sum_pos, inv_neg = 1.0f / sum_neg;
    #pragma omp simd
    for (int f = 0; f < Fh; f++) {
        phi[f] *= inv_pos;
        phi[Fh + f] *= inv_neg;
    }
}

/* Returns 0, or -1 for arguments the kernel does not cover (the caller then takes the torch step). */
int hybrid_step_f32(int B, int H, int Hk, int D, int w, int F, long long seen, int formulation, int map,
                    const float *q, const float *k, const float *v, float *k_win, float *v_win,
                    unsigned char *valid, float *S, float *z, const float *window_logit, const float *linear_logit,
                    const float *wq, const float *bq, const float *wk, const float *bk, float *out) {
    if (B < 1 || Hk < 1 || H % Hk || D < 1 || D > MAX_D || w < 1 || w > MAX_W || F < 1 || F > MAX_F)
        return -1;
    if (map == MAP_ELU1 ? F != D : (map != MAP_HEDGEHOG || F % 2))
        return -1;
    const int g = H / Hk;
    const int slot = (int)(seen % w);
    const int folds = seen >= w;           /* position seen - w leaves the window now */
    const int n = seen + 1 < w ? (int)(seen + 1) : w; /* keys in the window after the write: slots 0..n-1 */
    const int linear = folds && formulation != FORM_WINDOW;
    const float scale = 1.0f / sqrtf((float)D);
    float phi[MAX_F], scores[MAX_W], acc[MAX_D], num[MAX_D]; /* 21 KB of stack at most */

    for (int bi = 0; bi < B; bi++) {
        valid[(size_t)bi * w + slot] = 1;
        for (int kh = 0; kh < Hk; kh++) {
            const size_t head = (size_t)bi * Hk + kh;
            float *K = k_win + head * w * D, *V = v_win + head * w * D;
            float *Sh = S + head * F * D, *zh = z + head * F;
            if (folds) {
                feature_map(map, D, F, K + (size_t)slot * D, wk + (size_t)kh * D * (F / 2), bk + (size_t)kh * (F / 2),
                            phi);
                const float *vo = V + (size_t)slot * D;
                for (int f = 0; f < F; f++) {
                    const float pf = phi[f];
                    float *row = Sh + (size_t)f * D;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) row[d] += pf * vo[d];
                    zh[f] += pf;
                }
            }
            memcpy(K + (size_t)slot * D, k + head * D, sizeof(float) * D);
            memcpy(V + (size_t)slot * D, v + head * D, sizeof(float) * D);

            for (int j = 0; j < g; j++) {
                const int h = kh * g + j;
                const float *qh = q + ((size_t)bi * H + h) * D;
                float *o = out + ((size_t)bi * H + h) * D;
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
                feature_map(map, D, F, qh, wq + (size_t)h * D * (F / 2), bq + (size_t)h * (F / 2), phi);
                memset(num, 0, sizeof(float) * D);  /* phi(q) S */
                float den = 0.0f;                   /* phi(q) . z */
                for (int f = 0; f < F; f++) {
                    const float pf = phi[f];
                    const float *row = Sh + (size_t)f * D;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) num[d] += pf * row[d];
                    den += pf * zh[f];
                }
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
    }
    return 0;
}
