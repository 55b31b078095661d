"""test_loader.py — how fmha/_lib.py finds libfmha's CUDA runtime when the
dynamic loader does not: the search of NVIDIA's pip packages
(nvidia/cu13/lib, nvidia/cuda_runtime/lib) and the load of the runtime before
libfmha again, end to end on a stand-in libfmha that needs a made-up
runtime."""
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
