/* The interface of cpu_kernels.c, declared once.
 *
 * cpu_kernels.c includes this file, so the compiler holds every definition to its declaration here;
 * it also compiles HYBRID_KERNELS into hybrid_interface(), the text of these declarations, so a built
 * library says which interface it was built with. ops/native/build.py reads this file for the
 * constants and the declarations, refuses a library that reports other declarations (naming each
 * entry point that differs), and builds the ctypes types from them; Python callers bind arguments
 * by these parameter names (bindings.Kernel), so a call that misses or adds one fails by name.
 *
 * build.py parses two forms only: `enum { NAME = integer, ... };` and the X(...) lines of
 * HYBRID_KERNELS, one entry point per line, parameters `type name` with the types of KERNEL_TYPES
 * in build.py.
 */
#ifndef HYBRID_LLAMA_CPU_KERNELS_H
#define HYBRID_LLAMA_CPU_KERNELS_H

enum { FORM_HYBRID = 0, FORM_LOLCATS = 1, FORM_WINDOW = 2 };  /* the formulations */
enum { MAP_ELU1 = 0, MAP_HEDGEHOG = 1 };                       /* the feature maps */
/* Scratch lives on the stack (no allocation per step); these bound it for any thread's stack.
 * MAX_G: query heads per KV head (prefill); DECODE_G: the same for softmax_decode_f32. */
enum { MAX_D = 256, MAX_F = 1024, MAX_W = 4096, MAX_G = 64, DECODE_G = 16 };
enum { TILE = 64 };  /* the prefills' key/value tile, and the head dim's granule */

#define HYBRID_KERNELS(X) \
    X(int, hybrid_step_f32, (int B, int H, int Hk, int D, int w, int F, long long seen, int formulation, int map, int threads, const float *q, const float *k, const float *v, float *k_win, float *v_win, unsigned char *valid, float *S, float *z, const float *window_logit, const float *linear_logit, const float *wq, const float *bq, const float *wk, const float *bk, float *out, const float *cos, const float *sin, long long rope_stride, const float *log_decay)) \
    X(int, hybrid_sparse_step_f32, (int B, int H, int Hk, int D, int w, int F, int ns, int lam, long long seen, int map, const float *q, const float *k, const float *v, float *k_win, float *v_win, unsigned char *win_valid, float *S, float *z, const float *log_decay, float *sink_k, float *sink_v, unsigned char *sink_valid, float *pend_k, float *pend_v, unsigned char *pend_valid, const float *cache_k, const float *cache_v, const unsigned char *cache_valid, const float *window_logit, const float *linear_logit, const float *wq, const float *bq, float *out, const float *cos, const float *sin, long long rope_stride)) \
    X(int, hybrid_sparse_group_f32, (int B, int H, int Hk, int D, int F, int w, int ns, int lam, long long T, long long t0, long long t1, long long range_lo, int map, int threads, const float *q, long long q_b, long long q_h, long long q_t, const float *k, long long k_b, long long k_h, long long k_t, const float *v, long long v_b, long long v_h, long long v_t, const float *cache_k, const float *cache_v, const unsigned char *cache_ok, const float *S, const float *z, const float *log_decay, const float *wa, const float *wb, const float *wq, const float *bq, float *out, long long o_b, long long o_h, long long o_t, float *work)) \
    X(long long, hybrid_sparse_group_workspace, (int B, int Hk, int g, int D, int F, int w, int ns, int lam, int threads)) \
    X(int, hybrid_sparse_close_f32, (int B, int Hk, int D, int F, int w, int lam, int map, long long block, int threads, const float *k, long long k_b, long long k_h, long long k_t, const float *v, long long v_b, long long v_h, long long v_t, float *cache_k, float *cache_v, long long *cache_pos, unsigned char *cache_ok, float *S, float *z, const float *log_decay, const float *wk, const float *bk, float *work)) \
    X(long long, hybrid_sparse_close_workspace, (int B, int Hk, int D, int F, int w, int lam)) \
    X(int, hybrid_prefill_f32, (int B, int H, int Hk, long long T, int D, int w, int F, int formulation, int map, int segments, const long long *bounds, const float *q, long long q_b, long long q_h, long long q_t, const float *k, long long k_b, long long k_h, long long k_t, const float *v, long long v_b, long long v_h, long long v_t, const float *wq, const float *bq, const float *wk, const float *bk, const float *wa, const float *wb, const float *log_decay, float *S, float *z, float *out, long long o_b, long long o_h, long long o_t, float *work, long long work_stride)) \
    X(long long, hybrid_prefill_workspace, (int g, int w, int D)) \
    X(int, softmax_decode_f32, (int B, int H, int Hk, int D, long long L, long long chunk, int threads, const float *q, long long q_b, long long q_h, const float *k, long long k_b, long long k_h, long long k_t, const float *v, long long v_b, long long v_h, long long v_t, float scale, float *out, long long o_b, long long o_h, float *work)) \
    X(long long, softmax_decode_workspace, (int B, int H, int Hk, int D, long long L, long long chunk)) \
    X(int, hybrid_native_threads, (void))

#define HYBRID_DECLARE(ret, name, params) ret name params;
HYBRID_KERNELS(HYBRID_DECLARE)
#undef HYBRID_DECLARE

/* The declarations above as text, one `ret name(params)` per line. */
const char *hybrid_interface(void);

#endif
