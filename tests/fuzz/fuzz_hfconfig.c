/* fuzz_hfconfig.c — libFuzzer harness of the model-config reader
 * (tools/hfconfig.c): the input is the text of a config.json, handed to
 * hf_config_parse as it is (no NUL after it, so that a read past `len` is an
 * ASan report). A refused config must come with a message and a zeroed shape;
 * an accepted one must hold what hfconfig.h and fmha_config want: heads and
 * KV heads positive with KV heads dividing heads, every size at most
 * 2^31 - 1, hidden_size 0 or head_dim x heads, and a NUL-terminated source.
 * And it must be a config every JSON reader reads alike: no field that is
 * read appears twice in its object (text_config's fields are read only where
 * the top level has no head count) (Python's json takes the last, cJSON the
 * first), and no key spells U+0000 (\u0000, which cJSON's C strings cut
 * off, so "num_heads\u0000x" would read as num_heads). Parsing the same text
 * twice gives the same answer. Any broken promise calls __builtin_trap(),
 * which libFuzzer reports. */
#include "hfconfig.h"

#include <cjson/cJSON.h>
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

/* Every name hfconfig.h reads a field by. */
static const char *const FIELDS[] = {
    "num_attention_heads", "n_heads",    "num_heads",   "num_key_value_heads",
    "num_kv_heads",        "n_kv_heads", "head_dim",    "attention_head_dim",
    "hidden_size",         "dim",        "text_config", NULL};

/* Whether a field name appears more than once among obj's keys. */
static int repeats_a_field(const cJSON *obj)
{
    for (int f = 0; FIELDS[f] != NULL; f++) {
        int n = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, obj) n += strcmp(it->string, FIELDS[f]) == 0;
        if (n > 1)
            return 1;
    }
    return 0;
}

/* Whether obj has a non-null head count under any of its names. */
static int has_heads(const cJSON *obj)
{
    static const char *const HEADS[] = {"num_attention_heads", "n_heads", "num_heads"};
    for (int i = 0; i < 3; i++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, HEADS[i]);
        if (it != NULL && !cJSON_IsNull(it))
            return 1;
    }
    return 0;
}

/* Whether JSON text spells U+0000 (\u0000); an escaped backslash is skipped. */
static int has_escaped_nul(const char *text, size_t len)
{
    for (size_t i = 0; i + 1 < len; i++)
        if (text[i] == '\\') {
            if (text[i + 1] == 'u' && len - i >= 6 && memcmp(text + i + 2, "0000", 4) == 0)
                return 1;
            i++;
        }
    return 0;
}

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
    REQUIRE(!has_escaped_nul((const char *)data, size));
    cJSON *root = cJSON_ParseWithLength((const char *)data, size);
    REQUIRE(root != NULL);
    REQUIRE(!repeats_a_field(root));
    /* text_config is read only where the top level has no head count (a
     * null one counts as none). */
    const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    REQUIRE(!cJSON_IsObject(tc) || has_heads(root) || !repeats_a_field(tc));
    cJSON_Delete(root);
    return 0;
}
