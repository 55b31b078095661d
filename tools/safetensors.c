/* safetensors.c — validating reader and atomic writer of safetensors files.
 * The checks follow the reference implementation: bounded header, known
 * dtypes, exact sizes, and tensors that tile the data section with no gaps. */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#if defined(__GNUC__)
#define ST_PRINTF(f, a) __attribute__((format(printf, f, a)))
#else
#define ST_PRINTF(f, a)
#endif

/* JSON numbers arrive as doubles; beyond 2^53 they are no longer exact. */
#define ST_MAX_EXACT_INT 9007199254740992.0

static const char *const META_KEY = "__metadata__";

ST_PRINTF(3, 4)
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    if (err == NULL || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

const char *st_status_string(st_status status)
{
    switch (status) {
    case ST_OK: return "ST_OK";
    case ST_ERR_ARG: return "ST_ERR_ARG";
    case ST_ERR_IO: return "ST_ERR_IO";
    case ST_ERR_FORMAT: return "ST_ERR_FORMAT";
    case ST_ERR_NOMEM: return "ST_ERR_NOMEM";
    }
    return "ST_ERR_UNKNOWN";
}

/* ------------------------------------------------------------------ dtypes */

static const struct {
    const char *name;
    size_t size;
} DTYPES[ST_DTYPE_COUNT] = {
    [ST_DTYPE_BOOL] = {"BOOL", 1},       [ST_DTYPE_U8] = {"U8", 1},
    [ST_DTYPE_I8] = {"I8", 1},           [ST_DTYPE_F8_E5M2] = {"F8_E5M2", 1},
    [ST_DTYPE_F8_E4M3] = {"F8_E4M3", 1}, [ST_DTYPE_F8_E8M0] = {"F8_E8M0", 1},
    [ST_DTYPE_I16] = {"I16", 2},         [ST_DTYPE_U16] = {"U16", 2},
    [ST_DTYPE_F16] = {"F16", 2},         [ST_DTYPE_BF16] = {"BF16", 2},
    [ST_DTYPE_I32] = {"I32", 4},         [ST_DTYPE_U32] = {"U32", 4},
    [ST_DTYPE_F32] = {"F32", 4},         [ST_DTYPE_F64] = {"F64", 8},
    [ST_DTYPE_I64] = {"I64", 8},         [ST_DTYPE_U64] = {"U64", 8},
    [ST_DTYPE_C64] = {"C64", 8},
};

static int dtype_valid(st_dtype d)
{
    return (int)d >= 0 && d < ST_DTYPE_COUNT;
}

const char *st_dtype_name(st_dtype dtype)
{
    return dtype_valid(dtype) ? DTYPES[dtype].name : NULL;
}

size_t st_dtype_size(st_dtype dtype)
{
    return dtype_valid(dtype) ? DTYPES[dtype].size : 0;
}

int st_dtype_from_name(const char *name, st_dtype *out)
{
    if (name == NULL)
        return -1;
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        if (strcmp(name, DTYPES[i].name) == 0) {
            *out = (st_dtype)i;
            return 0;
        }
    }
    return -1;
}

int st_dtype_to_fmha(st_dtype dtype, fmha_dtype *out)
{
    switch (dtype) {
    case ST_DTYPE_F32: *out = FMHA_DTYPE_F32; return 0;
    case ST_DTYPE_F16: *out = FMHA_DTYPE_F16; return 0;
    case ST_DTYPE_BF16: *out = FMHA_DTYPE_BF16; return 0;
    case ST_DTYPE_F8_E4M3: *out = FMHA_DTYPE_F8_E4M3; return 0;
    default: return -1;
    }
}

int st_dtype_from_fmha(fmha_dtype dtype, st_dtype *out)
{
    switch (dtype) {
    case FMHA_DTYPE_F32: *out = ST_DTYPE_F32; return 0;
    case FMHA_DTYPE_F16: *out = ST_DTYPE_F16; return 0;
    case FMHA_DTYPE_BF16: *out = ST_DTYPE_BF16; return 0;
    case FMHA_DTYPE_F8_E4M3: *out = ST_DTYPE_F8_E4M3; return 0;
    }
    return -1;
}

/* ------------------------------------------------------------ size helpers */

/* Elements of a shape, or -1 if an entry is negative or the product does
 * not fit int64. */
static int64_t shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return -1;
        if (shape[i] != 0 && n > INT64_MAX / shape[i])
            return -1;
        n *= shape[i];
    }
    return n;
}

/* Bytes of numel elements of `size` bytes, or -1 on overflow. */
static int64_t numel_bytes(int64_t numel, size_t size)
{
    if (numel < 0 || size == 0)
        return -1;
    if (numel > INT64_MAX / (int64_t)size)
        return -1;
    return numel * (int64_t)size;
}

/* Formats "[2, 3, 4]" into buf for error messages. */
static const char *shape_str(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t pos = 0;
    pos += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && pos < len; i++)
        pos += (size_t)snprintf(buf + pos, len - pos, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (pos < len)
        snprintf(buf + pos, len - pos, "]");
    return buf;
}

st_tensor st_tensor_make(const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                         void *data)
{
    st_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.dtype = dtype;
    t.ndim = ndim;
    t.data = data;
    if (ndim < 0 || ndim > ST_MAX_DIMS || (ndim > 0 && shape == NULL))
        return t;
    for (int i = 0; i < ndim; i++)
        t.shape[i] = shape[i];
    int64_t bytes = numel_bytes(shape_numel(ndim, t.shape), st_dtype_size(dtype));
    if (bytes >= 0 && (uint64_t)bytes <= SIZE_MAX)
        t.nbytes = (size_t)bytes;
    return t;
}

/* ------------------------------------------------------------------ UTF-8 */

/* Strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF.
 * Returns the byte offset of the first bad byte, or len if all is valid. */
static size_t utf8_check(const unsigned char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t n;
        unsigned lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
        if (c >= 0xC2 && c <= 0xDF) {
            n = 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 3;
            if (c == 0xE0)
                lo = 0xA0; /* overlong */
            if (c == 0xED)
                hi = 0x9F; /* surrogates */
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 4;
            if (c == 0xF0)
                lo = 0x90; /* overlong */
            if (c == 0xF4)
                hi = 0x8F; /* > U+10FFFF */
        } else {
            return i;
        }
        if (len - i < n)
            return i;
        if (s[i + 1] < lo || s[i + 1] > hi)
            return i;
        for (size_t k = 2; k < n; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF)
                return i;
        i += n;
    }
    return len;
}

/* ------------------------------------------------------------------ reader */

/* A tensor entry as parsed, before the data section is read. */
typedef struct entry {
    const char *name; /* points into the cJSON tree */
    st_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t begin, end;
} entry;

static int cmp_str_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int cmp_entry_offsets(const void *a, const void *b)
{
    const entry *x = *(const entry *const *)a, *y = *(const entry *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* An exact integer JSON number. Returns 0 and sets *out, or -1. */
static int json_int(const cJSON *item, int64_t *out)
{
    if (!cJSON_IsNumber(item))
        return -1;
    double d = item->valuedouble;
    if (!(d >= -ST_MAX_EXACT_INT && d <= ST_MAX_EXACT_INT))
        return -1; /* also NaN */
    int64_t v = (int64_t)d;
    if ((double)v != d)
        return -1;
    *out = v;
    return 0;
}

/* Validates one tensor entry (everything that needs no other tensor). */
static st_status parse_entry(const char *path, const cJSON *item, int64_t data_size, entry *e,
                             char *err, size_t errlen)
{
    const char *name = item->string;
    e->name = name;
    if (!cJSON_IsObject(item)) {
        set_err(err, errlen, "%s: tensor \"%s\": entry is not a JSON object", path, name);
        return ST_ERR_FORMAT;
    }

    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    if (dt == NULL) {
        set_err(err, errlen, "%s: tensor \"%s\": no \"dtype\"", path, name);
        return ST_ERR_FORMAT;
    }
    if (!cJSON_IsString(dt) || st_dtype_from_name(dt->valuestring, &e->dtype) != 0) {
        set_err(err, errlen, "%s: tensor \"%s\": unknown or unsupported dtype %s%s%s", path, name,
                cJSON_IsString(dt) ? "\"" : "",
                cJSON_IsString(dt) ? dt->valuestring : "(not a string)",
                cJSON_IsString(dt) ? "\"" : "");
        return ST_ERR_FORMAT;
    }

    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(item, "shape");
    if (!cJSON_IsArray(sh)) {
        set_err(err, errlen, "%s: tensor \"%s\": \"shape\" %s", path, name,
                sh ? "is not an array" : "is missing");
        return ST_ERR_FORMAT;
    }
    int nd = cJSON_GetArraySize(sh);
    if (nd > ST_MAX_DIMS) {
        set_err(err, errlen, "%s: tensor \"%s\": shape has %d dimensions; at most %d supported",
                path, name, nd, ST_MAX_DIMS);
        return ST_ERR_FORMAT;
    }
    e->ndim = nd;
    int i = 0;
    const cJSON *dim;
    cJSON_ArrayForEach(dim, sh)
    {
        if (json_int(dim, &e->shape[i]) != 0 || e->shape[i] < 0) {
            char *txt = cJSON_PrintUnformatted(dim);
            const double d = cJSON_IsNumber(dim) ? dim->valuedouble : 0.0;
            /* Doubles past 2^53 are all integers; written in full below 1e20
             * (cJSON rounds to 15 digits). d - d == 0 leaves out inf. */
            if (d > ST_MAX_EXACT_INT && d - d == 0)
                set_err(err, errlen,
                        d < 1e20 ? "%s: tensor \"%s\": shape[%d] = %.0f is too large: a dim must "
                                   "be at most 2^53 = 9007199254740992 (JSON numbers are exact "
                                   "only that far)"
                                 : "%s: tensor \"%s\": shape[%d] = %g is too large: a dim must "
                                   "be at most 2^53 = 9007199254740992 (JSON numbers are exact "
                                   "only that far)",
                        path, name, i, d);
            else
                set_err(err, errlen,
                        "%s: tensor \"%s\": shape[%d] = %s is not a non-negative integer", path,
                        name, i, txt ? txt : "?");
            cJSON_free(txt);
            return ST_ERR_FORMAT;
        }
        i++;
    }

    char sbuf[256];
    int64_t bytes = numel_bytes(shape_numel(e->ndim, e->shape), DTYPES[e->dtype].size);
    if (bytes < 0) {
        set_err(err, errlen, "%s: tensor \"%s\": shape %s of %s overflows a 64-bit byte count",
                path, name, shape_str(sbuf, sizeof sbuf, e->ndim, e->shape), DTYPES[e->dtype].name);
        return ST_ERR_FORMAT;
    }

    const cJSON *off = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        json_int(cJSON_GetArrayItem(off, 0), &e->begin) != 0 ||
        json_int(cJSON_GetArrayItem(off, 1), &e->end) != 0 || e->begin < 0 || e->end < 0) {
        char *txt = off ? cJSON_PrintUnformatted(off) : NULL;
        set_err(err, errlen,
                "%s: tensor \"%s\": \"data_offsets\" must be [begin, end] of two non-negative "
                "integers, got %s",
                path, name, off ? (txt ? txt : "?") : "nothing");
        cJSON_free(txt);
        return ST_ERR_FORMAT;
    }
    if (e->end < e->begin) {
        set_err(err, errlen, "%s: tensor \"%s\": data_offsets [%lld, %lld] end before they begin",
                path, name, (long long)e->begin, (long long)e->end);
        return ST_ERR_FORMAT;
    }
    if (e->end - e->begin != bytes) {
        set_err(err, errlen,
                "%s: tensor \"%s\": data_offsets [%lld, %lld] hold %lld bytes but shape %s of %s "
                "needs %lld",
                path, name, (long long)e->begin, (long long)e->end, (long long)(e->end - e->begin),
                shape_str(sbuf, sizeof sbuf, e->ndim, e->shape), DTYPES[e->dtype].name,
                (long long)bytes);
        return ST_ERR_FORMAT;
    }
    if (e->end > data_size) {
        set_err(err, errlen,
                "%s: tensor \"%s\": data_offsets [%lld, %lld] run past the data section "
                "(%lld bytes)",
                path, name, (long long)e->begin, (long long)e->end, (long long)data_size);
        return ST_ERR_FORMAT;
    }
    return ST_OK;
}

/* cJSON keeps repeated keys of an object; the format forbids them. Sets
 * *dup to the first repeated key in sorted order, or NULL. */
static st_status first_repeated_key(const cJSON *obj, const char **dup)
{
    *dup = NULL;
    const int n = cJSON_GetArraySize(obj);
    if (n < 2)
        return ST_OK;
    const char **keys = malloc((size_t)n * sizeof *keys);
    if (keys == NULL)
        return ST_ERR_NOMEM;
    int k = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, obj) keys[k++] = it->string;
    qsort(keys, (size_t)n, sizeof *keys, cmp_str_ptr);
    for (k = 1; k < n && *dup == NULL; k++)
        if (strcmp(keys[k - 1], keys[k]) == 0)
            *dup = keys[k];
    free(keys);
    return ST_OK;
}

/* The whole header: structure, names, metadata and tiling of the data
 * section. Fills ents (count entries) and returns the metadata object (or
 * NULL) through *meta. */
static st_status check_header(const char *path, const cJSON *root, int64_t data_size,
                              entry **ents_out, int *count_out, const cJSON **meta, char *err,
                              size_t errlen)
{
    *ents_out = NULL;
    *count_out = 0;
    *meta = NULL;

    if (!cJSON_IsObject(root)) {
        set_err(err, errlen, "%s: header is JSON but not an object", path);
        return ST_ERR_FORMAT;
    }
    int nkeys = cJSON_GetArraySize(root);

    const char *dup;
    st_status st = first_repeated_key(root, &dup);
    if (st != ST_OK || dup != NULL) {
        if (st != ST_OK)
            set_err(err, errlen, "%s: out of memory", path);
        else
            set_err(err, errlen, "%s: name \"%s\" appears more than once in the header", path, dup);
        return st != ST_OK ? st : ST_ERR_FORMAT;
    }

    const cJSON *md = cJSON_GetObjectItemCaseSensitive(root, META_KEY);
    if (md != NULL && !cJSON_IsNull(md)) {
        if (!cJSON_IsObject(md)) {
            set_err(err, errlen, "%s: \"__metadata__\" is not an object of strings", path);
            return ST_ERR_FORMAT;
        }
        const cJSON *kv;
        cJSON_ArrayForEach(kv, md)
        {
            if (!cJSON_IsString(kv)) {
                set_err(err, errlen, "%s: \"__metadata__\" value of \"%s\" is not a string", path,
                        kv->string);
                return ST_ERR_FORMAT;
            }
        }
        /* A repeated key would have two values, of which st_meta_get sees
         * the first (the reference reader keeps the last), and st_write
         * would refuse to write what was read. */
        if ((st = first_repeated_key(md, &dup)) != ST_OK) {
            set_err(err, errlen, "%s: out of memory", path);
            return st;
        }
        if (dup != NULL) {
            set_err(err, errlen, "%s: metadata key \"%s\" appears more than once in the header",
                    path, dup);
            return ST_ERR_FORMAT;
        }
        *meta = md;
    }

    int count = nkeys - (md != NULL ? 1 : 0);
    entry *ents = calloc(count > 0 ? (size_t)count : 1, sizeof *ents);
    entry **order = calloc(count > 0 ? (size_t)count : 1, sizeof *order);
    if (ents == NULL || order == NULL) {
        free(ents);
        free(order);
        set_err(err, errlen, "%s: out of memory", path);
        return ST_ERR_NOMEM;
    }
    st = ST_OK;
    int n = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, root)
    {
        if (item == md)
            continue;
        st = parse_entry(path, item, data_size, &ents[n], err, errlen);
        if (st != ST_OK)
            goto fail;
        order[n] = &ents[n];
        n++;
    }

    /* Sorted by offsets, each tensor must start where the previous ended and
     * the last must end at the end of the data section. */
    qsort(order, (size_t)count, sizeof *order, cmp_entry_offsets);
    int64_t cursor = 0;
    const entry *prev = NULL;
    for (int i = 0; i < count; i++) {
        const entry *e = order[i];
        if (e->begin < cursor) {
            set_err(err, errlen,
                    "%s: tensor \"%s\" [%lld, %lld] overlaps tensor \"%s\" [%lld, %lld]", path,
                    e->name, (long long)e->begin, (long long)e->end, prev->name,
                    (long long)prev->begin, (long long)prev->end);
            st = ST_ERR_FORMAT;
            goto fail;
        }
        if (e->begin > cursor) {
            set_err(err, errlen,
                    "%s: data bytes [%lld, %lld) belong to no tensor (gap before tensor \"%s\")",
                    path, (long long)cursor, (long long)e->begin, e->name);
            st = ST_ERR_FORMAT;
            goto fail;
        }
        cursor = e->end;
        prev = e;
    }
    if (cursor != data_size) {
        set_err(err, errlen,
                "%s: data bytes [%lld, %lld) at the end of the file belong to no tensor", path,
                (long long)cursor, (long long)data_size);
        st = ST_ERR_FORMAT;
        goto fail;
    }
    free(order);
    *ents_out = ents;
    *count_out = count;
    return ST_OK;

fail:
    free(ents);
    free(order);
    return st;
}

/* Copies the validated header into *out; the data buffer is attached later. */
static st_status build_file(const entry *ents, int count, const cJSON *md, st_file *out)
{
    int nmeta = md ? cJSON_GetArraySize(md) : 0;
    size_t strbytes = 0;
    for (int i = 0; i < count; i++)
        strbytes += strlen(ents[i].name) + 1;
    const cJSON *kv;
    if (md)
        cJSON_ArrayForEach(kv, md) strbytes += strlen(kv->string) + strlen(kv->valuestring) + 2;

    out->tensors = calloc(count > 0 ? (size_t)count : 1, sizeof *out->tensors);
    out->meta_kv = calloc(2 * (size_t)nmeta + 1, sizeof *out->meta_kv);
    out->strings_ = malloc(strbytes > 0 ? strbytes : 1);
    if (out->tensors == NULL || out->meta_kv == NULL || out->strings_ == NULL)
        return ST_ERR_NOMEM;

    char *s = out->strings_;
#define ST_COPY(dst, src)            \
    do {                             \
        size_t l_ = strlen(src) + 1; \
        memcpy(s, (src), l_);        \
        (dst) = s;                   \
        s += l_;                     \
    } while (0)
    for (int i = 0; i < count; i++) {
        st_tensor *t = &out->tensors[i];
        ST_COPY(t->name, ents[i].name);
        t->dtype = ents[i].dtype;
        t->ndim = ents[i].ndim;
        memcpy(t->shape, ents[i].shape, sizeof t->shape);
        t->nbytes = (size_t)(ents[i].end - ents[i].begin);
    }
    int k = 0;
    if (md) {
        cJSON_ArrayForEach(kv, md)
        {
            ST_COPY(out->meta_kv[k], kv->string);
            ST_COPY(out->meta_kv[k + 1], kv->valuestring);
            k += 2;
        }
    }
#undef ST_COPY
    out->meta_kv[k] = NULL;
    out->count = count;
    out->meta_count = nmeta;
    return ST_OK;
}

/* Points each tensor at its bytes. Files may place a tensor at an offset
 * that is not a multiple of its element size (ours do when the caller's
 * order mixes sizes); those are copied to a second buffer so every data
 * pointer can be cast to its element type. */
static st_status align_tensors(const entry *ents, st_file *out)
{
    size_t extra = 0;
    for (int i = 0; i < out->count; i++)
        if (ents[i].begin % (int64_t)DTYPES[ents[i].dtype].size != 0 && ents[i].end > ents[i].begin)
            extra += (out->tensors[i].nbytes + 15) & ~(size_t)15; /* <= data size: no overflow */
    if (extra > 0) {
        out->aligned_ = malloc(extra);
        if (out->aligned_ == NULL)
            return ST_ERR_NOMEM;
    }
    size_t pos = 0;
    for (int i = 0; i < out->count; i++) {
        st_tensor *t = &out->tensors[i];
        const char *src = (const char *)out->data_ + ents[i].begin;
        if (t->nbytes == 0) {
            t->data = out->data_; /* any aligned, valid pointer will do */
        } else if (ents[i].begin % (int64_t)DTYPES[ents[i].dtype].size != 0) {
            t->data = (char *)out->aligned_ + pos;
            memcpy(t->data, src, t->nbytes);
            pos += (t->nbytes + 15) & ~(size_t)15;
        } else {
            t->data = (char *)src;
        }
    }
    return ST_OK;
}

/* Where the reader's bytes come from: an open file (st_read) or a buffer
 * (st_read_mem). One parser reads both, so a file and its bytes in memory
 * get the same answer. */
typedef struct st_source {
    FILE *fp; /* NULL: the buffer below */
    const unsigned char *mem;
    size_t len, pos;
} st_source;

/* The next n bytes into buf; 0 when fewer are there or the read fails. */
static int read_exact(st_source *src, void *buf, size_t n)
{
    if (n == 0)
        return 1;
    if (src->fp != NULL)
        return fread(buf, 1, n, src->fp) == n;
    if (src->len - src->pos < n)
        return 0;
    memcpy(buf, src->mem + src->pos, n);
    src->pos += n;
    return 1;
}

/* Reads and validates a whole file of fsize bytes from src into *out (zeroed
 * by the caller; freed again on failure); `path` names it in messages. */
static st_status read_source(const char *path, st_source *src, int64_t fsize, st_file *out,
                             char *err, size_t errlen)
{
    st_status st = ST_OK;
    char *hdr = NULL;
    cJSON *root = NULL;
    entry *ents = NULL;
    int count = 0;

    if (fsize < 8) {
        set_err(err, errlen,
                "%s: file is %lld bytes, shorter than the 8-byte header length that starts a "
                "safetensors file",
                path, (long long)fsize);
        st = ST_ERR_FORMAT;
        goto done;
    }

    unsigned char lenbuf[8];
    if (!read_exact(src, lenbuf, 8)) {
        set_err(err, errlen, "%s: cannot read the header length", path);
        st = ST_ERR_IO;
        goto done;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | lenbuf[i];
    if (hlen > ST_MAX_HEADER_BYTES) {
        set_err(err, errlen, "%s: header length %llu exceeds the %d-byte limit", path,
                (unsigned long long)hlen, ST_MAX_HEADER_BYTES);
        st = ST_ERR_FORMAT;
        goto done;
    }
    if ((int64_t)hlen > fsize - 8) {
        set_err(err, errlen, "%s: header length %llu runs past the end of the %lld-byte file", path,
                (unsigned long long)hlen, (long long)fsize);
        st = ST_ERR_FORMAT;
        goto done;
    }
    int64_t data_size = fsize - 8 - (int64_t)hlen;

    hdr = malloc((size_t)hlen + 1);
    if (hdr == NULL) {
        set_err(err, errlen, "%s: out of memory for a %llu-byte header", path,
                (unsigned long long)hlen);
        st = ST_ERR_NOMEM;
        goto done;
    }
    if (!read_exact(src, hdr, (size_t)hlen)) {
        set_err(err, errlen, "%s: cannot read the %llu-byte header", path,
                (unsigned long long)hlen);
        st = ST_ERR_IO;
        goto done;
    }
    hdr[hlen] = '\0';

    /* The JSON must be an object; saying so up front beats cJSON's offset. */
    size_t first = strspn(hdr, " \t\r\n");
    if (first == (size_t)hlen || hdr[first] != '{') {
        set_err(err, errlen, "%s: header does not start with '{'", path);
        st = ST_ERR_FORMAT;
        goto done;
    }
    /* cJSON reads C strings, so a NUL would silently end the header early. */
    const char *nul = memchr(hdr, '\0', (size_t)hlen);
    if (nul != NULL) {
        set_err(err, errlen, "%s: header has a NUL byte at offset %lld", path,
                (long long)(nul - hdr));
        st = ST_ERR_FORMAT;
        goto done;
    }
    size_t bad = utf8_check((const unsigned char *)hdr, (size_t)hlen);
    if (bad != (size_t)hlen) {
        set_err(err, errlen, "%s: header is not valid UTF-8 (byte 0x%02x at offset %zu)", path,
                (unsigned)(unsigned char)hdr[bad], bad);
        st = ST_ERR_FORMAT;
        goto done;
    }
    /* JSON may spell U+0000 as \u0000, which cJSON decodes into its C
     * strings, where it ends them: "a\u0000b" would come back as the name
     * "a", "F32\u0000x" as F32. Names, dtypes and metadata are C strings
     * here, so such a header is refused. An escaped backslash is skipped
     * whole, so \\u0000 (text) is not caught. */
    for (size_t i = 0; i + 1 < (size_t)hlen; i++) {
        if (hdr[i] != '\\')
            continue;
        if (hdr[i + 1] == 'u' && strncmp(hdr + i + 2, "0000", 4) == 0) {
            set_err(err, errlen,
                    "%s: header spells U+0000 (\\u0000) at byte %zu: names, dtypes and metadata "
                    "are read as C strings, which cannot hold it",
                    path, i);
            st = ST_ERR_FORMAT;
            goto done;
        }
        i++; /* the escaped character, a backslash included */
    }
    const char *parse_end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &parse_end, 0);
    if (root == NULL) {
        long long at = parse_end ? (long long)(parse_end - hdr) : -1;
        set_err(err, errlen, "%s: header is not valid JSON (error near byte %lld of %llu)", path,
                at, (unsigned long long)hlen);
        st = ST_ERR_FORMAT;
        goto done;
    }
    /* Only JSON whitespace (the writer's space padding) may follow the
     * object; cJSON's own check would also let control bytes through. */
    size_t rest = (size_t)(parse_end - hdr);
    rest += strspn(parse_end, " \t\r\n");
    if (rest != (size_t)hlen) {
        set_err(err, errlen, "%s: header is not valid JSON (unexpected text at byte %zu of %llu)",
                path, rest, (unsigned long long)hlen);
        st = ST_ERR_FORMAT;
        goto done;
    }
    free(hdr);
    hdr = NULL;

    const cJSON *md = NULL;
    st = check_header(path, root, data_size, &ents, &count, &md, err, errlen);
    if (st != ST_OK)
        goto done;

    if ((uint64_t)data_size > SIZE_MAX) {
        set_err(err, errlen, "%s: data section of %lld bytes does not fit in memory", path,
                (long long)data_size);
        st = ST_ERR_NOMEM;
        goto done;
    }
    st = build_file(ents, count, md, out);
    if (st != ST_OK) {
        set_err(err, errlen, "%s: out of memory", path);
        goto done;
    }
    out->data_ = malloc(data_size > 0 ? (size_t)data_size : 1);
    if (out->data_ == NULL) {
        set_err(err, errlen, "%s: out of memory for the %lld-byte data section", path,
                (long long)data_size);
        st = ST_ERR_NOMEM;
        goto done;
    }
    if (!read_exact(src, out->data_, (size_t)data_size)) {
        set_err(err, errlen, "%s: cannot read the %lld-byte data section%s%s", path,
                (long long)data_size,
                src->fp && ferror(src->fp) ? ": " : " (file shrank while reading)",
                src->fp && ferror(src->fp) ? strerror(errno) : "");
        st = ST_ERR_IO;
        goto done;
    }
    st = align_tensors(ents, out);
    if (st != ST_OK)
        set_err(err, errlen, "%s: out of memory", path);

done:
    free(hdr);
    free(ents);
    cJSON_Delete(root);
    if (st != ST_OK)
        st_free(out);
    return st;
}

st_status st_read(const char *path, st_file *out, char *err, size_t errlen)
{
    if (out == NULL || path == NULL) {
        set_err(err, errlen, "st_read: path and out must not be NULL");
        return ST_ERR_ARG;
    }
    memset(out, 0, sizeof *out);

    FILE *fp = fopen(path, "rb");
    if (fp == NULL) {
        set_err(err, errlen, "%s: cannot open: %s", path, strerror(errno));
        return ST_ERR_IO;
    }
    st_status st;
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0) {
        set_err(err, errlen, "%s: cannot stat: %s", path, strerror(errno));
        st = ST_ERR_IO;
    } else if (!S_ISREG(sb.st_mode)) {
        set_err(err, errlen, "%s: not a regular file", path);
        st = ST_ERR_IO;
    } else {
        st_source src = {fp, NULL, 0, 0};
        st = read_source(path, &src, (int64_t)sb.st_size, out, err, errlen);
    }
    fclose(fp);
    return st;
}

st_status st_read_mem(const void *data, size_t len, const char *name, st_file *out, char *err,
                      size_t errlen)
{
    if (name == NULL)
        name = "(memory)";
    if (out == NULL || (data == NULL && len > 0)) {
        set_err(err, errlen, "st_read_mem: out and data must not be NULL");
        return ST_ERR_ARG;
    }
    memset(out, 0, sizeof *out);
    if ((uint64_t)len > (uint64_t)INT64_MAX) {
        set_err(err, errlen, "%s: %zu bytes: more than a file can hold", name, len);
        return ST_ERR_ARG;
    }
    st_source src = {NULL, data, len, 0};
    return read_source(name, &src, (int64_t)len, out, err, errlen);
}

const st_tensor *st_find(const st_file *f, const char *name)
{
    if (f == NULL || name == NULL)
        return NULL;
    for (int i = 0; i < f->count; i++)
        if (strcmp(f->tensors[i].name, name) == 0)
            return &f->tensors[i];
    return NULL;
}

const char *st_meta_get(const st_file *f, const char *key)
{
    if (f == NULL || key == NULL || f->meta_kv == NULL)
        return NULL;
    for (int i = 0; i < f->meta_count; i++)
        if (strcmp(f->meta_kv[2 * i], key) == 0)
            return f->meta_kv[2 * i + 1];
    return NULL;
}

void st_free(st_file *f)
{
    if (f == NULL)
        return;
    free(f->tensors);
    free(f->meta_kv);
    free(f->data_);
    free(f->aligned_);
    free(f->strings_);
    memset(f, 0, sizeof *f);
}

/* ------------------------------------------------------------------ writer */

static st_status check_write_args(const st_tensor *tensors, int count, const char *const *meta_kv,
                                  int64_t *data_size, char *err, size_t errlen)
{
    if (count < 0 || (count > 0 && tensors == NULL)) {
        set_err(err, errlen, "st_write: %d tensors at %p", count, (const void *)tensors);
        return ST_ERR_ARG;
    }
    int64_t total = 0;
    char sbuf[256];
    for (int i = 0; i < count; i++) {
        const st_tensor *t = &tensors[i];
        if (t->name == NULL) {
            set_err(err, errlen, "st_write: tensor %d has no name", i);
            return ST_ERR_ARG;
        }
        size_t nlen = strlen(t->name);
        if (utf8_check((const unsigned char *)t->name, nlen) != nlen) {
            set_err(err, errlen, "st_write: tensor %d: name is not valid UTF-8", i);
            return ST_ERR_ARG;
        }
        if (strcmp(t->name, META_KEY) == 0) {
            set_err(err, errlen, "st_write: tensor %d: \"%s\" is reserved for metadata", i,
                    META_KEY);
            return ST_ERR_ARG;
        }
        if (!dtype_valid(t->dtype)) {
            set_err(err, errlen, "st_write: tensor \"%s\": invalid dtype %d", t->name,
                    (int)t->dtype);
            return ST_ERR_ARG;
        }
        if (t->ndim < 0 || t->ndim > ST_MAX_DIMS) {
            set_err(err, errlen, "st_write: tensor \"%s\": ndim %d is outside 0..%d", t->name,
                    t->ndim, ST_MAX_DIMS);
            return ST_ERR_ARG;
        }
        int64_t bytes = numel_bytes(shape_numel(t->ndim, t->shape), DTYPES[t->dtype].size);
        if (bytes < 0) {
            set_err(err, errlen,
                    "st_write: tensor \"%s\": shape %s has a negative entry or overflows", t->name,
                    shape_str(sbuf, sizeof sbuf, t->ndim, t->shape));
            return ST_ERR_ARG;
        }
        if ((uint64_t)bytes != (uint64_t)t->nbytes) {
            set_err(err, errlen,
                    "st_write: tensor \"%s\": nbytes is %zu but shape %s of %s needs %lld", t->name,
                    t->nbytes, shape_str(sbuf, sizeof sbuf, t->ndim, t->shape),
                    DTYPES[t->dtype].name, (long long)bytes);
            return ST_ERR_ARG;
        }
        if (t->nbytes > 0 && t->data == NULL) {
            set_err(err, errlen, "st_write: tensor \"%s\": data is NULL", t->name);
            return ST_ERR_ARG;
        }
        if (bytes > INT64_MAX - total) {
            set_err(err, errlen, "st_write: total data size overflows");
            return ST_ERR_ARG;
        }
        total += bytes;
    }
    /* O(n^2) is fine: files written by the tools hold a handful of tensors,
     * and it spares a copy of the name array. */
    for (int i = 0; i < count; i++)
        for (int j = i + 1; j < count; j++)
            if (strcmp(tensors[i].name, tensors[j].name) == 0) {
                set_err(err, errlen, "st_write: tensor name \"%s\" is used twice", tensors[i].name);
                return ST_ERR_ARG;
            }
    if (meta_kv != NULL) {
        for (int i = 0; meta_kv[i] != NULL; i += 2) {
            if (meta_kv[i + 1] == NULL) {
                set_err(err, errlen, "st_write: metadata key \"%s\" has no value", meta_kv[i]);
                return ST_ERR_ARG;
            }
            for (int k = 0; k < 2; k++) {
                size_t l = strlen(meta_kv[i + k]);
                if (utf8_check((const unsigned char *)meta_kv[i + k], l) != l) {
                    set_err(err, errlen, "st_write: metadata %s %d is not valid UTF-8",
                            k ? "value" : "key", i / 2);
                    return ST_ERR_ARG;
                }
            }
            for (int j = 0; j < i; j += 2)
                if (strcmp(meta_kv[i], meta_kv[j]) == 0) {
                    set_err(err, errlen, "st_write: metadata key \"%s\" is used twice", meta_kv[i]);
                    return ST_ERR_ARG;
                }
        }
    }
    *data_size = total;
    return ST_OK;
}

/* An integer as a raw JSON number: cJSON would print large ones in
 * exponent notation, which readers of integer fields reject. */
static int add_int(cJSON *array, int64_t v)
{
    char buf[32];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    cJSON *n = cJSON_CreateRaw(buf);
    return n != NULL && cJSON_AddItemToArray(array, n);
}

/* The header JSON (unpadded), or NULL when out of memory. */
static char *build_header(const st_tensor *tensors, int count, const char *const *meta_kv)
{
    cJSON *root = cJSON_CreateObject();
    if (root == NULL)
        return NULL;
    char *json = NULL;
    if (meta_kv != NULL && meta_kv[0] != NULL) {
        cJSON *md = cJSON_AddObjectToObject(root, META_KEY);
        if (md == NULL)
            goto done;
        for (int i = 0; meta_kv[i] != NULL; i += 2)
            if (cJSON_AddStringToObject(md, meta_kv[i], meta_kv[i + 1]) == NULL)
                goto done;
    }
    int64_t offset = 0;
    for (int i = 0; i < count; i++) {
        const st_tensor *t = &tensors[i];
        cJSON *obj = cJSON_AddObjectToObject(root, t->name);
        if (obj == NULL || cJSON_AddStringToObject(obj, "dtype", DTYPES[t->dtype].name) == NULL)
            goto done;
        cJSON *shape = cJSON_AddArrayToObject(obj, "shape");
        if (shape == NULL)
            goto done;
        for (int d = 0; d < t->ndim; d++)
            if (!add_int(shape, t->shape[d]))
                goto done;
        cJSON *off = cJSON_AddArrayToObject(obj, "data_offsets");
        if (off == NULL || !add_int(off, offset) || !add_int(off, offset + (int64_t)t->nbytes))
            goto done;
        offset += (int64_t)t->nbytes;
    }
    json = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return json;
}

static int write_all(FILE *fp, const void *buf, size_t n)
{
    return n == 0 || fwrite(buf, 1, n, fp) == n;
}

/* "DIR/.BASE.fmha-tmp.PID" for path "DIR/BASE": hidden, in the same
 * directory (rename stays on one file system), and recognisable by the
 * writer's pid, so that a later write can tell a killed writer's leftover
 * from a live one's file. Caller frees; NULL when out of memory. */
static char *temp_path(const char *path, long pid)
{
    const char *slash = strrchr(path, '/');
    const size_t dlen = slash ? (size_t)(slash - path + 1) : 0;
    const size_t n = strlen(path) + 48;
    char *tmp = malloc(n);
    if (tmp != NULL)
        snprintf(tmp, n, "%.*s.%s.fmha-tmp.%ld", (int)dlen, path, path + dlen, pid);
    return tmp;
}

/* Removes DIR/.BASE.fmha-tmp.PID files whose writer no longer runs: a write
 * killed before its rename leaves one of up to the output's size. */
static void remove_stale_temps(const char *path)
{
    const char *slash = strrchr(path, '/');
    const size_t dlen = slash ? (size_t)(slash - path + 1) : 0;
    const char *base = path + dlen;
    char *dir = malloc(dlen + 2);
    if (dir == NULL)
        return;
    if (dlen)
        snprintf(dir, dlen + 1, "%.*s", (int)dlen, path);
    else
        strcpy(dir, ".");
    DIR *d = opendir(dir);
    const size_t blen = strlen(base);
    struct dirent *e;
    while (d != NULL && (e = readdir(d)) != NULL) {
        const char *name = e->d_name;
        if (name[0] != '.' || strncmp(name + 1, base, blen) != 0 ||
            strncmp(name + 1 + blen, ".fmha-tmp.", 10) != 0)
            continue;
        const char *digits = name + 1 + blen + 10;
        char *end;
        errno = 0;
        long pid = strtol(digits, &end, 10);
        if (*digits < '0' || *digits > '9' || *end || errno || pid <= 0 || pid == (long)getpid())
            continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue; /* alive (or not ours to ask about): its writer may still rename it */
        char *stale = temp_path(path, pid);
        if (stale != NULL)
            unlink(stale);
        free(stale);
    }
    if (d != NULL)
        closedir(d);
    free(dir);
}

static const char *file_kind(mode_t mode)
{
    return S_ISDIR(mode)    ? "a directory"
           : S_ISCHR(mode)  ? "a character device"
           : S_ISBLK(mode)  ? "a block device"
           : S_ISFIFO(mode) ? "a FIFO"
           : S_ISSOCK(mode) ? "a socket"
                            : "a special file";
}

st_status st_check_output(const char *path, const char *const *inputs, char *err, size_t errlen)
{
    struct stat out;
    if (stat(path, &out) != 0)
        return ST_OK; /* nothing there (or a dangling link): the write creates it */
    if (!S_ISREG(out.st_mode)) {
        set_err(err, errlen,
                "%s exists and is %s, not a regular file; the output replaces the file at that "
                "path, so give the path of a regular file or of a new one",
                path, file_kind(out.st_mode));
        return ST_ERR_ARG;
    }
    for (int i = 0; inputs != NULL && inputs[i] != NULL; i++) {
        struct stat in;
        if (stat(inputs[i], &in) == 0 && in.st_dev == out.st_dev && in.st_ino == out.st_ino) {
            set_err(err, errlen,
                    "output %s is the same file as input %s; writing it would destroy the "
                    "input: give another output path",
                    path, inputs[i]);
            return ST_ERR_ARG;
        }
    }
    return ST_OK;
}

st_status st_write(const char *path, const st_tensor *tensors, int count,
                   const char *const *meta_kv, char *err, size_t errlen)
{
    if (path == NULL) {
        set_err(err, errlen, "st_write: path is NULL");
        return ST_ERR_ARG;
    }
    int64_t data_size = 0;
    st_status st = check_write_args(tensors, count, meta_kv, &data_size, err, errlen);
    if (st != ST_OK)
        return st;

    char *json = build_header(tensors, count, meta_kv);
    if (json == NULL) {
        set_err(err, errlen, "%s: out of memory building the header", path);
        return ST_ERR_NOMEM;
    }
    size_t jlen = strlen(json);
    size_t pad = (8 - jlen % 8) % 8; /* data section starts 8-byte aligned */
    if (jlen + pad > ST_MAX_HEADER_BYTES) {
        set_err(err, errlen, "%s: header would be %zu bytes, over the %d-byte limit", path,
                jlen + pad, ST_MAX_HEADER_BYTES);
        cJSON_free(json);
        return ST_ERR_ARG;
    }
    uint64_t hlen = (uint64_t)(jlen + pad);
    if (data_size > INT64_MAX - 8 - (int64_t)hlen) {
        set_err(err, errlen, "%s: file size overflows", path);
        cJSON_free(json);
        return ST_ERR_ARG;
    }
    unsigned char lenbuf[8];
    for (int i = 0; i < 8; i++)
        lenbuf[i] = (unsigned char)(hlen >> (8 * i));
    static const char spaces[8] = {' ', ' ', ' ', ' ', ' ', ' ', ' ', ' '};

    st = st_check_output(path, NULL, err, errlen);
    if (st != ST_OK) {
        cJSON_free(json);
        return st;
    }
    char *tmp = temp_path(path, (long)getpid());
    if (tmp == NULL) {
        set_err(err, errlen, "%s: out of memory", path);
        cJSON_free(json);
        return ST_ERR_NOMEM;
    }
    remove_stale_temps(path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
        /* Our own pid: left by a killed process that had it before us. */
        unlink(tmp);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    }
    if (fd < 0) {
        set_err(err, errlen, "%s: cannot create temporary file %s: %s", path, tmp, strerror(errno));
        free(tmp);
        cJSON_free(json);
        return ST_ERR_IO;
    }
    /* The temporary file is 0600, which would lock other users out of the
     * result: keep an existing file's mode, else use 0644 (umask 022's). */
    struct stat old;
    mode_t mode = (stat(path, &old) == 0 && S_ISREG(old.st_mode)) ? (old.st_mode & 07777) : 0644;
    FILE *fp = NULL;
    const char *what = NULL;
    if (fchmod(fd, mode) != 0) {
        what = "set the mode of";
        goto fail;
    }
    fp = fdopen(fd, "wb");
    if (fp == NULL) {
        what = "open";
        goto fail;
    }
    fd = -1; /* owned by fp now */
    what = "write";
    if (!write_all(fp, lenbuf, 8) || !write_all(fp, json, jlen) || !write_all(fp, spaces, pad))
        goto fail;
    for (int i = 0; i < count; i++)
        if (!write_all(fp, tensors[i].data, tensors[i].nbytes))
            goto fail;
    if (fflush(fp) != 0)
        goto fail;
    what = "fsync";
    if (fsync(fileno(fp)) != 0)
        goto fail;
    what = "close";
    int rc = fclose(fp);
    fp = NULL;
    if (rc != 0)
        goto fail;
    what = "rename";
    if (rename(tmp, path) != 0)
        goto fail;

    free(tmp);
    cJSON_free(json);
    return ST_OK;

fail:
    set_err(err, errlen, "%s: cannot %s temporary file %s: %s", path, what, tmp, strerror(errno));
    if (fp != NULL)
        fclose(fp);
    if (fd >= 0)
        close(fd);
    unlink(tmp);
    free(tmp);
    cJSON_free(json);
    return ST_ERR_IO;
}
