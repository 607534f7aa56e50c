"""MFU: the model's training FLOPs per second over the device's peak, and a peak that holds still.

Why this file exists: the old denominator was one 2048^3 matrix product timed once at start-up. On
a shared CPU it ranged from 0.36 to 2.61 TFLOP/s across runs of one configuration, and the model's
own LM-head products ran faster than that "peak", so MFU moved with the neighbours' load and could
pass 100%.

The denominator now comes from, in order:
  1. `--peak-tflops X`: the user's figure (source "override");
  2. the data sheet of a known GPU (PEAK_FLOPS, source "table"): the hardware's own ceiling;
  3. a measurement, once per machine and dtype, cached (source "measured" or "cache").

The measurement times every unit of work that `minigpt.model.flops_per_token` counts, at the
model's own shapes (`model_workloads`), each forward and backward together: every Linear layer
(fc, proj, qkv, the tied LM head) and causal attention, plus two square products (1024^3 and
2048^3) as machine-wide reference points. Each unit gets a warm-up call, then ROUNDS timed calls
(fewer when they pass UNIT_BUDGET_S); each unit's rate is its counted FLOPs over its fastest call,
and the denominator is the best rate of all. The spread (lowest and highest round of the winning
unit) goes beside it.

Why MFU cannot pass 100% (no clamp anywhere): a training step's counted FLOPs F are the sum of
the units' counted FLOPs F_u (6 per weight and bias per token for every Linear, including the tied
LM head; 12*L*d*T per token for attention, counted at full T as flops_per_token counts it, though
the causal kernel skips half). The step runs those units one after another on the device and other
work besides, so its time T >= sum of t_u. Hence F / T <= sum F_u / sum t_u <= max_u (F_u / t_u),
and each F_u / t_u is at most that unit's best isolated rate, which the denominator is at least.
Two things are measured apart from the model and are therefore the residual risk, stated here
rather than hidden: a unit inside training would have to run faster than the best of ROUNDS
isolated calls of the same shape, dtype and thread count on the same machine, which happens only
when the cache was filled while a neighbour loaded the machine. The cache keeps the first
measurement; delete its file (PEAK_CACHE_FILE under minigpt.data.cache_dir()) to measure again on
a quiet machine. The LayerNorm parameters' share (12*d per layer per token of ~6N) is counted FLOPs
of a memory-bound op that runs far below any GEMM's rate, so it cannot lift the step above D.
For GPUs in the table the data sheet bounds every unit by construction. An `--peak-tflops` figure
is the user's word and is not checked.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch

from minigpt.data import cache_dir
from minigpt.fileio import atomic_write

PEAK_CACHE_FILE = "peak_flops.json"  # under minigpt.data.cache_dir(): one entry per machine, dtype, torch
ROUNDS = 3  # timed calls per unit after its warm-up: the best is kept, the rounds give the spread
# A unit whose timed calls already took this long stops early (one timed call at least): bf16 on a
# CPU without native bf16 runs a 50k-vocabulary LM head at ~1 GFLOP/s, a minute per call.
UNIT_BUDGET_S = 2.0
SQUARE_SIZES = (1024, 2048)  # machine-wide reference products, beside the model's own units
# A unit whose warm-up and one timed call would take longer than this at the best rate measured so
# far is skipped (and named in the source): emulated bf16 on a CPU without native bf16 runs a 2048^3
# product in about a minute (63 s on the AVX2 machine of benchmarks/results), the LM head longer.
SKIP_PREDICTED_S = 10.0

# Dense peak FLOP/s per GPU from the vendors' data sheets (no 2:4 sparsity), by AMP dtype.
# fp32 means plain fp32 (TF32 off, PyTorch's default for matmuls).
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
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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
        """FLOPs as minigpt.model.flops_per_token counts them for this unit."""
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


@dataclass
class PeakFlops:
    """The MFU denominator of one device: FLOP/s, where it comes from, the (lowest, highest) round
    of the winning unit when measured, and each unit's best rate."""

    value: float
    source: str
    spread: tuple[float, float] | None = None
    shapes: list[dict] = field(default_factory=list)

    def config(self) -> dict:
        """The keys config.json carries."""
        return {
            "peak_flops": self.value,
            "peak_flops_source": self.source,
            "peak_flops_spread": list(self.spread) if self.spread else None,
        }


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | PeakFlops) -> float:
    """Model FLOPs utilisation: the training FLOPs the model needs per second over the peak.
    Tokens/s is per device, so under DDP pass the job's figure divided by the world size, and
    count every micro-batch of gradient accumulation in the tokens."""
    value = peak.value if isinstance(peak, PeakFlops) else peak
    return achieved_tflops(flops_per_token, tokens_per_s_per_device) * 1e12 / value


def achieved_tflops(flops_per_token: float, tokens_per_s_per_device: float) -> float:
    """The model's training TFLOP/s per device: needs no denominator, so it is as steady as tokens/s."""
    return flops_per_token * tokens_per_s_per_device / 1e12


def machine_key(device: str, dtype: str) -> str:
    """What a measured peak belongs to: the processor, the threads torch uses, the dtype, torch."""
    if device == "cuda":
        where = f"{torch.cuda.get_device_name()}"
    else:
        where = f"{cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads"
    return f"{device}: {where} | {dtype} | torch {torch.__version__}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def table_peak(device: str, dtype: str) -> tuple[float, str] | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    # Whole words, longest names first: "H100 PCIe" before "H100"; "L4" is not "L40S", "A10" not "A10G".
    for gpu in sorted(PEAK_FLOPS, key=len, reverse=True):
        if re.search(rf"\b{re.escape(gpu)}\b", name) and dtype in PEAK_FLOPS[gpu]:
            return PEAK_FLOPS[gpu][dtype], f"table: {gpu} {dtype} dense"
    return None


def peak_flops(
    device: str,
    dtype: str,
    workloads: list[Workload] | None = None,
    override_tflops: float | None = None,
    cache: bool = True,
) -> PeakFlops:
    """The MFU denominator for `device` ("cpu" or "cuda") in `dtype` ("fp32", "bf16", "fp16").
    Pass the model's units (model_workloads) so the denominator is at least their best rate;
    without them only the square reference products are measured."""
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"--peak-tflops must be positive, got {override_tflops}")
        return PeakFlops(override_tflops * 1e12, "override: --peak-tflops")
    from_table = table_peak(device, dtype)
    if from_table:
        return PeakFlops(*from_table)
    units = [Workload("matmul", (n, n, n)) for n in SQUARE_SIZES] + list(dict.fromkeys(workloads or []))
    key, path = machine_key(device, dtype), cache_dir() / PEAK_CACHE_FILE
    known = read_cache(path).get(key, {}) if cache else {}
    missing = sorted((u for u in units if u.name not in known), key=lambda u: u.flops)  # smallest first
    fresh, skipped = {}, []
    for u in missing:
        # Predicted from the largest unit timed so far (the nearest in size): small units can run at
        # rates a big product never reaches (emulated bf16), so the best rate would be optimistic.
        timed = [r for r in (*known.values(), *fresh.values()) if r["flops"] <= u.flops]
        nearest = max(timed, key=lambda r: r["flops"], default=None)
        if nearest and 2 * u.flops / max(nearest["rounds"]) > SKIP_PREDICTED_S:
            skipped.append(u.name)
            continue
        fresh[u.name] = {
            "rounds": measure(device, dtype, u),
            "flops": u.flops,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }
    if cache and fresh:
        entries = read_cache(path)  # again, just before writing: another process may have added units
        entries[key] = {**entries.get(key, {}), **fresh}
        atomic_write(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
    rates = {u.name: {**known, **fresh}[u.name] for u in units if u.name not in skipped}
    shapes = [
        {"name": n, "flops": r["flops"], "best": max(r["rounds"]), "rounds": r["rounds"]}
        for n, r in rates.items()
    ]
    best = max(shapes, key=lambda s: s["best"])
    how = (
        "cache"
        if not fresh
        else "measured now"
        if len(fresh) == len(units) - len(skipped)  # every unit timed here, none read from the cache
        else "measured now, partly cached"
    )
    where = f"{path}" if cache else "not cached"
    source = (
        f"{how}: best of {len(shapes)} units ({best['name']}) in {dtype} on {device}, "
        f"up to {ROUNDS} rounds each after a warm-up [{where}]"
    )
    if skipped:  # not measured, so MFU's bound holds for the measured units only: said, not hidden
        source += f"; {len(skipped)} unit(s) too slow to time here skipped: {', '.join(skipped)}"
    return PeakFlops(best["best"], source, (min(best["rounds"]), max(best["rounds"])), shapes)


def read_cache(path: Path) -> dict:
    """The cache file, or {} when it is absent or unreadable (then it is measured and rewritten)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measure(device: str, dtype: str, unit: Workload, rounds: int = ROUNDS) -> list[float]:
    """FLOP/s of `unit` in each of `rounds` timed calls after one warm-up call. Under bf16/fp16
    the linear and attention units run as the model does, fp32 weights under autocast."""
    gen = torch.Generator(device).manual_seed(0)  # its own generator: the training RNG stays untouched
    amp = dtype != "fp32"
    param_dtype = torch.float32 if unit.kind != "matmul" else TORCH_DTYPES[dtype]

    def rand(*shape, grad=False):
        t = torch.randn(*shape, device=device, dtype=param_dtype, generator=gen)
        return t.requires_grad_(grad)

    if unit.kind == "linear":
        m, k, n, bias = unit.dims
        x, w, b = rand(m, k, grad=True), rand(n, k, grad=True), rand(n, grad=True) if bias else None
        out_grad, leaves = rand(m, n), [t for t in (x, w, b) if t is not None]

        def call():
            with torch.autocast(device, dtype=TORCH_DTYPES[dtype], enabled=amp):
                y = torch.nn.functional.linear(x, w, b)
            torch.autograd.backward(y, out_grad.to(y.dtype))
    elif unit.kind == "attention":
        bsz, h, s, hd = unit.dims
        q, k_, v = (rand(bsz, h, s, hd, grad=True) for _ in range(3))
        out_grad, leaves = rand(bsz, h, s, hd), [q, k_, v]

        def call():
            with torch.autocast(device, dtype=TORCH_DTYPES[dtype], enabled=amp):
                y = torch.nn.functional.scaled_dot_product_attention(q, k_, v, is_causal=True)
            torch.autograd.backward(y, out_grad.to(y.dtype))
    else:
        m, k, n = unit.dims
        a, b_, leaves = rand(m, k), rand(k, n), []

        def call():
            a @ b_

    rates: list[float] = []
    spent = 0.0
    for i in range(rounds + 1):
        if len(rates) >= 1 and spent > UNIT_BUDGET_S:
            break
        for t in leaves:  # as after the loop's zero_grad(set_to_none=True): no accumulation to time
            t.grad = None
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if device == "cuda":
            torch.cuda.synchronize()
        if i:  # the first call pays for warm-up: allocation, thread pool, kernel selection
            elapsed = time.perf_counter() - t0
            rates.append(unit.flops / elapsed)
            spent += elapsed
    return rates


def describe(peak: PeakFlops) -> str:
    """One line for the log: the denominator, its source and spread."""
    spread = f" (rounds {peak.spread[0] / 1e12:.3g}-{peak.spread[1] / 1e12:.3g})" if peak.spread else ""
    return f"MFU peak {peak.value / 1e12:.3g} TFLOP/s{spread}; {peak.source}"
