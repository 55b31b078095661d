/* test_safetensors.c — checks tools/safetensors.c: round trips, every kind of
 * corrupt file the reader must refuse, and that a failed write never leaves
 * a partial or temporary file behind. Exits nonzero if any check fails. */
#define _POSIX_C_SOURCE 200809L

#include "safetensors.h"
#include "testutil.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[64];

#define CHECK TU_CHECK

static const char *tpath(const char *name)
{
    static char buf[4][256]; /* a few live at once in one expression */
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof buf[k], "%s/%s", g_dir, name);
    return buf[k];
}

static int write_bytes(const char *path, const void *data, size_t len)
{
    FILE *fp = fopen(path, "wb");
    if (fp == NULL)
        return -1;
    int ok = fwrite(data, 1, len, fp) == len;
    return (fclose(fp) == 0 && ok) ? 0 : -1;
}

static unsigned char *read_bytes(const char *path, size_t *len)
{
    FILE *fp = fopen(path, "rb");
    if (fp == NULL)
        return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf && fread(buf, 1, (size_t)n, fp) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(fp);
    *len = (size_t)n;
    return buf;
}

/* A raw file: the given header length field, header text and data bytes. */
static void write_raw_len(const char *path, uint64_t hlen_field, const char *header,
                          size_t header_len, const void *data, size_t dlen)
{
    size_t total = 8 + header_len + dlen;
    unsigned char *buf = malloc(total);
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(hlen_field >> (8 * i));
    memcpy(buf + 8, header, header_len);
    if (dlen)
        memcpy(buf + 8 + header_len, data, dlen);
    if (write_bytes(path, buf, total) != 0) {
        printf("cannot write %s\n", path);
        exit(2);
    }
    free(buf);
}

static void write_raw(const char *path, const char *header, size_t dlen)
{
    static const unsigned char zeros[64];
    if (dlen > sizeof zeros)
        exit(2);
    write_raw_len(path, strlen(header), header, strlen(header), zeros, dlen);
}

/* Reads `path` and checks it fails with `want` and a message containing `sub`. */
static void expect_fail(int line, const char *what, const char *path, st_status want,
                        const char *sub)
{
    st_file f;
    char err[512] = "";
    st_status st = st_read(path, &f, err, sizeof err);
    int ok = st == want && strstr(err, sub) != NULL && f.tensors == NULL && f.count == 0;
    if (ok) {
        tu_passed++;
    } else {
        tu_failed++;
        printf("FAIL line %d (%s): got %s \"%s\", want %s containing \"%s\"\n", line, what,
               st_status_string(st), err, st_status_string(want), sub);
    }
    st_free(&f);

    /* The same bytes in memory: st_read_mem must say exactly what st_read said. */
    size_t len = 0;
    unsigned char *raw = want == ST_ERR_FORMAT ? read_bytes(path, &len) : NULL;
    if (raw != NULL) {
        char merr[512] = "";
        st = st_read_mem(raw, len, path, &f, merr, sizeof merr);
        ok = st == want && strcmp(merr, err) == 0 && f.tensors == NULL && f.count == 0;
        if (ok) {
            tu_passed++;
        } else {
            tu_failed++;
            printf("FAIL line %d (%s, in memory): got %s \"%s\", want %s \"%s\"\n", line, what,
                   st_status_string(st), merr, st_status_string(want), err);
        }
        st_free(&f);
        free(raw);
    }
}

/* One header with `data_bytes` of zero data must be refused with `sub` in the message. */
#define BAD_HEADER(what, header, data_bytes, sub)                                  \
    do {                                                                           \
        write_raw(tpath("bad.safetensors"), header, data_bytes);                   \
        expect_fail(__LINE__, what, tpath("bad.safetensors"), ST_ERR_FORMAT, sub); \
    } while (0)

static int count_temp_files(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, ".tmp.") != NULL || strstr(e->d_name, ".fmha-tmp.") != NULL)
            n++;
    closedir(d);
    return n;
}

/* ------------------------------------------------------------------ tests */

/* fmha_dtype_size lives in libfmha, which these tools do not link. */
static size_t fmha_size(fmha_dtype d)
{
    return d == FMHA_DTYPE_F32 ? 4 : d == FMHA_DTYPE_F8_E4M3 ? 1 : 2;
}

static void test_dtypes(void)
{
    CHECK(strcmp(st_dtype_name(ST_DTYPE_BF16), "BF16") == 0, "BF16 name");
    CHECK(strcmp(st_dtype_name(ST_DTYPE_F8_E4M3), "F8_E4M3") == 0, "F8_E4M3 name");
    CHECK(st_dtype_name(ST_DTYPE_COUNT) == NULL, "invalid dtype has no name");
    CHECK(st_dtype_size(ST_DTYPE_F64) == 8 && st_dtype_size(ST_DTYPE_F16) == 2 &&
              st_dtype_size(ST_DTYPE_U8) == 1 && st_dtype_size(ST_DTYPE_COUNT) == 0,
          "dtype sizes");
    for (int i = 0; i < ST_DTYPE_COUNT; i++) {
        st_dtype d;
        CHECK(st_dtype_from_name(st_dtype_name((st_dtype)i), &d) == 0 && d == (st_dtype)i,
              "name round trip %d", i);
    }
    st_dtype d;
    CHECK(st_dtype_from_name("f32", &d) != 0, "names are case-sensitive");
    CHECK(st_dtype_from_name("F33", &d) != 0, "unknown name");

    fmha_dtype fd[] = {FMHA_DTYPE_F32, FMHA_DTYPE_F16, FMHA_DTYPE_BF16, FMHA_DTYPE_F8_E4M3};
    for (size_t i = 0; i < sizeof fd / sizeof fd[0]; i++) {
        st_dtype s;
        fmha_dtype back;
        CHECK(st_dtype_from_fmha(fd[i], &s) == 0 && st_dtype_to_fmha(s, &back) == 0 &&
                  back == fd[i] && st_dtype_size(s) == fmha_size(fd[i]),
              "fmha dtype %zu round trip", i);
    }
    fmha_dtype out = FMHA_DTYPE_F16;
    CHECK(st_dtype_to_fmha(ST_DTYPE_I32, &out) != 0 && out == FMHA_DTYPE_F16,
          "I32 has no fmha dtype and leaves *out alone");
}

/* The fixtures of the round trip: several dtypes, odd sizes, a scalar and
 * empty tensors. */
typedef struct fixture {
    float f32[6];
    uint16_t bf16[4];
    uint16_t f16[3];
    int64_t i64[2];
    uint8_t u8[5];
    double scalar;
    uint8_t f8[3];
    st_tensor t[9];
    int count;
} fixture;

static void make_fixture(fixture *x)
{
    memset(x, 0, sizeof *x);
    for (int i = 0; i < 6; i++)
        x->f32[i] = 0.5f * (float)i - 1.0f;
    for (int i = 0; i < 4; i++)
        x->bf16[i] = (uint16_t)(0x3f80 + i);
    for (int i = 0; i < 3; i++)
        x->f16[i] = (uint16_t)(0x3c00 + 7 * i);
    x->i64[0] = -5;
    x->i64[1] = INT64_MAX;
    for (int i = 0; i < 5; i++)
        x->u8[i] = (uint8_t)(250 + i);
    x->scalar = 3.25;
    x->f8[0] = 0x38, x->f8[1] = 0x7e, x->f8[2] = 0x80;

    int64_t s23[] = {2, 3}, s4[] = {4}, s113[] = {1, 1, 3}, s2[] = {2}, s5[] = {5}, s04[] = {0, 4},
            s3[] = {3}, s7x0[] = {7, 0};
    int n = 0;
    /* u8 first so every later tensor starts at an odd offset. */
    x->t[n++] = st_tensor_make("bytes", ST_DTYPE_U8, 1, s5, x->u8);
    x->t[n++] = st_tensor_make("q.weight", ST_DTYPE_F32, 2, s23, x->f32);
    x->t[n++] = st_tensor_make("k", ST_DTYPE_BF16, 1, s4, x->bf16);
    x->t[n++] = st_tensor_make("empty", ST_DTYPE_I32, 2, s04, NULL);
    x->t[n++] = st_tensor_make("v/héllo", ST_DTYPE_F16, 3, s113, x->f16);
    x->t[n++] = st_tensor_make("ids", ST_DTYPE_I64, 1, s2, x->i64);
    x->t[n++] = st_tensor_make("scale", ST_DTYPE_F64, 0, NULL, &x->scalar);
    x->t[n++] = st_tensor_make("fp8", ST_DTYPE_F8_E4M3, 1, s3, x->f8);
    x->t[n++] = st_tensor_make("empty2", ST_DTYPE_BF16, 2, s7x0, NULL);
    x->count = n;
}

static int same_tensor(const st_tensor *a, const st_tensor *b)
{
    if (strcmp(a->name, b->name) != 0 || a->dtype != b->dtype || a->ndim != b->ndim ||
        a->nbytes != b->nbytes)
        return 0;
    for (int d = 0; d < a->ndim; d++)
        if (a->shape[d] != b->shape[d])
            return 0;
    return a->nbytes == 0 || memcmp(a->data, b->data, a->nbytes) == 0;
}

static void test_round_trip(void)
{
    fixture x;
    make_fixture(&x);
    CHECK(x.t[6].nbytes == 8 && x.t[3].nbytes == 0, "st_tensor_make sizes (scalar, empty)");

    const char *meta[] = {"format", "pt", "note", "quote \" backslash \\ tab \t ünï", NULL};
    char err[512] = "";
    const char *p = tpath("rt.safetensors");
    st_status st = st_write(p, x.t, x.count, meta, err, sizeof err);
    CHECK(st == ST_OK, "write: %s", err);
    CHECK(count_temp_files(g_dir) == 0, "no temp file left after a write");

    struct stat sb;
    CHECK(stat(p, &sb) == 0 && (sb.st_mode & 07777) == 0644, "new file has mode 0644 (%o)",
          (unsigned)(sb.st_mode & 07777));

    /* Layout: header padded with spaces to 8 bytes; data contiguous, in order. */
    size_t len = 0;
    unsigned char *raw = read_bytes(p, &len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | raw[i];
    size_t want_data = 0;
    for (int i = 0; i < x.count; i++)
        want_data += x.t[i].nbytes;
    CHECK(hlen % 8 == 0 && 8 + hlen + want_data == len, "layout: hlen %llu, file %zu",
          (unsigned long long)hlen, len);
    CHECK(raw[8] == '{', "header starts with {");
    size_t last = 8 + hlen - 1;
    while (raw[last] == ' ')
        last--;
    CHECK(raw[last] == '}' && 8 + hlen - 1 - last < 8, "padding is fewer than 8 spaces");
    size_t off = 8 + hlen;
    int contiguous = 1;
    for (int i = 0; i < x.count; i++) {
        if (x.t[i].nbytes && memcmp(raw + off, x.t[i].data, x.t[i].nbytes) != 0)
            contiguous = 0;
        off += x.t[i].nbytes;
    }
    CHECK(contiguous, "tensor bytes are contiguous in the given order");

    st_file f;
    st = st_read(p, &f, err, sizeof err);
    CHECK(st == ST_OK, "read: %s", err);
    if (st == ST_OK) {
        CHECK(f.count == x.count, "count %d", f.count);
        int all = f.count == x.count;
        for (int i = 0; all && i < x.count; i++)
            if (!same_tensor(&f.tensors[i], &x.t[i])) {
                all = 0;
                CHECK(0, "tensor %d (%s) differs", i, x.t[i].name);
            }
        CHECK(all, "all tensors equal, in header order");
        int aligned = 1;
        for (int i = 0; i < f.count; i++)
            if ((uintptr_t)f.tensors[i].data % st_dtype_size(f.tensors[i].dtype) != 0)
                aligned = 0;
        CHECK(aligned, "data pointers aligned to the element size");
        /* A typed load: UBSan flags it if the pointer is misaligned. */
        const st_tensor *t = st_find(&f, "scale");
        CHECK(t && t->ndim == 0 && *(const double *)t->data == 3.25, "0-d scalar");
        t = st_find(&f, "empty");
        CHECK(t && t->nbytes == 0 && t->ndim == 2 && t->shape[0] == 0 && t->shape[1] == 4,
              "empty tensor");
        CHECK(st_find(&f, "nope") == NULL, "st_find of a missing name");
        CHECK(f.meta_count == 2 && strcmp(st_meta_get(&f, "format"), "pt") == 0 &&
                  strcmp(st_meta_get(&f, "note"), meta[3]) == 0 &&
                  st_meta_get(&f, "missing") == NULL && f.meta_kv[4] == NULL,
              "metadata");

        /* What was read writes back byte for byte. */
        const char *p2 = tpath("rt2.safetensors");
        st = st_write(p2, f.tensors, f.count, f.meta_kv, err, sizeof err);
        CHECK(st == ST_OK, "rewrite: %s", err);
        size_t len2 = 0;
        unsigned char *raw2 = read_bytes(p2, &len2);
        CHECK(raw2 && len2 == len && memcmp(raw, raw2, len) == 0, "rewrite is identical");
        free(raw2);

        /* The file's bytes in memory read as the file does. */
        st_file m;
        st = st_read_mem(raw, len, p, &m, err, sizeof err);
        CHECK(st == ST_OK, "read from memory: %s", err);
        int same = st == ST_OK && m.count == f.count && m.meta_count == f.meta_count;
        for (int i = 0; same && i < f.count; i++)
            same = same_tensor(&m.tensors[i], &f.tensors[i]) &&
                   (uintptr_t)m.tensors[i].data % st_dtype_size(m.tensors[i].dtype) == 0;
        for (int i = 0; same && i < 2 * f.meta_count; i++)
            same = strcmp(m.meta_kv[i], f.meta_kv[i]) == 0;
        CHECK(same, "st_read_mem gives what st_read gives, data aligned");
        st_free(&m);
        st_free(&f);
        CHECK(f.tensors == NULL && f.count == 0, "st_free zeroes");
        st_free(&f); /* twice is harmless */
        st_free(NULL);
    }
    free(raw);

    /* Nothing at all: header "{}" plus padding, no data. */
    p = tpath("empty.safetensors");
    st = st_write(p, NULL, 0, NULL, err, sizeof err);
    CHECK(st == ST_OK, "write empty: %s", err);
    raw = read_bytes(p, &len);
    CHECK(raw && len == 16 && memcmp(raw + 8, "{}      ", 8) == 0, "empty file layout");
    free(raw);
    st = st_read(p, &f, err, sizeof err);
    CHECK(st == ST_OK && f.count == 0 && f.meta_count == 0 && f.meta_kv && !f.meta_kv[0],
          "read empty: %s", err);
    st_free(&f);

    /* Overwrite keeps an existing file's mode. */
    p = tpath("mode.safetensors");
    write_bytes(p, "x", 1);
    chmod(p, 0600);
    st = st_write(p, x.t, 2, NULL, err, sizeof err);
    CHECK(st == ST_OK && stat(p, &sb) == 0 && (sb.st_mode & 07777) == 0600,
          "overwrite keeps mode 0600 (%o): %s", (unsigned)(sb.st_mode & 07777), err);
    st = st_read(p, &f, err, sizeof err);
    CHECK(st == ST_OK && f.count == 2, "overwritten file reads back");
    st_free(&f);

    /* Metadata that is JSON null counts as none; extra tensor fields are ignored. */
    write_raw(tpath("nullmeta.safetensors"),
              "{\"__metadata__\":null,\"a\":{\"dtype\":\"U8\",\"shape\":[2],"
              "\"data_offsets\":[0,2],\"extra\":[1]}}",
              2);
    st = st_read(tpath("nullmeta.safetensors"), &f, err, sizeof err);
    CHECK(st == ST_OK && f.count == 1 && f.meta_count == 0, "null metadata: %s", err);
    st_free(&f);

    /* Leading JSON whitespace is fine, as in the reference reader. */
    write_raw(tpath("lead.safetensors"),
              " \n{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2);
    st = st_read(tpath("lead.safetensors"), &f, err, sizeof err);
    CHECK(st == ST_OK && f.count == 1, "leading whitespace: %s", err);
    st_free(&f);

    /* A zero-size tensor may sit at the end of the data section. */
    write_raw(tpath("zend.safetensors"),
              "{\"a\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]},"
              "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[2,2]}}",
              2);
    st = st_read(tpath("zend.safetensors"), &f, err, sizeof err);
    CHECK(st == ST_OK && f.count == 2, "zero-size tensor at the end: %s", err);
    st_free(&f);
}

static void test_corrupt(void)
{
    static const char OK1[] = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

    /* Sanity: the base header is accepted, so each failure below is the mutation's. */
    {
        write_raw(tpath("ok.safetensors"), OK1, 8);
        st_file f;
        char err[256];
        CHECK(st_read(tpath("ok.safetensors"), &f, err, sizeof err) == ST_OK, "base: %s", err);
        st_free(&f);
    }

    /* Framing. */
    write_bytes(tpath("zero.safetensors"), "", 0);
    expect_fail(__LINE__, "empty file", tpath("zero.safetensors"), ST_ERR_FORMAT, "shorter");
    write_bytes(tpath("five.safetensors"), "\x02\0\0\0\0", 5);
    expect_fail(__LINE__, "5-byte file", tpath("five.safetensors"), ST_ERR_FORMAT, "is 5 bytes");
    write_raw_len(tpath("huge.safetensors"), 100000001, "{}", 2, NULL, 0);
    expect_fail(__LINE__, "header over limit", tpath("huge.safetensors"), ST_ERR_FORMAT,
                "header length 100000001 exceeds");
    write_raw_len(tpath("huge2.safetensors"), UINT64_MAX, "{}", 2, NULL, 0);
    expect_fail(__LINE__, "header length 2^64-1", tpath("huge2.safetensors"), ST_ERR_FORMAT,
                "exceeds");
    write_raw_len(tpath("past.safetensors"), 1000, "{}", 2, NULL, 0);
    expect_fail(__LINE__, "header past EOF", tpath("past.safetensors"), ST_ERR_FORMAT,
                "runs past the end");
    write_raw_len(tpath("hzero.safetensors"), 0, "", 0, NULL, 0);
    expect_fail(__LINE__, "zero-length header", tpath("hzero.safetensors"), ST_ERR_FORMAT,
                "does not start with '{'");

    /* Truncations of a valid file: every length short of the full file fails. */
    {
        fixture x;
        make_fixture(&x);
        char err[256];
        const char *p = tpath("trunc_src.safetensors");
        st_write(p, x.t, x.count, NULL, err, sizeof err);
        size_t len = 0;
        unsigned char *raw = read_bytes(p, &len);
        int bad = 0;
        for (size_t cut = 0; cut < len; cut++) {
            write_bytes(tpath("trunc.safetensors"), raw, cut);
            st_file f;
            if (st_read(tpath("trunc.safetensors"), &f, err, sizeof err) != ST_ERR_FORMAT) {
                bad++;
                if (bad < 3)
                    printf("  truncated to %zu: accepted or wrong error: %s\n", cut, err);
            }
            st_free(&f);
        }
        CHECK(bad == 0, "all %zu truncations refused (%d not)", len, bad);
        /* One byte cut from the data: the last tensor runs past the data. */
        write_bytes(tpath("trunc.safetensors"), raw, len - 1);
        expect_fail(__LINE__, "data cut by 1", tpath("trunc.safetensors"), ST_ERR_FORMAT,
                    "run past the data section");
        /* One byte appended: a byte that belongs to no tensor. */
        unsigned char *more = malloc(len + 1);
        memcpy(more, raw, len);
        more[len] = 0;
        write_bytes(tpath("long.safetensors"), more, len + 1);
        expect_fail(__LINE__, "extra trailing byte", tpath("long.safetensors"), ST_ERR_FORMAT,
                    "belong to no tensor");

        /* Byte flips all over the header: structural ones must fail, and none
         * may crash or leak (ASan watches). */
        uint64_t hlen = 0;
        for (int i = 7; i >= 0; i--)
            hlen = (hlen << 8) | raw[i];
        static const unsigned char vals[] = {0x00, 0xff, '{', '}', '"', ',',  ':',
                                             '[',  ']',  '-', '9', ' ', 0x80, 0xc3};
        int accepted = 0, tried = 0;
        unsigned sink = 0;
        for (size_t pos = 8; pos < 8 + hlen; pos++) {
            for (size_t v = 0; v < sizeof vals; v++) {
                if (raw[pos] == vals[v])
                    continue;
                memcpy(more, raw, len);
                more[pos] = vals[v];
                write_bytes(tpath("flip.safetensors"), more, len);
                st_file f;
                st_status st = st_read(tpath("flip.safetensors"), &f, err, sizeof err);
                tried++;
                if (st == ST_OK) {
                    /* Only a flip inside a name or value string can stay valid;
                     * touch every byte so ASan sees any tensor out of bounds. */
                    accepted++;
                    for (int i = 0; i < f.count; i++)
                        for (size_t b = 0; b < f.tensors[i].nbytes; b++)
                            sink += ((volatile unsigned char *)f.tensors[i].data)[b];
                }
                st_free(&f);
            }
        }
        CHECK(tried > 1000 && accepted < tried / 10, "header flips: %d of %d accepted (%u)",
              accepted, tried, sink & 0);
        /* Specific flips. */
        memcpy(more, raw, len);
        more[8] = 0xff;
        write_bytes(tpath("flip.safetensors"), more, len);
        expect_fail(__LINE__, "first byte 0xff", tpath("flip.safetensors"), ST_ERR_FORMAT,
                    "does not start with '{'");
        memcpy(more, raw, len);
        more[9] = 0xff;
        write_bytes(tpath("flip.safetensors"), more, len);
        expect_fail(__LINE__, "0xff in header", tpath("flip.safetensors"), ST_ERR_FORMAT,
                    "not valid UTF-8");
        memcpy(more, raw, len);
        more[8 + hlen - 1] = 0;
        write_bytes(tpath("flip.safetensors"), more, len);
        expect_fail(__LINE__, "NUL in header", tpath("flip.safetensors"), ST_ERR_FORMAT,
                    "NUL byte");
        memcpy(more, raw, len);
        more[0] ^= 0x08; /* header length off by 8: JSON ends early or runs into data */
        write_bytes(tpath("flip.safetensors"), more, len);
        expect_fail(__LINE__, "header length changed", tpath("flip.safetensors"), ST_ERR_FORMAT,
                    "");
        free(more);
        free(raw);
    }

    /* JSON. */
    BAD_HEADER("not JSON", "{abc", 0, "not valid JSON");
    BAD_HEADER("truncated JSON", "{\"a\":{\"dtype\":\"F32\"", 0, "not valid JSON");
    BAD_HEADER("trailing text", "{} x", 0, "not valid JSON");
    BAD_HEADER("trailing control byte", "{}  \x01", 0, "unexpected text at byte 4");
    BAD_HEADER("two objects", "{}{}", 0, "not valid JSON");
    /* U+0000 spelled \u0000: cJSON decodes it into a C string, which ends
     * there, so "a\u0000b" read as "a" and "F32\u0000x" as F32 (found by
     * fuzz_safetensors). Refused wherever it is; \\u0000 (a backslash, then
     * text) is no such escape. */
    BAD_HEADER("\\u0000 in a name",
               "{\"a\\u0000b\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               "U+0000 (\\u0000) at byte 3");
    BAD_HEADER("\\u0000 in a dtype",
               "{\"a\":{\"dtype\":\"U8\\u0000x\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1,
               "U+0000");
    BAD_HEADER("\\u0000 in a metadata key", "{\"__metadata__\":{\"\\u0000\":\"pt\"}}", 0, "U+0000");
    BAD_HEADER("\\u0000 in a metadata value", "{\"__metadata__\":{\"k\":\"x\\u0000\"}}", 0,
               "U+0000");
    {
        write_raw(tpath("bs.safetensors"), "{\"__metadata__\":{\"k\":\"\\\\u0000\"}}", 0);
        st_file f;
        char err[512] = "";
        st_status st = st_read(tpath("bs.safetensors"), &f, err, sizeof err);
        CHECK(st == ST_OK && strcmp(st_meta_get(&f, "k"), "\\u0000") == 0,
              "an escaped backslash before u0000 is text: %s", err);
        st_free(&f);
    }
    BAD_HEADER("array", "[1,2]", 0, "does not start with '{'");
    BAD_HEADER("whitespace only", "  \n ", 0, "does not start with '{'");
    BAD_HEADER("control byte before {", "\x01{}", 0, "does not start with '{'");
    BAD_HEADER("overlong UTF-8", "{\"\xc0\xaf\":1}", 0, "not valid UTF-8");
    BAD_HEADER("surrogate UTF-8", "{\"\xed\xa0\x80\":1}", 0, "not valid UTF-8");
    BAD_HEADER("entry not object", "{\"a\":[1]}", 0, "\"a\": entry is not a JSON object");

    /* dtype. */
    BAD_HEADER("unknown dtype", "{\"a\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}",
               8, "\"a\": unknown or unsupported dtype \"F33\"");
    BAD_HEADER("lowercase dtype",
               "{\"a\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               "dtype \"f32\"");
    BAD_HEADER("sub-byte dtype", "{\"a\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]}}",
               1, "dtype \"F4\"");
    BAD_HEADER("dtype number", "{\"a\":{\"dtype\":4,\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
               "not a string");
    BAD_HEADER("no dtype", "{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, "no \"dtype\"");

    /* shape. */
    /* A dim past 2^53 is too large, not "not an integer". */
    BAD_HEADER("dim 2^60",
               "{\"a\":{\"dtype\":\"U8\",\"shape\":[1152921504606846976],\"data_offsets\":[0,0]}}",
               0, "\"a\": shape[0] = 1152921504606846976 is too large: a dim must be at most 2^53");
    BAD_HEADER("negative dim",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1,2],\"data_offsets\":[0,8]}}", 8,
               "\"a\": shape[0] = -1 is not a non-negative integer");
    BAD_HEADER("fractional dim",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,1.5],\"data_offsets\":[0,8]}}", 8,
               "shape[1] = 1.5");
    BAD_HEADER("string dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}",
               8, "shape[0] = \"2\"");
    BAD_HEADER("huge dim", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,8]}}",
               8, "shape[0]");
    BAD_HEADER("shape not array", "{\"a\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}",
               8, "\"shape\" is not an array");
    BAD_HEADER("no shape", "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8,
               "\"shape\" is missing");
    BAD_HEADER("9 dims",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],"
               "\"data_offsets\":[0,8]}}",
               8, "9 dimensions");
    BAD_HEADER("shape product overflow",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],"
               "\"data_offsets\":[0,8]}}",
               8, "overflows");
    BAD_HEADER("byte count overflow",
               "{\"a\":{\"dtype\":\"F64\",\"shape\":[4503599627370496,1024],"
               "\"data_offsets\":[0,8]}}",
               8, "overflows");

    /* data_offsets. */
    BAD_HEADER("one offset", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8,
               "\"a\": \"data_offsets\" must be [begin, end]");
    BAD_HEADER("three offsets",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,8]}}", 8,
               "data_offsets");
    BAD_HEADER("negative offset",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[-8,0]}}", 8, "[-8,0]");
    BAD_HEADER("string offset",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[\"0\",8]}}", 8,
               "data_offsets");
    BAD_HEADER("fractional offset",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8.5]}}", 8,
               "data_offsets");
    BAD_HEADER("offset past 2^53",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
               "\"data_offsets\":[0,18446744073709551616]}}",
               8, "data_offsets");
    BAD_HEADER("no offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "got nothing");
    BAD_HEADER("end before begin",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
               "[8, 0] end before they begin");
    BAD_HEADER("size mismatch", "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}",
               8, "\"a\": data_offsets [0, 4] hold 4 bytes but shape [2] of F32 needs 8");
    BAD_HEADER("scalar size mismatch",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,8]}}", 8,
               "shape [] of F32 needs 4");
    BAD_HEADER("past data section",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
               "run past the data section (8 bytes)");

    /* Tiling of the data section. */
    BAD_HEADER("overlap",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
               12, "tensor \"b\" [4, 12] overlaps tensor \"a\" [0, 8]");
    BAD_HEADER("same range twice",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"b\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}",
               8, "overlaps");
    BAD_HEADER("empty tensor inside another",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
               "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}",
               8, "\"z\" [4, 4] overlaps");
    BAD_HEADER("hole",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
               12, "data bytes [4, 8) belong to no tensor (gap before tensor \"b\")");
    BAD_HEADER("hole at start", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
               8, "[0, 4) belong to no tensor");
    BAD_HEADER("trailing data", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
               8, "[4, 8) at the end of the file belong to no tensor");
    BAD_HEADER("data but no tensors", "{}", 8, "[0, 8) at the end");

    /* Names and metadata. */
    BAD_HEADER("duplicate name",
               "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
               "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
               8, "name \"a\" appears more than once");
    BAD_HEADER("duplicate metadata", "{\"__metadata__\":{},\"__metadata__\":{}}", 0,
               "\"__metadata__\" appears");
    /* A repeated metadata key was kept twice: st_meta_get saw the first
     * value (the reference reader keeps the last) and st_write refused to
     * write the file back (found by fuzz_safetensors). */
    BAD_HEADER("duplicate metadata key",
               "{\"__metadata__\":{\"fmha.seed\":\"1\",\"k\":\"x\",\"fmha.seed\":\"2\"}}", 0,
               "metadata key \"fmha.seed\" appears more than once");
    BAD_HEADER("metadata not object", "{\"__metadata__\":[\"a\"]}", 0,
               "\"__metadata__\" is not an object");
    BAD_HEADER("metadata value not string", "{\"__metadata__\":{\"k\":1}}", 0,
               "value of \"k\" is not a string");

    /* Not a file. */
    expect_fail(__LINE__, "missing file", tpath("does-not-exist"), ST_ERR_IO, "cannot open");
    expect_fail(__LINE__, "directory", g_dir, ST_ERR_IO, "");
    {
        st_file f;
        char err[512] = "";
        CHECK(st_read_mem(NULL, 8, "x", &f, err, sizeof err) == ST_ERR_ARG && err[0],
              "st_read_mem of NULL data");
        CHECK(st_read_mem(NULL, 0, NULL, &f, err, sizeof err) == ST_ERR_FORMAT &&
                  strstr(err, "(memory): file is 0 bytes") == err && f.tensors == NULL,
              "st_read_mem of no bytes: %s", err);
    }

    /* A NULL or tiny error buffer is fine. */
    st_file f;
    CHECK(st_read(tpath("zero.safetensors"), &f, NULL, 0) == ST_ERR_FORMAT, "NULL err");
    char tiny[4] = "xxx";
    CHECK(st_read(tpath("zero.safetensors"), &f, tiny, sizeof tiny) == ST_ERR_FORMAT &&
              strlen(tiny) == 3,
          "tiny err buffer truncated and terminated");
}

/* Writes that must fail leave `victim` (an existing file) exactly as it was
 * and no temporary file behind. */
static void check_untouched(int line, const char *what, const char *victim)
{
    size_t len = 0;
    unsigned char *raw = read_bytes(victim, &len);
    int ok = raw && len == 9 && memcmp(raw, "old bytes", 9) == 0 && count_temp_files(g_dir) == 0;
    if (ok) {
        tu_passed++;
    } else {
        tu_failed++;
        printf("FAIL line %d (%s): existing file changed or temp file left\n", line, what);
    }
    free(raw);
}

static void expect_write_fail(int line, const char *what, const st_tensor *t, int n,
                              const char *const *meta, st_status want, const char *sub)
{
    const char *victim = tpath("victim.safetensors");
    write_bytes(victim, "old bytes", 9);
    char err[512] = "";
    st_status st = st_write(victim, t, n, meta, err, sizeof err);
    if (st == want && strstr(err, sub)) {
        tu_passed++;
    } else {
        tu_failed++;
        printf("FAIL line %d (%s): got %s \"%s\", want %s containing \"%s\"\n", line, what,
               st_status_string(st), err, st_status_string(want), sub);
    }
    check_untouched(line, what, victim);
}

static void test_write_failures(void)
{
    fixture x;
    make_fixture(&x);
    char err[512];

    /* A directory that does not exist: nothing is created anywhere. */
    char nodir[256];
    snprintf(nodir, sizeof nodir, "%s/no/such/dir/out.safetensors", g_dir);
    st_status st = st_write(nodir, x.t, x.count, NULL, err, sizeof err);
    CHECK(st == ST_ERR_IO && strstr(err, "cannot create temporary file"),
          "write into a missing directory: %s %s", st_status_string(st), err);
    CHECK(access(nodir, F_OK) != 0 && count_temp_files(g_dir) == 0, "nothing created");

    /* Invalid arguments are refused before any file is touched. */
    st_tensor t[2];
    int64_t s2[] = {2};
    t[0] = st_tensor_make("a", ST_DTYPE_F32, 1, s2, x.f32);
    t[1] = t[0];
    expect_write_fail(__LINE__, "duplicate names", t, 2, NULL, ST_ERR_ARG, "\"a\" is used twice");
    t[1].name = "__metadata__";
    expect_write_fail(__LINE__, "reserved name", t, 2, NULL, ST_ERR_ARG, "reserved");
    t[1] = t[0];
    t[1].name = NULL;
    expect_write_fail(__LINE__, "NULL name", t, 2, NULL, ST_ERR_ARG, "tensor 1 has no name");
    t[1].name = "bad\xff";
    expect_write_fail(__LINE__, "non-UTF-8 name", t, 2, NULL, ST_ERR_ARG, "UTF-8");
    t[1] = t[0];
    t[1].name = "b";
    t[1].nbytes = 7;
    expect_write_fail(__LINE__, "nbytes mismatch", t, 2, NULL, ST_ERR_ARG,
                      "\"b\": nbytes is 7 but shape [2] of F32 needs 8");
    t[1].nbytes = 8;
    t[1].data = NULL;
    expect_write_fail(__LINE__, "NULL data", t, 2, NULL, ST_ERR_ARG, "data is NULL");
    t[1].data = x.f32;
    t[1].dtype = ST_DTYPE_COUNT;
    expect_write_fail(__LINE__, "bad dtype", t, 2, NULL, ST_ERR_ARG, "invalid dtype");
    t[1].dtype = ST_DTYPE_F32;
    t[1].ndim = 9;
    expect_write_fail(__LINE__, "ndim 9", t, 2, NULL, ST_ERR_ARG, "ndim 9");
    t[1].ndim = 1;
    t[1].shape[0] = -2;
    expect_write_fail(__LINE__, "negative dim", t, 2, NULL, ST_ERR_ARG, "shape [-2]");
    int64_t big[] = {INT64_MAX / 2, 3};
    t[1] = st_tensor_make("b", ST_DTYPE_U8, 2, big, x.f32);
    CHECK(t[1].nbytes == 0, "st_tensor_make: overflow gives nbytes 0");
    expect_write_fail(__LINE__, "shape overflow", t, 2, NULL, ST_ERR_ARG, "overflows");
    expect_write_fail(__LINE__, "negative count", t, -1, NULL, ST_ERR_ARG, "-1 tensors");
    const char *m1[] = {"k", NULL};
    expect_write_fail(__LINE__, "key without value", t, 1, m1, ST_ERR_ARG,
                      "metadata key \"k\" has no value");
    const char *m2[] = {"k", "1", "k", "2", NULL};
    expect_write_fail(__LINE__, "duplicate metadata key", t, 1, m2, ST_ERR_ARG,
                      "\"k\" is used twice");

    /* Failure in the middle of writing the data: a file-size limit makes
     * write() fail with EFBIG after the temp file has been created. */
    {
        struct sigaction ign, old_sa;
        memset(&ign, 0, sizeof ign);
        ign.sa_handler = SIG_IGN;
        sigaction(SIGXFSZ, &ign, &old_sa);
        struct rlimit old_rl, rl;
        getrlimit(RLIMIT_FSIZE, &old_rl);
        size_t n = 1 << 20;
        uint8_t *blob = calloc(n, 1);
        int64_t sn[] = {(int64_t)n};
        st_tensor bt = st_tensor_make("blob", ST_DTYPE_U8, 1, sn, blob);
        const char *victim = tpath("victim.safetensors");
        write_bytes(victim, "old bytes", 9);
        rl = old_rl;
        rl.rlim_cur = 64 * 1024;
        if (setrlimit(RLIMIT_FSIZE, &rl) == 0) {
            st = st_write(victim, &bt, 1, NULL, err, sizeof err);
            setrlimit(RLIMIT_FSIZE, &old_rl);
            CHECK(st == ST_ERR_IO && strstr(err, "cannot write temporary file"),
                  "write past the file-size limit fails: %s %s", st_status_string(st), err);
            check_untouched(__LINE__, "EFBIG mid-write", victim);
        } else {
            CHECK(0, "setrlimit: %s", strerror(errno));
        }
        sigaction(SIGXFSZ, &old_sa, NULL);
        free(blob);
    }

    /* A directory at the path is refused before anything is written. */
    {
        const char *dir = tpath("adir");
        mkdir(dir, 0755);
        char inner[300];
        snprintf(inner, sizeof inner, "%s/keep", dir);
        write_bytes(inner, "k", 1);
        st = st_write(dir, x.t, x.count, NULL, err, sizeof err);
        struct stat sb;
        CHECK(st == ST_ERR_ARG && strstr(err, "is a directory, not a regular file") &&
                  stat(inner, &sb) == 0 && count_temp_files(g_dir) == 0,
              "a directory as output is refused: %s %s", st_status_string(st), err);
        unlink(inner);
        rmdir(dir);
    }
}

/* Outputs that would destroy something: a non-regular file (a device node
 * would be replaced by a regular file when run as root), and an input, by
 * its own name, a hard link or a symlink. */
static void test_output_guard(void)
{
    fixture x;
    make_fixture(&x);
    char err[512] = "";
    st_status st = st_check_output("/dev/null", NULL, err, sizeof err);
    CHECK(st == ST_ERR_ARG && strstr(err, "/dev/null exists and is a character device"),
          "/dev/null refused: %s %s", st_status_string(st), err);
    /* Written to, a FIFO stands for a device node (replacing /dev/null in a
     * test run as root would break the machine when the check regresses). */
    struct stat sb;
    const char *fifo = tpath("fifo");
    CHECK(mkfifo(fifo, 0644) == 0, "mkfifo: %s", strerror(errno));
    st = st_write(fifo, x.t, x.count, NULL, err, sizeof err);
    CHECK(st == ST_ERR_ARG && strstr(err, "is a FIFO, not a regular file") &&
              stat(fifo, &sb) == 0 && S_ISFIFO(sb.st_mode) && count_temp_files(g_dir) == 0,
          "st_write refuses a FIFO and leaves it one: %s %s", st_status_string(st), err);
    unlink(fifo);

    const char *in = tpath("in.safetensors");
    CHECK(st_write(in, x.t, x.count, NULL, err, sizeof err) == ST_OK, "write input: %s", err);
    const char *inputs[] = {in, NULL};
    st = st_check_output(in, inputs, err, sizeof err);
    CHECK(st == ST_ERR_ARG && strstr(err, "is the same file as input") &&
              strstr(err, "give another output path"),
          "output = input refused: %s %s", st_status_string(st), err);
    const char *hard = tpath("hard.safetensors"), *soft = tpath("soft.safetensors");
    CHECK(link(in, hard) == 0 && symlink(in, soft) == 0, "make links: %s", strerror(errno));
    CHECK(st_check_output(hard, inputs, err, sizeof err) == ST_ERR_ARG, "hard link refused");
    CHECK(st_check_output(soft, inputs, err, sizeof err) == ST_ERR_ARG, "symlink refused");
    const char *via_soft[] = {soft, NULL};
    CHECK(st_check_output(in, via_soft, err, sizeof err) == ST_ERR_ARG,
          "input named through a symlink refused");
    CHECK(st_check_output(tpath("new.safetensors"), inputs, err, sizeof err) == ST_OK,
          "a new path is fine: %s", err);
    unlink(hard);
    unlink(soft);
    unlink(in);
}

/* A write killed before its rename leaves DIR/.BASE.fmha-tmp.PID; the next
 * write to BASE removes it when PID is gone, and keeps a live writer's. */
static void test_stale_temps(void)
{
    fixture x;
    make_fixture(&x);
    char err[512];
    pid_t child = fork();
    if (child == 0)
        _exit(0);
    waitpid(child, NULL, 0); /* a pid that ran and is gone */
    char dead[300], live[300], other[300];
    snprintf(dead, sizeof dead, "%s/.out.safetensors.fmha-tmp.%ld", g_dir, (long)child);
    snprintf(live, sizeof live, "%s/.out.safetensors.fmha-tmp.%ld", g_dir, (long)getppid());
    snprintf(other, sizeof other, "%s/.other.safetensors.fmha-tmp.%ld", g_dir, (long)child);
    write_bytes(dead, "partial", 7);
    write_bytes(live, "partial", 7);
    write_bytes(other, "partial", 7);
    CHECK(st_write(tpath("out.safetensors"), x.t, x.count, NULL, err, sizeof err) == ST_OK,
          "write: %s", err);
    CHECK(access(dead, F_OK) != 0, "a dead writer's temp file is removed");
    CHECK(access(live, F_OK) == 0, "a live writer's temp file is kept");
    CHECK(access(other, F_OK) == 0, "another output's temp file is kept");
    unlink(live);
    unlink(other);
    unlink(tpath("out.safetensors"));
}

static void remove_dir(const char *dir)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
            continue;
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "/tmp/fmha_test_st_XXXXXX");
    if (mkdtemp(g_dir) == NULL) {
        printf("mkdtemp: %s\n", strerror(errno));
        return 2;
    }
    test_dtypes();
    test_round_trip();
    test_corrupt();
    test_write_failures();
    test_output_guard();
    test_stale_temps();
    remove_dir(g_dir);
    return tu_summary();
}
