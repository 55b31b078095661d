"""test_results_md.py — the benches' --out path without a GPU: results_md.py's section writing,
and each GPU bench's Markdown on synthetic numbers (torch and triton replaced by stubs, which
only have to make the imports succeed: the functions tested use neither).

usage: python3 bench/test_results_md.py
"""
import argparse
import math
import os
import sys
import tempfile
import types
import unittest


def stub_gpu_modules():
    """Empty torch / triton modules with the names the benches import, where torch is absent."""
    try:
        import torch  # noqa: F401
        import triton.testing  # noqa: F401
        return
    except ImportError:
        pass
    mods = {name: types.ModuleType(name) for name in
            ("torch", "torch.nn", "torch.nn.functional", "torch.nn.attention", "triton", "triton.testing")}
    mods["torch.nn.attention"].SDPBackend = types.SimpleNamespace(FLASH_ATTENTION=0, CUDNN_ATTENTION=1)
    mods["torch.nn.attention"].sdpa_kernel = None
    mods["triton.testing"].do_bench = None
    mods["torch"].nn = mods["torch.nn"]
    mods["torch.nn"].functional = mods["torch.nn.functional"]
    sys.modules.update(mods)


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
stub_gpu_modules()
import bench_cuda  # noqa: E402
import bench_fp8  # noqa: E402
import bench_quant  # noqa: E402
import results_md  # noqa: E402


def options(path, headings, **kw):
    """What a bench's parser gives for `--out path` plus kw."""
    ap = argparse.ArgumentParser()
    results_md.add_arguments(ap, headings)
    opt = ap.parse_args(["--out", path])
    for key, val in kw.items():
        setattr(opt, key, val)
    return opt


class SectionWriting(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "RESULTS.md")
        with open(self.path, "w") as f:
            f.write("# results\n\nHand-written text.\n\n<!-- fmha-bench:other begin -->\nother\n"
                    "<!-- fmha-bench:other end -->\n\nTrailing text.\n")

    def tearDown(self):
        self.dir.cleanup()

    def read(self):
        with open(self.path) as f:
            return f.read()

    def test_append_then_replace_in_place(self):
        opt = options(self.path, {"demo": "Demo table"}, note=["a shared machine"])
        results_md.write(opt, [("Machine", "test box")], results_md.table(["a", "b"], [["1", "2.0"]], "lr"))
        first = self.read()
        self.assertTrue(first.startswith("# results\n\nHand-written text.\n"))
        self.assertIn("Trailing text.\n\n<!-- fmha-bench:demo begin -->\n## Demo table\n", first)
        for field in ("Date", "Commit", "Machine", "Command", "Note"):
            self.assertIn(f"- **{field}:** ", first)
        self.assertIn("| a | b |\n| --- | ---: |\n| 1 | 2.0 |", first)
        results_md.write(opt, [("Machine", "test box")], results_md.table(["a", "b"], [["3", "4.0"]], "lr"))
        second = self.read()
        self.assertEqual(second.count("fmha-bench:demo begin"), 1)
        self.assertNotIn("| 1 | 2.0 |", second)
        self.assertIn("| 3 | 4.0 |", second)
        self.assertEqual(second.split("<!-- fmha-bench:demo begin")[0], first.split("<!-- fmha-bench:demo begin")[0])

    def test_replaces_a_section_in_the_middle_only(self):
        opt = options(self.path, {"other": "Other"})
        results_md.write(opt, [], "new body")
        text = self.read()
        self.assertIn("Hand-written text.\n\n<!-- fmha-bench:other begin -->\n## Other\n", text)
        self.assertIn("new body\n\n<!-- fmha-bench:other end -->\n\nTrailing text.\n", text)
        self.assertNotIn("\nother\n", text)

    def test_section_and_heading_options(self):
        opt = options(self.path, {"cpu": "CPU forward"}, section="cpu-intel")
        results_md.write(opt, [], "x")
        self.assertIn("<!-- fmha-bench:cpu-intel begin -->\n## CPU forward (cpu-intel)\n", self.read())
        opt = options(self.path, {"cpu": "CPU forward"}, section="cpu-intel", heading="CPU forward, Intel")
        results_md.write(opt, [], "y")
        self.assertIn("## CPU forward, Intel\n", self.read())
        self.assertEqual(self.read().count("fmha-bench:cpu-intel begin"), 1)

    def test_refuses_a_broken_or_doubled_section(self):
        with open(self.path, "a") as f:
            f.write("<!-- fmha-bench:half begin -->\n")
        with self.assertRaises(SystemExit):
            results_md.write_section(self.path, "half", "x")
        with self.assertRaises(SystemExit):
            results_md.render("Bad Name", "h", [], "x")

    def test_dirty_tree_except_the_results_file(self):
        commit = results_md.git_commit(exclude=[self.path])  # a file outside the tree
        self.assertRegex(commit, r"^([0-9a-f]{4,}(-dirty)?|unknown .*)$")
        if commit.startswith("unknown"):
            return
        dirty = results_md._run(["git", "status", "--porcelain", "--untracked-files=no"])
        self.assertEqual(commit.endswith("-dirty"), bool(dirty))
        changed = [line.split(maxsplit=1)[1] for line in dirty.splitlines()]
        if len(changed) == 1:  # the only change is the results file: not dirty
            top = results_md._run(["git", "rev-parse", "--show-toplevel"])
            self.assertFalse(results_md.git_commit(exclude=[os.path.join(top, changed[0])]).endswith("-dirty"))


class CtypesMirrors(unittest.TestCase):
    """The benches' ctypes structs (bench_cuda.py, bench_backward.py) lay out fmha.h's structs as
    the package's (python/fmha/_lib.py, whose tests check it against the library) do: libfmha
    reads every field, so a missing tail field reads whatever follows the struct."""

    def test_layouts(self):
        import ctypes
        import importlib.util
        spec = importlib.util.spec_from_file_location(
            "fmha_lib_structs",
            os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "fmha", "_lib.py"))
        with open(spec.origin) as f:
            src = f.read()
        head = src[:src.index("\ndef ")]  # the struct definitions, before anything loads the library
        ns = {}
        exec(compile(head, spec.origin, "exec"), ns)
        pairs = [(bench_cuda.Tensor, ns["Tensor"]), (bench_cuda.Config, ns["Config"]),
                 (bench_cuda.AttnMask, ns["AttnMask"]), (bench_cuda.Args, ns["ForwardArgs"])]
        for mine, theirs in pairs:
            self.assertEqual([f[0] for f in mine._fields_], [f[0] for f in theirs._fields_], mine.__name__)
            self.assertEqual(ctypes.sizeof(mine), ctypes.sizeof(theirs), mine.__name__)
            for name, _ in mine._fields_:
                self.assertEqual(getattr(mine, name).offset, getattr(theirs, name).offset, name)


class BenchTables(unittest.TestCase):
    def test_cuda(self):
        row = ("flux_1024", 628.7, 259.7, 325.6, 587.6, 3.1e-3, 1740, 1725, 688, 689, 23, 100, 1.144, 1.236,
               math.nan)
        text = bench_cuda.markdown([row], [("flux_1024", "FMHA_CUDA_CLUSTER=0", 620.0, 587.6, 640.0, 1740)])
        self.assertIn("| flux_1024 | 628.7 | 259.7 | 325.6 | 587.6 | 1.93 | 1.07 | 3.1e-03 | 1740 / 1725 "
                      "| 688 / 689 | 23 / 100 | 1.144 / 1.236 |\n", text)
        self.assertIn("| flux_1024 | `FMHA_CUDA_CLUSTER=0` | 620.0 | 1.06 | 1.032 | 1740 |", text)
        self.assertNotIn("mem-efficient", text)
        # head dims above 256: the memory-efficient peer's columns, on every row
        big = ("hd512", 300.0, 300.0, math.nan, math.nan, 2e-3, 1700, math.nan, 600, math.nan, 20, math.nan,
               1.5, math.nan, 200.0)
        text = bench_cuda.markdown([row, big], [])
        self.assertIn("| torch mem-efficient | fmha / mem-efficient |", text)
        self.assertIn("| 1.144 / 1.236 | nan | nan |", text)
        self.assertIn("| hd512 | 300.0 | 300.0 | nan | nan | nan | nan | 2.0e-03 |", text)
        self.assertIn("| 200.0 | 1.50 |", text)

    def test_fp8(self):
        tf = {"auto": 816.6, "two_level": 734.6, "single": 811.8, "bf16": 625.8, "cudnn": 591.6,
              "layer0": 650.2, "layer1": 539.6}
        err = {"two_level": (2.62e-2, 5.40e-2), "single": (2.63e-2, 5.41e-2), "layer0": 5.41e-2, "layer1": 5.41e-2}
        clk = {"auto": (1905, 690), "bf16": (1695, 689), "cudnn": (1755, math.nan)}
        pj = {"auto": 0.891, "bf16": 1.164, "cudnn": 1.239}
        gemm = [("bf16 (`torch.matmul`)", 686.6, 1965, 690, 1.007)]
        text = bench_fp8.markdown(gemm, [("flux_1024", tf, err, 2.35e-3, 2.5e-3, clk, pj)], [], True)
        self.assertIn("| bf16 (`torch.matmul`) | 686.6 | 1965 | 690 | 1.007 |", text)
        self.assertIn("| flux_1024 | 816.6 | 734.6 | 811.8 | 625.8 | 591.6 | 1.30 | 1.38 | 2.62e-02 / 2.63e-02 "
                      "| 2.5e-03 | 5.40e-02 | 2.35e-03 | 1905 / 690, 1695 / 689, 1755 / nan "
                      "| 0.891, 1.164, 1.239 |", text)
        self.assertIn("| flux_1024 | 816.6 | 650.2 | 539.6 | +20.5% | 5.41e-02 / 5.41e-02 |", text)
        tuning = bench_fp8.markdown([], [], [["flux_1024", "808.4 (1860)", "732.0 (1900)", "808.4 (1860)", "0.785"]],
                                    False)
        self.assertIn("| flux_1024 | 808.4 (1860) |", tuning)

    def test_quant(self):
        text = bench_quant.markdown((1, 90000, 40, 128), 921.6e6, 460.8e6, 0.3213, 4.30e12, 0.3213, 0.5356,
                                    0.5847, 0.3397, 3.7981, True, 0)
        self.assertIn("x [1, 90000, 40, 128] bf16 (921.6 MB)", text)
        self.assertIn("| per tensor (one launch, grid-wide amax) | 584.7 µs | 1.82 | 1.09 | torch per tensor "
                      "3798.1 µs, same scale, 0 codes differ |", text)
        self.assertIn("| per block of 128 tokens (single pass) | 339.7 µs | 1.06 | — |  |", text)


if __name__ == "__main__":
    unittest.main()
