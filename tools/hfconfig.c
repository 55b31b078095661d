/* hfconfig.c — attention shape from a Hugging Face / diffusers config.json.
 * Every number is checked here, with messages that name the config field,
 * because a wrong shape otherwise surfaces later as a confusing tensor error. */
#define _POSIX_C_SOURCE 200809L

#include "hfconfig.h"

#include <errno.h>
#include <stdarg.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#if defined(__GNUC__)
#define HF_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define HF_PRINTF(f, a)
#endif

/* A config.json is a few kilobytes; anything this big is the wrong file. */
#define HF_MAX_CONFIG_BYTES (64L * 1024 * 1024)

HF_PRINTF(3, 4)
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

/* Outcome of reading one optional integer field. */
enum { FIELD_ABSENT = 0, FIELD_OK, FIELD_BAD };

/* The names each quantity goes by, most common first. Besides the
 * transformers / diffusers standard names: Lumina2 (diffusers) says
 * num_kv_heads; Z-Image says n_heads, n_kv_heads and dim; Wan's original
 * config says num_heads and dim. Reading only the standard names would take
 * Lumina2's 24/8 GQA for 24/24 MHA without a word. */
static const char *const HEADS_KEYS[] = {"num_attention_heads", "n_heads", "num_heads", NULL};
static const char *const KV_KEYS[] = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", NULL};
static const char *const HEAD_DIM_KEYS[] = {"head_dim", "attention_head_dim", NULL};
static const char *const HIDDEN_KEYS[] = {"hidden_size", "dim", NULL};

/* The first of `keys` present in `obj` and not null, or NULL. */
static const cJSON *find_field(const cJSON *obj, const char *const *keys, const char **key)
{
    for (; *keys != NULL; keys++) {
        const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, *keys);
        if (it != NULL && !cJSON_IsNull(it)) {
            *key = *keys;
            return it;
        }
    }
    return NULL;
}

/* Head counts and head sizes beyond int32: no model has them, and past 2^53
 * the JSON number is not even exact. */
#define HF_MAX_SIZE 2147483647LL

/* Reads the first present of `keys` as a positive integer into *out and its
 * name into *key. Absent and null are ABSENT; anything else that is not a
 * positive integer is BAD with a message. */
static int get_positive(const cJSON *obj, const char *const *keys, const char *name,
                        const char *where, int64_t *out, const char **key, char *err, size_t errlen)
{
    const cJSON *it = find_field(obj, keys, key);
    if (it == NULL)
        return FIELD_ABSENT;
    /* Doubles hold integers exactly only up to 2^53; beyond, integral values
     * are reported as too large below. */
    double d = cJSON_IsNumber(it) ? it->valuedouble : 0.0;
    if (!cJSON_IsNumber(it) || d != d || (fabs(d) < 0x1p62 && (double)(int64_t)d != d)) {
        char *txt = cJSON_PrintUnformatted(it);
        set_err(err, errlen, "%s: %s%s is %s; it must be a positive integer", name, where, *key,
                txt ? txt : "not a number");
        cJSON_free(txt);
        return FIELD_BAD;
    }
    if (d <= 0) {
        char *txt = cJSON_PrintUnformatted(it);
        set_err(err, errlen, "%s: %s%s is %s; it must be a positive integer", name, where, *key,
                txt ? txt : "?");
        cJSON_free(txt);
        return FIELD_BAD;
    }
    if (d > HF_MAX_SIZE) { /* written in full up to 1e20 (cJSON would round it to 15 digits) */
        set_err(err, errlen,
                d < 1e20 ? "%s: %s%s is %.0f, too large: at most %lld (2^31 - 1), far beyond any "
                           "model's; check the config"
                         : "%s: %s%s is %g, too large: at most %lld (2^31 - 1), far beyond any "
                           "model's; check the config",
                name, where, *key, d, (long long)HF_MAX_SIZE);
        return FIELD_BAD;
    }
    *out = (int64_t)d;
    return FIELD_OK;
}

/* Every key a field is read by, and text_config. */
static const char *const *const FIELD_KEYS[] = {HEADS_KEYS, KV_KEYS, HEAD_DIM_KEYS, HIDDEN_KEYS,
                                                NULL};

/* A key of `keys` that `obj` holds more than once: cJSON keeps every copy
 * and its lookup finds the first, while Python's json (and so transformers)
 * keeps the last, so the two would read different numbers. NULL if none;
 * *times says how often. */
static const char *repeated_key(const cJSON *obj, const char *const *keys, int *times)
{
    for (; *keys != NULL; keys++) {
        int n = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, obj) n += strcmp(it->string, *keys) == 0;
        if (n > 1) {
            *times = n;
            return *keys;
        }
    }
    return NULL;
}

/* Refuses an object in which a field it is read for appears twice. */
static int check_repeats(const cJSON *obj, const char *name, const char *where, char *err,
                         size_t errlen)
{
    static const char *const TEXT_CONFIG[] = {"text_config", NULL};
    int times = 0;
    const char *key = NULL;
    for (int f = 0; FIELD_KEYS[f] != NULL && key == NULL; f++)
        key = repeated_key(obj, FIELD_KEYS[f], &times);
    if (key == NULL && !*where)
        key = repeated_key(obj, TEXT_CONFIG, &times);
    if (key == NULL)
        return 0;
    set_err(err, errlen,
            "%s: %s%s appears %d times; JSON readers disagree on which value counts (Python's "
            "json, and so transformers, takes the last): keep one",
            name, where, key, times);
    return -1;
}

static int derive(const cJSON *root, const char *name, hf_attn_shape *out, char *err, size_t errlen)
{
    if (!cJSON_IsObject(root)) {
        set_err(err, errlen, "%s: config is JSON but not an object", name);
        return -1;
    }
    if (check_repeats(root, name, "", err, errlen) != 0)
        return -1;
    /* Multimodal configs keep the language model under "text_config"; take
     * every field from one place so a vision tower's numbers never mix in. */
    const cJSON *sec = root;
    const char *where = "";
    const char *unused;
    if (find_field(root, HEADS_KEYS, &unused) == NULL) {
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (cJSON_IsObject(tc)) {
            sec = tc;
            where = "text_config.";
            if (check_repeats(sec, name, where, err, errlen) != 0)
                return -1;
        }
    }

    int64_t heads = 0, kv = 0, hd = 0, hidden = 0;
    const char *heads_key = NULL, *kv_key = NULL, *hd_key = NULL, *hidden_key = NULL;
    int r = get_positive(sec, HEADS_KEYS, name, where, &heads, &heads_key, err, errlen);
    if (r == FIELD_BAD)
        return -1;
    if (r == FIELD_ABSENT) {
        set_err(err, errlen,
                "%s: no num_attention_heads (nor n_heads / num_heads; looked at the top level "
                "and in text_config); is this a model's config.json?",
                name);
        return -1;
    }

    r = get_positive(sec, KV_KEYS, name, where, &kv, &kv_key, err, errlen);
    if (r == FIELD_BAD)
        return -1;
    if (r == FIELD_ABSENT) {
        kv = heads;
        kv_key = "default (MHA: no KV-heads field)";
    }
    if (kv > heads) {
        set_err(err, errlen,
                "%s: num_kv_heads (%lld) exceeds num_heads (%lld); check %s / %s in the model "
                "config",
                name, (long long)kv, (long long)heads, heads_key, kv_key);
        return -1;
    }
    if (heads % kv != 0) {
        /* Users and scripts match this exact wording; it is the same
         * sentence fmha_layer_init reports. */
        set_err(err, errlen,
                "num_heads (%lld) must be a multiple of num_kv_heads (%lld): each KV head "
                "serves an equal group of query heads; check num_attention_heads / "
                "num_key_value_heads in the model config",
                (long long)heads, (long long)kv);
        return -1;
    }

    r = get_positive(sec, HEAD_DIM_KEYS, name, where, &hd, &hd_key, err, errlen);
    if (r == FIELD_BAD)
        return -1;
    int have_hd = r == FIELD_OK;

    r = get_positive(sec, HIDDEN_KEYS, name, where, &hidden, &hidden_key, err, errlen);
    if (r == FIELD_BAD)
        return -1;
    int have_hidden = r == FIELD_OK;

    if (have_hd && have_hidden) {
        /* Compared by division: hd * heads can overflow int64. */
        if (hidden % heads != 0 || hd != hidden / heads) {
            set_err(err, errlen,
                    "%s: %s%s (%lld) x %s (%lld) does not equal %s (%lld); if the model sets "
                    "head_dim on purpose (Qwen3 does), attention still runs with that head_dim",
                    name, where, hd_key, (long long)hd, heads_key, (long long)heads, hidden_key,
                    (long long)hidden);
            return -1;
        }
    } else if (!have_hd) {
        if (!have_hidden) {
            set_err(err, errlen,
                    "%s: no head dimension: %sneeds head_dim, attention_head_dim or hidden_size",
                    name, where);
            return -1;
        }
        if (hidden % heads != 0) {
            set_err(err, errlen,
                    "%s: %s (%lld) is not divisible by %s (%lld), so head_dim cannot be "
                    "derived; add head_dim to the config",
                    name, hidden_key, (long long)hidden, heads_key, (long long)heads);
            return -1;
        }
        hd = hidden / heads;
        hd_key = strcmp(hidden_key, "dim") == 0 ? "dim/heads" : "hidden_size/heads";
    }

    out->num_heads = heads;
    out->num_kv_heads = kv;
    out->head_dim = hd;
    out->hidden_size = have_hidden ? hidden : 0;
    snprintf(out->source, sizeof out->source,
             "%s: num_heads=%lld from %s, num_kv_heads=%lld from %s, head_dim=%lld from %s",
             *where ? "text_config" : "top level", (long long)heads, heads_key, (long long)kv,
             kv_key, (long long)hd, hd_key);
    return 0;
}

int hf_config_parse(const char *json, size_t len, const char *name, hf_attn_shape *out, char *err,
                    size_t errlen)
{
    if (name == NULL)
        name = "config";
    if (out == NULL || (json == NULL && len > 0)) {
        set_err(err, errlen, "hf_config_parse: NULL argument");
        return -1;
    }
    memset(out, 0, sizeof *out);
    /* JSON may spell U+0000 as \u0000, which cJSON decodes into its C
     * strings, where it ends them: the key "n_heads\u0000x", which Python
     * reads as another key, would be read as n_heads. No config needs one.
     * An escaped backslash is skipped whole, so \\u0000 (text) is fine. */
    for (size_t i = 0; i + 1 < len; i++) {
        if (json[i] != '\\')
            continue;
        if (json[i + 1] == 'u' && len - i >= 6 && memcmp(json + i + 2, "0000", 4) == 0) {
            set_err(err, errlen,
                    "%s: spells U+0000 (\\u0000) at byte %zu, which would cut a key short here; "
                    "no config needs it",
                    name, i);
            return -1;
        }
        i++;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json ? json : "", len, &end, 0);
    if (root == NULL) {
        set_err(err, errlen, "%s: not valid JSON (error near byte %lld)", name,
                end && json ? (long long)(end - json) : 0LL);
        return -1;
    }
    /* ParseWithLengthOpts stops after the first value; trailing text other
     * than whitespace means the file is not one JSON document. */
    size_t pos = (size_t)(end - json);
    while (pos < len &&
           (json[pos] == ' ' || json[pos] == '\t' || json[pos] == '\n' || json[pos] == '\r'))
        pos++;
    int rc;
    if (pos < len) {
        set_err(err, errlen, "%s: not valid JSON (unexpected text at byte %zu)", name, pos);
        rc = -1;
    } else {
        rc = derive(root, name, out, err, errlen);
    }
    cJSON_Delete(root);
    if (rc != 0)
        memset(out, 0, sizeof *out);
    return rc;
}

int hf_config_read(const char *path, hf_attn_shape *out, char *err, size_t errlen)
{
    if (path == NULL || out == NULL) {
        set_err(err, errlen, "hf_config_read: NULL argument");
        return -1;
    }
    memset(out, 0, sizeof *out);
    FILE *fp = fopen(path, "rb");
    if (fp == NULL) {
        set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return -1;
    }
    /* Read in chunks rather than trusting a file size, so pipes work too. */
    size_t cap = 0, len = 0;
    char *buf = NULL;
    int rc = -1;
    for (;;) {
        if (len == cap) {
            if (cap >= (size_t)HF_MAX_CONFIG_BYTES) {
                set_err(err, errlen, "%s: larger than %ld bytes; not a config.json", path,
                        HF_MAX_CONFIG_BYTES);
                goto done;
            }
            size_t ncap = cap ? cap * 2 : 16384;
            char *nb = realloc(buf, ncap);
            if (nb == NULL) {
                set_err(err, errlen, "%s: out of memory", path);
                goto done;
            }
            buf = nb;
            cap = ncap;
        }
        size_t got = fread(buf + len, 1, cap - len, fp);
        len += got;
        if (got == 0) {
            if (ferror(fp)) {
                set_err(err, errlen, "%s: cannot read: %s", path, strerror(errno));
                goto done;
            }
            break;
        }
    }
    buf[len] = '\0'; /* len < cap here: the last fread had room and read 0 */
    rc = hf_config_parse(buf, len, path, out, err, errlen);
done:
    free(buf);
    fclose(fp);
    return rc;
}
