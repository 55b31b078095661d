"""The repository's CLI (build/fmha) and this package agree through
safetensors files: what `fmha run` writes loads with the official safetensors
package and matches fmha.attention, and a file written by
safetensors.numpy.save_file runs through `fmha run --check`. Skipped where the
CLI is not built (make) or safetensors is missing."""
import os
import subprocess

import numpy as np
import pytest

import fmha
import reference as ref
from conftest import ROOT

CLI = os.path.join(ROOT, "build", "fmha")
pytestmark = pytest.mark.skipif(not os.access(CLI, os.X_OK),
                                reason="build/fmha is not built (run make at the repo root)")
st_numpy = pytest.importorskip("safetensors.numpy")


def run_cli(*args):
    res = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, "fmha %s: %s%s" % (" ".join(args), res.stdout, res.stderr)
    return res.stdout


@pytest.mark.skipif(ref.BF16 is None, reason="bf16 files need ml_dtypes")
def test_cli_output_loads_and_matches(tmp_path):
    path = str(tmp_path / "flux.safetensors")
    run_cli("run", "--model", "flux-1024", "--seqlen", "64", "-o", path)
    t = st_numpy.load_file(path)  # bf16 through ml_dtypes (imported by reference)
    assert set(t) >= {"q", "k", "v", "out", "lse"}
    assert t["q"].shape == (1, 64, 24, 128) and t["q"].dtype == ref.BF16
    assert t["out"].dtype == ref.BF16 and t["lse"].shape == (1, 24, 64)
    out, lse = fmha.attention(t["q"], t["k"], t["v"], return_lse=True)
    ref.assert_close(out, t["out"], "f32")  # same library, same kernel: as good as equal
    np.testing.assert_allclose(lse, t["lse"], rtol=1e-6, atol=1e-6)
    want, _ = ref.attention(t["q"], t["k"], t["v"])
    ref.assert_close(t["out"], want, "bf16")


@pytest.mark.parametrize("dtype,causal", [("f32", False), ("f16", True)])
def test_python_file_runs_through_cli(tmp_path, rng, dtype, causal):
    q = ref.make(rng, (2, 37, 4, 64), dtype)
    k, v = (ref.make(rng, (2, 45, 2, 64), dtype) for _ in range(2))
    src, dst = str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")
    st_numpy.save_file({"q": q, "k": k, "v": v}, src)
    stdout = run_cli("run", src, "-o", dst, "--check", *(["--causal"] if causal else []))
    assert ": ok" in stdout
    t = st_numpy.load_file(dst)
    assert t["out"].dtype == q.dtype and t["out"].shape == q.shape
    out, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    ref.assert_close(out, t["out"], "f32")
    np.testing.assert_allclose(lse, t["lse"], rtol=1e-6, atol=1e-6)
