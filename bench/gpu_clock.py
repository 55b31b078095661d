"""gpu_clock.py — the SM clock and board power while a benchmark runs, read
from NVML (libnvidia-ml, part of the driver) on a background thread, so that
a table can say at what clock each kernel was timed: on a power-limited GPU a
long run of one kernel can be clocked lower than another's.

    with ClockSampler() as s:
        do_bench(fn)
    mhz, watts = s.result()   # medians over the samples; nan without NVML

Device index 0 of NVML: meant for one-GPU machines, where it is the GPU that
torch uses.
"""
import ctypes as C
import functools
import math
import statistics
import threading

NVML_CLOCK_SM = 1


@functools.lru_cache(maxsize=None)
def _load_nvml():
    """(library, device handle), or None where NVML cannot be used; once."""
    try:
        lib = C.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        dev = C.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(C.c_uint(0), C.byref(dev)) != 0:
            return None
        return lib, dev
    except (OSError, AttributeError):
        return None


def nvml_reader():
    """A function returning (SM MHz, watts) now, or None without NVML."""
    nvml = _load_nvml()
    if nvml is None:
        return None
    lib, dev = nvml

    def read():
        mhz, mw = C.c_uint(0), C.c_uint(0)
        if lib.nvmlDeviceGetClockInfo(dev, C.c_int(NVML_CLOCK_SM), C.byref(mhz)) != 0:
            return None
        if lib.nvmlDeviceGetPowerUsage(dev, C.byref(mw)) != 0:
            return None
        return float(mhz.value), mw.value / 1000.0
    return read


class ClockSampler:
    """Samples every `period` seconds between __enter__ and __exit__."""

    def __init__(self, period=0.02, reader=None):
        self.period = period
        self.reader = reader if reader is not None else nvml_reader()
        self.samples = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.is_set():
            s = self.reader()
            if s is not None:
                self.samples.append(s)
            self._stop.wait(self.period)

    def __enter__(self):
        if self.reader is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def result(self):
        """(median SM MHz, median watts) over the samples; nan, nan with none."""
        if not self.samples:
            return math.nan, math.nan
        return (statistics.median(s[0] for s in self.samples),
                statistics.median(s[1] for s in self.samples))
