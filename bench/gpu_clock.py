"""gpu_clock.py — the SM clock and board power while a benchmark runs, read
from NVML (libnvidia-ml, part of the driver) on a background thread, so that
a table can say at what clock each kernel was timed: on a power-limited GPU a
long run of one kernel can be clocked lower than another's.

    with ClockSampler() as s:
        do_bench(fn)
    mhz, watts = s.result()   # medians over the samples; nan without NVML

    joules = energy_per_call(fn, torch.cuda.synchronize)   # nan without NVML

energy_per_call runs fn back to back and reads the board's energy counter
around the run: at the board's power limit a kernel's speed follows the energy
it spends per FLOP, which this measures directly.

Device index 0 of NVML: meant for one-GPU machines, where it is the GPU that
torch uses.
"""
import ctypes as C
import functools
import math
import statistics
import threading
import time

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


def nvml_energy():
    """A function returning the board's energy counter in joules (NVML counts from
    the driver's load), or None without NVML."""
    nvml = _load_nvml()
    if nvml is None:
        return None
    lib, dev = nvml

    def read():
        mj = C.c_ulonglong(0)
        if lib.nvmlDeviceGetTotalEnergyConsumption(dev, C.byref(mj)) != 0:
            return None
        return mj.value / 1000.0
    return read


def energy_per_call(fn, sync, seconds=2.0, reader=None):
    """Joules per call of fn, run back to back (no cache flush between calls) for
    about `seconds` after one warm-up call: the energy counter's growth over the
    run divided by the calls. nan without NVML. The counter advances in steps
    (milliseconds to tens of them, by driver), so runs of seconds keep its
    rounding near 1%."""
    read = reader if reader is not None else nvml_energy()
    if read is None:
        return math.nan
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    per_call = max(time.perf_counter() - t0, 1e-6)
    n = max(1, int(seconds / per_call))
    e0 = read()
    for _ in range(n):
        fn()
    sync()
    e1 = read()
    if e0 is None or e1 is None:
        return math.nan
    return (e1 - e0) / n
