"""make_packed.py — writes a packed (variable-length) safetensors input for
the CLI tests with the standard library only: three sequences, one of them
empty, q [45, 4, 32], k/v [50, 2, 32] (GQA), f32, plus int32 cu_seqlens."""
import json
import random
import struct
import sys

random.seed(7)
tensors = {
    "q": ("F32", [45, 4, 32], [random.gauss(0, 1) for _ in range(45 * 4 * 32)]),
    "k": ("F32", [50, 2, 32], [random.gauss(0, 1) for _ in range(50 * 2 * 32)]),
    "v": ("F32", [50, 2, 32], [random.gauss(0, 1) for _ in range(50 * 2 * 32)]),
    "cu_seqlens_q": ("I32", [4], [0, 20, 20, 45]),
    "cu_seqlens_k": ("I32", [4], [0, 25, 30, 50]),
}
header, blobs, offset = {}, [], 0
for name, (dtype, shape, values) in tensors.items():
    blob = struct.pack("<%d%s" % (len(values), "f" if dtype == "F32" else "i"), *values)
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
text = json.dumps(header).encode()
text += b" " * (-len(text) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
