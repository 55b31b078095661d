"""test_loader.py — how fmha/_lib.py finds libfmha's CUDA runtime: the ELF
reader that says whether libfmha needs libcudart, the search of NVIDIA's pip
packages (nvidia/cu13/lib, nvidia/cuda_runtime/lib), and the preload before
libfmha, end to end on a stand-in libfmha that needs a made-up runtime."""
import ctypes
import os
import shutil
import subprocess
import sys

import pytest

from fmha import _lib


def _touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()
    return path


def test_needed_reads_the_real_libfmha():
    needed = _lib._needed(_lib.path)
    assert "libc.so.6" in needed
    # A CPU build must not ask for the CUDA runtime, a CUDA build must.
    wants_cudart = any(n.startswith("libcudart.so.") for n in needed)
    assert wants_cudart == bool(_lib.fmha_cuda_backend_built())


def test_needed_of_what_is_not_elf(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"not a library at all\n")
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(open(_lib.path, "rb").read()[:80])
    assert _lib._needed(str(text)) == []
    assert _lib._needed(str(truncated)) == []
    assert _lib._needed(str(_touch(str(tmp_path / "empty.so")))) == []
    assert _lib._needed(str(tmp_path / "missing.so")) == []


def test_find_cudart_in_package_layouts(tmp_path):
    site_a, site_b = tmp_path / "a" / "nvidia", tmp_path / "b" / "nvidia"
    cu13 = _touch(str(site_a / "cu13" / "lib" / "libcudart.so.13"))
    cu12 = _touch(str(site_b / "cuda_runtime" / "lib" / "libcudart.so.12"))
    roots = [str(site_a), str(site_b)]
    assert _lib._find_cudart("libcudart.so.13", roots) == cu13
    assert _lib._find_cudart("libcudart.so.12", roots) == cu12
    # Another major's runtime is never taken for the one libfmha names.
    assert _lib._find_cudart("libcudart.so.14", roots) is None
    assert _lib._find_cudart("libcudart.so.13", [str(site_b)]) is None
    # The first root on sys.path wins, as Python's own imports do.
    other = _touch(str(site_b / "cu13" / "lib" / "libcudart.so.13"))
    assert _lib._find_cudart("libcudart.so.13", [str(site_b), str(site_a)]) == other


def test_nvidia_roots_follow_sys_path(tmp_path, monkeypatch):
    _touch(str(tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13"))
    assert str(tmp_path / "nvidia") not in _lib._nvidia_roots()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert str(tmp_path / "nvidia") in _lib._nvidia_roots()


def _cc():
    return shutil.which(os.environ.get("CC", "cc"))


def _stand_in(tmp_path, major):
    """A fake CUDA runtime libcudart.so.<major> in a pip-like site folder,
    and a library that needs it by soname only (no RPATH): without the
    preload the dynamic loader cannot find it."""
    site = tmp_path / "site"
    libdir = site / "nvidia" / ("cu%d" % major) / "lib"
    libdir.mkdir(parents=True)
    soname = "libcudart.so.%d" % major
    src = tmp_path / "stub.c"
    src.write_text("int fmha_stub(void) { return 7; }\n")
    subprocess.check_call([_cc(), "-shared", "-fPIC", "-o", str(libdir / soname),
                           "-Wl,-soname," + soname, str(src)])
    lib = tmp_path / "libfmha.so"
    subprocess.check_call([_cc(), "-shared", "-fPIC", "-o", str(lib), str(src),
                           "-Wl,--no-as-needed", str(libdir / soname)])
    return str(site), str(libdir / soname), str(lib), soname


# A soname no system has, so that only the preload can satisfy it.
MADE_UP_MAJOR = 97


@pytest.mark.skipif(not _cc(), reason="needs a C compiler to make the stand-in libraries")
def test_load_preloads_the_pip_runtime(tmp_path):
    site, runtime, lib, soname = _stand_in(tmp_path, MADE_UP_MAJOR)
    assert soname in _lib._needed(lib)
    # In a child process, since a loaded library stays for the process; the
    # child imports this fmha, then loads the stand-in as FMHA_LIBRARY.
    package_parent = os.path.dirname(os.path.dirname(_lib.__file__))
    code = ("import os, sys\n"
            "sys.path[:0] = [%r, %r]\n"
            "from fmha import _lib\n"
            "os.environ['FMHA_LIBRARY'] = %r\n"
            "handle, path = _lib._load()\n"
            "assert handle.fmha_stub() == 7\n"
            "assert %r in open('/proc/self/maps').read(), 'not the pip runtime'\n"
            % (package_parent, site, lib, runtime))
    subprocess.check_call([sys.executable, "-c", code], cwd=str(tmp_path))


@pytest.mark.skipif(not _cc(), reason="needs a C compiler to make the stand-in libraries")
def test_load_without_the_runtime_names_the_extra(tmp_path, monkeypatch):
    _, runtime, lib, soname = _stand_in(tmp_path, MADE_UP_MAJOR + 1)
    os.remove(runtime)
    monkeypatch.setenv("FMHA_LIBRARY", lib)
    with pytest.raises(ImportError) as err:
        _lib._load()
    assert soname in str(err.value) and "fmha[cuda13]" in str(err.value)


@pytest.mark.skipif(bool(_lib.fmha_cuda_backend_built()), reason="a CPU build's libfmha")
def test_preload_skips_a_cpu_library(monkeypatch):
    loaded = []
    monkeypatch.setattr(_lib.ctypes, "CDLL", lambda *a, **k: loaded.append(a))
    assert _lib._preload_cuda_runtime(_lib.path) == (None, None)
    assert loaded == []


def test_preload_leaves_a_loaded_runtime_alone(tmp_path, monkeypatch):
    # A runtime already in the process (torch's, say) is the one libfmha must
    # share: no second copy is loaded from a package.
    runtime = _touch(str(tmp_path / "nvidia" / "cu13" / "lib" / "libcudart.so.13"))
    monkeypatch.setattr(_lib, "_needed", lambda path: ["libm.so.6", "libcudart.so.13"])
    monkeypatch.setattr(_lib, "_nvidia_roots", lambda: [str(tmp_path / "nvidia")])
    loaded = []
    monkeypatch.setattr(_lib.ctypes, "CDLL", lambda *a, **k: loaded.append(a))
    monkeypatch.setattr(_lib, "_already_loaded", lambda soname: True)
    assert _lib._preload_cuda_runtime("libfmha.so") == ("libcudart.so.13", None)
    assert loaded == []
    monkeypatch.setattr(_lib, "_already_loaded", lambda soname: False)
    assert _lib._preload_cuda_runtime("libfmha.so") == ("libcudart.so.13", runtime)
    assert loaded == [(runtime,)]


def test_already_loaded():
    ctypes.CDLL("libc.so.6")
    assert _lib._already_loaded("libc.so.6")
    assert not _lib._already_loaded("libcudart.so.%d" % MADE_UP_MAJOR)
