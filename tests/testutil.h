/* testutil.h — what the C tests share: a seeded RNG, tensors in any layout
 * with poisoned padding, a naive same-precision attention whose error sets
 * the tolerance, and pass/fail counting. */
#ifndef FMHA_TESTUTIL_H
#define FMHA_TESTUTIL_H

#include "fmha.h"

#include <stdint.h>
#include <stdio.h>

typedef struct tu_rng {
    uint64_t s;
} tu_rng;

uint64_t tu_next(tu_rng *r);
double tu_uniform(tu_rng *r); /* [0, 1) */
double tu_normal(tu_rng *r);
int64_t tu_range(tu_rng *r, int64_t n); /* [0, n) */

/* A tensor with its own allocation. layout 0 = BSHD, 1 = BHSD, 2 = BSHD with
 * padded strides (gaps between rows and heads). The whole allocation is
 * filled with `poison` bytes before the elements are set. */
typedef struct tu_tensor {
    fmha_tensor t;
    void *alloc;
    size_t alloc_bytes;
} tu_tensor;

void tu_tensor_init(tu_tensor *x, fmha_dtype dtype, int64_t b, int64_t s, int64_t h, int64_t d,
                    int layout, unsigned char poison);
void tu_tensor_free(tu_tensor *x);
void tu_fill_normal(tu_tensor *x, tu_rng *r, double sigma);
double tu_get(const tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c);
void tu_set(tu_tensor *x, int64_t b, int64_t s, int64_t h, int64_t c, double v);
/* Largest |x - ref| over n LSE values; sets *bad where ref is -inf (a row
 * without keys) and x is not, or x is not finite where ref is. */
double tu_lse_err(const float *x, const float *ref, int64_t n, int *bad);
/* Largest |x - ref| over x's view (same shapes); sets *bad where x is not
 * finite. */
double tu_max_err(const tu_tensor *x, const tu_tensor *ref, int *bad);
/* Relative L2 distance of x from ref over x's view (same shapes). */
double tu_rel_l2(const tu_tensor *x, const tu_tensor *ref);
/* 1 if every byte of the allocation outside the view still equals `poison`. */
int tu_gaps_untouched(const tu_tensor *x, unsigned char poison);

/* Naive attention in f32 arithmetic on the same inputs (16-bit inputs also
 * round the probabilities to their dtype before P V, as 16-bit attention
 * kernels do): its error against the reference is the yardstick for a fast
 * path's error. */
int tu_naive_forward(const fmha_config *cfg, const fmha_forward_args *a);
/* The score modifiers' bias (fmha_forward_args: mask, ALiBi) at query i,
 * key j of sequence b, head h, in f32: -inf where a boolean mask hides it.
 * The naive forward and backward add it (and count the sinks). Written apart
 * from the reference's score_bias on purpose: the yardstick must not share
 * its mistakes. */
float tu_score_bias(const fmha_forward_args *a, int64_t b, int64_t h, int64_t i, int64_t j,
                    int64_t sq, int64_t sk);
/* The backward in f32 arithmetic from the out and lse given, one row at a
 * time with plain running sums: the yardstick of a backward kernel's error.
 * operands16: with 16-bit inputs, dO, P and dS are rounded to the inputs'
 * dtype before their products, as 16-bit tensor-core kernels round them. */
void tu_naive_backward(const fmha_config *cfg, const fmha_backward_args *a, int operands16);

/* Counting. */
extern int tu_passed, tu_failed;
#define TU_CHECK(cond, ...)                                      \
    do {                                                         \
        if (cond) {                                              \
            tu_passed++;                                         \
        } else {                                                 \
            tu_failed++;                                         \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
            fprintf(stderr, __VA_ARGS__);                        \
            fprintf(stderr, "\n");                               \
        }                                                        \
    } while (0)
int tu_summary(void); /* prints "N passed, M failed", returns the exit code */

/* GPU suites start here: line-buffers stdout and prints device 0, or prints
 * why there is none and returns 0 (the suite then exits 77, skipped). */
int tu_cuda_begin(void);

#endif
