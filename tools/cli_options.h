/* cli_options.h — the options of `fmha run`, `fmha bench` and `fmha accuracy`:
 * parsing of the words after the command, with every integer flag checked
 * against its range. Kept apart from fmha_cli.c so that it can be tested and
 * fuzzed on its own. Nothing here prints or exits, except that getopt_long
 * prints its own complaint about an unknown flag or a missing value while
 * `opterr` is nonzero (its default), as the command line wants.
 *
 * Usage:
 *
 *     cli_options o;
 *     char err[512];
 *     int rc = cli_parse_options(argc, argv, &o, err, sizeof err);
 *     if (rc == CLI_PARSE_HELP) ...          // -h / --help: print the usage
 *     else if (rc != CLI_PARSE_OK) ...       // err says why, or is "" (getopt's)
 */
#ifndef FMHA_TOOLS_CLI_OPTIONS_H
#define FMHA_TOOLS_CLI_OPTIONS_H

#include <stddef.h>
#include <stdint.h>

#include "fmha.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Ranges of the integer flags. Sizes stay within int32 (cu_seqlens are I32,
 * and a bigger one could not be allocated anyway); products of sizes are
 * checked where buffers are sized. */
#define CLI_MAX_SEQLEN   2147483647LL
#define CLI_MAX_BATCH    2147483647LL
#define CLI_MAX_HEADS    65536LL
#define CLI_MAX_HEAD_DIM 65536LL
#define CLI_MAX_WINDOW   2147483647LL
#define CLI_MAX_THREADS  4096LL
#define CLI_MAX_ITERS    1000000LL
#define CLI_MAX_SP       65536LL /* fmha_sp_config's degrees */

/* The run options a written file records in its metadata: bits of
 * cli_options.given, in the order of the metadata keys. */
enum {
    OPTION_CAUSAL = 1u << 0,
    OPTION_WINDOW_LEFT = 1u << 1,
    OPTION_WINDOW_RIGHT = 1u << 2,
    OPTION_SCALE = 1u << 3,
    OPTION_SOFTCAP = 1u << 4,
    OPTION_DROPOUT = 1u << 5,
    OPTION_SEED = 1u << 6
};

/* What the command line said. Sizes left out are 0 (the command's default
 * applies); windows default to -1, dtype to bf16 (dtype_set says whether
 * --dtype was given). Strings point into argv. After a successful parse:
 * seqlen, seqlen_k, batch 0 or in [1, 2^31 - 1]; heads, kv_heads, head_dim
 * 0 or in [1, 65536]; windows in [-1, 2^31 - 1]; threads in [0, 4096]; iters
 * 0 or in [1, 10^6]; sp_ulysses, sp_ring 0 or in [1, 65536]; sp_joint_tokens
 * in [1, 2^31 - 1] where sp_joint is set; scale, softcap
 * and dropout finite (their ranges are the library's to check); seed any
 * uint64. */
typedef struct cli_options {
    const char *input, *output, *model;
    int64_t batch, seqlen, seqlen_k, heads, kv_heads, head_dim;
    fmha_dtype dtype;
    int dtype_set;
    int causal;
    int64_t window_left, window_right;
    double scale, softcap, dropout;
    uint64_t seed;
    fmha_device device;
    int threads, check, json, iters, check_finite;
    int backward;             /* bench: time the backward too */
    int sp_ulysses, sp_ring;  /* sequence-parallel degrees under mpirun (tools/sp_cli.h) */
    fmha_sp_layout sp_layout; /* --sp-layout contiguous (default) or zigzag */
    int sp_layout_set;
    fmha_sp_joint sp_joint; /* --sp-joint front:N or rear:N: N text tokens on every rank */
    int64_t sp_joint_tokens;
    unsigned given; /* OPTION_* bits: set on the command line (a file's metadata fills the rest) */
} cli_options;

enum {
    CLI_PARSE_OK = 0,
    CLI_PARSE_HELP = 1,   /* -h or --help: the caller prints the usage */
    CLI_PARSE_ERROR = -1, /* a value out of range or malformed: err says which and why */
    CLI_PARSE_GETOPT = -2 /* an unknown flag or a missing value: getopt_long's own complaint
                             (printed while opterr is nonzero); err is "" */
};

/* Parses argv[1..argc-1] (argv[0] is the command's name) into *o: flags in
 * any order, then at most one input file. Returns CLI_PARSE_*; on an error
 * *o holds what was parsed before it. */
int cli_parse_options(int argc, char **argv, cli_options *o, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_TOOLS_CLI_OPTIONS_H */
