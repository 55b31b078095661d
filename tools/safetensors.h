/* safetensors.h — reader and writer of the safetensors file format, for the
 * fmha tools and tests (inputs and reference outputs live in such files).
 * Not part of libfmha; needs only libc, POSIX and cJSON (-lcjson).
 *
 * Usage:
 *
 *     char err[512];
 *     st_file f;
 *     if (st_read("qkv.safetensors", &f, err, sizeof err) != ST_OK) {
 *         fprintf(stderr, "%s\n", err); ...
 *     }
 *     const st_tensor *q = st_find(&f, "q");       // NULL if absent
 *     const char *note = st_meta_get(&f, "note");  // NULL if absent
 *     ...
 *     st_free(&f);
 *
 *     int64_t shape[4] = {B, S, H, D};
 *     st_tensor out = st_tensor_make("out", ST_DTYPE_BF16, 4, shape, ptr);
 *     const char *meta[] = {"format", "pt", NULL};
 *     if (st_write("out.safetensors", &out, 1, meta, err, sizeof err) != ST_OK) ...
 *
 * File layout: an 8-byte little-endian header length N, N bytes of UTF-8
 * JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
 * "__metadata__": {string: string}}, then the data section. Offsets are
 * relative to the data section, whose every byte belongs to exactly one tensor.
 *
 * Nothing here prints or exits; every error returns a nonzero st_status and
 * writes a message naming the file, tensor and value into err (when err is
 * not NULL and errlen > 0; long messages are truncated). */
#ifndef FMHA_TOOLS_SAFETENSORS_H
#define FMHA_TOOLS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "fmha.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum st_status {
    ST_OK = 0,
    ST_ERR_ARG,    /* the caller passed something impossible (writer) */
    ST_ERR_IO,     /* open/read/write/rename failed; message has strerror */
    ST_ERR_FORMAT, /* the file is not a valid safetensors file */
    ST_ERR_NOMEM
} st_status;

const char *st_status_string(st_status status); /* "ST_ERR_FORMAT" */

/* Every byte-sized dtype of the format. Sub-byte ones (F4, F6_*) are not
 * supported and read as a format error. */
typedef enum st_dtype {
    ST_DTYPE_BOOL = 0,
    ST_DTYPE_U8,
    ST_DTYPE_I8,
    ST_DTYPE_F8_E5M2,
    ST_DTYPE_F8_E4M3,
    ST_DTYPE_F8_E8M0,
    ST_DTYPE_I16,
    ST_DTYPE_U16,
    ST_DTYPE_F16,
    ST_DTYPE_BF16,
    ST_DTYPE_I32,
    ST_DTYPE_U32,
    ST_DTYPE_F32,
    ST_DTYPE_F64,
    ST_DTYPE_I64,
    ST_DTYPE_U64,
    ST_DTYPE_C64,
    ST_DTYPE_COUNT
} st_dtype;

const char *st_dtype_name(st_dtype dtype); /* "BF16" as in the file; NULL if invalid */
size_t st_dtype_size(st_dtype dtype);      /* bytes per element; 0 if invalid */
/* Exact, case-sensitive lookup of a file dtype name. Returns 0 on success. */
int st_dtype_from_name(const char *name, st_dtype *out);
/* F32/F16/BF16/F8_E4M3 <-> fmha_dtype. Return 0 on success, nonzero when the
 * dtype has no counterpart (then *out is untouched). */
int st_dtype_to_fmha(st_dtype dtype, fmha_dtype *out);
int st_dtype_from_fmha(fmha_dtype dtype, st_dtype *out);

#define ST_MAX_DIMS 8
/* The format's own limit; a larger header is rejected on read and write. */
#define ST_MAX_HEADER_BYTES 100000000

typedef struct st_tensor {
    const char *name;
    st_dtype dtype;
    int ndim;                   /* 0..ST_MAX_DIMS; 0 is a scalar (one element) */
    int64_t shape[ST_MAX_DIMS]; /* entries >= 0; entries past ndim are ignored */
    void *data;                 /* row-major, tightly packed; may be NULL if nbytes == 0 */
    size_t nbytes;              /* = product(shape) * st_dtype_size(dtype) */
} st_tensor;

/* A contiguous tensor over caller memory, nbytes computed from the shape
 * (0 if the product overflows or an argument is invalid; st_write then
 * rejects it with a message). */
st_tensor st_tensor_make(const char *name, st_dtype dtype, int ndim, const int64_t *shape,
                         void *data);

/* A file loaded into memory. Every pointer in it is owned by the st_file and
 * valid until st_free. */
typedef struct st_file {
    st_tensor *tensors; /* in header order */
    int count;
    /* "__metadata__" as key0, value0, key1, value1, ..., NULL (never NULL
     * itself after a successful read, so it can go straight to st_write). */
    const char **meta_kv;
    int meta_count; /* number of key/value pairs */
    void *data_;    /* private: the data section */
    void *aligned_; /* private: copies of tensors stored misaligned */
    char *strings_; /* private: names, keys and values */
} st_file;

/* Reads and validates the whole file. On success fills *out (free it with
 * st_free); on error *out is zeroed, so st_free on it is harmless.
 * Every tensor's data is aligned to its element size, so it may be cast to
 * e.g. const uint16_t * for BF16.
 * Integers in the header must be exact (|x| <= 2^53), since JSON numbers
 * are read as doubles; for the same reason an integral float such as 2.0
 * is taken as an integer (the reference reader refuses it). */
st_status st_read(const char *path, st_file *out, char *err, size_t errlen);

/* st_read on the `len` bytes of a whole file in memory (the same parser and
 * checks), e.g. a file received over a socket; `name` labels messages
 * ("(memory)" if NULL). The data is copied: `data` may be freed afterwards. */
st_status st_read_mem(const void *data, size_t len, const char *name, st_file *out, char *err,
                      size_t errlen);

const st_tensor *st_find(const st_file *f, const char *name); /* NULL if absent */
const char *st_meta_get(const st_file *f, const char *key);   /* NULL if absent */
void st_free(st_file *f);                                     /* zeroes *f; NULL-safe */

/* Writes `count` tensors, contiguous and in the given order, with the
 * metadata `meta_kv` (key, value, ..., NULL; or NULL for none). Names must be
 * unique, valid UTF-8 and not "__metadata__"; each nbytes must equal the
 * shape's size. The header is padded with spaces so the data section starts
 * 8-byte aligned.
 *
 * The file is written to DIR/.BASE.fmha-tmp.PID beside `path` (DIR/BASE),
 * flushed with fsync and renamed over `path`, so `path` either keeps its old
 * content or holds the complete new file; on failure the temporary file is
 * removed, and such files left by killed writers (whose PID no longer runs)
 * are removed by the next write to the same path. A new file gets mode 0644;
 * an existing file's mode is kept. A symlink at `path` is replaced by the
 * file, not followed. An existing `path` that is not a regular file (after
 * symlinks), such as /dev/null or a directory, is refused (ST_ERR_ARG), as
 * in st_check_output. */
st_status st_write(const char *path, const st_tensor *tensors, int count,
                   const char *const *meta_kv, char *err, size_t errlen);

/* Whether `path` may take an output: ST_ERR_ARG, with a message naming the
 * path and the fix, when it exists and is not a regular file (symlinks
 * followed), or is the same file (device and inode, so also through hard
 * links and symlinks) as one of `inputs` (NULL-terminated; NULL for none).
 * ST_OK when it does not exist. */
st_status st_check_output(const char *path, const char *const *inputs, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FMHA_TOOLS_SAFETENSORS_H */
