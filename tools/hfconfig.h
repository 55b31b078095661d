/* hfconfig.h — derive a model's attention shape (heads, KV heads, head dim)
 * from a Hugging Face transformers or diffusers config.json, so the fmha
 * tools can be pointed at a model instead of at four numbers. Needs cJSON.
 *
 * Usage:
 *
 *     hf_attn_shape s;
 *     char err[512];
 *     if (hf_config_read("config.json", &s, err, sizeof err) != 0) {
 *         fprintf(stderr, "%s\n", err); ...
 *     }
 *     fmha_config_init(&cfg, s.num_heads, s.num_kv_heads, s.head_dim);
 *
 * Fields read (from the top level, or from "text_config" when the top level
 * has no heads field, as in multimodal models); the first name present wins:
 *   heads      num_attention_heads | n_heads | num_heads           required
 *   kv heads   num_key_value_heads | num_kv_heads | n_kv_heads    absent or null: MHA
 *   head dim   head_dim | attention_head_dim (diffusers)           absent or null: derived
 *   hidden     hidden_size | dim                                   optional
 * Without a head dim, head_dim = hidden / heads. With both, head_dim x heads
 * must equal hidden. The aliases cover Lumina2 (num_kv_heads), Z-Image
 * (n_heads, n_kv_heads, dim) and Wan's original config (num_heads, dim).
 * A config that JSON readers would read differently is refused: one where a
 * field above (or text_config) appears twice in its object (Python's json
 * takes the last copy), or one that spells U+0000 (\u0000).
 * Nothing here prints or exits; errors return nonzero with a message in err. */
#ifndef FMHA_TOOLS_HFCONFIG_H
#define FMHA_TOOLS_HFCONFIG_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hf_attn_shape {
    int64_t num_heads;    /* query heads */
    int64_t num_kv_heads; /* divides num_heads */
    int64_t head_dim;
    int64_t hidden_size; /* 0 if the config has none */
    /* Where the numbers came from, e.g. "text_config: num_heads=32 from
     * num_attention_heads, num_kv_heads=8 from num_key_value_heads, head_dim=128
     * from hidden_size/heads". */
    char source[256];
} hf_attn_shape;

/* Reads and checks the config file at `path`. Returns 0 and fills *out, or
 * nonzero with *out zeroed and a message in err (if err && errlen > 0). */
int hf_config_read(const char *path, hf_attn_shape *out, char *err, size_t errlen);

/* The same on JSON text in memory (`len` bytes, no NUL needed); `name`
 * labels error messages (e.g. the file name). */
int hf_config_parse(const char *json, size_t len, const char *name, hf_attn_shape *out, char *err,
                    size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_TOOLS_HFCONFIG_H */
