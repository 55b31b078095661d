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
 * has no num_attention_heads, as in multimodal models):
 *   num_attention_heads                 required
 *   num_key_value_heads                 absent or null: = num_attention_heads (MHA)
 *   head_dim, else attention_head_dim   (diffusers) absent or null: derived
 *   hidden_size                         optional; head_dim = hidden_size / heads
 *                                       when no head dim is given
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
    int64_t hidden_size;  /* 0 if the config has none */
    /* Where the numbers came from, e.g. "text_config: num_attention_heads=32,
     * num_key_value_heads=8, head_dim=hidden_size/num_attention_heads". */
    char source[256];
} hf_attn_shape;

/* Reads and checks the config file at `path`. Returns 0 and fills *out, or
 * nonzero with *out zeroed and a message in err (if err && errlen > 0). */
int hf_config_read(const char *path, hf_attn_shape *out, char *err, size_t errlen);

/* The same on JSON text in memory (`len` bytes, no NUL needed); `name`
 * labels error messages (e.g. the file name). */
int hf_config_parse(const char *json, size_t len, const char *name, hf_attn_shape *out,
                    char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_TOOLS_HFCONFIG_H */
