/* example.c — fmha's layer API from C: one causal GQA layer (8 query heads
 * sharing 2 KV heads, head dim 64) on random bf16 inputs, checked against the
 * float64 reference. Exits 0 when the two agree, 1 otherwise.
 *
 *   cc example.c $(pkg-config --cflags --libs fmha) -o example && ./example
 */
#include <fmha.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { BATCH = 2, SEQLEN = 256, HEADS = 8, KV_HEADS = 2, HEAD_DIM = 64 };

/* A small fixed-seed generator, so that every run sees the same data. */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static float uniform(void) /* [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (2.0 / (1 << 24)) - 1.0);
}

static uint16_t *random_bf16(size_t n)
{
    uint16_t *x = malloc(n * sizeof *x);
    for (size_t i = 0; x && i < n; i++)
        x[i] = fmha_f32_to_bf16(uniform());
    return x;
}

static double max_abs(double m, double x) /* max(m, |x|), without libm */
{
    return x > m ? x : -x > m ? -x : m;
}

int main(void)
{
    size_t nq = (size_t)BATCH * SEQLEN * HEADS * HEAD_DIM;
    size_t nkv = (size_t)BATCH * SEQLEN * KV_HEADS * HEAD_DIM;
    uint16_t *q = random_bf16(nq), *k = random_bf16(nkv), *v = random_bf16(nkv);
    float *out = malloc(nq * sizeof *out), *ref = malloc(nq * sizeof *ref);
    if (!q || !k || !v || !out || !ref) {
        fprintf(stderr, "example: out of memory\n");
        return 1;
    }

    fmha_config cfg;
    fmha_config_init(&cfg, HEADS, KV_HEADS, HEAD_DIM); /* bf16 inputs by default */
    cfg.causal = 1;

    fmha_layer *layer;
    if (fmha_layer_init(&layer, &cfg) != FMHA_STATUS_OK) {
        fprintf(stderr, "example: %s\n", fmha_last_error());
        return 1;
    }

    fmha_forward_args a = {0};
    a.q = fmha_tensor_bshd(q, FMHA_DTYPE_BF16, BATCH, SEQLEN, HEADS, HEAD_DIM);
    a.k = fmha_tensor_bshd(k, FMHA_DTYPE_BF16, BATCH, SEQLEN, KV_HEADS, HEAD_DIM);
    a.v = fmha_tensor_bshd(v, FMHA_DTYPE_BF16, BATCH, SEQLEN, KV_HEADS, HEAD_DIM);
    a.out = fmha_tensor_bshd(out, FMHA_DTYPE_F32, BATCH, SEQLEN, HEADS, HEAD_DIM);
    fmha_status st = fmha_layer_forward(layer, &a);
    if (st == FMHA_STATUS_OK) {
        a.out.data = ref; /* the same call through the float64 reference */
        st = fmha_reference_forward(&cfg, &a);
    }
    if (st != FMHA_STATUS_OK) {
        fprintf(stderr, "example: %s: %s\n", fmha_status_string(st), fmha_last_error());
        fmha_layer_free(layer);
        return 1;
    }

    double err = 0, scale = 0; /* max |out - ref|, max |ref| */
    for (size_t i = 0; i < nq; i++) {
        err = max_abs(err, (double)out[i] - ref[i]);
        scale = max_abs(scale, ref[i]);
    }
    /* f32 accumulation on bf16 inputs stays far below 1% of the largest value. */
    int ok = err <= 1e-2 * scale;
    printf("fmha %s, kernel %s: max |out - ref| = %.2g (max |ref| = %.2g): %s\n",
           FMHA_VERSION_STRING, fmha_layer_kernel(layer)->name, err, scale, ok ? "ok" : "FAILED");

    fmha_layer_free(layer);
    free(q);
    free(k);
    free(v);
    free(out);
    free(ref);
    return ok ? 0 : 1;
}
