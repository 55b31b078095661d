/* fuzz_safetensors.c — libFuzzer harness of the safetensors reader
 * (tools/safetensors.c). The input is a whole file's bytes, read with
 * st_read_mem (st_read's parser). A refused file must come with a message and
 * leave the st_file zeroed. An accepted one must keep what safetensors.h
 * promises, checked here against the raw bytes, with the header parsed again
 * independently: every tensor's offsets inside the data section, the tensors
 * tiling it without gap or overlap, nbytes = product(shape) x element size,
 * data equal to the file's bytes and aligned to the element size, names
 * unique, metadata as a NULL-ended key/value list, and no string cut short
 * (C strings cannot hold the U+0000 that JSON can spell \u0000). And what
 * was read must write back (st_write) and read again to the same tensors and
 * metadata. Any broken promise calls __builtin_trap(), which libFuzzer
 * reports.
 *
 * An input that starts with '{' is the header's text instead, then a NUL
 * byte and the data section, and the harness writes the 8-byte length in
 * front: mutations of the header then keep its length right, which in a
 * whole file they almost never do. (As a file such an input is refused
 * anyway: "{..." read as a length is far over the limit.) */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define REQUIRE(cond)                                                                    \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "fuzz_safetensors: %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            __builtin_trap();                                                            \
        }                                                                                \
    } while (0)

/* Where write-backs go: a tmpfs when there is one, since st_write fsyncs. */
static char g_out[256];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    struct stat sb;
    const char *dir = stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) ? "/dev/shm" : "/tmp";
    snprintf(g_out, sizeof g_out, "%s/fmha_fuzz_st.%ld.safetensors", dir, (long)getpid());
    return 0;
}

static uint64_t le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Elements of a shape with checked arithmetic; -1 on overflow or a negative entry. */
static int64_t numel(const st_tensor *t)
{
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        if (t->shape[d] < 0 || __builtin_mul_overflow(n, t->shape[d], &n))
            return -1;
    return n;
}

typedef struct span {
    int64_t begin, end;
} span;

static int cmp_span(const void *a, const void *b)
{
    const span *x = a, *y = b;
    return x->begin != y->begin ? (x->begin < y->begin ? -1 : 1)
                                : (x->end < y->end ? -1 : x->end > y->end);
}

/* Whether JSON text spells U+0000 as an escape (\u0000) anywhere: an
 * escaped backslash (\\) is skipped whole, so \\u0000 is not one. */
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

/* The promises of safetensors.h about an accepted file, against its bytes. */
static void check_file(const st_file *f, const uint8_t *data, size_t size)
{
    REQUIRE(size >= 8);
    const uint64_t hlen = le64(data);
    REQUIRE(hlen <= ST_MAX_HEADER_BYTES && hlen <= size - 8);
    const uint8_t *section = data + 8 + hlen;
    /* Every string comes back whole: none held a U+0000. */
    REQUIRE(!has_escaped_nul((const char *)data + 8, (size_t)hlen));
    const int64_t section_bytes = (int64_t)(size - 8 - hlen);

    /* The header again, by cJSON directly: what each name's data_offsets say. */
    cJSON *root = cJSON_ParseWithLength((const char *)data + 8, (size_t)hlen);
    REQUIRE(root != NULL && cJSON_IsObject(root));

    REQUIRE(f->count >= 0 && f->tensors != NULL && f->meta_kv != NULL && f->meta_count >= 0);
    span *spans = calloc((size_t)f->count + 1, sizeof *spans);
    REQUIRE(spans != NULL);
    for (int i = 0; i < f->count; i++) {
        const st_tensor *t = &f->tensors[i];
        REQUIRE(t->name != NULL && strcmp(t->name, "__metadata__") != 0);
        REQUIRE(st_dtype_name(t->dtype) != NULL);
        REQUIRE(t->ndim >= 0 && t->ndim <= ST_MAX_DIMS);
        const int64_t n = numel(t);
        const size_t es = st_dtype_size(t->dtype);
        int64_t bytes;
        REQUIRE(n >= 0 && !__builtin_mul_overflow(n, (int64_t)es, &bytes));
        REQUIRE((uint64_t)bytes == (uint64_t)t->nbytes);
        REQUIRE(t->data != NULL && (uintptr_t)t->data % es == 0);
        for (int j = 0; j < i; j++)
            REQUIRE(strcmp(f->tensors[j].name, t->name) != 0);
        REQUIRE(st_find(f, t->name) == t);

        const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, t->name);
        const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
        REQUIRE(cJSON_GetArraySize(off) == 2);
        const double b = cJSON_GetArrayItem(off, 0)->valuedouble;
        const double en = cJSON_GetArrayItem(off, 1)->valuedouble;
        REQUIRE(b >= 0 && b <= en && en <= (double)section_bytes);
        spans[i].begin = (int64_t)b;
        spans[i].end = (int64_t)en;
        REQUIRE(spans[i].end - spans[i].begin == bytes);
        /* The tensor's bytes are the file's (and reading them is in bounds). */
        REQUIRE(bytes == 0 || memcmp(t->data, section + spans[i].begin, (size_t)bytes) == 0);
    }
    /* Every byte of the data section belongs to exactly one tensor. */
    qsort(spans, (size_t)f->count, sizeof *spans, cmp_span);
    int64_t cursor = 0;
    for (int i = 0; i < f->count; i++) {
        REQUIRE(spans[i].begin == cursor);
        cursor = spans[i].end;
    }
    REQUIRE(cursor == section_bytes);
    free(spans);

    for (int i = 0; i < f->meta_count; i++) {
        const char *k = f->meta_kv[2 * i], *v = f->meta_kv[2 * i + 1];
        REQUIRE(k != NULL && v != NULL);
        const cJSON *md = cJSON_GetObjectItemCaseSensitive(root, "__metadata__");
        const cJSON *mv = cJSON_GetObjectItemCaseSensitive(md, k);
        REQUIRE(cJSON_IsString(mv));
        REQUIRE(st_meta_get(f, k) != NULL);
    }
    REQUIRE(f->meta_kv[2 * f->meta_count] == NULL);
    cJSON_Delete(root);
}

/* What was read writes back, and that file reads as the same tensors and
 * metadata (safetensors.h: meta_kv "can go straight to st_write"). */
static void check_write_back(const st_file *f)
{
    char err[512] = "";
    st_status st = st_write(g_out, f->tensors, f->count, f->meta_kv, err, sizeof err);
    if (st != ST_OK)
        fprintf(stderr, "fuzz_safetensors: write-back refused: %s\n", err);
    REQUIRE(st == ST_OK);
    st_file g;
    st = st_read(g_out, &g, err, sizeof err);
    if (st != ST_OK)
        fprintf(stderr, "fuzz_safetensors: written file refused: %s\n", err);
    REQUIRE(st == ST_OK);
    REQUIRE(g.count == f->count && g.meta_count == f->meta_count);
    for (int i = 0; i < f->count; i++) {
        const st_tensor *a = &f->tensors[i], *b = &g.tensors[i];
        REQUIRE(strcmp(a->name, b->name) == 0 && a->dtype == b->dtype && a->ndim == b->ndim);
        REQUIRE(memcmp(a->shape, b->shape, sizeof(int64_t) * (size_t)a->ndim) == 0);
        REQUIRE(a->nbytes == b->nbytes &&
                (a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0));
    }
    for (int i = 0; i < 2 * f->meta_count; i++)
        REQUIRE(strcmp(f->meta_kv[i], g.meta_kv[i]) == 0);
    st_free(&g);
    unlink(g_out);
}

int LLVMFuzzerTestOneInput(const uint8_t *input, size_t input_size)
{
    const uint8_t *data = input;
    size_t size = input_size;
    uint8_t *file = NULL;
    if (input_size > 0 && input[0] == '{') { /* header text, NUL, data: add the length */
        const uint8_t *nul = memchr(input, 0, input_size);
        const size_t hlen = nul ? (size_t)(nul - input) : input_size;
        const size_t dlen = nul ? input_size - hlen - 1 : 0;
        file = malloc(8 + hlen + dlen);
        REQUIRE(file != NULL);
        for (int i = 0; i < 8; i++)
            file[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
        memcpy(file + 8, input, hlen);
        if (dlen)
            memcpy(file + 8 + hlen, nul + 1, dlen);
        data = file;
        size = 8 + hlen + dlen;
    }
    st_file f;
    char err[512];
    memset(err, 0, sizeof err);
    st_status st = st_read_mem(data, size, "fuzz.safetensors", &f, err, sizeof err);
    if (st != ST_OK) {
        /* A memory source cannot fail to read, and the arguments are fine. */
        REQUIRE(st == ST_ERR_FORMAT || st == ST_ERR_NOMEM);
        REQUIRE(err[0] != '\0');
        REQUIRE(f.tensors == NULL && f.count == 0 && f.meta_kv == NULL && f.meta_count == 0);
        free(file);
        return 0;
    }
    check_file(&f, data, size);
    check_write_back(&f);
    st_free(&f);
    REQUIRE(f.tensors == NULL && f.count == 0);
    free(file);
    return 0;
}
