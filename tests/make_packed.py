"""make_packed.py OUT [self|past] — writes a packed (variable-length) safetensors
input for the CLI tests with the standard library only: three sequences, one
of them empty, q [45, 4, 32], k/v [50, 2, 32] (GQA), f32, plus int32
cu_seqlens. With `self`, q and k/v hold the same four sequences (20, 0, 1
and 37 tokens: q [58, 4, 32], k/v [58, 2, 32]), as sequence parallelism
needs; `past` the same with offsets ending at 60, past the tensors."""
import json
import random
import struct
import sys

random.seed(7)
cu_q, cu_k = [0, 20, 20, 45], [0, 25, 30, 50]
if sys.argv[2:] in (["self"], ["past"]):
    cu_q = cu_k = [0, 20, 20, 21, 58]
nq, nk = cu_q[-1], cu_k[-1]
if sys.argv[2:] == ["past"]:  # offsets that end past the tensors' 58 tokens
    cu_q = cu_k = [0, 20, 20, 21, 60]
tensors = {
    "q": ("F32", [nq, 4, 32], [random.gauss(0, 1) for _ in range(nq * 4 * 32)]),
    "k": ("F32", [nk, 2, 32], [random.gauss(0, 1) for _ in range(nk * 2 * 32)]),
    "v": ("F32", [nk, 2, 32], [random.gauss(0, 1) for _ in range(nk * 2 * 32)]),
    "cu_seqlens_q": ("I32", [len(cu_q)], cu_q),
    "cu_seqlens_k": ("I32", [len(cu_k)], cu_k),
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
