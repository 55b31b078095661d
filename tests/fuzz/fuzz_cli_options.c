/* fuzz_cli_options.c — libFuzzer harness of the `fmha` command's option
 * parsing (tools/cli_options.c). The input is split at newlines into words,
 * each its own allocation (so that reading past a word is an ASan report),
 * after argv[0] = "run". The parser must never crash or exit; an error must
 * come with a message (or be getopt_long's own, CLI_PARSE_GETOPT); a success
 * must leave every value in the range cli_options.h documents and every
 * string pointing into the words. The same words parsed again must give the
 * same answer: the parser keeps no state between calls. Any broken promise
 * calls __builtin_trap(), which libFuzzer reports. */
#include "cli_options.h"

#include <getopt.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REQUIRE(cond)                                                                    \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "fuzz_cli_options: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            __builtin_trap();                                                            \
        }                                                                                \
    } while (0)

enum { MAX_WORDS = 64 };

/* 0 or within [lo, hi]: sizes left out stay 0. */
static int unset_or_in(int64_t v, int64_t lo, int64_t hi)
{
    return v == 0 || (v >= lo && v <= hi);
}

/* NULL, or a pointer into one of the words (optarg may point past "--flag="). */
static int in_words(const char *s, char *const *words, int n)
{
    if (s == NULL)
        return 1;
    for (int i = 0; i < n; i++)
        if (s >= words[i] && s <= words[i] + strlen(words[i]))
            return 1;
    return 0;
}

static void check_ranges(const cli_options *o, char *const *words, int n)
{
    REQUIRE(unset_or_in(o->seqlen, 1, CLI_MAX_SEQLEN));
    REQUIRE(unset_or_in(o->seqlen_k, 1, CLI_MAX_SEQLEN));
    REQUIRE(unset_or_in(o->batch, 1, CLI_MAX_BATCH));
    REQUIRE(unset_or_in(o->heads, 1, CLI_MAX_HEADS));
    REQUIRE(unset_or_in(o->kv_heads, 1, CLI_MAX_HEADS));
    REQUIRE(unset_or_in(o->head_dim, 1, CLI_MAX_HEAD_DIM));
    REQUIRE(o->window_left >= -1 && o->window_left <= CLI_MAX_WINDOW);
    REQUIRE(o->window_right >= -1 && o->window_right <= CLI_MAX_WINDOW);
    REQUIRE(o->threads >= 0 && o->threads <= CLI_MAX_THREADS);
    REQUIRE(unset_or_in(o->iters, 1, CLI_MAX_ITERS));
    REQUIRE(unset_or_in(o->sp_ulysses, 1, CLI_MAX_SP) && unset_or_in(o->sp_ring, 1, CLI_MAX_SP));
    REQUIRE(isfinite(o->scale) && isfinite(o->softcap) && isfinite(o->dropout));
    REQUIRE((unsigned)o->dtype <= FMHA_DTYPE_F8_E4M3 && (o->dtype_set == 0 || o->dtype_set == 1));
    REQUIRE(o->dtype_set || o->dtype == FMHA_DTYPE_BF16);
    REQUIRE(o->device == FMHA_DEVICE_CPU || o->device == FMHA_DEVICE_CUDA);
    REQUIRE(o->causal == 0 || o->causal == 1);
    REQUIRE((o->check | o->json | o->check_finite) <= 1 && o->check >= 0 && o->json >= 0 &&
            o->check_finite >= 0);
    REQUIRE((o->given & ~0x7fu) == 0);
    REQUIRE(in_words(o->input, words, n) && in_words(o->output, words, n) &&
            in_words(o->model, words, n));
}

static int same_options(const cli_options *a, const cli_options *b)
{
    return a->input == b->input && a->output == b->output && a->model == b->model &&
           a->batch == b->batch && a->seqlen == b->seqlen && a->seqlen_k == b->seqlen_k &&
           a->heads == b->heads && a->kv_heads == b->kv_heads && a->head_dim == b->head_dim &&
           a->dtype == b->dtype && a->dtype_set == b->dtype_set && a->causal == b->causal &&
           a->window_left == b->window_left && a->window_right == b->window_right &&
           memcmp(&a->scale, &b->scale, sizeof a->scale) == 0 &&
           memcmp(&a->softcap, &b->softcap, sizeof a->softcap) == 0 &&
           memcmp(&a->dropout, &b->dropout, sizeof a->dropout) == 0 && a->seed == b->seed &&
           a->device == b->device && a->threads == b->threads && a->check == b->check &&
           a->json == b->json && a->iters == b->iters && a->check_finite == b->check_finite &&
           a->sp_ulysses == b->sp_ulysses && a->sp_ring == b->sp_ring && a->given == b->given;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *words[MAX_WORDS + 1];
    int n = 0;
    words[n++] = strdup("run");
    size_t start = 0;
    for (size_t i = 0; i <= size && n < MAX_WORDS; i++) {
        if (i == size || data[i] == '\n') {
            char *w = malloc(i - start + 1);
            REQUIRE(w != NULL);
            memcpy(w, data + start, i - start);
            w[i - start] = '\0';
            words[n++] = w;
            start = i + 1;
        }
    }
    words[n] = NULL;
    /* getopt_long permutes argv: both parses get their own array of the same words. */
    char *argv1[MAX_WORDS + 1], *argv2[MAX_WORDS + 1];
    memcpy(argv1, words, sizeof(char *) * (size_t)(n + 1));
    memcpy(argv2, words, sizeof(char *) * (size_t)(n + 1));

    opterr = 0; /* getopt_long's complaints would flood the fuzzer's output */
    cli_options o, again;
    char err[512], err2[512];
    int rc = cli_parse_options(n, argv1, &o, err, sizeof err);
    int rc2 = cli_parse_options(n, argv2, &again, err2, sizeof err2);
    REQUIRE(rc == CLI_PARSE_OK || rc == CLI_PARSE_HELP || rc == CLI_PARSE_ERROR ||
            rc == CLI_PARSE_GETOPT);
    REQUIRE(rc == rc2 && strcmp(err, err2) == 0 && same_options(&o, &again));
    if (rc == CLI_PARSE_ERROR)
        REQUIRE(err[0] != '\0');
    if (rc == CLI_PARSE_GETOPT)
        REQUIRE(err[0] == '\0');
    if (rc == CLI_PARSE_OK)
        check_ranges(&o, words, n);
    for (int i = 0; i < n; i++)
        free(words[i]);
    return 0;
}
