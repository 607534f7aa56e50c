"""MFU's denominator, fixed for the whole run and found at its first log line (figures.py): the
device's peak FLOP/s in its fastest dtype. It is --peak-tflops, else a known GPU's data sheet
(dense), else a measurement, cached once per machine, dtype and torch version beside the token
cache: the best of many short calls of square products, each timed by the smaller of its wall
clock and its CPU time, so a call that lost the cores to another process does not count; a figure
timed while others took over a quarter of the cores is measured again at the next start. A CPU's
candidates: bf16 with AMX, fp32 without native bf16, both with AVX512-BF16 alone (its bf16
products ran at 1.9x fp32's on an AMD Zen 4, 0.5x on an Intel Xeon): the fastest measured wins."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from dataclasses import dataclass

import torch

from minigpt.config import BUSY, atomic_write, busy_share, cpu_seconds
from minigpt.core.data import cache_dir
from minigpt.instruments.mfu import DTYPES, cpu_bf16_features

PEAK_CACHE_FILE, SIZES, CALLS_S = "peak_flops.json", (1024, 2048), 0.5  # seconds of calls a size
UNWRITABLE: set = set()


# Dense TFLOP/s (bf16 and fp16, TF32, fp32) from NVIDIA's data sheets (nvidia.com/en-us/data-center/
# h100, h200, a100, l40s, l4, a10 and v100; sparse figures halved); the longest name is matched first.
DATA_SHEETS = {
    "H100 PCIe": (756, 378, 51.2),
    "H100 NVL": (835, 418, 60),
    "H200 NVL": (835, 418, 60),
    "H100": (989, 495, 67),  # SXM
    "H200": (989, 495, 67),  # SXM
    "A100": (312, 156, 19.5),
    "L40S": (362, 183, 91.6),
    "L4": (121, 60, 30.3),
    "A10": (125, 62.5, 31.2),
    "V100": (125, 15.7, 15.7),  # fp16 tensor cores; no bf16, no TF32
}


@dataclass
class Peak:
    value: float  # FLOP/s
    dtype: str
    source: str
    others: float | None = None  # measured while other processes took this share of the cores

    def config(self) -> dict:  # what config.json keeps: the one record the report and compare read
        return {"peak_flops": self.value, "peak_flops_dtype": self.dtype, "peak_flops_source": self.source}

    def describe(self) -> str:
        busy = f"\nMFU peak timed while others took {self.others or 0:.0%} of the cores: it may be low"
        peak = f"MFU peak {self.value / 1e12:.3g} TFLOP/s ({self.dtype}, the device's fastest)"
        # the source on a line of its own (a cache's path in it): said once, measured again
        return f"{peak}\n  {self.source}{busy * ((self.others or 0) > BUSY)}"


def peak_dtypes(device: str) -> tuple[str, ...]:
    if device == "cuda":
        return ("bf16",) if torch.cuda.is_bf16_supported() else ("fp16",)
    native = cpu_bf16_features()
    return ("bf16",) if native["amx"] else ("bf16", "fp32") if native["avx512_bf16"] else ("fp32",)


def data_sheet(name: str, dtype: str) -> float | None:
    sheet = next((peaks for gpu, peaks in DATA_SHEETS.items() if re.search(rf"\b{gpu}\b", name)), None)
    return sheet and 1e12 * sheet[{"bf16": 0, "fp16": 0, "tf32": 1, "fp32": 2}[dtype]]


def device_peak(override_tflops: float | None, device: str, dist=None) -> Peak:
    """The MFU denominator (see the module's text). Under torchrun, rank 0 measures first, alone."""
    dtypes, name = peak_dtypes(device), torch.cuda.get_device_name() if device == "cuda" else ""
    if override_tflops is not None:
        return Peak(override_tflops * 1e12, dtypes[0], "override: --peak-tflops")
    if sheet := data_sheet(name, dtypes[0]):
        return Peak(sheet, dtypes[0], f"data sheet: {name} {dtypes[0]} dense")
    if dist is not None and dist.enabled:  # rank 0's figure for every rank: one denominator for the job
        from minigpt.core.distributed import gather

        peaks = gather([measured(device, d) for d in dtypes] if dist.is_main else None, dist)[0]
    else:
        peaks = [measured(device, d) for d in dtypes]
    best = max(peaks, key=lambda p: p.value)
    if best is not peaks[0]:  # a CPU whose bf16 is slower than its fp32
        best.source += (
            f"; {peaks[0].dtype}'s is {peaks[0].value / best.value:.0%} of it: --no-amp may train faster"
        )
    return best


def machine_key(device: str, dtype: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = "unknown CPU"
    where = torch.cuda.get_device_name() if device == "cuda" else f"{cpu}, {os.cpu_count()} cores"
    return f"{device}: {where}, {torch.get_num_threads()} threads | {dtype} | torch {torch.__version__}"


def measured(device: str, dtype: str) -> Peak:
    """The cached figure; measured now (and cached) where there is none, or only a busy one."""
    path, key = cache_dir() / PEAK_CACHE_FILE, machine_key(device, dtype)
    entry = read_cache(path).get(key)
    fresh = entry is None or entry.get("others", 0) > BUSY
    if fresh:
        # the new figure alone: a busy one kept beside it would be measured again at every start
        entry = max((measure(device, dtype, n) for n in SIZES), key=lambda e: e["best"])
        write_cache(path, key, entry)
    where = "measured now" if fresh else f"cache [{path}]"
    source = f"{where}: {entry['what']}, the best of {entry['calls']} calls on {entry['date']}"
    return Peak(entry["best"], dtype, source, entry.get("others") if fresh else None)


def measure(device: str, dtype: str, n: int) -> dict:
    gen = torch.Generator(device).manual_seed(0)  # its own: the training's random numbers stay untouched
    a, b = (torch.randn(n, n, device=device, dtype=DTYPES[dtype], generator=gen) for _ in range(2))
    a @ b  # the first call pays for allocation and the thread pool
    before, best, calls, spent = cpu_seconds(), 0.0, 0, 0.0
    while spent < CALLS_S and calls < 1000 or calls < 5 and spent < 4 * CALLS_S:
        c0, t0 = time.process_time(), time.perf_counter()
        a @ b
        torch.cuda.synchronize() if device == "cuda" else None
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        rate = 2 * n**3 / (min(wall, cpu) if device == "cpu" and cpu > 0 else wall)
        best, calls, spent = max(best, rate), calls + 1, spent + wall
    date, others = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), busy_share(before, cpu_seconds()) or 0
    return dict(best=best, calls=calls, date=date, what=f"matmul {n}x{n}x{n} in {dtype}", others=others)


def read_cache(path) -> dict:
    """The cache; {} where it is missing, not a regular file (a FIFO would block), or not JSON."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            data = json.loads(f.read(1 << 22)) if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else {}
        keys = {"calls", "date", "what"}
        return {k: v for k, v in data.items() if 1e6 < float(v["best"]) < 1e18 and keys <= v.keys()}
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError):
        return {}


def write_cache(path, key: str, entry: dict) -> None:
    """The entry into the cache, read again first: another process may have measured meanwhile."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({**read_cache(path), key: entry}, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        if path not in UNWRITABLE:  # said once a process
            UNWRITABLE.add(path)
            print(
                f"note: the MFU peak is not cached: {path} cannot be written ({e.strerror})", file=sys.stderr
            )
