/* test_hfconfig.c — checks tools/hfconfig.c against real-world config shapes
 * (Llama GQA, diffusers, multimodal text_config) and every error it must
 * report, including the exact GQA divisibility message. Exits nonzero on failure. */
#define _POSIX_C_SOURCE 200809L

#include "hfconfig.h"
#include "testutil.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char g_dir[64];
static char g_path[128];

#define CHECK TU_CHECK

/* Writes `json` to a file and reads it back through hf_config_read. */
static int read_json(const char *json, hf_attn_shape *s, char *err, size_t errlen)
{
    FILE *fp = fopen(g_path, "wb");
    if (fp == NULL || fputs(json, fp) < 0 || fclose(fp) != 0) {
        printf("cannot write %s\n", g_path);
        exit(2);
    }
    return hf_config_read(g_path, s, err, errlen);
}

static void expect_ok(int line, const char *what, const char *json, int64_t heads, int64_t kv,
                      int64_t hd, int64_t hidden, const char *src_sub)
{
    hf_attn_shape s;
    char err[512] = "";
    int rc = read_json(json, &s, err, sizeof err);
    if (rc == 0 && s.num_heads == heads && s.num_kv_heads == kv && s.head_dim == hd &&
        s.hidden_size == hidden && strstr(s.source, src_sub) != NULL) {
        tu_passed++;
    } else {
        tu_failed++;
        printf("FAIL line %d (%s): rc %d err \"%s\" got %lld/%lld/%lld/%lld \"%s\"\n", line, what,
               rc, err, (long long)s.num_heads, (long long)s.num_kv_heads, (long long)s.head_dim,
               (long long)s.hidden_size, s.source);
    }
}

static void expect_err(int line, const char *what, const char *json, const char *sub)
{
    hf_attn_shape s;
    memset(&s, 0x5a, sizeof s);
    char err[512] = "";
    int rc = read_json(json, &s, err, sizeof err);
    if (rc != 0 && strstr(err, sub) != NULL && s.num_heads == 0 && s.head_dim == 0) {
        tu_passed++;
    } else {
        tu_failed++;
        printf("FAIL line %d (%s): rc %d err \"%s\", want one containing \"%s\"\n", line, what, rc,
               err, sub);
    }
}

#define OK(what, json, h, kv, hd, hid, src) expect_ok(__LINE__, what, json, h, kv, hd, hid, src)
#define ERR(what, json, sub)                expect_err(__LINE__, what, json, sub)

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/fmha_test_hf_XXXXXX");
    if (mkdtemp(g_dir) == NULL) {
        printf("mkdtemp: %s\n", strerror(errno));
        return 2;
    }
    snprintf(g_path, sizeof g_path, "%s/config.json", g_dir);

    /* Models. */
    OK("Llama-3-8B GQA 32/8",
       "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":4096,"
       "\"num_attention_heads\":32,\"num_key_value_heads\":8,\"head_dim\":128,"
       "\"rope_theta\":500000.0}",
       32, 8, 128, 4096, "num_kv_heads=8 from num_key_value_heads, head_dim=128 from head_dim");
    OK("Llama-2-7B: no head_dim, derived",
       "{\"hidden_size\":4096,\"num_attention_heads\":32,"
       "\"num_key_value_heads\":32}",
       32, 32, 128, 4096, "head_dim=128 from hidden_size/heads");
    OK("GPT-style MHA: no kv heads", "{\"hidden_size\":768,\"num_attention_heads\":12}", 12, 12, 64,
       768, "num_kv_heads=12 from default (MHA");
    OK("kv heads null = MHA",
       "{\"hidden_size\":2048,\"num_attention_heads\":16,\"num_key_value_heads\":null,"
       "\"head_dim\":null}",
       16, 16, 128, 2048, "MHA");
    OK("MQA 71/1", "{\"hidden_size\":4544,\"num_attention_heads\":71,\"num_key_value_heads\":1}",
       71, 1, 64, 4544, "num_kv_heads=1");
    OK("Wan 2.1 14B (diffusers)",
       "{\"_class_name\":\"WanTransformer3DModel\",\"num_attention_heads\":40,"
       "\"attention_head_dim\":128,\"in_channels\":16,\"patch_size\":[1,2,2]}",
       40, 40, 128, 0, "head_dim=128 from attention_head_dim");
    OK("Flux (diffusers)",
       "{\"_class_name\":\"FluxTransformer2DModel\",\"num_attention_heads\":24,"
       "\"attention_head_dim\":128,\"joint_attention_dim\":4096}",
       24, 24, 128, 0, "top level");
    OK("Lumina2 (diffusers): num_kv_heads",
       "{\"_class_name\":\"Lumina2Transformer2DModel\",\"hidden_size\":2304,"
       "\"num_attention_heads\":24,\"num_kv_heads\":8,\"num_layers\":26}",
       24, 8, 96, 2304, "num_kv_heads=8 from num_kv_heads, head_dim=96 from hidden_size/heads");
    OK("Z-Image (diffusers): n_heads, n_kv_heads, dim",
       "{\"_class_name\":\"ZImageTransformer2DModel\",\"dim\":3840,\"n_heads\":30,"
       "\"n_kv_heads\":30,\"n_layers\":30}",
       30, 30, 128, 3840,
       "num_heads=30 from n_heads, num_kv_heads=30 from n_kv_heads, "
       "head_dim=128 from dim/heads");
    OK("Wan original config: num_heads, dim",
       "{\"_class_name\":\"WanModel\",\"dim\":5120,\"num_heads\":40,\"ffn_dim\":13824}", 40, 40,
       128, 5120, "from num_heads");
    OK("standard name wins over alias",
       "{\"num_attention_heads\":32,\"num_heads\":7,\"num_key_value_heads\":8,"
       "\"n_kv_heads\":3,\"head_dim\":128}",
       32, 8, 128, 0, "from num_attention_heads");
    OK("head_dim wins over attention_head_dim",
       "{\"num_attention_heads\":8,\"head_dim\":64,\"attention_head_dim\":32}", 8, 8, 64, 0,
       "from head_dim");
    OK("text_config (multimodal)",
       "{\"architectures\":[\"LlavaForConditionalGeneration\"],"
       "\"vision_config\":{\"hidden_size\":1024,\"num_attention_heads\":16},"
       "\"text_config\":{\"hidden_size\":4096,\"num_attention_heads\":32,"
       "\"num_key_value_heads\":8}}",
       32, 8, 128, 4096, "text_config: num_heads=32");
    OK("top level wins over text_config",
       "{\"num_attention_heads\":16,\"hidden_size\":1024,"
       "\"text_config\":{\"hidden_size\":4096,\"num_attention_heads\":32}}",
       16, 16, 64, 1024, "top level");
    OK("integral float values", "{\"num_attention_heads\":32.0,\"hidden_size\":4096.0}", 32, 32,
       128, 4096, "");
    OK("whitespace around JSON", "\n  {\"num_attention_heads\":4,\"head_dim\":16}  \n\n", 4, 4, 16,
       0, "");

    /* The exact GQA message, word for word. */
    {
        hf_attn_shape s;
        char err[512] = "";
        int rc =
            read_json("{\"hidden_size\":3584,\"num_attention_heads\":28,\"num_key_value_heads\":6}",
                      &s, err, sizeof err);
        const char *want = "num_heads (28) must be a multiple of num_kv_heads (6): each KV head "
                           "serves an equal group of query heads; check num_attention_heads / "
                           "num_key_value_heads in the model config";
        CHECK(rc != 0 && strcmp(err, want) == 0, "28/6 message is exactly\n  \"%s\"\ngot\n  \"%s\"",
              want, err);
    }

    /* Errors. */
    ERR("kv > heads", "{\"hidden_size\":4096,\"num_attention_heads\":8,\"num_key_value_heads\":16}",
        "num_kv_heads (16) exceeds num_heads (8)");
    ERR("zero heads", "{\"hidden_size\":4096,\"num_attention_heads\":0}",
        "num_attention_heads is 0; it must be a positive integer");
    ERR("negative heads", "{\"hidden_size\":4096,\"num_attention_heads\":-4}",
        "num_attention_heads is -4");
    ERR("zero kv heads",
        "{\"hidden_size\":4096,\"num_attention_heads\":32,\"num_key_value_heads\":0}",
        "num_key_value_heads is 0");
    ERR("zero head_dim", "{\"num_attention_heads\":32,\"head_dim\":0}", "head_dim is 0");
    ERR("zero attention_head_dim", "{\"num_attention_heads\":32,\"attention_head_dim\":0}",
        "attention_head_dim is 0");
    ERR("zero hidden", "{\"num_attention_heads\":32,\"hidden_size\":0}", "hidden_size is 0");
    ERR("fractional heads", "{\"num_attention_heads\":32.5,\"hidden_size\":4096}",
        "num_attention_heads is 32.5");
    ERR("string heads", "{\"num_attention_heads\":\"32\",\"hidden_size\":4096}",
        "num_attention_heads is \"32\"");
    ERR("list head dim (UNet style)", "{\"num_attention_heads\":8,\"attention_head_dim\":[5,10]}",
        "attention_head_dim is [5,10]");
    ERR("bad value inside text_config",
        "{\"text_config\":{\"num_attention_heads\":32,\"hidden_size\":-1}}",
        "text_config.hidden_size is -1");
    ERR("mismatched hidden size",
        "{\"hidden_size\":4096,\"num_attention_heads\":32,\"head_dim\":96}",
        "head_dim (96) x num_attention_heads (32) does not equal hidden_size (4096)");
    ERR("mismatched hidden size (diffusers field)",
        "{\"hidden_size\":5000,\"num_attention_heads\":40,\"attention_head_dim\":128}",
        "attention_head_dim (128) x num_attention_heads (40) does not equal hidden_size (5000)");
    ERR("huge head_dim cannot overflow",
        "{\"hidden_size\":4096,\"num_attention_heads\":9007199254740992,"
        "\"head_dim\":9007199254740992}",
        "num_attention_heads is 9007199254740992, too large: at most 2147483647 (2^31 - 1)");
    /* Sizes no model has were accepted (fmha check printed 2^53 heads). */
    ERR("2^53 heads", "{\"num_attention_heads\":9007199254740992,\"head_dim\":128}",
        "num_attention_heads is 9007199254740992, too large: at most 2147483647");
    ERR("2^31 heads", "{\"num_attention_heads\":2147483648,\"head_dim\":128}",
        "num_attention_heads is 2147483648, too large");
    ERR("2^60 head_dim", "{\"num_attention_heads\":8,\"head_dim\":1152921504606846976}",
        "head_dim is 1152921504606846976, too large");
    ERR("1e300 kv heads",
        "{\"num_attention_heads\":8,\"num_key_value_heads\":1e300,\"head_dim\":64}",
        "num_key_value_heads is 1e+300, too large");
    ERR("-1e300 heads", "{\"num_attention_heads\":-1e300,\"head_dim\":64}",
        "num_attention_heads is -1e+300; it must be a positive integer");
    ERR("2^53 + 0.5 is no integer", "{\"num_attention_heads\":2.5e15,\"head_dim\":64}",
        "num_attention_heads is 2500000000000000, too large");
    ERR("mismatched dim (alias names in message)", "{\"dim\":3840,\"n_heads\":30,\"head_dim\":64}",
        "head_dim (64) x n_heads (30) does not equal dim (3840)");
    /* Configs JSON readers read differently (found by fuzz_hfconfig): a field
     * twice (cJSON's lookup took the first; Python's json, and so
     * transformers, takes the last) and a key spelling U+0000, which cJSON's
     * C strings cut off ("n_heads\u0000x" read as n_heads). */
    ERR("field twice",
        "{\"num_attention_heads\":32,\"hidden_size\":4096,\"num_attention_heads\":8}",
        "num_attention_heads appears 2 times");
    ERR("alias twice, in text_config",
        "{\"text_config\":{\"n_heads\":30,\"dim\":3840,\"dim\":3840}}",
        "text_config.dim appears 2 times");
    ERR("text_config twice",
        "{\"text_config\":{\"n_heads\":2,\"dim\":64},\"text_config\":{\"n_heads\":4,\"dim\":64}}",
        "text_config appears 2 times");
    ERR("\\u0000 in a key", "{\"n_heads\\u0000x\":30,\"dim\":3840}", "U+0000 (\\u0000) at byte 9");
    OK("a field not read may repeat",
       "{\"num_attention_heads\":4,\"head_dim\":16,\"note\":\"a\",\"note\":\"b\"}", 4, 4, 16, 0,
       "");
    OK("\\\\u0000 is text", "{\"num_attention_heads\":4,\"head_dim\":16,\"note\":\"\\\\u0000\"}", 4,
       4, 16, 0, "");
    ERR("GQA error with alias names", "{\"dim\":2304,\"n_heads\":24,\"n_kv_heads\":7}",
        "num_heads (24) must be a multiple of num_kv_heads (7)");
    ERR("kv > heads names the config fields",
        "{\"hidden_size\":2304,\"num_attention_heads\":4,\"num_kv_heads\":8}",
        "check num_attention_heads / num_kv_heads");
    ERR("hidden not divisible", "{\"hidden_size\":4100,\"num_attention_heads\":32}",
        "hidden_size (4100) is not divisible by num_attention_heads (32)");
    ERR("no head dim at all", "{\"num_attention_heads\":32}",
        "needs head_dim, attention_head_dim or hidden_size");
    ERR("missing heads", "{\"hidden_size\":4096}", "no num_attention_heads");
    ERR("null heads, no text_config", "{\"num_attention_heads\":null,\"hidden_size\":4096}",
        "no num_attention_heads");
    ERR("text_config without heads", "{\"text_config\":{\"hidden_size\":4096}}",
        "no num_attention_heads");
    ERR("not JSON", "{\"num_attention_heads\": 32,", "not valid JSON");
    ERR("trailing garbage", "{\"num_attention_heads\":4,\"head_dim\":16} x", "not valid JSON");
    ERR("empty file", "", "not valid JSON");
    ERR("JSON array", "[1,2,3]", "not an object");

    /* Not a readable file. */
    {
        hf_attn_shape s;
        char err[512] = "";
        char missing[160];
        snprintf(missing, sizeof missing, "%s/nope.json", g_dir);
        CHECK(hf_config_read(missing, &s, err, sizeof err) != 0 && strstr(err, "cannot open"),
              "missing file: %s", err);
        CHECK(hf_config_read(g_dir, &s, err, sizeof err) != 0 && strstr(err, g_dir),
              "directory: %s", err);
        CHECK(hf_config_read(missing, &s, NULL, 0) != 0, "NULL err buffer");
    }

    /* In-memory parse, not NUL-terminated. */
    {
        const char buf[] = "{\"num_attention_heads\":2,\"head_dim\":8}GARBAGE";
        hf_attn_shape s;
        char err[256] = "";
        int rc = hf_config_parse(buf, sizeof buf - 1 - 7, "mem", &s, err, sizeof err);
        CHECK(rc == 0 && s.num_heads == 2 && s.head_dim == 8, "hf_config_parse: %s", err);
        /* An exact-size heap copy: ASan catches any read past `len`. */
        size_t n = sizeof buf - 1 - 7;
        char *heap = malloc(n);
        memcpy(heap, buf, n);
        rc = hf_config_parse(heap, n, "heap", &s, err, sizeof err);
        CHECK(rc == 0 && s.num_heads == 2, "hf_config_parse, no NUL: %s", err);
        rc = hf_config_parse(heap, n - 1, "heap", &s, err, sizeof err); /* drops the '}' */
        CHECK(rc != 0 && strstr(err, "heap: not valid JSON"), "cut JSON, no NUL: %s", err);
        free(heap);
    }

    unlink(g_path);
    rmdir(g_dir);
    return tu_summary();
}
