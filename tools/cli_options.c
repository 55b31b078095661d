/* cli_options.c — option parsing of the `fmha` command (cli_options.h). */
#define _POSIX_C_SOURCE 200809L
#include "cli_options.h"

#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__GNUC__)
#define CLI_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define CLI_PRINTF(f, a)
#endif

CLI_PRINTF(3, 4)
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* A decimal integer in [min, max]; otherwise a message naming the flag, the
 * value and the range. */
static int parse_int(const char *s, const char *name, int64_t min, int64_t max, int64_t *out,
                     char *err, size_t errlen)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end) {
        set_err(err, errlen, "%s '%s' is not an integer (allowed: %lld to %lld)", name, s,
                (long long)min, (long long)max);
        return -1;
    }
    if (errno == ERANGE || v < min || v > max) {
        set_err(err, errlen, "%s %s is out of range: allowed %lld to %lld", name, s, (long long)min,
                (long long)max);
        return -1;
    }
    *out = v;
    return 0;
}

/* --seed: any 64-bit unsigned value. */
static int parse_u64(const char *s, const char *name, uint64_t *out, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (!*s || *end || *s == '-' || *s == '+') {
        set_err(err, errlen, "%s '%s' is not an unsigned integer (allowed: 0 to %llu)", name, s,
                (unsigned long long)UINT64_MAX);
        return -1;
    }
    if (errno == ERANGE) {
        set_err(err, errlen, "%s %s is out of range: allowed 0 to %llu", name, s,
                (unsigned long long)UINT64_MAX);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_double(const char *s, const char *name, double *out, char *err, size_t errlen)
{
    char *end;
    double v = strtod(s, &end);
    if (!*s || *end || !isfinite(v)) {
        set_err(err, errlen, "%s '%s' is not a finite number", name, s);
        return -1;
    }
    *out = v;
    return 0;
}

static int parse_dtype(const char *s, fmha_dtype *out, char *err, size_t errlen)
{
    static const struct {
        const char *name;
        fmha_dtype dt;
    } names[] = {{"f32", FMHA_DTYPE_F32},
                 {"f16", FMHA_DTYPE_F16},
                 {"bf16", FMHA_DTYPE_BF16},
                 {"fp8", FMHA_DTYPE_F8_E4M3},
                 {"f8_e4m3", FMHA_DTYPE_F8_E4M3}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(s, names[i].name)) {
            *out = names[i].dt;
            return 0;
        }
    set_err(err, errlen, "--dtype '%s' is not one of f32, f16, bf16, fp8", s);
    return -1;
}

enum {
    OPT_MODEL = 256,
    OPT_SEQLEN,
    OPT_SEQLEN_K,
    OPT_BATCH,
    OPT_HEADS,
    OPT_KV_HEADS,
    OPT_HEAD_DIM,
    OPT_DTYPE,
    OPT_CAUSAL,
    OPT_WL,
    OPT_WR,
    OPT_SCALE,
    OPT_SOFTCAP,
    OPT_DROPOUT,
    OPT_SEED,
    OPT_DEVICE,
    OPT_THREADS,
    OPT_CHECK,
    OPT_JSON,
    OPT_ITERS,
    OPT_NO_CAUSAL,
    OPT_CHECK_FINITE,
    OPT_BACKWARD,
    OPT_SP_ULYSSES,
    OPT_SP_RING,
    OPT_SP_LAYOUT,
    OPT_SP_JOINT
};

int cli_parse_options(int argc, char **argv, cli_options *o, char *err, size_t errlen)
{
    static const struct option longopts[] = {{"output", required_argument, 0, 'o'},
                                             {"model", required_argument, 0, OPT_MODEL},
                                             {"seqlen", required_argument, 0, OPT_SEQLEN},
                                             {"seqlen-k", required_argument, 0, OPT_SEQLEN_K},
                                             {"batch", required_argument, 0, OPT_BATCH},
                                             {"heads", required_argument, 0, OPT_HEADS},
                                             {"kv-heads", required_argument, 0, OPT_KV_HEADS},
                                             {"head-dim", required_argument, 0, OPT_HEAD_DIM},
                                             {"dtype", required_argument, 0, OPT_DTYPE},
                                             {"causal", no_argument, 0, OPT_CAUSAL},
                                             {"no-causal", no_argument, 0, OPT_NO_CAUSAL},
                                             {"check-finite", no_argument, 0, OPT_CHECK_FINITE},
                                             {"backward", no_argument, 0, OPT_BACKWARD},
                                             {"window-left", required_argument, 0, OPT_WL},
                                             {"window-right", required_argument, 0, OPT_WR},
                                             {"scale", required_argument, 0, OPT_SCALE},
                                             {"softcap", required_argument, 0, OPT_SOFTCAP},
                                             {"dropout", required_argument, 0, OPT_DROPOUT},
                                             {"seed", required_argument, 0, OPT_SEED},
                                             {"device", required_argument, 0, OPT_DEVICE},
                                             {"threads", required_argument, 0, OPT_THREADS},
                                             {"check", no_argument, 0, OPT_CHECK},
                                             {"json", no_argument, 0, OPT_JSON},
                                             {"iters", required_argument, 0, OPT_ITERS},
                                             {"sp-ulysses", required_argument, 0, OPT_SP_ULYSSES},
                                             {"sp-ring", required_argument, 0, OPT_SP_RING},
                                             {"sp-layout", required_argument, 0, OPT_SP_LAYOUT},
                                             {"sp-joint", required_argument, 0, OPT_SP_JOINT},
                                             {"help", no_argument, 0, 'h'},
                                             {0, 0, 0, 0}};
    set_err(err, errlen, "%s", "");
    memset(o, 0, sizeof *o);
    o->window_left = o->window_right = -1;
    o->dtype = FMHA_DTYPE_BF16;
    o->seed = 0;
    /* 0, not 1: glibc then starts afresh, forgetting where a previous call
     * stopped inside a word (-h in a cluster such as -hx leaves it pointing
     * at the x, possibly in a word freed since). */
    optind = 0;
    int c;
    int64_t v;
    while ((c = getopt_long(argc, argv, "o:h", longopts, NULL)) != -1) {
        switch (c) {
        case 'o': o->output = optarg; break;
        case OPT_MODEL: o->model = optarg; break;
        case OPT_SEQLEN:
            if (parse_int(optarg, "--seqlen", 1, CLI_MAX_SEQLEN, &o->seqlen, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_SEQLEN_K:
            if (parse_int(optarg, "--seqlen-k", 1, CLI_MAX_SEQLEN, &o->seqlen_k, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_BATCH:
            if (parse_int(optarg, "--batch", 1, CLI_MAX_BATCH, &o->batch, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_HEADS:
            if (parse_int(optarg, "--heads", 1, CLI_MAX_HEADS, &o->heads, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_KV_HEADS:
            if (parse_int(optarg, "--kv-heads", 1, CLI_MAX_HEADS, &o->kv_heads, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_HEAD_DIM:
            if (parse_int(optarg, "--head-dim", 1, CLI_MAX_HEAD_DIM, &o->head_dim, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_DTYPE:
            if (parse_dtype(optarg, &o->dtype, err, errlen))
                return CLI_PARSE_ERROR;
            o->dtype_set = 1;
            break;
        case OPT_CAUSAL:
            o->causal = 1;
            o->given |= OPTION_CAUSAL;
            break;
        case OPT_NO_CAUSAL:
            o->causal = 0;
            o->given |= OPTION_CAUSAL;
            break;
        case OPT_WL:
            o->given |= OPTION_WINDOW_LEFT;
            if (parse_int(optarg, "--window-left", -1, CLI_MAX_WINDOW, &o->window_left, err,
                          errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_WR:
            o->given |= OPTION_WINDOW_RIGHT;
            if (parse_int(optarg, "--window-right", -1, CLI_MAX_WINDOW, &o->window_right, err,
                          errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_SCALE:
            o->given |= OPTION_SCALE;
            if (parse_double(optarg, "--scale", &o->scale, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_SOFTCAP:
            o->given |= OPTION_SOFTCAP;
            if (parse_double(optarg, "--softcap", &o->softcap, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_DROPOUT:
            o->given |= OPTION_DROPOUT;
            if (parse_double(optarg, "--dropout", &o->dropout, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_SEED:
            o->given |= OPTION_SEED;
            if (parse_u64(optarg, "--seed", &o->seed, err, errlen))
                return CLI_PARSE_ERROR;
            break;
        case OPT_DEVICE:
            if (!strcmp(optarg, "cpu"))
                o->device = FMHA_DEVICE_CPU;
            else if (!strcmp(optarg, "cuda"))
                o->device = FMHA_DEVICE_CUDA;
            else {
                set_err(err, errlen, "--device '%s' is not cpu or cuda", optarg);
                return CLI_PARSE_ERROR;
            }
            break;
        case OPT_THREADS:
            if (parse_int(optarg, "--threads", 0, CLI_MAX_THREADS, &v, err, errlen))
                return CLI_PARSE_ERROR;
            o->threads = (int)v;
            break;
        case OPT_CHECK: o->check = 1; break;
        case OPT_CHECK_FINITE: o->check_finite = 1; break;
        case OPT_BACKWARD: o->backward = 1; break;
        case OPT_JSON: o->json = 1; break;
        case OPT_ITERS:
            if (parse_int(optarg, "--iters", 1, CLI_MAX_ITERS, &v, err, errlen))
                return CLI_PARSE_ERROR;
            o->iters = (int)v;
            break;
        case OPT_SP_ULYSSES:
            if (parse_int(optarg, "--sp-ulysses", 1, CLI_MAX_SP, &v, err, errlen))
                return CLI_PARSE_ERROR;
            o->sp_ulysses = (int)v;
            break;
        case OPT_SP_RING:
            if (parse_int(optarg, "--sp-ring", 1, CLI_MAX_SP, &v, err, errlen))
                return CLI_PARSE_ERROR;
            o->sp_ring = (int)v;
            break;
        case OPT_SP_LAYOUT:
            if (!strcmp(optarg, "contiguous") || !strcmp(optarg, "zigzag")) {
                o->sp_layout = optarg[0] == 'z' ? FMHA_SP_LAYOUT_ZIGZAG : FMHA_SP_LAYOUT_CONTIGUOUS;
                o->sp_layout_set = 1;
                break;
            }
            set_err(err, errlen,
                    "--sp-layout '%s' is neither contiguous nor zigzag (zigzag balances a causal "
                    "ring: fmha_sp_layout)",
                    optarg);
            return CLI_PARSE_ERROR;
        case OPT_SP_JOINT: {
            const int front = !strncmp(optarg, "front:", 6), rear = !strncmp(optarg, "rear:", 5);
            if (!front && !rear) {
                set_err(err, errlen,
                        "--sp-joint '%s' is neither front:N nor rear:N (N text tokens that every "
                        "rank holds whole, before or after the distributed ones: fmha_sp_joint)",
                        optarg);
                return CLI_PARSE_ERROR;
            }
            if (parse_int(optarg + (front ? 6 : 5), "--sp-joint's token count", 1, INT32_MAX, &v,
                          err, errlen))
                return CLI_PARSE_ERROR;
            o->sp_joint = front ? FMHA_SP_JOINT_FRONT : FMHA_SP_JOINT_REAR;
            o->sp_joint_tokens = v;
            break;
        }
        case 'h': return CLI_PARSE_HELP;
        default: return CLI_PARSE_GETOPT;
        }
    }
    if (optind < argc)
        o->input = argv[optind++];
    if (optind < argc) {
        set_err(err, errlen, "unexpected argument '%s'", argv[optind]);
        return CLI_PARSE_ERROR;
    }
    return CLI_PARSE_OK;
}
