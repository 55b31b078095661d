/* fuzz_hfconfig.c — libFuzzer harness of the model-config reader
 * (tools/hfconfig.c): the input is the text of a config.json, handed to
 * hf_config_parse as it is (no NUL after it, so that a read past `len` is an
 * ASan report). A refused config must come with a message and a zeroed shape;
 * an accepted one must hold what hfconfig.h and fmha_config want: heads and
 * KV heads positive with KV heads dividing heads, every size at most
 * 2^31 - 1, hidden_size 0 or head_dim x heads, and a NUL-terminated source.
 * Parsing the same text twice gives the same answer. Any broken promise calls
 * __builtin_trap(), which libFuzzer reports. */
#include "hfconfig.h"

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define REQUIRE(cond)                                                                 \
    do {                                                                              \
        if (!(cond)) {                                                                \
            fprintf(stderr, "fuzz_hfconfig: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            __builtin_trap();                                                         \
        }                                                                             \
    } while (0)

#define MAX_SIZE 2147483647LL

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    hf_attn_shape s, again;
    char err[512], err2[512];
    memset(err, 0, sizeof err);
    memset(err2, 0, sizeof err2);
    int rc = hf_config_parse((const char *)data, size, "fuzz.json", &s, err, sizeof err);
    int rc2 = hf_config_parse((const char *)data, size, "fuzz.json", &again, err2, sizeof err2);
    REQUIRE(rc == rc2 && memcmp(&s, &again, sizeof s) == 0 && strcmp(err, err2) == 0);
    if (rc != 0) {
        static const hf_attn_shape zero;
        REQUIRE(err[0] != '\0');
        REQUIRE(memcmp(&s, &zero, sizeof s) == 0);
        return 0;
    }
    REQUIRE(s.num_heads >= 1 && s.num_heads <= MAX_SIZE);
    REQUIRE(s.num_kv_heads >= 1 && s.num_kv_heads <= s.num_heads);
    REQUIRE(s.num_heads % s.num_kv_heads == 0);
    REQUIRE(s.head_dim >= 1 && s.head_dim <= MAX_SIZE);
    REQUIRE(s.hidden_size >= 0 && s.hidden_size <= MAX_SIZE);
    /* Both below 2^31: the product fits int64. */
    REQUIRE(s.hidden_size == 0 || s.hidden_size == s.head_dim * s.num_heads);
    REQUIRE(memchr(s.source, '\0', sizeof s.source) != NULL && s.source[0] != '\0');
    return 0;
}
