/* test_cli_options.c — the `fmha` command's option parsing
 * (tools/cli_options.c) as a function: values and their ranges, the
 * messages, -h, getopt_long's own errors, and that one parse leaves nothing
 * behind for the next (fuzz_cli_options found a -h in a cluster of short
 * flags leaking into the next call). */
#include "cli_options.h"
#include "testutil.h"

#include <getopt.h>
#include <string.h>

/* Parses the NULL-terminated words after argv[0] = "run". */
static int parse(cli_options *o, char *err, size_t errlen, const char *const *words)
{
    char *argv[32];
    int argc = 0;
    static char run[] = "run";
    argv[argc++] = run;
    for (int i = 0; words[i] != NULL && argc < 31; i++)
        argv[argc++] = (char *)words[i];
    argv[argc] = NULL;
    return cli_parse_options(argc, argv, o, err, errlen);
}

#define WORDS(...) ((const char *const[]){__VA_ARGS__, NULL})

int main(void)
{
    opterr = 0; /* getopt_long's own complaints are not under test */
    cli_options o;
    char err[512];

    int rc = parse(&o, err, sizeof err,
                   WORDS("--seqlen", "128", "--causal", "--threads=3", "in.safetensors", "-o",
                         "out.safetensors", "--dtype", "f16", "--window-left", "-1"));
    TU_CHECK(rc == CLI_PARSE_OK && err[0] == '\0', "valid options: rc %d, \"%s\"", rc, err);
    TU_CHECK(o.seqlen == 128 && o.causal == 1 && o.threads == 3 && o.dtype == FMHA_DTYPE_F16 &&
                 o.dtype_set && o.window_left == -1 && o.window_right == -1 &&
                 !strcmp(o.input, "in.safetensors") && !strcmp(o.output, "out.safetensors"),
             "values of valid options");
    TU_CHECK(o.given == (OPTION_CAUSAL | OPTION_WINDOW_LEFT), "given bits %#x", o.given);

    rc = parse(&o, err, sizeof err, WORDS("--threads", "5000"));
    TU_CHECK(rc == CLI_PARSE_ERROR &&
                 strstr(err, "--threads 5000 is out of range: allowed 0 to 4096"),
             "--threads 5000: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--seqlen", "12x"));
    TU_CHECK(rc == CLI_PARSE_ERROR && strstr(err, "--seqlen '12x' is not an integer"),
             "--seqlen 12x: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--scale", "inf"));
    TU_CHECK(rc == CLI_PARSE_ERROR && strstr(err, "--scale 'inf' is not a finite number"),
             "--scale inf: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--sp-ulysses", "2", "--sp-ring=4"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_ulysses == 2 && o.sp_ring == 4,
             "--sp-ulysses 2 --sp-ring 4: rc %d, %d x %d, \"%s\"", rc, o.sp_ulysses, o.sp_ring,
             err);
    rc = parse(&o, err, sizeof err, WORDS("--seqlen", "64"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_ulysses == 0 && o.sp_ring == 0,
             "sp degrees left out: %d x %d (0 = not given)", o.sp_ulysses, o.sp_ring);
    rc = parse(&o, err, sizeof err, WORDS("--sp-ulysses", "0"));
    TU_CHECK(rc == CLI_PARSE_ERROR &&
                 strstr(err, "--sp-ulysses 0 is out of range: allowed 1 to 65536"),
             "--sp-ulysses 0: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--sp-layout", "zigzag"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_layout == FMHA_SP_LAYOUT_ZIGZAG && o.sp_layout_set,
             "--sp-layout zigzag: rc %d, layout %d, \"%s\"", rc, (int)o.sp_layout, err);
    rc = parse(&o, err, sizeof err, WORDS("--seqlen", "64"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_layout == FMHA_SP_LAYOUT_CONTIGUOUS && !o.sp_layout_set,
             "--sp-layout left out: layout %d, set %d", (int)o.sp_layout, o.sp_layout_set);
    rc = parse(&o, err, sizeof err, WORDS("--sp-layout", "spiral"));
    TU_CHECK(rc == CLI_PARSE_ERROR &&
                 strstr(err, "--sp-layout 'spiral' is neither contiguous nor zigzag"),
             "--sp-layout spiral: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--sp-joint", "rear:77"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_joint == FMHA_SP_JOINT_REAR && o.sp_joint_tokens == 77,
             "--sp-joint rear:77: rc %d, joint %d, tokens %lld, \"%s\"", rc, (int)o.sp_joint,
             (long long)o.sp_joint_tokens, err);
    rc = parse(&o, err, sizeof err, WORDS("--sp-joint", "front:1"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_joint == FMHA_SP_JOINT_FRONT && o.sp_joint_tokens == 1,
             "--sp-joint front:1: rc %d, joint %d", rc, (int)o.sp_joint);
    rc = parse(&o, err, sizeof err, WORDS("--seqlen", "64"));
    TU_CHECK(rc == CLI_PARSE_OK && o.sp_joint == FMHA_SP_JOINT_NONE && !o.sp_joint_tokens,
             "--sp-joint left out: joint %d", (int)o.sp_joint);
    const char *bad_joint[][2] = {{"front:0", "--sp-joint's token count 0 is out of range"},
                                  {"rear:", "--sp-joint's token count '' is not an integer"},
                                  {"front:3x", "--sp-joint's token count '3x' is not an integer"},
                                  {"7", "--sp-joint '7' is neither front:N nor rear:N"}};
    for (int i = 0; i < 4; i++) {
        rc = parse(&o, err, sizeof err, WORDS("--sp-joint", bad_joint[i][0]));
        TU_CHECK(rc == CLI_PARSE_ERROR && strstr(err, bad_joint[i][1]),
                 "--sp-joint %s: rc %d, \"%s\"", bad_joint[i][0], rc, err);
    }
    rc = parse(&o, err, sizeof err, WORDS("--sp-ring", "2x"));
    TU_CHECK(rc == CLI_PARSE_ERROR && strstr(err, "--sp-ring '2x' is not an integer"),
             "--sp-ring 2x: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("a", "b"));
    TU_CHECK(rc == CLI_PARSE_ERROR && strstr(err, "unexpected argument 'b'"),
             "two inputs: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--bogus"));
    TU_CHECK(rc == CLI_PARSE_GETOPT && err[0] == '\0', "--bogus: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("--seqlen"));
    TU_CHECK(rc == CLI_PARSE_GETOPT, "--seqlen without a value: rc %d", rc);
    rc = parse(&o, err, sizeof err, WORDS("--help"));
    TU_CHECK(rc == CLI_PARSE_HELP, "--help: rc %d", rc);

    /* -h in the middle of a cluster of short flags: getopt_long stops inside
     * the word, and a parser that only set optind = 1 went on from there in
     * its next call (reading "x" as a flag here; a word already freed in
     * general). */
    rc = parse(&o, err, sizeof err, WORDS("-hx"));
    TU_CHECK(rc == CLI_PARSE_HELP, "-hx: rc %d", rc);
    rc = parse(&o, err, sizeof err, WORDS("--causal"));
    TU_CHECK(rc == CLI_PARSE_OK && o.causal == 1,
             "--causal after a parse stopped inside -hx: rc %d, \"%s\"", rc, err);
    rc = parse(&o, err, sizeof err, WORDS("-ho", "x.safetensors"));
    TU_CHECK(rc == CLI_PARSE_HELP, "-ho: rc %d", rc);
    rc = parse(&o, err, sizeof err, WORDS("in.safetensors"));
    TU_CHECK(rc == CLI_PARSE_OK && o.output == NULL && o.input &&
                 !strcmp(o.input, "in.safetensors"),
             "input after a parse stopped inside -ho: rc %d, \"%s\"", rc, err);
    return tu_summary();
}
