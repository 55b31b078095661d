/* fmha_cli.c — the `fmha` command: run attention on a safetensors file or a
 * model preset (checked against the float64 reference), benchmark against
 * the machine's measured peak, check a model config's attention shape, and
 * report what this build and machine offer. All printing happens here. */
#define _POSIX_C_SOURCE 200809L
#include "fmha.h"
#include "cli_options.h"
#include "devmem.h"
#include "fp8_cli.h"
#include "hfconfig.h"
#include "peak.h"
#include "presets.h"
#include "safetensors.h"
#include "sp_cli.h"
#include "sp_plan.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { EXIT_USAGE = 2 };

static const char usage_text[] =
    "usage: fmha <command> [options]\n"
    "\n"
    "commands:\n"
    "  run [IN.safetensors -o OUT.safetensors] [--model PRESET] [--seqlen N] [--batch B]\n"
    "      [--dtype f32|f16|bf16|fp8] [--causal] [--window-left N] [--window-right N] [--scale S]\n"
    "      [--softcap C] [--dropout P --seed N] [--device cpu|cuda] [--threads N] [--check]\n"
    "      [--no-causal] [--check-finite]   --check-finite refuses q, k, v holding NaN or\n"
    "      inf (--check reports them and fails). OUT records the run's options (mask, scale,\n"
    "      softcap, dropout, seed) in its metadata; `fmha run OUT` uses them where the command\n"
    "      line gives none.\n"
    "      IN holds q, k, v [batch, seq, heads, head_dim] (F32/F16/BF16), or packed\n"
    "      [tokens, heads, head_dim] with cu_seqlens_q and cu_seqlens_k (I32). OUT gets out\n"
    "      (dtype of q) and lse (F32). Without IN, runs a model preset "
    "(default " FMHA_DEFAULT_PRESET ")\n"
    "      on random data and checks sampled rows against the float64 reference; -o then\n"
    "      also saves q, k, v, so that `fmha run OUT --check` can run it again.\n"
    "      --dtype fp8 quantizes bf16 inputs (or IN's) to FP8 E4M3, one scale per tensor, and\n"
    "      runs FP8 attention (CPU, or Hopper GPUs); the check is on the dequantized inputs.\n"
    "      mpirun -np N fmha run ... --sp-ulysses U --sp-ring R (U x R = N) runs it\n"
    "      sequence-parallel on CPU ranks (docs/sequence_parallel.md): rank 0 prints, and\n"
    "      checks every row of the gathered output against one process's forward;\n"
    "      --sp-layout zigzag deals the ring's tokens in 2R chunks (a causal ring balanced);\n"
    "      --sp-joint front:N (or rear:N) makes the sequence's first (last) N tokens text that\n"
    "      every rank holds whole, joined to the distributed ones (Flux, SD3, HunyuanVideo).\n"
    "  bench [--model PRESET | --batch B --seqlen S [--seqlen-k S] --heads H --kv-heads HK\n"
    "      --head-dim D] [--dtype f32|f16|bf16|fp8] [--causal] [--device cpu|cuda] [--threads N]\n"
    "      [--iters N] [--json] [--backward]   (no shape: [1, 2048, 16, 128] in f32 and bf16)\n"
    "      --backward also times the backward and forward + backward (CPU, or CUDA with\n"
    "      f16/bf16), the forward in the same loop; backward FLOPs are 2.5x the forward's\n"
    "      mpirun -np N fmha bench ... --sp-ulysses U --sp-ring R (U x R = N): the\n"
    "      sequence-parallel forward on CPU ranks, the slowest rank's time per call and the\n"
    "      bytes each rank sent\n"
    "  accuracy [--model PRESET | shape options as bench] [--causal] [--threads N] [--seed N]\n"
    "      relative L2 error of FP8 attention against the float64 reference and the bf16\n"
    "      path, on Gaussian inputs and on K with outlier channels (scaled or offset), for each\n"
    "      kind of scales and with K's mean subtracted (fp8_smooth_k)  (no shape: [1, 2048, 8, "
    "128])\n"
    "  check CONFIG.json   attention shape of a Hugging Face / diffusers config\n"
    "  info                version, backends, CPU features, GPUs, communicators\n"
    "  sp-plan [--model PRESET | shape] [--devices N[,N...]] [links, kernel speed]\n"
    "      predicted time of sequence-parallel attention for each split ulysses x ring, and\n"
    "      the best (fmha sp-plan --help)\n"
    "\n"
    "presets:";

static void usage(FILE *f)
{
    fputs(usage_text, f);
    for (int i = 0; fmha_preset_at(i); i++)
        fprintf(f, "%s%s", i % 6 == 0 ? "\n  " : " ", fmha_preset_at(i)->name);
    fputs("\n", f);
}

/* ------------------------------------------------------------- options */

typedef cli_options options;

/* cli_parse_options, with its message printed: 0 to go on, 1 after -h
 * printed the usage (the command then ends with status 0), -1 on an error. */
static int parse_options(int argc, char **argv, options *o)
{
    char err[512];
    int rc = cli_parse_options(argc, argv, o, err, sizeof err);
    if (rc == CLI_PARSE_HELP) {
        usage(stdout);
        return 1;
    }
    if (rc != CLI_PARSE_OK && err[0])
        fprintf(stderr, "fmha: %s\n", err);
    return rc == CLI_PARSE_OK ? 0 : -1;
}

/* Whether a [a, b, c, d] tensor's elements, at 8 bytes each, fit int64 (and
 * so every size computed from its dims); otherwise says which and returns 0. */
static int shape_fits(const char *what, int64_t a, int64_t b, int64_t c, int64_t d)
{
    int64_t n;
    if (!__builtin_mul_overflow(a, b, &n) && !__builtin_mul_overflow(n, c, &n) &&
        !__builtin_mul_overflow(n, d, &n) && n <= INT64_MAX / 8)
        return 1;
    fprintf(stderr,
            "fmha: %s [%lld, %lld, %lld, %lld] has more than 2^60 elements, too many to "
            "allocate: use a smaller batch, sequence length or head count\n",
            what, (long long)a, (long long)b, (long long)c, (long long)d);
    return 0;
}

/* q, k/v and out of a padded problem (lse is [b, h, sq], smaller than q). */
static int problem_fits(int64_t batch, int64_t sq, int64_t sk, int64_t heads, int64_t kv, int64_t d,
                        int64_t dv)
{
    return shape_fits("q", batch, sq, heads, d) && shape_fits("k", batch, sk, kv, d) &&
           shape_fits("v", batch, sk, kv, dv) && shape_fits("out", batch, sq, heads, dv);
}

static void config_from_options(const options *o, fmha_config *cfg, int64_t heads, int64_t kv,
                                int64_t d, int64_t dv)
{
    fmha_config_init(cfg, heads, kv, d);
    cfg->head_dim_v = dv;
    cfg->dtype = o->dtype;
    cfg->causal = o->causal;
    cfg->window_left = o->window_left;
    cfg->window_right = o->window_right;
    cfg->softmax_scale = o->scale;
    cfg->softcap = o->softcap;
    cfg->dropout_p = o->dropout;
    cfg->device = o->device;
    cfg->num_threads = o->threads;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static char cli_error[256];

static int fail_lib(const char *what, fmha_status st)
{
    const char *msg = cli_error[0] ? cli_error : fmha_last_error();
    fprintf(stderr, "fmha: %s: %s (%s)\n", what, msg, fmha_status_string(st));
    return 1;
}

/* ---------------------------------------------------- forward with progress */

/* A failure of the CLI's own (device copies), reported like a library one. */
static fmha_status cli_set_error(const char *msg)
{
    snprintf(cli_error, sizeof cli_error, "%s", msg);
    return FMHA_STATUS_BACKEND_ERROR;
}

/* Runs the whole forward on host buffers. On CUDA the buffers go to the
 * device and the output comes back. On a terminal, long CPU runs go one KV
 * head group at a time (views, no copies) so that a progress bar can move. */
static fmha_status forward_with_progress(const fmha_config *cfg, const fmha_forward_args *a)
{
    if (cfg->device == FMHA_DEVICE_CUDA) {
        dev_args d;
        char err[256];
        if (dev_args_upload(&d, a, cfg->device, err, sizeof err))
            return cli_set_error(err);
        fmha_status st = fmha_forward(cfg, &d.a);
        if (st == FMHA_STATUS_OK && dev_args_download(&d, a, err, sizeof err))
            st = cli_set_error(err);
        dev_args_free(&d);
        return st;
    }
    double flops = a->cu_seqlens_q ? 0 : fmha_flops(cfg, a->q.batch, a->q.seqlen, a->k.seqlen);
    /* Dropout draws by (sequence, head): views would renumber both. */
    int chunked = isatty(STDERR_FILENO) && flops > 2e11 && cfg->dropout_p == 0.0;
    if (!chunked)
        return fmha_forward(cfg, a);

    fmha_config sub = *cfg;
    const int64_t group = cfg->num_heads / cfg->num_kv_heads;
    sub.num_heads = group;
    sub.num_kv_heads = 1;
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &sub);
    if (st != FMHA_STATUS_OK)
        return st;
    const int64_t steps = a->q.batch * cfg->num_kv_heads;
    for (int64_t step = 0; step < steps && st == FMHA_STATUS_OK; step++) {
        int64_t b = step / cfg->num_kv_heads, g = step % cfg->num_kv_heads;
        fmha_forward_args s = *a;
        const fmha_tensor *src[4] = {&a->q, &a->k, &a->v, &a->out};
        fmha_tensor *dst[4] = {&s.q, &s.k, &s.v, &s.out};
        for (int t = 0; t < 4; t++) {
            int64_t h0 = (t == 1 || t == 2) ? g : g * group;
            *dst[t] = *src[t];
            dst[t]->batch = 1;
            dst[t]->heads = (t == 1 || t == 2) ? 1 : group;
            dst[t]->data =
                (char *)src[t]->data + (b * src[t]->stride_batch + h0 * src[t]->stride_head) *
                                           (int64_t)fmha_dtype_size(src[t]->dtype);
        }
        if (a->lse)
            s.lse = a->lse + (b * cfg->num_heads + g * group) * a->q.seqlen;
        st = fmha_layer_forward(layer, &s);
        int pct = (int)(100 * (step + 1) / steps), filled = pct * 40 / 100;
        fprintf(stderr, "\r  [%.*s%*s] %3d%%", filled, "########################################",
                40 - filled, "", pct);
    }
    fprintf(stderr, "\r%*s\r", 52, "");
    fmha_layer_free(layer);
    return st;
}

/* ------------------------------------------------------------ comparisons */

typedef struct errstats {
    double max_abs, ref_max, diff2, ref2;
    int64_t nonfinite;
} errstats;

/* Accumulates |x - ref| over rows [s0, s0 + n) of x against rows [0, n) of ref. */
static void compare_rows(const fmha_tensor *x, int64_t s0, const fmha_tensor *ref, int64_t b,
                         int64_t rb, int64_t n, errstats *e)
{
    for (int64_t s = 0; s < n; s++)
        for (int64_t h = 0; h < x->heads; h++)
            for (int64_t c = 0; c < x->head_dim; c++) {
                double a = cli_elem(x, b, s0 + s, h, c), r = cli_elem(ref, rb, s, h, c);
                if (!isfinite(a))
                    e->nonfinite++;
                double d = fabs(a - r);
                if (d > e->max_abs)
                    e->max_abs = d;
                if (fabs(r) > e->ref_max)
                    e->ref_max = fabs(r);
                e->diff2 += d * d;
                e->ref2 += r * r;
            }
}

/* Relative L2 error allowed for an output dtype: a few units of its rounding.
 * The GPU's FP8 kernel multiplies P in e4m3 (3 mantissa bits, ~2.6e-2 on its
 * own: bench/NOTES.md), so FP8 on CUDA gets twice that. */
static double tolerance(fmha_dtype out, int p_e4m3)
{
    if (p_e4m3)
        return 5e-2;
    return out == FMHA_DTYPE_F32 ? 1e-5 : out == FMHA_DTYPE_F16 ? 2e-3 : 1e-2;
}

static int report_check(const errstats *e, fmha_dtype out, int p_e4m3, const char *what)
{
    double rel = e->ref2 > 0 ? sqrt(e->diff2 / e->ref2) : sqrt(e->diff2);
    const double tol = tolerance(out, p_e4m3);
    int ok = e->nonfinite == 0 && rel <= tol;
    printf("check (%s): max |out - ref| = %.3g (max |ref| = %.3g), relative L2 = %.3g, "
           "tolerance %.0e%s: %s\n",
           what, e->max_abs, e->ref_max, rel, tol, p_e4m3 ? " (P in e4m3 on the GPU)" : "",
           ok ? "ok" : "FAILED");
    if (e->nonfinite)
        printf("  %lld non-finite outputs\n", (long long)e->nonfinite);
    return ok ? 0 : 1;
}

/* ------------------------------------------------- sequence parallelism */

/* The whole problem `a` (every rank holds it alike) through fmha_sp_forward:
 * this rank's tokens, then out and lse gathered into `a` on rank 0. *secs is
 * the slowest rank's time, *sent the most bytes a rank sent. Returns the exit
 * status every rank agreed on. */
static int sp_forward_whole(cli_sp *sp, const fmha_config *cfg, const fmha_forward_args *a,
                            double *secs, int64_t *sent)
{
    cli_sp_shard sh;
    int64_t mine = 0;
    int rc = cli_sp_agree(sp, cli_sp_shard_init(sp, &sh, a));
    if (rc == 0) {
        const fmha_status st = cli_sp_forward(sp, cfg, &sh, secs, &mine);
        rc = cli_sp_agree(
            sp, st == FMHA_STATUS_OK ? 0 : fail_lib("sequence-parallel attention failed", st));
    }
    if (rc == 0)
        rc = cli_sp_gather(sp, &sh, a);
    if (rc == 0)
        *sent = cli_sp_max_i64(sp, mine);
    cli_sp_shard_free(&sh);
    return rc;
}

/* A run's forward, timed: over the ranks where the run is sequence
 * parallel (then only rank 0 goes on: *stop for the others, with rc 0), or
 * in this process. A failure before it returned on its own rank: the others
 * learn of it in sp_forward_whole's first agreement. */
static int timed_forward(cli_sp *sp, const fmha_config *cfg, const fmha_forward_args *a,
                         double *secs, int64_t *sent, int *stop)
{
    if (sp->on) {
        const int rc = sp_forward_whole(sp, cfg, a, secs, sent);
        *stop = rc != 0 || sp->rank != 0;
        return rc;
    }
    const double t0 = now_s();
    const fmha_status st = forward_with_progress(cfg, a);
    *secs = now_s() - t0;
    *stop = st != FMHA_STATUS_OK;
    return *stop ? fail_lib("attention failed", st) : 0;
}

static void sp_print_summary(const cli_sp *sp, int64_t sent)
{
    char text[64] = "";
    if (sp->joint)
        snprintf(text, sizeof text, ", %lld text tokens at the %s", (long long)sp->joint_tokens,
                 sp->joint == FMHA_SP_JOINT_FRONT ? "front" : "rear");
    printf("sequence parallel: ulysses %d x ring %d on %d CPU ranks%s%s (the time is the slowest "
           "rank's), %.3g MB sent per rank (the most)\n",
           sp->ulysses, sp->ring, sp->ranks,
           sp->layout == FMHA_SP_LAYOUT_ZIGZAG ? ", zigzag tokens" : "", text, (double)sent * 1e-6);
}

/* Rank 0 of a sequence-parallel run: the same forward in this process alone,
 * and every row of the gathered out and lse against it. */
static int check_against_one_process(const fmha_config *cfg, const fmha_forward_args *a)
{
    const fmha_tensor *o = &a->out;
    const int64_t nlse = a->q.batch * a->q.heads * a->q.seqlen;
    void *out1 =
        malloc((size_t)(o->batch * o->seqlen * o->heads * o->head_dim) * fmha_dtype_size(o->dtype));
    float *lse1 = malloc(sizeof(float) * (size_t)(nlse ? nlse : 1));
    int rc = 1;
    if (!out1 || !lse1) {
        fprintf(stderr, "fmha: out of memory for the one-process forward\n");
        goto done;
    }
    fmha_forward_args one = *a;
    one.out = fmha_tensor_bshd(out1, o->dtype, o->batch, o->seqlen, o->heads, o->head_dim);
    one.lse = lse1;
    const double t0 = now_s();
    fmha_status st = forward_with_progress(cfg, &one);
    const double secs = now_s() - t0;
    if (st != FMHA_STATUS_OK) {
        rc = fail_lib("the one-process forward failed", st);
        goto done;
    }
    printf("one process (rank 0): %.1f ms\n", secs * 1e3);
    errstats e = {0};
    for (int64_t b = 0; b < a->q.batch; b++)
        compare_rows(&a->out, 0, &one.out, b, b, a->q.seqlen, &e);
    rc = report_check(&e, o->dtype, 0, "all rows against one process's forward");
    if (a->lse) {
        /* Both in f32 from the same scores; the ring's merges add a few roundings. */
        const double tol = 1e-4;
        double worst = 0;
        for (int64_t i = 0; i < nlse; i++) {
            const double x = a->lse[i], y = lse1[i];
            const double d = x == y ? 0 : isfinite(x) && isfinite(y) ? fabs(x - y) : INFINITY;
            worst = d > worst ? d : worst;
        }
        printf("check (lse, all rows against one process's): max |lse - ref| = %.3g, tolerance "
               "%.0e: %s\n",
               worst, tol, worst <= tol ? "ok" : "FAILED");
        rc = rc || worst > tol;
    }
done:
    free(out1);
    free(lse1);
    return rc;
}

/* ---------------------------------------------------- non-finite inputs */

/* Counts the NaN and +-inf elements of q, k and v and prints each tensor
 * that has some, with the first one's index (docs/reliability.md says what
 * they produce). One pass over the inputs; returns the total. */
static int64_t report_nonfinite(const fmha_forward_args *a)
{
    const fmha_tensor *ts[3] = {&a->q, &a->k, &a->v};
    const char *names[3] = {"q", "k", "v"};
    int64_t total = 0;
    for (int t = 0; t < 3; t++) {
        const fmha_tensor *x = ts[t];
        int64_t n = 0, at[4] = {0};
        double first = 0;
        for (int64_t b = 0; b < x->batch; b++)
            for (int64_t s = 0; s < x->seqlen; s++)
                for (int64_t h = 0; h < x->heads; h++)
                    for (int64_t c = 0; c < x->head_dim; c++) {
                        const double e = cli_elem(x, b, s, h, c);
                        if (!isfinite(e) && n++ == 0) {
                            at[0] = b, at[1] = s, at[2] = h, at[3] = c;
                            first = e;
                        }
                    }
        if (n)
            printf("non-finite input: %s holds %lld NaN/inf value%s (first %s[%lld, %lld, %lld, "
                   "%lld] = %g); its rows give NaN (docs/reliability.md)\n",
                   names[t], (long long)n, n == 1 ? "" : "s", names[t], (long long)at[0],
                   (long long)at[1], (long long)at[2], (long long)at[3], first);
        total += n;
    }
    return total;
}

/* -------------------------------------------------------------- fmha run */

static uint64_t rng_state;

static double rng_normal(void)
{
    uint64_t z[2];
    for (int i = 0; i < 2; i++) {
        uint64_t x = (rng_state += 0x9E3779B97F4A7C15ull);
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
        z[i] = x ^ (x >> 31);
    }
    double u = ((double)(z[0] >> 11) + 0.5) * 0x1p-53, v = (double)(z[1] >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

static void *alloc_random(fmha_dtype dt, int64_t n)
{
    size_t es = fmha_dtype_size(dt);
    void *p = malloc((size_t)n * es);
    if (!p)
        return NULL;
    for (int64_t i = 0; i < n; i++) {
        float x = (float)rng_normal();
        if (dt == FMHA_DTYPE_F32)
            ((float *)p)[i] = x;
        else if (dt == FMHA_DTYPE_BF16)
            ((uint16_t *)p)[i] = fmha_f32_to_bf16(x);
        else
            ((uint16_t *)p)[i] = fmha_f32_to_f16(x);
    }
    return p;
}

/* Metadata keys of the run options, in OPTION_* bit order. */
static const char *const META_KEYS[7] = {
    "fmha.causal",  "fmha.window_left", "fmha.window_right", "fmha.softmax_scale",
    "fmha.softcap", "fmha.dropout_p",   "fmha.seed"};

/* Options a file records (write_outputs) that the command line did not
 * give. Prints which were taken; -1 with a message for a malformed value. */
static int meta_options(const st_file *f, const char *path, options *o)
{
    char taken[256] = "";
    for (int i = 0; i < 7; i++) {
        const char *v = st_meta_get(f, META_KEYS[i]);
        if (!v || (o->given & (1u << i)))
            continue;
        char *end;
        errno = 0;
        int ok;
        if (i == 3 || i == 4 || i == 5) {
            double d = strtod(v, &end);
            ok = *v && !*end && isfinite(d);
            if (ok)
                *(i == 3 ? &o->scale : i == 4 ? &o->softcap : &o->dropout) = d;
        } else if (i == 6) {
            unsigned long long u = strtoull(v, &end, 10);
            ok = *v >= '0' && *v <= '9' && !*end && !errno;
            if (ok)
                o->seed = u;
        } else {
            long long n = strtoll(v, &end, 10);
            ok = *v && !*end && !errno && (i == 0 ? (n == 0 || n == 1) : n >= -1);
            if (ok && i == 0)
                o->causal = (int)n;
            else if (ok)
                *(i == 1 ? &o->window_left : &o->window_right) = n;
        }
        if (!ok) {
            fprintf(stderr,
                    "fmha: %s: metadata %s = '%s' is not a valid value; fix or remove "
                    "it, or give the option on the command line\n",
                    path, META_KEYS[i], v);
            return -1;
        }
        size_t n = strlen(taken);
        snprintf(taken + n, sizeof taken - n, "%s%s %s", n ? ", " : "", META_KEYS[i] + 5, v);
    }
    if (taken[0])
        printf("options from %s's metadata: %s\n", path, taken);
    return 0;
}

/* Writes out and lse; with `inputs`, also q, k and v, so that the file can
 * be run again (`fmha run FILE --check`). */
static int write_outputs(const char *path, const fmha_tensor *out, int packed, const float *lse,
                         const char *kernel, const fmha_forward_args *inputs,
                         const fmha_config *cfg, uint64_t seed)
{
    st_tensor ts[5];
    int n = 0;
    int64_t ps[3] = {out->seqlen, out->heads, out->head_dim}, ls[2] = {out->heads, out->seqlen};
    int64_t oshape[4] = {out->batch, out->seqlen, out->heads, out->head_dim};
    int64_t lshape[3] = {out->batch, out->heads, out->seqlen};
    st_dtype odt;
    st_dtype_from_fmha(out->dtype, &odt);
    if (packed) {
        ts[n++] = st_tensor_make("out", odt, 3, ps, out->data);
        ts[n++] = st_tensor_make("lse", ST_DTYPE_F32, 2, ls, (void *)lse);
    } else {
        ts[n++] = st_tensor_make("out", odt, 4, oshape, out->data);
        ts[n++] = st_tensor_make("lse", ST_DTYPE_F32, 3, lshape, (void *)lse);
    }
    int64_t shapes[3][4];
    if (inputs) { /* contiguous BSHD tensors, as run_model makes them */
        const fmha_tensor *in[3] = {&inputs->q, &inputs->k, &inputs->v};
        const char *names[3] = {"q", "k", "v"};
        for (int i = 0; i < 3; i++) {
            st_dtype dt;
            st_dtype_from_fmha(in[i]->dtype, &dt);
            int64_t sh[4] = {in[i]->batch, in[i]->seqlen, in[i]->heads, in[i]->head_dim};
            memcpy(shapes[i], sh, sizeof sh);
            ts[n++] = st_tensor_make(names[i], dt, 4, shapes[i], in[i]->data);
        }
    }
    /* The options the output was computed with, so that `fmha run FILE`
     * computes the same attention (a preset's causal mask was lost before). */
    char vals[7][32];
    snprintf(vals[0], sizeof vals[0], "%d", cfg->causal ? 1 : 0);
    snprintf(vals[1], sizeof vals[1], "%lld", (long long)cfg->window_left);
    snprintf(vals[2], sizeof vals[2], "%lld", (long long)cfg->window_right);
    snprintf(vals[3], sizeof vals[3], "%.17g", cfg->softmax_scale);
    snprintf(vals[4], sizeof vals[4], "%.17g", cfg->softcap);
    snprintf(vals[5], sizeof vals[5], "%.17g", cfg->dropout_p);
    snprintf(vals[6], sizeof vals[6], "%llu", (unsigned long long)seed);
    const char *meta[] = {"producer",   "fmha " FMHA_VERSION_STRING,
                          "kernel",     kernel,
                          META_KEYS[0], vals[0],
                          META_KEYS[1], vals[1],
                          META_KEYS[2], vals[2],
                          META_KEYS[3], vals[3],
                          META_KEYS[4], vals[4],
                          META_KEYS[5], vals[5],
                          META_KEYS[6], vals[6],
                          NULL};
    char err[512];
    if (st_write(path, ts, n, meta, err, sizeof err) != ST_OK) {
        fprintf(stderr, "fmha: cannot write %s: %s\n", path, err);
        return 1;
    }
    printf("wrote %s (%s)\n", path, inputs ? "out, lse, q, k, v" : "out, lse");
    return 0;
}

static int tensor_from_file(const st_file *f, const char *name, fmha_tensor *t, int *ndim)
{
    const st_tensor *s = st_find(f, name);
    if (!s) {
        fprintf(stderr, "fmha: input has no tensor '%s' (needs q, k, v)\n", name);
        return -1;
    }
    fmha_dtype dt;
    if (st_dtype_to_fmha(s->dtype, &dt) || dt == FMHA_DTYPE_F8_E4M3) {
        fprintf(stderr, "fmha: tensor '%s' has dtype %s; q, k, v must be F32, F16 or BF16\n", name,
                st_dtype_name(s->dtype));
        return -1;
    }
    if (s->ndim == 4)
        *t = fmha_tensor_bshd(s->data, dt, s->shape[0], s->shape[1], s->shape[2], s->shape[3]);
    else if (s->ndim == 3)
        *t = fmha_tensor_packed(s->data, dt, s->shape[0], s->shape[1], s->shape[2]);
    else {
        fprintf(stderr,
                "fmha: tensor '%s' has %d dims; expected [batch, seq, heads, head_dim] or packed "
                "[tokens, heads, head_dim]\n",
                name, s->ndim);
        return -1;
    }
    *ndim = s->ndim;
    return 0;
}

static int run_file(const options *o, cli_sp *sp)
{
    char err[512];
    st_file f;
    if (st_read(o->input, &f, err, sizeof err) != ST_OK) {
        fprintf(stderr, "fmha: cannot read %s: %s\n", o->input, err);
        return 1;
    }
    int rc = 1;
    void *outbuf = NULL, *refbuf = NULL;
    float *lse = NULL;
    fmha_forward_args a;
    memset(&a, 0, sizeof a);
    int nq, nk, nv;
    if (tensor_from_file(&f, "q", &a.q, &nq) || tensor_from_file(&f, "k", &a.k, &nk) ||
        tensor_from_file(&f, "v", &a.v, &nv))
        goto done;
    if (nq != nk || nq != nv) {
        fprintf(stderr, "fmha: q, k, v must all be 4-d or all packed 3-d (got %d, %d, %d dims)\n",
                nq, nk, nv);
        goto done;
    }
    const int packed = nq == 3;
    if (packed) {
        const st_tensor *cq = st_find(&f, "cu_seqlens_q"), *ck = st_find(&f, "cu_seqlens_k");
        if (!cq || !ck || cq->dtype != ST_DTYPE_I32 || ck->dtype != ST_DTYPE_I32 || cq->ndim != 1 ||
            ck->ndim != 1 || cq->shape[0] != ck->shape[0] || cq->shape[0] < 2) {
            fprintf(stderr, "fmha: packed q, k, v need cu_seqlens_q and cu_seqlens_k: 1-d I32 "
                            "tensors of batch + 1 entries each\n");
            goto done;
        }
        a.cu_seqlens_q = cq->data;
        a.cu_seqlens_k = ck->data;
        a.varlen_batch = cq->shape[0] - 1;
    }
    if (a.q.dtype != a.k.dtype || a.q.dtype != a.v.dtype) {
        fprintf(stderr, "fmha: q, k, v dtypes differ (%s, %s, %s)\n", fmha_dtype_name(a.q.dtype),
                fmha_dtype_name(a.k.dtype), fmha_dtype_name(a.v.dtype));
        goto done;
    }
    int64_t nonfinite = 0;
    if (o->check || o->check_finite) {
        nonfinite = report_nonfinite(&a);
        if (o->check_finite && nonfinite) {
            fprintf(stderr,
                    "fmha: --check-finite: %s holds %lld non-finite input values; "
                    "nothing was run\n",
                    o->input, (long long)nonfinite);
            goto done;
        }
        if (o->check_finite)
            printf("check-finite: q, k, v hold no NaN or inf\n");
    }
    options oo = *o;
    oo.dtype = a.q.dtype;
    if (meta_options(&f, o->input, &oo))
        goto done;
    fmha_config cfg;
    config_from_options(&oo, &cfg, a.q.heads, a.k.heads, a.q.head_dim, a.v.head_dim);
    /* --dtype fp8 on a file: the layer quantizes q, k, v on the fly (fp8_compute). */
    const int fp8 = o->dtype_set && o->dtype == FMHA_DTYPE_F8_E4M3;
    if (fp8)
        cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;

    if (!shape_fits("out", a.q.batch, a.q.seqlen, a.q.heads, a.v.head_dim))
        goto done;
    size_t es = fmha_dtype_size(a.q.dtype);
    int64_t nout = a.q.batch * a.q.seqlen * a.q.heads * a.v.head_dim;
    outbuf = calloc((size_t)nout, es);
    lse = calloc((size_t)(a.q.batch * a.q.heads * a.q.seqlen), sizeof(float));
    if (!outbuf || !lse) {
        fprintf(stderr, "fmha: out of memory for the output\n");
        goto done;
    }
    a.out = fmha_tensor_bshd(outbuf, a.q.dtype, a.q.batch, a.q.seqlen, a.q.heads, a.v.head_dim);
    a.lse = lse;
    a.seed = oo.seed;

    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &cfg);
    if (st != FMHA_STATUS_OK) {
        rc = fail_lib("invalid configuration", st);
        goto done;
    }
    const char *kernel = fmha_layer_kernel(layer)->name, *reason;
    const int fp8_path = fmha_layer_get_path(layer, &reason) == FMHA_LAYER_PATH_FP8;
    if (fp8) /* the layer's choice, said once */
        printf("fp8 path: %s\n", reason);
    fmha_layer_free(layer);
    double dt;
    int64_t sent = 0;
    int stop;
    if ((rc = timed_forward(sp, &cfg, &a, &dt, &sent, &stop)) != 0 || stop)
        goto done;
    if (packed)
        printf("%s: %lld packed sequences, q [%lld, %lld, %lld]", o->input,
               (long long)a.varlen_batch, (long long)a.q.seqlen, (long long)a.q.heads,
               (long long)a.q.head_dim);
    else
        printf("%s: q [%lld, %lld, %lld, %lld]", o->input, (long long)a.q.batch,
               (long long)a.q.seqlen, (long long)a.q.heads, (long long)a.q.head_dim);
    printf(", k/v heads %lld, %s, kernel %s: %.1f ms\n", (long long)a.k.heads,
           fmha_dtype_name(a.q.dtype), kernel, dt * 1e3);
    if (sp->on)
        sp_print_summary(sp, sent);
    rc = 0;
    if (o->check) {
        refbuf = malloc((size_t)nout * sizeof(float));
        float *reflse = malloc(sizeof(float) * (size_t)(a.q.batch * a.q.heads * a.q.seqlen));
        fmha_forward_args r = a;
        r.out = fmha_tensor_bshd(refbuf, FMHA_DTYPE_F32, a.q.batch, a.q.seqlen, a.q.heads,
                                 a.v.head_dim);
        r.lse = reflse;
        if (!refbuf || !reflse || (st = fmha_reference_forward(&cfg, &r)) != FMHA_STATUS_OK) {
            rc = refbuf && reflse ? fail_lib("reference failed", st) : 1;
            free(reflse);
            goto done;
        }
        errstats e = {0}, e8 = {0};
        for (int64_t b = 0; b < a.q.batch; b++)
            compare_rows(&a.out, 0, &r.out, b, b, a.q.seqlen, &e);
        if (fp8_path) {
            /* The kernel is checked on what it computed on: the inputs quantized
             * as the layer quantizes them (fmha_quantize_fp8, per tensor). */
            fp8_args f8;
            char err[512];
            fmha_config c8 = cfg;
            c8.dtype = FMHA_DTYPE_F8_E4M3;
            c8.fp8_compute = FMHA_FP8_COMPUTE_OFF;
            if (fp8_args_make(&f8, &a, a.k.heads, FMHA_DESCALE_PER_TENSOR, 0, err, sizeof err)) {
                fprintf(stderr, "fmha: %s\n", err);
                free(reflse);
                rc = 1;
                goto done;
            }
            f8.a.out = r.out;
            f8.a.lse = reflse;
            st = fmha_reference_forward(&c8, &f8.a);
            fp8_args_free(&f8);
            if (st != FMHA_STATUS_OK) {
                rc = fail_lib("reference failed", st);
                free(reflse);
                goto done;
            }
            for (int64_t b = 0; b < a.q.batch; b++)
                compare_rows(&a.out, 0, &r.out, b, b, a.q.seqlen, &e8);
            rc = report_check(&e8, a.out.dtype, o->device == FMHA_DEVICE_CUDA,
                              "all rows against the float64 reference on the dequantized inputs");
            printf("fp8 against the float64 reference on the file's inputs (quantization "
                   "included): relative L2 = %.3g\n",
                   e.ref2 > 0 ? sqrt(e.diff2 / e.ref2) : 0.0);
        } else {
            rc = report_check(&e, a.out.dtype, 0, "all rows against the float64 reference");
        }
        if (nonfinite) {
            printf("check: FAILED: the inputs hold %lld non-finite values\n", (long long)nonfinite);
            rc = 1;
        }
        free(reflse);
    }
    if (sp->on && check_against_one_process(&cfg, &a))
        rc = 1;
    if (rc == 0 && o->output &&
        write_outputs(o->output, &a.out, packed, lse, kernel, NULL, &cfg, oo.seed))
        rc = 1;
done:
    free(outbuf);
    free(refbuf);
    free(lse);
    st_free(&f);
    return rc;
}

static int run_model(const options *o, cli_sp *sp)
{
    const char *name = o->model ? o->model : FMHA_DEFAULT_PRESET;
    const fmha_preset *p = fmha_preset_find(name);
    if (!p) {
        fprintf(stderr, "fmha: unknown preset '%s'; one of:", name);
        for (int i = 0; fmha_preset_at(i); i++)
            fprintf(stderr, " %s", fmha_preset_at(i)->name);
        fprintf(stderr, "\n");
        return EXIT_USAGE;
    }
    const int64_t batch = o->batch ? o->batch : 1;
    int64_t sq = p->seqlen_q, sk = p->seqlen_k;
    if (o->seqlen) {
        sk = sq == sk ? o->seqlen : sk; /* cross-attention keeps its text length */
        sq = o->seqlen;
    }
    if (!problem_fits(batch, sq, sk, p->heads, p->kv_heads, p->head_dim, p->head_dim))
        return 1;
    options oo = *o;
    oo.causal = (o->given & OPTION_CAUSAL) ? o->causal : p->causal; /* --no-causal too */
    fmha_config cfg;
    config_from_options(&oo, &cfg, p->heads, p->kv_heads, p->head_dim, p->head_dim);

    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &cfg);
    if (st != FMHA_STATUS_OK)
        return fail_lib("invalid configuration", st);
    const char *kernel = fmha_layer_kernel(layer)->name;
    fmha_layer_free(layer);

    rng_state = o->seed ? o->seed : 20261202;
    /* FP8 runs quantize a bf16 source per tensor and write bf16. */
    const int fp8 = cfg.dtype == FMHA_DTYPE_F8_E4M3;
    const fmha_dtype dt = fp8 ? FMHA_DTYPE_BF16 : cfg.dtype;
    const int64_t d = p->head_dim;
    void *q = alloc_random(dt, batch * sq * p->heads * d);
    void *k = alloc_random(dt, batch * sk * p->kv_heads * d);
    void *v = alloc_random(dt, batch * sk * p->kv_heads * d);
    void *out = malloc((size_t)(batch * sq * p->heads * d) * fmha_dtype_size(dt));
    float *lse = malloc(sizeof(float) * (size_t)(batch * p->heads * sq));
    fp8_args f8 = {0};
    int rc = 1;
    if (!q || !k || !v || !out || !lse) {
        fprintf(stderr, "fmha: out of memory for %s at %lld tokens\n", name, (long long)sq);
        goto done;
    }
    fmha_forward_args src, a;
    memset(&src, 0, sizeof src);
    src.q = fmha_tensor_bshd(q, dt, batch, sq, p->heads, d);
    src.k = fmha_tensor_bshd(k, dt, batch, sk, p->kv_heads, d);
    src.v = fmha_tensor_bshd(v, dt, batch, sk, p->kv_heads, d);
    src.out = fmha_tensor_bshd(out, dt, batch, sq, p->heads, d);
    src.lse = lse;
    src.seed = o->seed;
    a = src;
    if (fp8) {
        char err[512];
        if (fp8_args_make(&f8, &src, p->kv_heads, FMHA_DESCALE_PER_TENSOR, 0, err, sizeof err)) {
            fprintf(stderr, "fmha: %s\n", err);
            goto done;
        }
        a = f8.a;
    }

    printf("%s (%s): q [%lld, %lld, %lld, %lld], k/v [%lld, %lld, %lld, %lld], %s%s%s, kernel %s\n",
           p->name, p->model, (long long)batch, (long long)sq, (long long)p->heads, (long long)d,
           (long long)batch, (long long)sk, (long long)p->kv_heads, (long long)d,
           fmha_dtype_name(dt), fp8 ? " quantized to f8_e4m3 (one scale per tensor)" : "",
           cfg.causal ? ", causal" : "", kernel);
    fflush(stdout);
    double secs;
    int64_t sent = 0;
    int stop;
    if ((rc = timed_forward(sp, &cfg, &a, &secs, &sent, &stop)) != 0 || stop)
        goto done;
    double flops = fmha_flops(&cfg, batch, sq, sk);
    printf("time %.1f ms, %.1f GFLOP/s (%.3g GFLOP)\n", secs * 1e3, flops / secs * 1e-9,
           flops * 1e-9);
    if (sp->on)
        sp_print_summary(sp, sent);

    if (cfg.dropout_p > 0) {
        printf("check: skipped (dropout draws by row, and sampled rows renumber them; use "
               "`fmha run FILE --check`)\n");
        rc = 0;
    } else {
        /* The last n query rows against all keys see exactly what they see in
         * the full problem (masks are aligned bottom-right), so the reference
         * runs on that slice alone. */
        const int64_t n = sq < 16 ? sq : 16;
        float *ref = malloc(sizeof(float) * (size_t)(n * p->heads * d));
        errstats e = {0}, e_src = {0};
        rc = 0;
        /* FP8: the kernel is checked on the inputs it computed on (the codes
         * times their descales); the source's reference shows what the
         * quantization itself costs. */
        for (int pass = 0; pass < 1 + fp8 && ref && rc == 0; pass++) {
            const fmha_forward_args *in = pass ? &src : &a;
            const fmha_config *ref_cfg = &cfg;
            fmha_config c16 = cfg;
            c16.dtype = dt;
            if (pass)
                ref_cfg = &c16;
            for (int64_t b = 0; b < batch; b++) {
                fmha_forward_args r = *in;
                const int64_t qes = (int64_t)fmha_dtype_size(in->q.dtype);
                r.q.batch = r.k.batch = r.v.batch = 1;
                r.q.data = (char *)in->q.data + ((b * sq + sq - n) * p->heads * d) * qes;
                r.q.seqlen = n;
                r.k.data = (char *)in->k.data + b * in->k.stride_batch * qes;
                r.v.data = (char *)in->v.data + b * in->v.stride_batch * qes;
                r.out = fmha_tensor_bshd(ref, FMHA_DTYPE_F32, 1, n, p->heads, d);
                r.lse = NULL;
                if ((st = fmha_reference_forward(ref_cfg, &r)) != FMHA_STATUS_OK) {
                    rc = fail_lib("reference failed", st);
                    break;
                }
                compare_rows(&a.out, sq - n, &r.out, b, 0, n, pass ? &e_src : &e);
            }
        }
        if (!ref)
            fprintf(stderr, "fmha: out of memory for the reference check\n");
        if (rc == 0 && ref) {
            char what[128];
            snprintf(what, sizeof what,
                     "last %lld rows of every head against the float64 reference%s", (long long)n,
                     fp8 ? " on the dequantized inputs" : "");
            rc = report_check(&e, dt, fp8 && cfg.device == FMHA_DEVICE_CUDA, what);
            if (fp8)
                printf("fp8 against the float64 reference on the %s inputs (quantization "
                       "included): relative L2 = %.3g (see `fmha accuracy`)\n",
                       fmha_dtype_name(dt), e_src.ref2 > 0 ? sqrt(e_src.diff2 / e_src.ref2) : 0.0);
        }
        free(ref);
    }
    if (sp->on && check_against_one_process(&cfg, &a))
        rc = 1;
    /* FP8 runs save their bf16 source: `fmha run OUT --dtype fp8 --check` reruns it. */
    if (rc == 0 && o->output &&
        write_outputs(o->output, &a.out, 0, lse, kernel, &src, &cfg, o->seed))
        rc = 1;
done:
    fp8_args_free(&f8);
    free(q);
    free(k);
    free(v);
    free(out);
    free(lse);
    return rc;
}

/* cli_sp_setup with the command line's degrees and layout, and its joint
 * tokens, which only a sequence-parallel run takes. */
static int sp_setup(cli_sp *sp, const options *o, const char *command)
{
    const int rc = cli_sp_setup(sp, o->sp_ulysses, o->sp_ring, o->sp_layout, command);
    if (rc)
        return rc;
    if (o->sp_joint && !sp->on) {
        fprintf(stderr,
                "fmha: --sp-joint splits the tokens of a sequence-parallel %s: give it with "
                "`mpirun -np N fmha %s ... --sp-ulysses U --sp-ring R` (U x R = N > 1)\n",
                command, command);
        return EXIT_USAGE;
    }
    sp->joint = o->sp_joint;
    sp->joint_tokens = o->sp_joint_tokens;
    return 0;
}

static int cmd_run(cli_sp *sp, int argc, char **argv)
{
    options o;
    const int parsed = parse_options(argc, argv, &o);
    if (parsed)
        return parsed > 0 ? 0 : EXIT_USAGE;
    if (o.input && o.model) {
        fprintf(stderr, "fmha: give an input file or --model, not both\n");
        return EXIT_USAGE;
    }
    if (o.input && !o.output && !o.check && !o.check_finite) {
        fprintf(stderr, "fmha: run %s needs -o OUT.safetensors (or --check, --check-finite)\n",
                o.input);
        return EXIT_USAGE;
    }
    if (o.output) { /* before any work: the run would end by destroying its input */
        const char *inputs[] = {o.input, NULL};
        char err[512];
        if (st_check_output(o.output, inputs, err, sizeof err) != ST_OK) {
            fprintf(stderr, "fmha: -o: %s\n", err);
            return EXIT_USAGE;
        }
    }
    const int rc = sp_setup(sp, &o, "run");
    if (rc)
        return rc;
    return o.input ? run_file(&o, sp) : run_model(&o, sp);
}

/* ------------------------------------------------------------ fmha bench */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct bench_shape {
    const char *name;
    int64_t batch, sq, sk, heads, kv, d;
    int causal;
} bench_shape;

/* One benchmark line, or JSON object, of a forward's median time `med`
 * seconds over `iters` calls. A sequence-parallel run gives `sent`, the bytes
 * each rank sent in one call (NULL otherwise); its peaks are the ranks' sum. */
static void bench_report(const options *o, const bench_shape *s, const fmha_config *cfg,
                         const char *label, const char *kernel, int fp8_compute, int iters,
                         double med, double peak_f32, double peak_bf16, const cli_sp *sp,
                         const int64_t *sent)
{
    int64_t most = 0;
    for (int r = 0; sent && r < sp->ranks; r++)
        most = sent[r] > most ? sent[r] : most;
    double flops = fmha_flops(cfg, s->batch, s->sq, s->sk);
    double gflops = flops / med * 1e-9;
    int bf16dp = !strcmp(kernel, "cpu_avx512_bf16dp");
    double peak = bf16dp ? peak_bf16 : peak_f32;
    const char *peak_name = bf16dp ? "vdpbf16ps" : "f32 FMA";
    char shape[160];
    snprintf(shape, sizeof shape, "[%lld, %lld, %lld, %lld] kv %lld sk %lld%s", (long long)s->batch,
             (long long)s->sq, (long long)s->heads, (long long)s->d, (long long)s->kv,
             (long long)s->sk, s->causal ? " causal" : "");
    if (o->json) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "shape", shape);
        if (s->name)
            cJSON_AddStringToObject(j, "model", s->name);
        cJSON_AddNumberToObject(j, "batch", (double)s->batch);
        cJSON_AddNumberToObject(j, "seqlen_q", (double)s->sq);
        cJSON_AddNumberToObject(j, "seqlen_k", (double)s->sk);
        cJSON_AddNumberToObject(j, "heads", (double)s->heads);
        cJSON_AddNumberToObject(j, "kv_heads", (double)s->kv);
        cJSON_AddNumberToObject(j, "head_dim", (double)s->d);
        cJSON_AddBoolToObject(j, "causal", s->causal);
        cJSON_AddStringToObject(j, "device", o->device == FMHA_DEVICE_CUDA ? "cuda" : "cpu");
        cJSON_AddStringToObject(j, "dtype", fmha_dtype_name(cfg->dtype));
        if (fp8_compute)
            cJSON_AddStringToObject(j, "fp8_compute", "per_tensor");
        cJSON_AddStringToObject(j, "kernel", kernel);
        cJSON_AddNumberToObject(j, "threads", o->threads ? o->threads : omp_get_max_threads());
        cJSON_AddNumberToObject(j, "iters", iters);
        cJSON_AddNumberToObject(j, "ms", med * 1e3);
        cJSON_AddNumberToObject(j, "tflops", gflops * 1e-3);
        if (o->device == FMHA_DEVICE_CPU) {
            cJSON_AddStringToObject(j, "peak", peak_name);
            cJSON_AddNumberToObject(j, "peak_tflops", peak * 1e-3);
            cJSON_AddNumberToObject(j, "peak_fraction", peak > 0 ? gflops / peak : 0);
        }
        if (sent) {
            cJSON_AddNumberToObject(j, "ranks", sp->ranks);
            cJSON_AddNumberToObject(j, "ulysses", sp->ulysses);
            cJSON_AddNumberToObject(j, "ring", sp->ring);
            cJSON_AddStringToObject(j, "layout",
                                    sp->layout == FMHA_SP_LAYOUT_ZIGZAG ? "zigzag" : "contiguous");
            cJSON *per_rank = cJSON_AddArrayToObject(j, "bytes_sent_per_rank");
            for (int r = 0; r < sp->ranks && per_rank; r++)
                cJSON_AddItemToArray(per_rank, cJSON_CreateNumber((double)sent[r]));
            cJSON_AddNumberToObject(j, "bytes_sent_max", (double)most);
        }
        char *txt = cJSON_PrintUnformatted(j);
        printf("%s\n", txt);
        free(txt);
        cJSON_Delete(j);
    } else if (o->device == FMHA_DEVICE_CUDA) {
        printf("%-44s %-5s %-18s %9.3f ms %8.1f TFLOP/s\n", shape, label, kernel, med * 1e3,
               gflops * 1e-3);
    } else {
        printf("%-44s %-5s %-18s %9.2f ms %8.1f GFLOP/s  %5.1f%% of %s peak (%.0f)", shape, label,
               kernel, med * 1e3, gflops, peak > 0 ? 100 * gflops / peak : 0, peak_name, peak);
        if (sent)
            printf("  ulysses %d x ring %d, %.3g MB sent per rank (the most)", sp->ulysses,
                   sp->ring, (double)most * 1e-6);
        printf("\n");
    }
    fflush(stdout);
}

/* The configuration of a benchmark shape in dtype dt under the options. */
static void bench_config(const options *o, const bench_shape *s, fmha_dtype dt, fmha_config *cfg)
{
    options oo = *o;
    oo.dtype = dt;
    oo.causal = s->causal;
    config_from_options(&oo, cfg, s->heads, s->kv, s->d, s->d);
}

/* The forward arguments of a benchmark shape over buffers q, k, v, out of dtype dt. */
static void bench_views(const bench_shape *s, fmha_dtype dt, void *q, void *k, void *v, void *out,
                        fmha_forward_args *a)
{
    memset(a, 0, sizeof *a);
    a->q = fmha_tensor_bshd(q, dt, s->batch, s->sq, s->heads, s->d);
    a->k = fmha_tensor_bshd(k, dt, s->batch, s->sk, s->kv, s->d);
    a->v = fmha_tensor_bshd(v, dt, s->batch, s->sk, s->kv, s->d);
    a->out = fmha_tensor_bshd(out, dt, s->batch, s->sq, s->heads, s->d);
}

/* One benchmark line. dt f8_e4m3 times FP8 attention on a bf16 source
 * quantized beforehand (per tensor); fp8_compute times a bf16 layer that
 * quantizes on every call. */
static int bench_one(const options *o, const bench_shape *s, fmha_dtype dt, int fp8_compute,
                     double peak_f32, double peak_bf16)
{
    fmha_config cfg;
    bench_config(o, s, dt, &cfg);
    if (fp8_compute)
        cfg.fp8_compute = FMHA_FP8_COMPUTE_PER_TENSOR;
    const fmha_dtype sdt = dt == FMHA_DTYPE_F8_E4M3 ? FMHA_DTYPE_BF16 : dt; /* source and out */
    const char *label = fp8_compute                ? "fp8q"
                        : dt == FMHA_DTYPE_F8_E4M3 ? "fp8"
                                                   : fmha_dtype_name(dt);
    fp8_args f8 = {0};
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &cfg);
    if (st != FMHA_STATUS_OK)
        return fail_lib("invalid configuration", st);
    const fmha_kernel_info *kinfo = fmha_layer_kernel(layer);

    rng_state = 1;
    void *q = alloc_random(sdt, s->batch * s->sq * s->heads * s->d);
    void *k = alloc_random(sdt, s->batch * s->sk * s->kv * s->d);
    void *v = alloc_random(sdt, s->batch * s->sk * s->kv * s->d);
    void *out = malloc((size_t)(s->batch * s->sq * s->heads * s->d) * fmha_dtype_size(sdt));
    int rc = 1;
    if (!q || !k || !v || !out) {
        fprintf(stderr, "fmha: out of memory for the benchmark inputs\n");
        goto done;
    }
    fmha_forward_args a;
    bench_views(s, sdt, q, k, v, out, &a);
    if (dt == FMHA_DTYPE_F8_E4M3) {
        char qerr[512];
        if (fp8_args_make(&f8, &a, s->kv, FMHA_DESCALE_PER_TENSOR, 0, qerr, sizeof qerr)) {
            fprintf(stderr, "fmha: %s\n", qerr);
            goto done;
        }
        a = f8.a;
    }

    dev_args dev;
    char err[256];
    if (dev_args_upload(&dev, &a, o->device, err, sizeof err)) {
        fprintf(stderr, "fmha: %s\n", err);
        goto done;
    }
    double one;
    if ((st = dev_time_forward(layer, &dev, &one)) != FMHA_STATUS_OK) { /* warm-up */
        rc = fail_lib("attention failed", st);
        dev_args_free(&dev);
        goto done;
    }
    int iters = o->iters; /* in [1, CLI_MAX_ITERS] when given */
    if (!iters) {
        dev_time_forward(layer, &dev, &one);
        const double n = one > 0 ? 2000.0 / one : 200; /* about two seconds */
        iters = n < 5 ? 5 : n > 200 ? 200 : (int)n;    /* clamped before the conversion */
    }
    double *times = malloc(sizeof(double) * (size_t)iters);
    if (!times) {
        fprintf(stderr, "fmha: out of memory for %d timings\n", iters);
        dev_args_free(&dev);
        goto done;
    }
    for (int i = 0; i < iters; i++) {
        dev_time_forward(layer, &dev, &times[i]);
        times[i] *= 1e-3;
    }
    dev_args_free(&dev);
    qsort(times, (size_t)iters, sizeof times[0], cmp_double);
    double med = times[iters / 2];
    free(times);
    bench_report(o, s, &cfg, label, kinfo->name, fp8_compute, iters, med, peak_f32, peak_bf16, NULL,
                 NULL);
    rc = 0;
done:
    fmha_layer_free(layer);
    fp8_args_free(&f8);
    free(q);
    free(k);
    free(v);
    free(out);
    return rc;
}

/* bench_one under `mpirun -np N fmha bench --sp-ulysses U --sp-ring R`:
 * every rank makes the whole inputs alike and keeps its tokens; a call's time
 * is the slowest rank's (the ranks start together), the line the median over
 * the calls. Every failure is agreed on before the next call. */
static int bench_sp_one(cli_sp *sp, const options *o, const bench_shape *s, fmha_dtype dt,
                        double peak_f32, double peak_bf16)
{
    fmha_config cfg;
    bench_config(o, s, dt, &cfg);
    fmha_layer *layer;
    fmha_status st = fmha_layer_init(&layer, &cfg);
    if (st != FMHA_STATUS_OK)
        return fail_lib("invalid configuration", st);
    char kernel[64];
    snprintf(kernel, sizeof kernel, "%s", fmha_layer_kernel(layer)->name);
    fmha_layer_free(layer);

    rng_state = 1;
    void *q = alloc_random(dt, s->batch * s->sq * s->heads * s->d);
    void *k = alloc_random(dt, s->batch * s->sk * s->kv * s->d);
    void *v = alloc_random(dt, s->batch * s->sk * s->kv * s->d);
    void *out = malloc((size_t)(s->batch * s->sq * s->heads * s->d) * fmha_dtype_size(dt));
    double *times = NULL;
    int64_t *sent = malloc(sizeof(int64_t) * (size_t)sp->ranks);
    cli_sp_shard sh;
    memset(&sh, 0, sizeof sh);
    int rc = 0;
    if (!q || !k || !v || !out || !sent) {
        fprintf(stderr, "fmha: out of memory for the benchmark inputs\n");
        rc = 1;
    } else {
        fmha_forward_args a;
        bench_views(s, dt, q, k, v, out, &a);
        rc = cli_sp_shard_init(sp, &sh, &a);
    }
    double one;
    int64_t mine = 0;
    if ((rc = cli_sp_agree(sp, rc)) != 0)
        goto done;
    st = cli_sp_forward(sp, &cfg, &sh, &one, &mine); /* warm-up */
    if (st != FMHA_STATUS_OK)
        rc = fail_lib("sequence-parallel attention failed", st);
    if ((rc = cli_sp_agree(sp, rc)) != 0)
        goto done;
    int iters = o->iters; /* the same on every rank: `one` is the slowest rank's */
    if (!iters) {
        const double n = one > 0 ? 2.0 / one : 200; /* about two seconds */
        iters = n < 5 ? 5 : n > 200 ? 200 : (int)n;
    }
    times = malloc(sizeof(double) * (size_t)iters);
    if (!times)
        fprintf(stderr, "fmha: out of memory for %d timings\n", iters);
    if ((rc = cli_sp_agree(sp, times ? 0 : 1)) != 0)
        goto done;
    for (int i = 0; i < iters; i++) {
        st = cli_sp_forward(sp, &cfg, &sh, &times[i], &mine);
        if (st != FMHA_STATUS_OK)
            rc = fail_lib("sequence-parallel attention failed", st);
        if ((rc = cli_sp_agree(sp, rc)) != 0)
            goto done;
    }
    cli_sp_gather_i64(sp, mine, sent);
    qsort(times, (size_t)iters, sizeof times[0], cmp_double);
    if (sp->rank == 0)
        bench_report(o, s, &cfg, fmha_dtype_name(dt), kernel, 0, iters, times[iters / 2], peak_f32,
                     peak_bf16, sp, sent);
done:
    cli_sp_shard_free(&sh);
    free(times);
    free(sent);
    free(q);
    free(k);
    free(v);
    free(out);
    return rc;
}

/* --backward: the backward of dtype `dt` on o->device, and the forward beside
 * it, timed in turn in one loop; one line for the backward, one for forward
 * + backward. FLOPs: the backward counts 2.5 forwards (FlashAttention's
 * benchmarks' convention: five products of the forward's two), so fwd+bwd
 * 3.5. */
static int bench_backward(const options *o, const bench_shape *s, fmha_dtype dt, double peak_f32)
{
    options oo = *o;
    oo.dtype = dt;
    oo.causal = s->causal;
    fmha_config cfg;
    config_from_options(&oo, &cfg, s->heads, s->kv, s->d, s->d);
    fmha_kernel_info kinfo;
    fmha_status st = fmha_kernel_select_backward(&cfg, &kinfo);
    if (st != FMHA_STATUS_OK)
        return fail_lib("no backward for this configuration", st);
    fmha_layer *layer;
    if ((st = fmha_layer_init(&layer, &cfg)) != FMHA_STATUS_OK)
        return fail_lib("invalid configuration", st);
    const int64_t nq = s->batch * s->sq * s->heads * s->d, nk = s->batch * s->sk * s->kv * s->d;
    const size_t es = fmha_dtype_size(dt);
    rng_state = 1;
    void *q = alloc_random(dt, nq), *k = alloc_random(dt, nk), *v = alloc_random(dt, nk);
    void *dout = alloc_random(dt, nq), *out = malloc((size_t)nq * es);
    void *dq = malloc((size_t)nq * es), *dk = malloc((size_t)nk * es),
         *dv = malloc((size_t)nk * es);
    float *lse = malloc(sizeof(float) * (size_t)(s->batch * s->heads * s->sq));
    double *times = NULL;
    int rc = 1, uploaded = 0;
    dev_args df;
    dev_bwd db;
    if (!q || !k || !v || !dout || !out || !dq || !dk || !dv || !lse) {
        fprintf(stderr, "fmha: out of memory for the benchmark inputs\n");
        goto done;
    }
    fmha_forward_args f = {0};
    f.q = fmha_tensor_bshd(q, dt, s->batch, s->sq, s->heads, s->d);
    f.k = fmha_tensor_bshd(k, dt, s->batch, s->sk, s->kv, s->d);
    f.v = fmha_tensor_bshd(v, dt, s->batch, s->sk, s->kv, s->d);
    f.out = fmha_tensor_bshd(out, dt, s->batch, s->sq, s->heads, s->d);
    f.lse = lse;
    f.seed = o->seed;
    fmha_backward_args b = {
        .q = f.q, .k = f.k, .v = f.v, .out = f.out, .lse = lse, .seed = o->seed};
    b.dout = fmha_tensor_bshd(dout, dt, s->batch, s->sq, s->heads, s->d);
    b.dq = fmha_tensor_bshd(dq, dt, s->batch, s->sq, s->heads, s->d);
    b.dk = fmha_tensor_bshd(dk, dt, s->batch, s->sk, s->kv, s->d);
    b.dv = fmha_tensor_bshd(dv, dt, s->batch, s->sk, s->kv, s->d);
    /* On CUDA, device copies (tools/devmem.c); on the CPU, the buffers themselves. */
    char err[256];
    if (dev_args_upload(&df, &f, o->device, err, sizeof err) ||
        dev_bwd_upload(&db, &b, &df, err, sizeof err)) {
        fprintf(stderr, "fmha: %s\n", err);
        goto done;
    }
    uploaded = 1;
    double tf = 0, tb = 0;
    if ((st = dev_time_forward(layer, &df, &tf)) != FMHA_STATUS_OK) {
        rc = fail_lib("attention failed", st);
        goto done;
    }
    if ((st = dev_time_backward(layer, &db, &tb)) != FMHA_STATUS_OK) { /* and warm-up */
        rc = fail_lib("backward failed", st);
        goto done;
    }
    const double one = (tf + tb) * 1e-3;
    int iters = o->iters;
    if (!iters) {
        const double n = one > 0 ? 2.0 / one : 100; /* about two seconds */
        iters = n < 3 ? 3 : n > 100 ? 100 : (int)n;
    }
    times = malloc(sizeof(double) * 2 * (size_t)iters);
    if (!times) {
        fprintf(stderr, "fmha: out of memory for %d timings\n", iters);
        goto done;
    }
    for (int i = 0; i < iters; i++) {
        dev_time_forward(layer, &df, &times[i]);
        dev_time_backward(layer, &db, &times[iters + i]);
        times[i] *= 1e-3;
        times[iters + i] *= 1e-3;
    }
    qsort(times, (size_t)iters, sizeof times[0], cmp_double);
    qsort(times + iters, (size_t)iters, sizeof times[0], cmp_double);
    const double fwd = times[iters / 2], bwd = times[iters + iters / 2];
    const double flops = fmha_flops(&cfg, s->batch, s->sq, s->sk);
    const double g_bwd = 2.5 * flops / bwd * 1e-9, g_all = 3.5 * flops / (fwd + bwd) * 1e-9;
    char shape[160];
    snprintf(shape, sizeof shape, "[%lld, %lld, %lld, %lld] kv %lld sk %lld%s", (long long)s->batch,
             (long long)s->sq, (long long)s->heads, (long long)s->d, (long long)s->kv,
             (long long)s->sk, s->causal ? " causal" : "");
    if (o->json) {
        printf("{\"shape\": \"%s\", \"dtype\": \"%s\", \"kernel\": \"%s\", \"threads\": %d, "
               "\"iters\": %d, \"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"bwd_gflops\": %.2f, "
               "\"fwd_bwd_gflops\": %.2f, \"peak_gflops\": %.2f}\n",
               shape, fmha_dtype_name(dt), kinfo.name,
               o->threads ? o->threads : omp_get_max_threads(), iters, fwd * 1e3, bwd * 1e3, g_bwd,
               g_all, peak_f32);
    } else if (o->device == FMHA_DEVICE_CUDA) { /* the peers: bench/bench_backward.py */
        printf("%-44s %-5s %-19s %9.3f ms %8.1f TFLOP/s  %.2fx the forward\n", shape,
               fmha_dtype_name(dt), kinfo.name, bwd * 1e3, g_bwd * 1e-3, bwd / fwd);
        printf("%-44s %-5s %-19s %9.3f ms %8.1f TFLOP/s  (fwd+bwd)\n", "", fmha_dtype_name(dt), "",
               (fwd + bwd) * 1e3, g_all * 1e-3);
    } else {
        printf("%-44s %-5s %-18s %9.2f ms %8.1f GFLOP/s  %5.1f%% of f32 FMA peak (%.0f), %.2fx "
               "the forward\n",
               shape, fmha_dtype_name(dt), kinfo.name, bwd * 1e3, g_bwd,
               peak_f32 > 0 ? 100 * g_bwd / peak_f32 : 0, peak_f32, bwd / fwd);
        printf("%-44s %-5s %-18s %9.2f ms %8.1f GFLOP/s  %5.1f%% of f32 FMA peak (fwd+bwd)\n", "",
               fmha_dtype_name(dt), "", (fwd + bwd) * 1e3, g_all,
               peak_f32 > 0 ? 100 * g_all / peak_f32 : 0);
    }
    fflush(stdout);
    rc = 0;
done:
    if (uploaded) {
        dev_bwd_free(&db);
        dev_args_free(&df);
    }
    fmha_layer_free(layer);
    free(times);
    free(q);
    free(k);
    free(v);
    free(dout);
    free(out);
    free(dq);
    free(dk);
    free(dv);
    free(lse);
    return rc;
}

/* The shape of `bench` and `accuracy`: a preset or explicit sizes over `s`'s
 * defaults. 0, EXIT_USAGE for an unknown preset, 1 for a shape too large. */
static int shape_from_options(const options *o, bench_shape *s)
{
    if (o->model) {
        const fmha_preset *p = fmha_preset_find(o->model);
        if (!p) {
            fprintf(stderr, "fmha: unknown preset '%s' (see fmha --help)\n", o->model);
            return EXIT_USAGE;
        }
        *s = (bench_shape){p->name,  1,           p->seqlen_q, p->seqlen_k,
                           p->heads, p->kv_heads, p->head_dim, p->causal || o->causal};
        if (o->seqlen) {
            s->sk = s->sq == s->sk ? o->seqlen : s->sk;
            s->sq = o->seqlen;
        }
    } else {
        if (o->seqlen)
            s->sq = s->sk = o->seqlen;
        if (o->heads)
            s->heads = s->kv = o->heads;
    }
    if (o->batch)
        s->batch = o->batch;
    if (o->seqlen_k)
        s->sk = o->seqlen_k;
    if (o->kv_heads)
        s->kv = o->kv_heads;
    if (o->head_dim)
        s->d = o->head_dim;
    return problem_fits(s->batch, s->sq, s->sk, s->heads, s->kv, s->d, s->d) ? 0 : 1;
}

static int cmd_bench(cli_sp *sp, int argc, char **argv)
{
    options o;
    const int parsed = parse_options(argc, argv, &o);
    if (parsed)
        return parsed > 0 ? 0 : EXIT_USAGE;
    if (o.input) {
        fprintf(stderr, "fmha: bench takes no input file\n");
        return EXIT_USAGE;
    }
    int rc = sp_setup(sp, &o, "bench");
    if (rc)
        return rc;
    if (sp->on && o.backward) {
        fprintf(stderr, "fmha: bench --backward: sequence parallelism (--sp-ulysses, --sp-ring) "
                        "has a forward only\n");
        return EXIT_USAGE;
    }
    if (sp->on && o.dtype_set && o.dtype == FMHA_DTYPE_F8_E4M3) {
        fprintf(stderr, "fmha: bench --dtype fp8: sequence parallelism runs f32, f16 and bf16 "
                        "attention\n");
        return EXIT_USAGE;
    }
    bench_shape s = {NULL, 1, 2048, 2048, 16, 16, 128, o.causal};
    int src = shape_from_options(&o, &s);
    if (src)
        return src;

    const int threads = o.threads ? o.threads : omp_get_max_threads();
    double peak_f32 = 0, peak_bf16 = 0;
    if (o.device == FMHA_DEVICE_CPU) {
        /* Every rank measures its own at once, as they will run: the sum is the ranks' peak. */
        peak_f32 = cli_sp_sum(sp, fmha_peak_f32_gflops(threads));
        peak_bf16 = cli_sp_sum(sp, fmha_peak_bf16_gflops(threads));
        if (!o.json && sp->on)
            printf("measured peaks on %d ranks x %d threads (summed): f32 FMA %.1f GFLOP/s, "
                   "vdpbf16ps %.1f GFLOP/s\n",
                   sp->ranks, threads, peak_f32, peak_bf16);
        else if (!o.json)
            printf("measured peaks on %d threads: f32 FMA %.1f GFLOP/s, vdpbf16ps %.1f GFLOP/s\n",
                   threads, peak_f32, peak_bf16);
    }
    if (o.backward && o.dtype_set && o.dtype == FMHA_DTYPE_F8_E4M3) {
        fprintf(stderr, "fmha: bench --backward: FP8 attention has no backward; use --dtype "
                        "f32, f16 or bf16\n");
        return EXIT_USAGE;
    }
    if (o.dtype_set && o.dtype == FMHA_DTYPE_F8_E4M3) {
        int rc = bench_one(&o, &s, FMHA_DTYPE_F8_E4M3, 0, peak_f32, peak_bf16);
        rc = rc ? rc : bench_one(&o, &s, FMHA_DTYPE_BF16, 1, peak_f32, peak_bf16);
        if (!rc && !o.json)
            printf("fp8: FP8 attention on inputs quantized beforehand (per tensor); fp8q: a bf16 "
                   "layer with fp8_compute, quantizing on every call\n");
        return rc;
    }
    const fmha_dtype dts[2] = {FMHA_DTYPE_F32, FMHA_DTYPE_BF16};
    for (int i = o.dtype_set ? 1 : 0; i < 2 && !rc; i++) {
        const fmha_dtype dt = o.dtype_set ? o.dtype : dts[i];
        rc = sp->on ? bench_sp_one(sp, &o, &s, dt, peak_f32, peak_bf16)
                    : bench_one(&o, &s, dt, 0, peak_f32, peak_bf16);
        if (!rc && o.backward)
            rc = bench_backward(&o, &s, dt, peak_f32);
    }
    return rc;
}

/* --------------------------------------------------------- fmha accuracy */

static int cmd_accuracy(int argc, char **argv)
{
    options o;
    const int parsed = parse_options(argc, argv, &o);
    if (parsed)
        return parsed > 0 ? 0 : EXIT_USAGE;
    if (o.sp_ulysses || o.sp_ring || o.sp_layout_set || o.sp_joint) {
        fprintf(stderr, "fmha: --sp-ulysses, --sp-ring, --sp-layout and --sp-joint are options of "
                        "run and bench\n");
        return EXIT_USAGE;
    }
    if (o.input) {
        fprintf(stderr, "fmha: accuracy takes no input file\n");
        return EXIT_USAGE;
    }
    if (o.device != FMHA_DEVICE_CPU || (o.dtype_set && o.dtype != FMHA_DTYPE_F8_E4M3)) {
        fprintf(stderr, "fmha: accuracy measures FP8 attention on the CPU (against bf16)\n");
        return EXIT_USAGE;
    }
    bench_shape s = {NULL, 1, 2048, 2048, 8, 8, 128, o.causal};
    int src = shape_from_options(&o, &s);
    if (src)
        return src;
    options oo = o;
    oo.dtype = FMHA_DTYPE_BF16;
    oo.causal = s.causal;
    fmha_config cfg;
    config_from_options(&oo, &cfg, s.heads, s.kv, s.d, s.d);
    fmha_kernel_info info;
    fmha_status st = fmha_kernel_select(&cfg, &info);
    if (st != FMHA_STATUS_OK)
        return fail_lib("invalid configuration", st);
    rng_state = o.seed ? o.seed : 20261202;
    return fp8_accuracy_report(&cfg, s.batch, s.sq, s.sk, 256, rng_normal, stdout);
}

/* ------------------------------------------------------------ fmha check */

static int cmd_check(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: fmha check CONFIG.json\n");
        return EXIT_USAGE;
    }
    hf_attn_shape sh;
    char err[512];
    if (hf_config_read(argv[1], &sh, err, sizeof err)) {
        fprintf(stderr, "fmha: %s\n", err);
        return 1;
    }
    fmha_config cfg;
    fmha_kernel_info info;
    fmha_config_init(&cfg, sh.num_heads, sh.num_kv_heads, sh.head_dim);
    fmha_status st = fmha_kernel_select(&cfg, &info);
    if (st != FMHA_STATUS_OK)
        return fail_lib(argv[1], st);
    printf("%s: num_heads %lld, num_kv_heads %lld (%s), head_dim %lld\n", argv[1],
           (long long)sh.num_heads, (long long)sh.num_kv_heads,
           sh.num_kv_heads == sh.num_heads ? "MHA"
           : sh.num_kv_heads == 1          ? "MQA"
                                           : "GQA",
           (long long)sh.head_dim);
    printf("  q   [batch, seq, %lld, %lld]\n  k/v [batch, seq, %lld, %lld]\n",
           (long long)sh.num_heads, (long long)sh.head_dim, (long long)sh.num_kv_heads,
           (long long)sh.head_dim);
    printf("  from %s\n  bf16 kernel here: %s\n", sh.source, info.name);
    return 0;
}

/* ------------------------------------------------------------- fmha info */

static int cmd_info(void)
{
    printf("fmha %s\n", FMHA_VERSION_STRING);
    const int ngpu = fmha_cuda_device_count();
    char desc[256];
    const int cuda_built = fmha_cuda_backend_built();
    printf("backends: cpu (scalar, avx2, avx512, avx512-bf16); cuda: %s\n",
           cuda_built ? "built (sm_80 and later)" : "not built");
    fmha_cpu_isa isa = fmha_cpu_isa_detect();
    printf("cpu: best ISA %s, OpenMP threads %d\n", fmha_cpu_isa_name(isa), omp_get_max_threads());
    static const fmha_dtype dts[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16,
                                     FMHA_DTYPE_F8_E4M3};
    for (int i = 0; i < 4; i++) {
        fmha_config cfg;
        fmha_kernel_info k;
        fmha_config_init(&cfg, 1, 1, 128);
        cfg.dtype = dts[i];
        if (fmha_kernel_select(&cfg, &k) == FMHA_STATUS_OK)
            printf("  %-4s inputs run %s\n", fmha_dtype_name(dts[i]), k.name);
        else
            printf("  %-4s inputs: %s\n", fmha_dtype_name(dts[i]), fmha_last_error());
    }
    printf("sequence parallelism: mpi %s, nccl %s\n",
           fmha_comm_built(FMHA_COMM_MPI) ? "built" : "not built",
           fmha_comm_built(FMHA_COMM_NCCL) ? "built" : "not built");
    if (!cuda_built)
        printf("gpus: not looked for (this build has no CUDA backend)\n");
    else if (ngpu == 0)
        printf("gpus: none found\n");
    for (int i = 0; i < ngpu; i++)
        if (fmha_cuda_device_describe(i, desc, sizeof desc) == FMHA_STATUS_OK)
            printf("gpu %d: %s\n", i, desc);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "run") || !strcmp(cmd, "bench")) {
        /* Under mpirun every rank gets here: sp_cli.h says who prints. */
        cli_sp sp;
        cli_sp_begin(&sp, &argc, &argv);
        const int rc = !strcmp(cmd, "run") ? cmd_run(&sp, argc - 1, argv + 1)
                                           : cmd_bench(&sp, argc - 1, argv + 1);
        return cli_sp_end(&sp, rc);
    }
    if (!strcmp(cmd, "check"))
        return cmd_check(argc - 1, argv + 1);
    if (!strcmp(cmd, "accuracy"))
        return cmd_accuracy(argc - 1, argv + 1);
    if (!strcmp(cmd, "info"))
        return cmd_info();
    if (!strcmp(cmd, "sp-plan"))
        return sp_plan_main(argc - 1, argv + 1);
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("fmha %s\n", FMHA_VERSION_STRING);
        return 0;
    }
    if (!strcmp(cmd, "help") || !strcmp(cmd, "--help") || !strcmp(cmd, "-h")) {
        usage(stdout);
        return 0;
    }
    fprintf(stderr, "fmha: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return EXIT_USAGE;
}
