"""conftest.py — the hypothesis profile (no example database on disk, no
deadline: the first call of a shape may warm caches) and the `gpu` marker's
skip rule: GPU tests need torch with CUDA and an fmha that can use it."""
import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "fmha", database=None, deadline=None, max_examples=100, derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# HYPOTHESIS_PROFILE=stress: many more examples, for hunting rare failures.
settings.register_profile("stress", parent=settings.get_profile("fmha"), max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fmha"))

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Hypothesis keeps caches in ./.hypothesis of whatever folder pytest runs in;
# keep them in python/.hypothesis (git-ignored) instead.
try:
    from hypothesis.configuration import set_hypothesis_home_dir
    set_hypothesis_home_dir(os.path.join(ROOT, "python", ".hypothesis"))
except ImportError:  # an internal helper: without it the default folder is used
    pass


def _gpu_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    import fmha
    if not fmha.info()["cuda_backend"]:
        return "this fmha was built without its CUDA backend (no nvcc at build time)"
    if not fmha.info()["cuda_devices"]:
        return "libfmha sees no CUDA device"
    return None


def pytest_collection_modifyitems(config, items):
    gpu_items = [it for it in items if "gpu" in it.keywords]
    if not gpu_items:
        return
    reason = _gpu_reason()
    if reason:
        for it in gpu_items:
            it.add_marker(pytest.mark.skip(reason="GPU test: " + reason))


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name, so each test is reproducible."""
    import zlib

    import numpy as np
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
