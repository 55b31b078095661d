#!/usr/bin/env python3
"""interop_safetensors.py — cross-checks tools/safetensors.c against the official
`safetensors` package: files it writes must read in C, and files the C writer
produces must load in the official reader. Skips (exit 77) without safetensors+numpy.

Usage: python3 tests/interop_safetensors.py   (from anywhere; needs gcc and libcjson)
"""
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as e:  # optional test: the C tests do not need Python
    print(f"skipped: {e}")
    sys.exit(77)  # ctest's SKIP_RETURN_CODE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A tiny driver: "read FILE" lists tensors with an FNV-1a hash of their bytes;
# "write FILE" writes a fixed set of tensors whose bytes Python recomputes.
DRIVER = r"""
#include "safetensors.h"
#include <stdio.h>
#include <string.h>

static unsigned long long fnv(const void *p, size_t n) {
    const unsigned char *b = p; unsigned long long h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) { h ^= b[i]; h *= 1099511628211ULL; }
    return h;
}

int main(int argc, char **argv) {
    char err[512];
    if (argc == 3 && strcmp(argv[1], "read") == 0) {
        st_file f;
        if (st_read(argv[2], &f, err, sizeof err) != ST_OK) { printf("ERR %s\n", err); return 1; }
        for (int i = 0; i < f.count; i++) {
            const st_tensor *t = &f.tensors[i];
            printf("T %s %s [", t->name, st_dtype_name(t->dtype));
            for (int d = 0; d < t->ndim; d++) printf("%s%lld", d ? "," : "", (long long)t->shape[d]);
            printf("] %zu %llu\n", t->nbytes, fnv(t->data, t->nbytes));
        }
        for (int i = 0; i < f.meta_count; i++) printf("M %s=%s\n", f.meta_kv[2*i], f.meta_kv[2*i+1]);
        st_free(&f);
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "write") == 0) {
        static unsigned char u8[5] = {1, 2, 3, 250, 255};
        static float f32[2][3] = {{1.5f, -2.0f, 0.0f}, {3.25f, 1e-3f, -7.0f}};
        static unsigned short f16[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};
        static int i32[3] = {-1, 0, 2147483647};
        static double f64 = 2.5;
        int64_t s5[] = {5}, s23[] = {2, 3}, s4[] = {4}, s3[] = {3}, s02[] = {0, 2};
        st_tensor t[] = {
            st_tensor_make("u8", ST_DTYPE_U8, 1, s5, u8),
            st_tensor_make("f32", ST_DTYPE_F32, 2, s23, f32),
            st_tensor_make("f16", ST_DTYPE_F16, 1, s4, f16),
            st_tensor_make("empty", ST_DTYPE_F32, 2, s02, NULL),
            st_tensor_make("i32", ST_DTYPE_I32, 1, s3, i32),
            st_tensor_make("scalar", ST_DTYPE_F64, 0, NULL, &f64),
        };
        const char *meta[] = {"format", "np", "who", "fmha \"C\" writer", NULL};
        if (st_write(argv[2], t, 6, meta, err, sizeof err) != ST_OK) { printf("ERR %s\n", err); return 1; }
        return 0;
    }
    return 2;
}
"""

NP_TO_ST = {np.float32: "F32", np.float16: "F16", np.float64: "F64", np.int64: "I64",
            np.int32: "I32", np.int16: "I16", np.uint8: "U8", np.int8: "I8", np.bool_: "BOOL",
            np.uint16: "U16", np.uint32: "U32", np.uint64: "U64"}


def fnv(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def main() -> int:
    passed = failed = 0

    def check(cond, msg):
        nonlocal passed, failed
        if cond:
            passed += 1
        else:
            failed += 1
            print("FAIL", msg)

    tmp = tempfile.mkdtemp(prefix="fmha_interop_")
    try:
        exe = os.path.join(tmp, "driver")
        src = os.path.join(tmp, "driver.c")
        with open(src, "w") as f:
            f.write(DRIVER)
        subprocess.run(["gcc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-O1",
                        "-fsanitize=address,undefined", "-I" + os.path.join(ROOT, "include"),
                        "-I" + os.path.join(ROOT, "tools"), src,
                        os.path.join(ROOT, "tools", "safetensors.c"), "-lcjson", "-o", exe],
                       check=True)

        # Official writer -> C reader.
        rng = np.random.default_rng(0)
        tensors = {
            "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((7, 3)).astype(np.float32),
            "k": rng.standard_normal((2, 3, 4)).astype(np.float16),
            "v": rng.standard_normal((5,)).astype(np.float64),
            "ids": np.arange(-3, 3, dtype=np.int64),
            "bytes": np.arange(11, dtype=np.uint8),
            "mask": np.array([True, False, True]),
            "i8": np.array([-128, 127], dtype=np.int8),
            "u16": np.array([1, 65535], dtype=np.uint16),
            "scalar": np.array(3.0, dtype=np.float32),
            "empty": np.zeros((0, 4), dtype=np.float32),
        }
        path = os.path.join(tmp, "official.safetensors")
        save_file(tensors, path, metadata={"format": "np", "note": "héllo"})
        out = subprocess.run([exe, "read", path], capture_output=True, text=True)
        check(out.returncode == 0, f"C read of official file: {out.stdout}{out.stderr}")
        got = {}
        meta = {}
        for line in out.stdout.splitlines():
            parts = line.split(" ")
            if parts[0] == "T":
                got[parts[1]] = (parts[2], parts[3], int(parts[4]), int(parts[5]))
            elif parts[0] == "M":
                k, v = line[2:].split("=", 1)
                meta[k] = v
        check(set(got) == set(tensors), f"names: {sorted(got)}")
        for name, arr in tensors.items():
            want = (NP_TO_ST[arr.dtype.type], "[" + ",".join(map(str, arr.shape)) + "]",
                    arr.nbytes, fnv(np.ascontiguousarray(arr).tobytes()))
            check(got.get(name) == want, f"{name}: got {got.get(name)}, want {want}")
        check(meta == {"format": "np", "note": "héllo"}, f"metadata: {meta}")

        # C writer -> official reader (which validates the header on its own).
        path = os.path.join(tmp, "fromc.safetensors")
        out = subprocess.run([exe, "write", path], capture_output=True, text=True)
        check(out.returncode == 0, f"C write: {out.stdout}{out.stderr}")
        want = {
            "u8": np.array([1, 2, 3, 250, 255], dtype=np.uint8),
            "f32": np.array([[1.5, -2.0, 0.0], [3.25, 1e-3, -7.0]], dtype=np.float32),
            "f16": np.array([0x3c00, 0xc000, 0x0001, 0x7bff], dtype=np.uint16).view(np.float16),
            "empty": np.zeros((0, 2), dtype=np.float32),
            "i32": np.array([-1, 0, 2147483647], dtype=np.int32),
            "scalar": np.array(2.5, dtype=np.float64),
        }
        try:
            with safe_open(path, framework="numpy") as f:
                check(f.metadata() == {"format": "np", "who": 'fmha "C" writer'},
                      f"metadata: {f.metadata()}")
                check(sorted(f.keys()) == sorted(want), f"keys: {sorted(f.keys())}")
                for name, arr in want.items():
                    t = f.get_tensor(name)
                    check(t.dtype == arr.dtype and t.shape == arr.shape and
                          t.tobytes() == arr.tobytes(), f"{name}: {t!r} != {arr!r}")
        except Exception as e:  # the official reader refused our file
            check(False, f"official reader: {e}")
        with open(path, "rb") as f:
            hlen = int.from_bytes(f.read(8), "little")
        check((8 + hlen) % 8 == 0, f"data section aligned: header {hlen}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
