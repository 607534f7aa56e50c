"""MFU: the model's training FLOPs per second over the device's peak, and a peak that holds still.

Why a measured peak needs care: one large matrix product timed once at start-up moves with the
neighbours' load on a shared CPU (several-fold across runs of one configuration on 2 cores), and the
model's own LM-head products can run faster than it, so MFU against it moves with the load and can
pass 100%.

The denominator now comes from, in order:
  1. `--peak-tflops X`: the user's figure (source "override");
  2. the data sheet of a known GPU (PEAK_FLOPS, source "table"): the hardware's own ceiling;
  3. a measurement, once per machine and dtype, cached (source "measured" or "cache").

The measurement times every unit of work that `minigpt.core.model.flops_per_token` counts, at the
model's own shapes (`model_workloads`), each forward and backward together: every Linear layer
(fc, proj, qkv, the tied LM head) and causal attention, plus two square products (1024^3 and
2048^3) as machine-wide reference points. Each unit gets a warm-up call, then as many short timed
calls as fit in UNIT_BUDGET_S; each call's time is the smaller of its wall clock and the process's
CPU time (see `measure`), its rate is the unit's counted FLOPs over that, and the unit's figure is
its best call. The denominator is the best unit's figure. The log line says which unit, when, under
what load (os.getloadavg) and the median call beside the best.

Why many short calls and a cache that keeps each unit's best: on a 2-core machine shared with
other jobs, a few long rounds per unit spread widely across fresh processes, and a cache that kept
the first figure could hold one taken under load, against which a run's MFU read far too low. Many
short calls catch the slices where the process had the cores; the CPU time leaves out the slices it
did not; and the cache keeps, per unit, the best figure any process measured: a lower one never
replaces it.

Why MFU cannot pass 100% (no clamp anywhere): a training step's counted FLOPs F are the sum of
the units' counted FLOPs F_u (6 per weight and bias per token for every Linear, including the tied
LM head; 12*L*d*T per token for attention, counted at full T as flops_per_token counts it, though
the causal kernel skips half). The step runs those units one after another on the device and other
work besides, so its time T >= sum of t_u. Hence F / T <= sum F_u / sum t_u <= max_u (F_u / t_u),
and each F_u / t_u is at most that unit's best isolated rate, which the denominator is at least.
What is measured apart from the model is the residual risk, stated here rather than hidden: a
unit inside training would have to run faster than its best isolated call of the same shape,
dtype and thread count on the same machine. Neither clock can make a call look faster than it
runs on a quiet machine (see `measure`), and the cache only ever rises, so the figure errs low only
while every call of every unit was slowed. Two guards hold for that case. A unit timed while other
processes used more than LOAD_SHARE of the cores (LoadProbe) is said to be, serves its run, and is
measured again at the next start that finds the machine quieter (quiet_now), until a quiet figure
settles it. And a run whose achieved rate
passes the denominator has proved it low: the run says so once, lifts it to the achieved rate
(raise_peak) and caches that as ACHIEVED, so MFU never passes 100%, here or later.
`python -m minigpt estimate --time --remeasure` forgets the machine's figures and measures again.
The LayerNorm parameters' share (12*d per layer per
token of ~6N) is counted FLOPs of a memory-bound op that runs far below any GEMM's rate, so it
cannot lift the step above D.
For GPUs in the table the data sheet bounds every unit by construction. An `--peak-tflops` figure
is the user's word and is not checked.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from minigpt.core.data import cache_dir
from minigpt.fileio import UnreadableFile, display_path, read_bounded, write_cache
from minigpt.instruments.instrument import (
    ACHIEVED,
    CACHE_LIMIT,
    LOAD_SHARE,
    PEAK_CACHE_FILE,
    SQUARE_SIZES,
    TORCH_DTYPES,
    PeakFlops,
    machine_key,
    plausible,
)

# Dense peak FLOP/s per GPU from the vendors' data sheets (no 2:4 sparsity), by dtype. fp32 means
# plain fp32 (TF32 off, PyTorch's default for matmuls). MFU divides by the fastest (peak_dtypes).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},  # SXM
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}
# Each unit is timed in many short calls for this long (wall clock) after a warm-up, and its best
# call is kept: on a busy machine a short call often fits in a slice where the process had the
# cores, a long one rarely does. 0.25 s for each of ~8 units (0.5 s for the square products) keeps
# a new user's first run ~3 s longer on a quiet machine.
UNIT_BUDGET_S = 0.25
# ...but at least MIN_CALLS, unless they pass UNIT_LIMIT_S: under a load of 16 on 2 cores a tiny
# unit's first two calls took 0.25 s. MAX_CALLS bounds the calls of a tiny unit.
MIN_CALLS, UNIT_LIMIT_S, MAX_CALLS = 5, 2.0, 1000
# A unit whose warm-up and one timed call would take longer than this at the best rate measured so
# far is skipped (and named in the source): emulated bf16 on a CPU without native bf16 runs a 2048^3
# product in about a minute (63 s on the AVX2 machine of benchmarks/results), the LM head longer.
SKIP_PREDICTED_S = 10.0
# ...predicted only from a unit at least 1/PREDICT_WITHIN of its size: a tiny model's units (a few
# MFLOP) are all overhead and, under load, spin-waiting; a prediction from them would skip a square
# product that takes milliseconds, and the denominator would fall by orders of magnitude.
PREDICT_WITHIN = 64
# A measurement is "under load" when other processes used more than this share of the machine's
# cores while it was timed (LoadProbe: /proc/stat's busy time less this process's CPU time). Why
# not os.getloadavg: it is a 1-minute average that counts this process's own threads and lags, so
# just after a run ends a quiet machine reads ~2 on 2 cores, and a neighbour that starts mid-
# measurement barely shows. Why a quarter: a neighbour on one of 2 cores (0.5) cost the 2048^3
# product 2-5x here; jiffies (10 ms) and our own short idle waits keep a quiet machine under 0.1.
QUIET_WINDOW_S = 0.3  # how long a start looks at the load before measuring a busy figure again


@dataclass(frozen=True)
class Workload:
    """One unit of counted work: kind "linear" dims (tokens, in, out, bias 0/1), forward and
    backward of F.linear; "attention" dims (batch, heads, seq, head_dim), forward and backward of
    causal SDPA; "matmul" dims (m, k, n), one plain product."""

    kind: str
    dims: tuple[int, ...]

    @property
    def name(self) -> str:
        return f"{self.kind} {'x'.join(map(str, self.dims))}"

    @property
    def flops(self) -> int:
        """FLOPs as minigpt.core.model.flops_per_token counts them for this unit."""
        if self.kind == "linear":
            m, k, n, bias = self.dims
            return 6 * m * (k * n + bias * n)  # 6 per parameter per token: forward 2, backward 4
        if self.kind == "attention":
            b, h, s, hd = self.dims
            return 12 * b * s * s * h * hd  # 12 * d * T per token, T = s tokens per sequence
        m, k, n = self.dims
        return 2 * m * k * n


def model_workloads(
    batch_size: int, seq_len: int, d_model: int, d_ff: int, vocab_size: int, n_heads: int, bias: bool = True
) -> list[Workload]:
    """The units a GPT training step of this shape is made of (one micro-batch): qkv, the
    attention projection, the MLP's two layers, the tied LM head (no bias) and causal attention."""
    tokens, b = batch_size * seq_len, int(bias)
    return [
        Workload("linear", (tokens, d_model, 3 * d_model, b)),
        Workload("linear", (tokens, d_model, d_model, b)),
        Workload("linear", (tokens, d_model, d_ff, b)),
        Workload("linear", (tokens, d_ff, d_model, b)),
        Workload("linear", (tokens, d_model, vocab_size, 0)),
        Workload("attention", (batch_size, n_heads, seq_len, d_model // n_heads)),
    ]


def peak_flops(
    device: str,
    dtype: str,
    workloads: list[Workload] | None = None,
    override_tflops: float | None = None,
    cache: bool = True,
    remeasure: bool = False,
) -> PeakFlops:
    """The MFU denominator for `device` ("cpu" or "cuda") in `dtype` ("fp32", "bf16", "fp16").
    Pass the model's units (model_workloads) so the denominator is at least their best rate;
    without them only the square reference products are measured. `remeasure`: forget what this
    machine's cache holds for the dtype (units and achieved rates) and measure again."""
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"--peak-tflops must be positive, got {override_tflops}")
        return PeakFlops(override_tflops * 1e12, "override: --peak-tflops", device=device, dtype=dtype)
    from_table = table_peak(dtype) if device == "cuda" else None
    if from_table:
        return PeakFlops(*from_table, device=device, dtype=dtype)
    units = [Workload("matmul", (n, n, n)) for n in SQUARE_SIZES] + list(dict.fromkeys(workloads or []))
    key, path = machine_key(device, dtype), cache_dir() / PEAK_CACHE_FILE
    if cache and remeasure:
        forget(path, key)
    known = current(read_cache(path).get(key, {})) if cache else {}
    # A unit measured only under load is measured again once the machine is quieter (its figure
    # still predicts, below); while it is still busy, another figure would be no better.
    again = quiet_now() if any(u.name in known and not settled(known[u.name]) for u in units) else False
    missing = sorted(
        (u for u in units if u.name not in known or again and not settled(known[u.name])),
        key=lambda u: u.flops,
    )
    fresh, skipped = {}, []
    for u in missing:
        # Predicted from the largest unit timed so far (the nearest in size): small units can run at
        # rates a big product never reaches (emulated bf16), so the best rate would be optimistic.
        timed = [r for r in (*known.values(), *fresh.values()) if r["flops"] <= u.flops]
        nearest = max(timed, key=lambda r: r["flops"], default=None)
        near = nearest and nearest["flops"] * PREDICT_WITHIN >= u.flops
        if near and 2 * u.flops / nearest["best"] > SKIP_PREDICTED_S:
            skipped.append(u.name)
            continue
        fresh[u.name] = measure(device, dtype, u)
    rates = {**known, **fresh}
    if cache and fresh:
        kept, cache = keep_best(key, fresh)  # cache: False where it could not be written (warned)
        rates |= {n: r for n, r in kept.items() if n in rates}
    names = [u.name for u in units if u.name not in skipped] + [ACHIEVED] * (ACHIEVED in rates)
    shapes = [{"name": n, **rates[n]} for n in names]
    best = max(shapes, key=lambda s: s["best"])
    how = (
        "cache"
        if not fresh
        else "measured now"
        if len(fresh) == len(units) - len(skipped)  # every unit timed here, none read from the cache
        else "measured now, partly cached"
    )
    where = display_path(path) if cache else "not cached"
    source = f"{how}: {describe_unit(best, dtype, device, len(shapes))} [{where}]"
    if skipped:  # not measured, so MFU's bound holds for the measured units only: said, not hidden
        source += f"; {len(skipped)} unit(s) too slow to time here skipped: {', '.join(skipped)}"
    spread = (best["median"], best["best"])
    others = None if settled(best) else best["others"]
    load = best.get("load")
    return PeakFlops(best["best"], source, spread, shapes, best["date"], load, device, dtype, others)


def under_load_line(others: float) -> str:
    """The log's second MFU line for a peak timed while other processes used a share `others` of
    the cores (PeakFlops.describe)."""
    return (
        f"MFU peak measured under load: other processes used {100 * others:.0f}% of the cores while "
        "it was timed, so it may be low and MFU high; it is measured again at the next start that "
        "finds the machine quieter (or now: python -m minigpt estimate --time --remeasure)"
    )


def describe_unit(best: dict, dtype: str, device: str, units: int) -> str:
    """The winning unit: which, when, under what load, and its median call beside the best."""
    load = best.get("load")
    under = f"at load {load:.2f} on {best['cores']} cores" if load is not None else "(load unknown)"
    return (
        f"{best['name']} in {dtype} on {device}, the best of {units} units, measured {best['date']} "
        f"{under} (best of {best['calls']} calls; median {best['median'] / 1e12:.3g})"
    )


def settled(entry: dict | None) -> bool:
    """A cached figure that stands: measured while other processes left the cores alone (or before
    that was recorded), or achieved by a run. One measured only under load does not."""
    return entry is not None and (entry.get("others") or 0.0) <= LOAD_SHARE


def keep_best(key: str, fresh: dict) -> tuple[dict, bool]:
    """Merge `fresh` figures into the cache's entry `key`; return that entry and whether the cache
    could be written (where not, one warning line: the figures are used anyway). Read again just
    before writing (another process may have measured meanwhile) and keep, per unit, the best the
    machine has shown: a figure taken in a busier moment never replaces it. A unit stays marked as
    measured under load only while every figure of it was."""
    path = cache_dir() / PEAK_CACHE_FILE
    entries = read_cache(path)
    mine = current(entries.get(key, {}))
    for name, r in fresh.items():
        old = mine.get(name)
        kept = dict(r if old is None or r["best"] > old["best"] else old)
        if old is not None and (settled(old) or settled(r)) and not settled(kept):
            kept["others"] = min(old.get("others") or 0.0, r.get("others") or 0.0)
        mine[name] = kept
    entries[key] = mine
    return mine, write_cache(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")


def forget(path: Path, key: str) -> None:
    """Drop the cache's entry `key` (--remeasure): the next figures are measured afresh."""
    entries = read_cache(path)
    if entries.pop(key, None) is not None:
        write_cache(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")  # or warned


def current(entries) -> dict:
    """The cached units measured the current way (best of many short calls, with the time and load
    recorded) whose figures are plausible; older or damaged entries count as not measured, so they
    are measured once more."""
    if not isinstance(entries, dict):
        return {}
    return {n: r for n, r in entries.items() if plausible(r) and {"best", "median", "calls"} <= set(r)}


def read_cache(path: Path) -> dict:
    """The cache file, or {} when it is absent, unreadable, not a regular file, larger than any
    cache this code writes, or not JSON (hand-edited: nested too deep to parse, say); then it is
    measured and rewritten."""
    try:
        data = json.loads(read_bounded(path, CACHE_LIMIT))
    except (UnreadableFile, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def measure(device: str, dtype: str, unit: Workload, budget_s: float | None = None) -> dict:
    """The best rate of `unit` over many short timed calls after one warm-up call, with the time,
    the load and the call count. Under bf16/fp16 the linear and attention units run as the model
    does, fp32 weights under autocast.

    Each call is timed by the wall clock and, on the CPU, by the process's CPU time (every
    thread's); the call's time is the smaller. Both are at least the call's time on a quiet machine:
    the wall clock counts the slices another process took, and the CPU time counts every thread's
    work, the longest share and the others' (and their spin-waiting at barriers) besides. On a
    busy machine the wall clock of a short call still often fits in a slice where the process had
    the cores; the CPU time leaves out the slices it was descheduled, so a unit that runs on one
    thread is timed right even when no such slice comes. Dividing the CPU time by the threads
    would be right only when all of them did equal work: a product that runs on one of two
    threads (bf16 on AMX here) would then count at twice its rate."""
    if budget_s is None:  # the square products are the machine's reference, often the best: twice as long
        budget_s = UNIT_BUDGET_S * (2 if unit.kind == "matmul" else 1)
    gen = torch.Generator(device).manual_seed(0)  # its own generator: the training RNG stays untouched
    amp = dtype != "fp32"
    param_dtype = torch.float32 if unit.kind != "matmul" else TORCH_DTYPES[dtype]

    def rand(*shape, grad=False, dtype=param_dtype):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen).requires_grad_(grad)

    # The output's gradient in the output's dtype, made once, as the model's backward gets it (a
    # per-call cast is not the unit's work; the LM head's in fp32 alone is b x s x V x 4 bytes).
    out_dtype = TORCH_DTYPES[dtype] if amp else torch.float32
    if unit.kind == "linear":
        m, k, n, bias = unit.dims
        x, w, b = rand(m, k, grad=True), rand(n, k, grad=True), rand(n, grad=True) if bias else None
        out_grad, leaves = rand(m, n, dtype=out_dtype), [t for t in (x, w, b) if t is not None]

        def call():
            with torch.autocast(device, dtype=TORCH_DTYPES[dtype], enabled=amp):
                y = torch.nn.functional.linear(x, w, b)
            torch.autograd.backward(y, out_grad)
    elif unit.kind == "attention":
        bsz, h, s, hd = unit.dims
        q, k_, v = (rand(bsz, h, s, hd, grad=True) for _ in range(3))
        out_grad, leaves = rand(bsz, h, s, hd, dtype=out_dtype), [q, k_, v]

        def call():
            with torch.autocast(device, dtype=TORCH_DTYPES[dtype], enabled=amp):
                y = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
            torch.autograd.backward(y, out_grad)
    else:
        m, k, n = unit.dims
        a, b_, leaves = rand(m, k), rand(k, n), []

        def call():
            a @ b_

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    probe, rates, spent = LoadProbe(), [], 0.0  # rates: FLOP/s of each timed call
    for i in range(MAX_CALLS + 1):
        if rates and spent > budget_s and (len(rates) >= MIN_CALLS or spent > UNIT_LIMIT_S):
            break
        for t in leaves:  # as after the loop's zero_grad(set_to_none=True): no accumulation to time
            t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        c0, t0 = time.process_time(), time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i:  # the first call pays for warm-up: allocation, thread pool, kernel selection
            # The CPU time says nothing of a GPU's kernels, which run while the host waits.
            rates.append(unit.flops / (min(wall, cpu) if device == "cpu" and cpu > 0 else wall))
            spent += wall
    return {
        "flops": unit.flops,
        "best": max(rates),
        "median": statistics.median(rates),
        "calls": len(rates),
        "date": date,
        "load": load,
        "cores": os.cpu_count(),
        "others": probe.others(),
    }


class LoadProbe:
    """How much of the machine other processes used since it was made: the cores' busy time in
    /proc/stat (user, nice, system, irq, softirq, steal) less this process's own CPU time, over the
    wall time and the cores. None where /proc/stat is absent (not Linux): the load is then unknown,
    and a measurement is not marked. Its own clock (os.times), so tests that fake `time` hold."""

    def __init__(self):
        self.start = self.now()

    @staticmethod
    def now() -> tuple[float, float, float | None]:
        t = os.times()
        return t.elapsed, t.user + t.system, machine_busy_s()

    def others(self) -> float | None:
        (w0, c0, b0), (w1, c1, b1) = self.start, self.now()
        if b0 is None or b1 is None or w1 <= w0:
            return None
        share = ((b1 - b0) - (c1 - c0)) / ((w1 - w0) * (os.cpu_count() or 1))
        return round(min(1.0, max(0.0, share)), 3)


def quiet_now(window_s: float = QUIET_WINDOW_S) -> bool:
    """Whether other processes leave the cores alone now (LoadProbe over `window_s` of sleep)."""
    probe = LoadProbe()
    time.sleep(window_s)
    others = probe.others()
    return others is None or others <= LOAD_SHARE


def machine_busy_s() -> float | None:
    """Seconds of CPU time every process on the machine has used since boot (/proc/stat), or None."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def keep_achieved(device: str, dtype: str, achieved: float) -> str:
    """Cache a rate a run achieved above the measured peak (raise_peak): a lower bound of
    the machine's peak, so the denominator is never below it again. Returns where it was kept."""
    entry = {"flops": 0, "best": achieved, "median": achieved, "calls": 1, "cores": os.cpu_count()}
    entry |= {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "load": None}
    keep_best(machine_key(device, dtype), {ACHIEVED: entry})
    return f"kept in {display_path(cache_dir() / PEAK_CACHE_FILE)}"


def ranked_peak(device: str, dtype: str, info) -> PeakFlops:
    """Under torchrun: rank 0 measures (or reads the cache) alone, then the others read its cache."""
    from minigpt.core.distributed import barrier

    if not info.is_main:
        barrier(info)
    peak = peak_flops(device, dtype)
    if info.is_main:
        barrier(info)
    return peak


def raise_peak(peak: PeakFlops, achieved: float) -> str | None:
    """A rate the run has `achieved` (FLOP/s per device) above a measured peak proves the peak
    low (taken under load): lift it, here and in the cache, so MFU never passes 100%; the line
    saying so the first time. A --peak-tflops figure and a data sheet are not touched."""
    if achieved <= peak.value or not peak.source.startswith(("measured", "cache", ACHIEVED)):
        return None
    first = not peak.source.startswith(ACHIEVED)
    note = (
        f"MFU peak {peak.value / 1e12:.3g} TFLOP/s was below what this run achieved "
        f"({achieved / 1e12:.3g} TFLOP/s): it was measured under load; the peak is now the best "
        f"rate the run achieves, {keep_achieved(peak.device, peak.dtype, achieved)}"
    )
    if first:
        peak.source = f"{ACHIEVED} (the measured peak was lower); was: {peak.source}"
    peak.value = achieved
    return note if first else None


def table_peak(dtype: str) -> tuple[float, str] | None:
    """A known GPU's data-sheet peak in `dtype`, and its source; None for another device."""
    import re

    name = torch.cuda.get_device_name()
    # Whole words, longest names first: "H100 PCIe" before "H100"; "L4" is not "L40S", "A10" not "A10G".
    for gpu in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"\b{re.escape(gpu)}\b", name) and dtype in PEAK_FLOPS[gpu]:
            return PEAK_FLOPS[gpu][dtype], f"table: {gpu} {dtype} dense"
    return None
