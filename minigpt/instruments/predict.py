"""Predicting a step's time: each stage of one training step from this machine's measured rates.

    python -m minigpt estimate --time                      # the default job's stage times, predicted
    python -m minigpt estimate --time --json --no-amp      # the same in fp32, as JSON
    python -m minigpt estimate --time --use-activation-checkpoint --chunked-loss

The model is a roofline over the step's own ops. `step_ops` lists every op one training step of
minigpt/core/model.py runs, from the shape alone (minigpt/core/shape.py): its FLOPs (matrix products
and attention, counted as `Shape.flops_per_token` counts them), the bytes it reads and writes
(dtype-aware: autocast casts weights and inputs to bf16, LayerNorm and the log-softmax stay fp32),
its transcendental evaluations (exp, tanh) and its launches. An op takes

    max(work / its kernel's measured rate, bytes / bandwidth at its size, evaluations / exp rate)
      + launches x per-op overhead

and a stage is "compute", "memory" or "overhead" bound by whichever of those terms sums largest.

The rates are measured on this machine, once per machine, dtype and torch version, and cached
beside the MFU peak (minigpt/instruments/peak.py) in $MINIGPT_CACHE_DIR/STEP_RATES_FILE:
  - every distinct matrix product of the step at its own shape (m, n, k), dtype and operand
    layout (LAYOUTS: a weight's gradient reads its first operand transposed, up to 2.4x slower
    in bf16), with its bias where it has one (addmm), and causal attention's forward and backward
    at the model's shape: FLOPs over the mean time of its timed calls;
  - the few kernels no rate of the three prices: GELU's tanh forward and backward, a chunk of the
    chunked loss (passes over cache-sized blocks, with dtype conversions), the embedding's dense
    gradient, and clip_grad_norm_ with fused AdamW over the step's own parameter sizes, each timed
    at its shape as the products are;
  - each of those kernels timed twice: in a loop, on operands the call before left in cache, and
    out of cache (`_timed_as_in_a_step`: before each of EVICTED_CALLS calls the caches are emptied
    and only the input the op before has just written is read back in). In a step a weight, an
    activation saved in the forward or the optimizer's state was last touched a step's traffic
    ago, some of it still in the last-level cache: on the Xeon of benchmarks/results/cpu-small.md
    the small products took about 1.35x their in-cache time in the step and 0.8x their
    out-of-cache time. Where in the hierarchy each operand sits is not modelled: a kernel runs at
    the geometric mean of its two rates, and the prediction gives each stage's range with every
    kernel at one rate or the other;
  - bandwidth: an element-wise add at working sets either side of ATen's grain (one thread, or a
    parallel region) and up to 400 MB (a 2 MB activation stays in cache, a 400 MB logits tensor
    does not), interpolated at each op's own size, on buffers used again and again: an
    element-wise op reads what the op before wrote (with the caches emptied before each call, a
    small op took 1.7x its time in the step);
  - the exp rate (evaluations per second of a large fp32 exp);
  - the per-op overhead: a chain of one-element ops, forward (an eager op) and backward (an
    autograd node), per op.
Nothing is fitted to the stage times it predicts. A rate is its work over the mean time of its
calls, not the best call: the trainer's stage times are means over a log interval, and on a shared
machine the prediction then describes the machine as it was when measured, like the stage times
measured beside it. Rates measured while other processes took more than config.BUSY of the
cores serve the prediction that measured them, which says so, and are never cached: a busy
figure is never reused, and the next prediction measures them again (the trainer's
--predict-time, which measures nothing, then has none). `python -m minigpt estimate --time
--remeasure` forgets this machine's rates and peak and measures both again.

On CUDA the same model runs from the device's data sheet (minigpt.instruments.peak.DATA_SHEETS
and BANDWIDTH below, every product at the dense peak) with the per-op overhead measured on the GPU, and is
marked untested: no GPU has checked it yet. A GPU in neither table has no rates: one line, exit 2.
"""

from __future__ import annotations

import bisect
import glob
import json
import math
import os
import re
import stat
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import torch

from minigpt.config import BUSY, UsageError, atomic_write, busy_share, cpu_seconds
from minigpt.core import chunked_loss
from minigpt.core.data import cache_dir
from minigpt.core.shape import Shape, shape_of
from minigpt.instruments.mfu import DTYPES
from minigpt.instruments.peak import data_sheet, machine_key

STEP_RATES_FILE = "step_rates.json"  # under minigpt.core.data.cache_dir(): one entry per machine and dtype
RATES_VERSION = 5  # how the rates are measured: a change makes new entries, never reads old ones
PREDICTED_STAGES = ("forward", "backward", "optimizer_step")
BOUNDS = ("compute", "memory", "overhead")
ROUNDS = 3  # timed calls per rate after a warm-up; their mean time is kept
RATE_BUDGET_S = 1.0  # a rate whose timed calls already took this long stops early (one call at least)
SAMPLE_S = 0.5  # ...and short ones are timed until they have taken this long
MAX_ROUNDS = 200
# ATen's grain: an element-wise op over fewer elements runs on one thread, over more in a parallel
# region, which on a loaded machine waits for a descheduled thread (milliseconds, not microseconds).
GRAIN = 32768
# Working sets (bytes read + written) at which the bandwidth of an fp32 add is measured: just below
# and at the grain, then up to well past the caches a 2-core share of a server gets. The time per
# byte at an op's own size then includes what a parallel region of that size costs.
BANDWIDTH_SIZES = (12 * (GRAIN - 2048), 12 * GRAIN, *(12 * 2**e for e in range(17, 26, 2)))
EXP_ELEMENTS = 2**22  # a 16 MiB fp32 tensor: big enough that the launch does not count
OVERHEAD_OPS = 200  # one-element ops per overhead measurement
# How a kernel is timed out of cache: before each timed call the caches are emptied by writing over
# twice the last-level cache (at most EVICT_BYTES), then the inputs the op before it has just
# written are read back in. The rest (weights, activations saved in the forward, optimizer state)
# comes from memory, and the output is written over memory no recent op touched. Timed that way a
# small product takes about 1.7x what it takes on operands left in cache by the call before.
EVICT_BYTES = 2**30
LLC_FALLBACK_BYTES = 256 * 2**20  # where sysfs does not say how big the last-level cache is
# The most parameters the optimizer is timed on (16 bytes each with gradient and moments: 512 MiB)
OPTIMIZER_SAMPLE = 2**25
EVICTED_CALLS = 10  # timed calls per kernel when each is preceded by an eviction (about 60 ms each)
# Bytes an op moves count its passes over memory: LayerNorm reads its input twice (the statistics,
# then the normalised output) and writes once; log_softmax and its backward read three times
# (max, sum of exps, the output; or the gradient's sum, then the gradient and the output) and write once.
LN_PASSES = 3

# Memory bandwidth per GPU from the vendors' data sheets (bytes/s), keyed as peak.DATA_SHEETS.
# A100: the 40 GB part's figure (the 80 GB part's 2.0 TB/s would only lower the prediction).
BANDWIDTH: dict[str, float] = {
    "H200": 4.8e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,  # SXM
    "A100": 1.555e12,
    "L40S": 864e9,
    "L4": 300e9,
    "A10": 600e9,
    "V100": 900e9,
}


# ------------------------------------------------------------------------------------- the ops
@dataclass(frozen=True)
class Op:
    """One op of a training step. `kernel` names the measured rate its FLOPs run at ("matmul
    MxNxK" or "attention forward BxHxSxD"); `flops` are counted as flops_per_token counts them
    (attention at full T, though the causal kernel skips half); `count`: how many times it runs."""

    stage: str
    name: str
    flops: int = 0
    bytes: int = 0
    exps: int = 0  # transcendental evaluations: exp, tanh, log
    launches: int = 1
    kernel: str | None = None
    count: int = 1
    elements: int = 0  # the work of a measured kernel without FLOPs (GELU, the loss, AdamW): its elements
    # a kernel that streams memory (the optimizer): its measured time is memory time; unmeasured
    # (a data sheet's rates) its bytes over the bandwidth price it
    streams: bool = False

    @property
    def work(self) -> int:
        """What the kernel's measured rate is per second of: FLOPs, or elements where it has none."""
        return self.flops or self.elements


# How a product's operands lie in memory: "nt" is x @ weight.T (a linear's forward), "nn" is
# grad @ weight (its input's gradient), "tn" is grad.T @ x (its weight's gradient: the first operand
# read down its columns). One shape runs at different rates in each: in bf16 on a CPU with AMX a
# transposed first operand costs up to 2.4x (the LM head's weight gradient), so each is measured.
LAYOUTS = ("nn", "nt", "tn")


def matmul_kernel(m: int, n: int, k: int, layout: str = "nn") -> str:
    """The rate name of an (m x k) @ (k x n) product with its operands laid out as `layout` says."""
    return f"matmul {layout} {m}x{n}x{k}"


def attention_kernel(direction: str, b: int, heads: int, s: int, hd: int) -> str:
    return f"attention {direction} {b}x{heads}x{s}x{hd}"


# Kernels whose cost no roofline of this machine's rates gives, measured at their own shape as the
# products are: GELU's tanh costs several exps per element (forward and backward); the chunked loss
# makes its passes over blocks that stay in cache (the bandwidth of a DRAM-sized
# working set would price them at several times their time) with dtype conversions between.
def gelu_kernel(direction: str, rows: int, cols: int) -> str:
    return f"gelu {direction} {rows}x{cols}"


def embedding_kernel(tokens: int, vocab: int, h: int) -> str:
    """The embedding's backward: a dense vocab x h gradient zeroed, the tokens' rows added in."""
    return f"embedding backward {tokens}x{vocab}x{h}"


def loss_chunk_kernel(rows: int, vocab: int, h: int) -> str:
    """One chunk of minigpt.core.chunked_loss.ChunkedCrossEntropy: logits, softmax and both gradients."""
    return f"loss chunk {rows}x{vocab}x{h}"


def optimizer_kernel(sizes: list[int]) -> str:
    """clip_grad_norm_ and fused AdamW over parameters of these sizes: "optimizer adamw NxK,..."
    (K tensors of N elements), what the trainer's optimizer_step runs. Its rate is per parameter:
    past OPTIMIZER_SAMPLE parameters it is timed on a sample in which each size keeps its share,
    so that timing it never needs a large model's state."""
    counts = sorted(Counter(sizes).items())
    scale = min(1.0, OPTIMIZER_SAMPLE / max(sum(sizes), 1))
    if scale < 1.0:  # each size keeps its share of the parameters: fewer tensors, or one cut shorter
        shares = [(n, n * k * scale) for n, k in counts]
        counts = [(n, max(1, round(e / n))) if n <= e else (max(1, int(e)), 1) for n, e in shares]
    return "optimizer adamw " + ",".join(f"{n}x{k}" for n, k in counts)


class _OpList:
    """The ops of one step in the order they run: each method appends what one layer runs."""

    def __init__(self, shape: Shape, amp_dtype: str):
        self.shape = shape
        self.amp = amp_dtype != "fp32"
        self.p = 2 if self.amp else 4  # bytes of an autocast activation or weight copy
        self.N = shape.tokens
        self.ops: list[Op] = []

    def add(self, stage: str, name: str, **kw) -> None:
        self.ops.append(Op(stage, name, **kw))

    def cast(self, stage: str, name: str, elements: int, count: int = 1) -> None:
        """fp32 -> autocast dtype (or back): nothing in fp32."""
        if self.amp:
            self.add(stage, f"cast {name}", bytes=(4 + self.p) * elements, count=count)

    def gemm(
        self,
        stage: str,
        name: str,
        mnk: tuple[int, int, int],
        layout: str,
        count: int = 1,
        bias: bool = False,
    ) -> None:
        """A product; with bias, addmm (a linear's forward: the bias is first copied into every row)."""
        (m, n, k), p = mnk, self.p
        kernel = matmul_kernel(m, n, k, layout)
        self.add(
            stage,
            name,
            flops=2 * m * n * k,
            bytes=p * (m * k + k * n) + p * m * n,
            kernel=kernel.replace("matmul", "addmm", 1) if bias else kernel,
            count=count,
        )

    def linear_forward(self, stage: str, name: str, k: int, n: int, bias: bool, cast_input: bool, count: int):
        if cast_input:
            self.cast(stage, f"{name} input", self.N * k, count)
        self.cast(stage, f"{name} weight", k * n + (n if bias else 0), count)
        self.gemm(stage, name, (self.N, n, k), "nt", count, bias)

    def linear_backward(self, name: str, k: int, n: int, bias: bool, cast_input: bool, count: int):
        N = self.N
        self.gemm("backward", f"{name} grad input", (N, k, n), "nn", count)
        self.gemm("backward", f"{name} grad weight", (n, k, N), "tn", count)
        if bias:
            self.add("backward", f"{name} grad bias", bytes=self.p * N * n + 4 * n, count=count)
        self.cast("backward", f"{name} grad weight to fp32", k * n + (n if bias else 0), count)
        if cast_input:
            self.cast("backward", f"{name} grad input to fp32", N * k, count)

    def layer_norm(self, stage: str, name: str, count: int = 1) -> None:
        h, N = self.shape.d_model, self.N
        self.add(stage, name, bytes=LN_PASSES * 4 * N * h + 8 * N, exps=N, count=count)

    def layer_norm_backward(self, name: str, count: int = 1) -> None:
        # the row sums (gradient, input), the input's gradient (both again, one written) and the
        # affine's gradients (column sums of both): six reads and a write of N x h fp32
        h, N = self.shape.d_model, self.N
        self.add("backward", f"{name} backward", bytes=28 * N * h + 8 * N, count=count)

    def block_forward(self, stage: str, count: int) -> None:
        """One block's forward, `count` times: pre-LN attention and MLP with fp32 residuals."""
        s, p, N = self.shape, self.p, self.N
        h, f, b, a = s.d_model, s.d_ff, s.batch_size, s.n_heads
        self.layer_norm(stage, "ln_1", count)
        self.linear_forward(stage, "qkv", h, 3 * h, True, True, count)
        self.add(
            stage,
            "attention",
            flops=4 * N * s.seq_len * h,
            bytes=3 * p * N * h + p * N * h + 4 * b * a * s.seq_len,
            exps=b * a * s.seq_len * s.seq_len // 2,
            kernel=attention_kernel("forward", b, a, s.seq_len, h // a),
            count=count,
        )
        self.add(stage, "attention output contiguous", bytes=2 * p * N * h, count=count)
        self.linear_forward(stage, "attn proj", h, h, True, False, count)
        self.add(stage, "residual add", bytes=(8 + p) * N * h, count=count)
        self.layer_norm(stage, "ln_2", count)
        self.linear_forward(stage, "fc", h, f, True, True, count)
        self.add(
            stage,
            "gelu",
            bytes=2 * p * N * f,
            elements=N * f,
            kernel=gelu_kernel("forward", N, f),
            count=count,
        )
        self.linear_forward(stage, "mlp proj", f, h, True, False, count)
        self.add(stage, "residual add", bytes=(8 + p) * N * h, count=count)


def step_ops(
    shape: Shape,
    amp_dtype: str = "fp32",
    device: str = "cpu",
    loss_chunk_elements: int = chunked_loss.LOSS_CHUNK_ELEMENTS,
) -> list[Op]:
    """Every op of one micro-batch's forward and backward and of the optimizer step, as
    train_minimal.py runs them (fused AdamW, clip_grad_norm_, zero_grad(set_to_none=True)).
    `shape.vocab_size` is the padded one. Dropout is not modelled (0 in every preset). The ops are
    the same on every `device` (F.cross_entropy's on both); their rates differ."""
    o = _OpList(shape, amp_dtype)
    h, N = shape.d_model, shape.tokens
    o.add(
        "forward",
        "embeddings (wte, wpe gathers and add)",
        bytes=4 * N * h * 4 + 4 * shape.seq_len * h + 8 * N,
        launches=4,
    )
    o.block_forward("forward", shape.n_layers)
    o.layer_norm("forward", "ln_f")
    if shape.chunked_loss:
        _chunked_loss_ops(o, loss_chunk_elements)
    else:
        _loss_ops(o)
    _backward_ops(o)
    _optimizer_ops(o)
    return o.ops


def _loss_ops(o: _OpList) -> None:
    """The LM head and F.cross_entropy over whole logits, forward, and the backward of both: under
    autocast the logits are cast to fp32 for log_softmax, and its gradient cast back."""
    h, V, N = o.shape.d_model, o.shape.vocab_size, o.N
    fwd = "forward"
    o.linear_forward(fwd, "lm_head", h, V, False, True, 1)
    o.cast(fwd, "logits to fp32", N * V)
    o.add(fwd, "log_softmax", bytes=16 * N * V, exps=N * V + N, launches=1)
    o.add(fwd, "nll_loss", bytes=4 * N + 8 * N)
    o.add("backward", "nll_loss backward (dense fp32 gradient)", bytes=4 * N * V + 12 * N)
    o.add("backward", "log_softmax backward", bytes=16 * N * V, exps=N * V)
    o.cast("backward", "logits gradient", N * V)
    o.linear_backward("lm_head", h, V, False, True, 1)


def _chunked_loss_ops(o: _OpList, loss_chunk_elements: int) -> None:
    """ChunkedCrossEntropy: the loss and both gradients, chunk by chunk, inside the forward; in
    backward only the scale."""
    h, V, N, p, fwd = o.shape.d_model, o.shape.vocab_size, o.N, o.p, "forward"
    rows = max(1, loss_chunk_elements // V)
    o.add(fwd, "chunked loss: zero the weight gradient", bytes=4 * V * h)
    rows = min(rows, N)
    chunks = [(rows, N // rows)] + ([(N % rows, 1)] if N % rows else [])
    for r, n_chunks in chunks:
        # the weight and the rows cast, the logits (x @ W.T), their fp32 softmax in place, and the
        # two gradient products (probs @ W, probs.T @ x): one measured kernel, loss_chunk
        o.add(
            fwd,
            "chunk: logits, softmax, both gradients",
            flops=3 * 2 * r * V * h,
            bytes=2 * (4 + p) * V * h + (4 + 2 * p) * r * V * 2,
            kernel=loss_chunk_kernel(r, V, h),
            count=n_chunks,
        )
        o.add(
            fwd,
            "chunk: grad x rows, grad weight +=",
            bytes=(4 + p) * r * h + (8 + p) * V * h,
            launches=2,
            count=n_chunks,
        )
    o.add("backward", "chunked loss backward (scale both gradients)", bytes=8 * N * h + 8 * V * h, launches=2)


def _backward_ops(o: _OpList) -> None:
    """From ln_f's backward to the tied weight's gradient: the blocks in reverse, each layer's
    backward `n_layers` times (with checkpointing, each block's forward again first)."""
    s, p, N, bwd = o.shape, o.p, o.N, "backward"
    L, h, f, b, a = s.n_layers, s.d_model, s.d_ff, s.batch_size, s.n_heads
    o.layer_norm_backward("ln_f")
    if s.activation_checkpoint:  # each block's forward again, just before its backward
        o.block_forward(bwd, L)
    o.add(bwd, "residual gradient add", bytes=12 * N * h, count=2 * L)
    o.cast(bwd, "mlp proj output gradient", N * h, L)
    o.linear_backward("mlp proj", f, h, True, False, L)
    o.add(
        bwd,
        "gelu backward",
        bytes=3 * p * N * f,
        elements=N * f,
        kernel=gelu_kernel("backward", N, f),
        count=L,
    )
    o.linear_backward("fc", h, f, True, True, L)
    o.layer_norm_backward("ln_2", L)
    o.cast(bwd, "attn proj output gradient", N * h, L)
    o.linear_backward("attn proj", h, h, True, False, L)
    o.add(bwd, "attention output gradient contiguous", bytes=2 * p * N * h, count=L)
    o.add(
        bwd,
        "attention backward",
        flops=8 * N * s.seq_len * h,
        bytes=4 * p * N * h + 3 * p * N * h + 4 * b * a * s.seq_len,
        exps=b * a * s.seq_len * s.seq_len // 2,
        kernel=attention_kernel("backward", b, a, s.seq_len, h // a),
        count=L,
    )
    o.add(bwd, "q, k, v gradients into one", bytes=6 * p * N * h, count=L)
    o.linear_backward("qkv", h, 3 * h, True, True, L)
    o.layer_norm_backward("ln_1", L)
    o.add(bwd, "wpe gradient (sum over the batch)", bytes=4 * N * h + 4 * s.seq_len * h)
    # the embedding's dense V x h gradient, then the tied weight's two gradients summed
    V = s.vocab_size
    o.add(
        bwd,
        "wte gradient (zeros, index_add)",
        bytes=4 * V * h + 8 * N * h + 8 * N,
        elements=V * h,
        kernel=embedding_kernel(N, V, h),
    )
    o.add(bwd, "tied weight: sum of two gradients", bytes=12 * V * h)


def _optimizer_ops(o: _OpList) -> None:
    """clip_grad_norm_ and fused AdamW, one measured kernel at the step's own parameter sizes (a
    tensor at a time, each a parallel region); its bytes: the norm reads each gradient, the
    scaling reads and writes it, AdamW reads param, grad and the two moments and writes three."""
    sizes, opt = o.shape.param_sizes(), "optimizer_step"
    o.add(
        opt,
        "clip_grad_norm_ and fused AdamW",
        elements=sum(sizes),
        bytes=40 * sum(sizes),
        kernel=optimizer_kernel(sizes),
        launches=0,  # the measured kernel's own
        streams=True,
    )
    o.add(opt, "zero_grad (set to None)", launches=len(sizes))


def matmul_flops(ops: list[Op]) -> int:
    """FLOPs of the ops that run at a matmul or attention rate (what flops_per_token counts)."""
    return sum(o.flops * o.count for o in ops if o.kernel)


# ------------------------------------------------------------------------------------ the rates
@dataclass
class Rates:
    """What one device does per second: each kernel's work per second (`matmul`: FLOP/s of the
    products and attention, elements/s of GELU, the loss and the embedding's gradient), bytes/s at
    each working-set size (ascending), exp evaluations/s, and seconds per op."""

    device: str
    dtype: str
    matmul: dict[str, float]
    bandwidth: list[tuple[int, float]]
    exps_per_s: float
    overhead_s: dict[str, float]  # "op" (forward, optimizer) and "autograd" (a backward node)
    source: str
    tested: bool = True  # False: from a data sheet, not yet checked against a measured step
    measured: int = 0  # rates measured by this call (0: everything came from the cache or a table)
    # each kernel's rates on operands left in cache and out of cache, the faster first (nearly
    # always the in-cache one): `matmul` holds their geometric mean. Empty where there is one rate
    # (a data sheet, or rates given in a test).
    kernel_bounds: dict[str, tuple[float, float]] = field(default_factory=dict)
    under_load: str = ""  # what was measured under load, said on its own line (empty: nothing)

    def flop_rate(self, kernel: str) -> float:
        return self.matmul.get(kernel, self.matmul.get("*", 0.0))

    def at_bound(self, which: int) -> Rates:
        """These rates with every kernel at its faster (0: in cache) or slower (1: out of cache) rate."""
        return replace(self, matmul={**self.matmul, **{k: b[which] for k, b in self.kernel_bounds.items()}})

    def bytes_per_s(self, size: int) -> float:
        """Bandwidth at a working set of `size` bytes: log-linear between the measured sizes."""
        sizes = [s for s, _ in self.bandwidth]
        i = bisect.bisect_left(sizes, size)
        if i == 0:
            return self.bandwidth[0][1]
        if i == len(sizes):
            return self.bandwidth[-1][1]
        (s0, r0), (s1, r1) = self.bandwidth[i - 1], self.bandwidth[i]
        t = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return r0 + t * (r1 - r0)


def kernels(ops: list[Op]) -> list[str]:
    return sorted({o.kernel for o in ops if o.kernel})


def _timed(call, rounds: int = ROUNDS, sync=None, most: int = MAX_ROUNDS, before=None) -> list[float]:
    """Seconds of each timed call after one warm-up call: at least `rounds` calls and SAMPLE_S of
    them (a short op is timed many times: on a loaded machine one call may or may not meet a
    descheduled thread), at most `most`, and a long one stops past RATE_BUDGET_S. `before` runs,
    untimed, before each timed call."""
    call()
    times: list[float] = []
    while len(times) < most:
        spent = sum(times)
        if times and (spent > RATE_BUDGET_S or len(times) >= rounds and spent >= SAMPLE_S):
            break
        if before:
            before()
        if sync:
            sync()
        t0 = time.perf_counter()
        call()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return times


def last_level_cache_bytes() -> int:
    """The largest cache sysfs lists for CPU 0 (Linux), else LLC_FALLBACK_BYTES."""
    sizes = []
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if m := re.fullmatch(r"(\d+)([KMG]?)", text):
            sizes.append(int(m[1]) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}[m[2]])
    return max(sizes, default=LLC_FALLBACK_BYTES)


def cache_evictor(device: str):
    """A call that empties the CPU's caches (it writes over twice the last-level cache, at most
    EVICT_BYTES), or None on a GPU, whose kernels are not measured."""
    if device != "cpu":
        return None
    buffer = torch.empty(min(EVICT_BYTES, 2 * last_level_cache_bytes()) // 4)
    return lambda: buffer.fill_(1.0)


def _timed_as_in_a_step(call, fresh: tuple, evict, sync=None) -> list[float]:
    """_timed with each of EVICTED_CALLS calls preceded by an eviction and a read of the tensors in
    `fresh`, what the op before it in a step has just written."""

    def before():
        evict()
        for t in fresh:
            t.sum()

    return _timed(call, sync=sync, before=before, most=EVICTED_CALLS)


def measure_kernel(device: str, dtype: str, kernel: str, evict=None) -> dict:
    """The rate of one kernel at its own shape, its work (FLOPs, or elements for GELU and the loss
    by rows) over each timed call: "rounds" on operands the call before left in cache, and with
    `evict`, "cold": out of cache, as _timed_as_in_a_step times it."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    gen = torch.Generator(device).manual_seed(0)  # its own generator: the training RNG stays untouched
    dt = DTYPES[dtype]
    kind, *rest = kernel.split(" ")
    dims = [int(x) for x in re.split("[x,]", rest[-1])]

    def randn(*shape: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    work, call, fresh = KERNEL_CALLS[kind](randn, rest[0], dims, dt)
    entry = {"rounds": [work / t for t in _timed(call, sync=sync)], "flops": work}
    if evict:
        entry["cold"] = [work / t for t in _timed_as_in_a_step(call, fresh, evict, sync)]
    return entry


def _matmul_call(randn, layout: str, dims: list[int], dt: torch.dtype, bias: bool = False):
    """x @ w: x is what the op before wrote (a layer's input, or the gradient flowing back); w is a
    weight or a saved activation. A "t" operand is made in the other order and read through its
    transpose, as autograd does."""
    m, n, k = dims
    x = randn(k, m).t() if layout[0] == "t" else randn(m, k)
    w = randn(n, k).t() if layout[1] == "t" else randn(k, n)
    b, out = (randn(n) if bias else None), x.new_empty(m, n)

    def call():
        return torch.addmm(b, x, w, out=out) if bias else torch.mm(x, w, out=out)

    return 2 * m * n * k, call, (x,)


def _attention_call(randn, direction: str, dims: list[int], dt: torch.dtype):
    b, heads, s, hd = dims
    q, k, v = (randn(b, heads, s, hd).requires_grad_() for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if direction == "forward":
        return 4 * b * s * s * heads * hd, lambda: sdpa(q, k, v, is_causal=True), (q, k, v)
    y, grad = sdpa(q, k, v, is_causal=True), randn(b, heads, s, hd)
    call = lambda: torch.autograd.grad(y, (q, k, v), grad, retain_graph=True)  # noqa: E731
    return 8 * b * s * s * heads * hd, call, (grad,)


def _gelu_call(randn, direction: str, dims: list[int], dt: torch.dtype):
    x, grad = randn(*dims), randn(*dims)
    if direction == "forward":
        return math.prod(dims), lambda: torch.nn.functional.gelu(x, approximate="tanh"), (x,)
    call = lambda: torch.ops.aten.gelu_backward(grad, x, approximate="tanh")  # noqa: E731
    return math.prod(dims), call, (grad,)


def _loss_call(randn, kind: str, dims: list[int], dt: torch.dtype):
    """One chunk of the chunked loss at this shape (the tied weight read by every chunk: in cache)."""
    rows, vocab, h = dims
    # the weight at GPT-2's initial scale: logits of a plausible size (unit-scale weights make logits
    # so spread that most softmax terms underflow to subnormal floats, several times slower)
    x, weight, scale = (
        randn(rows, h, dtype=torch.float32),
        0.02 * randn(vocab, h, dtype=torch.float32),
        1.0 / rows,
    )
    targets = torch.randint(vocab, (rows,), device=x.device)
    call = lambda: chunked_loss.loss_chunk(x, weight, targets, dt, scale)  # noqa: E731
    return 6 * rows * vocab * h, call, (x, weight)


def _embedding_call(randn, direction: str, dims: list[int], dt: torch.dtype):
    tokens, vocab, h = dims
    grad = randn(tokens, h, dtype=torch.float32)  # the embedding's output is fp32 under autocast too
    ids = torch.randint(vocab, (tokens,), device=grad.device)
    call = lambda: torch.ops.aten.embedding_dense_backward(grad, ids, vocab, -1, False)  # noqa: E731
    return vocab * h, call, (grad, ids)


def _optimizer_call(randn, what: str, dims: list[int], dt: torch.dtype):
    """The trainer's clip_grad_norm_ and fused AdamW step over fp32 parameters of the sizes in
    `dims` (N, K pairs); the gradients are what the backward has just written."""
    sizes = [n for n, k in zip(dims[::2], dims[1::2]) for _ in range(k)]
    params = [torch.nn.Parameter(0.02 * randn(n, dtype=torch.float32)) for n in sizes]
    for p in params:
        p.grad = 1e-3 * randn(p.numel(), dtype=torch.float32)
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    def call():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return sum(sizes), call, tuple(p.grad for p in params)


KERNEL_CALLS = {
    "matmul": _matmul_call,
    "addmm": lambda *a: _matmul_call(*a, bias=True),
    "attention": _attention_call,
    "gelu": _gelu_call,
    "loss": _loss_call,
    "embedding": _embedding_call,
    "optimizer": _optimizer_call,
}


def measure_bandwidth(device: str) -> dict:
    """Bytes/s of an fp32 add (two read, one written) at each working set of BANDWIDTH_SIZES, on
    buffers used again and again: an element-wise op reads what the op before it has just written,
    and writes into memory malloc has just recycled."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    result = {}
    for size in BANDWIDTH_SIZES:
        n = size // 12
        x, y, out = (torch.ones(n, device=device) for _ in range(3))
        times = _timed(lambda x=x, y=y, out=out: torch.add(x, y, out=out), rounds=5, sync=sync)
        result[str(size)] = [12 * n / t for t in times]
    return result


def measure_exp(device: str) -> list[float]:
    sync = torch.cuda.synchronize if device == "cuda" else None
    x = torch.linspace(-4, 4, EXP_ELEMENTS, device=device)
    out = torch.empty_like(x)
    return [EXP_ELEMENTS / t for t in _timed(lambda: torch.exp(x, out=out), rounds=5, sync=sync)]


def measure_overhead(device: str) -> dict[str, list[float]]:
    """Seconds per op of a chain of one-element ops: eager in the forward, and per autograd node
    in its backward. What a launch costs beyond its work, measured, not chosen."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    x = torch.ones(1, device=device, requires_grad=True)
    one = torch.ones(1, device=device)

    def chain():
        y = x
        for _ in range(OVERHEAD_OPS):
            y = y + one
        return y

    forward = _timed(chain, rounds=5, sync=sync)
    ys = []

    def backward():
        torch.autograd.grad(ys[-1], x)

    def fresh():
        ys.append(chain())

    rounds = []
    for _ in range(5):
        fresh()
        rounds.extend(_timed(backward, rounds=1, sync=sync, most=1))
        ys.clear()
    return {"op": [t / OVERHEAD_OPS for t in forward], "autograd": [t / OVERHEAD_OPS for t in rounds]}


def cuda_table(device_name: str) -> tuple[str, float] | None:
    """(the GPU's name in the tables, bandwidth) when both tables know it."""
    for gpu in sorted(BANDWIDTH, key=len, reverse=True):
        if re.search(rf"\b{re.escape(gpu)}\b", device_name):
            return gpu, BANDWIDTH[gpu]
    return None


class NoRates(UsageError):
    """The device has no rates: a GPU in neither table, or (measure=False) a cache without them."""


def rates_key(device: str, dtype: str) -> str:
    """The cache entry for this machine, dtype and torch, measured this way (RATES_VERSION)."""
    return f"{machine_key(device, dtype)} | rates v{RATES_VERSION}"


UNWRITABLE: set = set()  # caches that could not be written: said once a process


def read_cache(path) -> dict:
    """The rates cache, {} where it is missing, not a regular file (a FIFO would block: opened
    without blocking, then refused), too large, or not a JSON object of objects."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            data = json.loads(f.read(1 << 26))
        return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}
    except (OSError, ValueError, RecursionError):
        return {}


def update_cache(path, update) -> bool:
    """update(entries) applied to the cache as it is now (another process may have added rates
    meanwhile), written atomically; False, said once a process, where it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = read_cache(path)
        update(entries)
        atomic_write(path, json.dumps(entries, indent=1, sort_keys=True) + "\n")
        return True
    except OSError as e:
        if path not in UNWRITABLE:
            UNWRITABLE.add(path)
            print(
                f"note: the step's rates are not cached: {path} cannot be written ({e.strerror})",
                file=sys.stderr,
            )
        return False


def step_rates(
    device: str,
    dtype: str,
    needed: list[str],
    cache: bool = True,
    measure: bool = True,
    remeasure: bool = False,
) -> Rates:
    """This device's rates for the kernels in `needed`: on the CPU measured once and cached (what
    the cache lacks is measured and added; with measure=False it raises NoRates instead, for
    readers that must not load the machine); on CUDA a known GPU's data sheet. Raises NoRates for
    a GPU in no table. Rates measured under load (others took more than BUSY of the cores) serve
    this call, which says so, and are never cached, nor read from a cache an earlier version
    wrote: a busy figure is never reused. `remeasure`: forget this machine's cached rates for the
    dtype first."""
    if device == "cuda":
        return _table_rates(dtype, cache)
    key, path = rates_key(device, dtype), cache_dir() / STEP_RATES_FILE
    if cache and remeasure:
        update_cache(path, lambda entries: entries.pop(key, None))
    known = read_cache(path).get(key, {}) if cache else {}
    known = {n: r for n, r in known.items() if _usable(r)}
    wanted = ["bandwidth", "exp", "overhead", *needed]
    if not measure and (missing := [n for n in wanted if n not in known]):
        how = "python -m minigpt estimate --time with the run's flags measures them"
        raise NoRates(f"no rates measured here for {len(missing)} of the step's kernels in {dtype}; {how}")
    fresh = _measure_missing(device, dtype, wanted, known, needed) if measure else {}
    quiet = {n: r for n, r in fresh.items() if not loaded(r)}
    if cache and quiet:
        cache = update_cache(
            path, lambda entries: entries.__setitem__(key, {**entries.get(key, {}), **quiet})
        )
    got = {**known, **fresh}
    under_load = [n for n in wanted if loaded(got[n])]
    rate = statistics.harmonic_mean  # of rates: the work over the calls' mean time
    # (faster, slower): a kernel timed faster out of cache than in it (noise) keeps the range ordered
    bounds = {
        k: tuple(sorted((rate(got[k]["rounds"]), rate(got[k]["cold"])), reverse=True))
        for k in needed
        if isinstance(got[k].get("cold"), list) and got[k]["cold"]
    }
    how = (
        "cache"
        if not fresh
        else "measured now"
        if len(fresh) == len(wanted)
        else "measured now, partly cached"
    )
    return Rates(
        device=device,
        dtype=dtype,
        matmul={
            k: math.sqrt(bounds[k][0] * bounds[k][1]) if k in bounds else rate(got[k]["rounds"])
            for k in needed
        },
        kernel_bounds=bounds,
        bandwidth=sorted((int(s), rate(r)) for s, r in got["bandwidth"]["rounds"].items()),
        exps_per_s=rate(got["exp"]["rounds"]),
        overhead_s={k: statistics.fmean(v) for k, v in got["overhead"]["rounds"].items()},
        source=f"{how}: {len(needed)} kernels (in cache and out of it), bandwidth at "
        f"{len(got['bandwidth']['rounds'])} sizes, exp, per-op overhead "
        f"[{path if cache else 'not cached'}]",
        measured=len(fresh),
        under_load=(
            f"{len(under_load)} rates measured under load (other processes on "
            f"{100 * max(got[n]['others'] for n in under_load):.0f}% of the cores): not cached; "
            "re-run on a quiet machine"
            if under_load
            else ""
        ),
    )


def cuda_overhead(cache: bool = True) -> dict[str, float]:
    """Seconds per op and per autograd node on this GPU (measure_overhead), measured once and cached
    beside the CPU's rates: a few thousand one-element ops, well under a second once CUDA is up,
    but a start-up measures nothing after the first (on an H200 every start had measured it: 80,248
    of a 100,000-entry CUDA memory history were these ops). A cache that cannot be written costs
    one warning line and the measurement."""
    key, path = rates_key("cuda", "any"), cache_dir() / STEP_RATES_FILE
    known = read_cache(path).get(key, {}).get("overhead") if cache else None
    if not (
        isinstance(known, dict)
        and all(isinstance(known.get(k), list) and known[k] for k in ("op", "autograd"))
    ):
        known = measure_overhead("cuda")
        if cache:
            date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
            entry = {"overhead": {**known, "date": date}}
            update_cache(path, lambda entries: entries.__setitem__(key, {**entries.get(key, {}), **entry}))
    return {k: statistics.fmean(known[k]) for k in ("op", "autograd")}


def loaded(entry: dict) -> bool:
    """A rate measured while other processes took more than BUSY of the cores."""
    others = entry.get("others")
    return isinstance(others, (int, float)) and others > BUSY


def _usable(entry) -> bool:
    """A cached rate that can serve: measured quietly, with the figures a rate is read from."""
    figures = entry.get("rounds") if isinstance(entry, dict) else None
    return bool(figures) and isinstance(figures, (list, dict)) and not loaded(entry)


def _measure_missing(device: str, dtype: str, wanted: list[str], known: dict, needed: list[str]) -> dict:
    """The rates of `wanted` that `known` lacks, each named on stderr as it starts (a minute of
    silence looks like a hang), and the share of the cores other processes took meanwhile
    (config.busy_share), recorded in every fresh entry."""
    todo = [n for n in wanted if n not in known]
    evict = cache_evictor(device) if any(n in todo for n in needed) else None
    before, fresh, t0 = cpu_seconds(), {}, time.perf_counter()
    for i, name in enumerate(todo, 1):
        elapsed = time.perf_counter() - t0
        print(f"[rates] {i}/{len(todo)} {name} ({elapsed:.0f} s)", file=sys.stderr, flush=True)
        if name == "bandwidth":
            entry = {"rounds": measure_bandwidth(device)}
        elif name == "exp":
            entry = {"rounds": measure_exp(device)}
        elif name == "overhead":
            entry = {"rounds": measure_overhead(device)}
        else:
            entry = measure_kernel(device, dtype, name, evict)
        fresh[name] = {**entry, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    others = busy_share(before, cpu_seconds()) if fresh else None
    for entry in fresh.values():
        entry["others"] = others
    return fresh


def _table_rates(dtype: str, cache: bool = True) -> Rates:
    name = torch.cuda.get_device_name()
    known = cuda_table(name)
    peak = data_sheet(name, dtype) if known else None
    if known is None or peak is None:
        raise NoRates(
            f"no rates for {name} in {dtype}: it is in neither minigpt.instruments.peak.DATA_SHEETS nor "
            "minigpt.instruments.predict.BANDWIDTH; add its data-sheet peak FLOP/s and bandwidth there"
        )
    overhead = cuda_overhead(cache)
    return Rates(
        device="cuda",
        dtype=dtype,
        matmul={"*": peak},
        bandwidth=[(1, known[1])],
        exps_per_s=math.inf,
        overhead_s=overhead,
        source=f"table: {known[0]} {dtype} dense peak {peak / 1e12:.0f} TFLOP/s, {known[1] / 1e12:.2f} TB/s; "
        "per-op overhead measured on this GPU (once, cached)",
        tested=False,
    )


# ------------------------------------------------------------------------------- the prediction
@dataclass
class StageTime:
    """A stage's predicted time and its parts: each op's larger of compute and memory time goes to
    that bound, its launches to overhead."""

    compute_ms: float = 0.0
    memory_ms: float = 0.0
    overhead_ms: float = 0.0

    @property
    def ms(self) -> float:
        return self.compute_ms + self.memory_ms + self.overhead_ms

    @property
    def bound(self) -> str:
        parts = dict(zip(BOUNDS, (self.compute_ms, self.memory_ms, self.overhead_ms)))
        return max(parts, key=parts.get)


@dataclass
class TimePrediction:
    stages: dict[str, StageTime]
    tokens_per_step: int
    grad_accum_steps: int
    rates: Rates
    config: dict = field(default_factory=dict)
    # each stage with every kernel at its in-cache rate, and at its out-of-cache rate
    range_ms: dict[str, tuple[float, float]] = field(default_factory=dict)

    @property
    def step_ms(self) -> float:
        return sum(s.ms for s in self.stages.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / (self.step_ms / 1000)

    def to_record(self) -> dict:
        """What --json prints: stage_ms, stage_ms_range, tokens_per_s, each stage's bound and parts,
        the rates' source."""
        return {
            "stage_ms": {k: s.ms for k, s in self.stages.items()},
            "tokens_per_s": self.tokens_per_s,
            "step_ms": self.step_ms,
            "bound": {k: s.bound for k, s in self.stages.items()},
            "parts_ms": {k: asdict(s) for k, s in self.stages.items()},
            "stage_ms_range": {k: list(v) for k, v in self.range_ms.items()},
            "device": self.rates.device,
            "dtype": self.rates.dtype,
            "tested": self.rates.tested,
            "rates_source": self.rates.source
            + (f"; {self.rates.under_load}" if self.rates.under_load else ""),
            "config": self.config,
        }


def predict_ops(ops: list[Op], rates: Rates, grad_accum_steps: int = 1) -> dict[str, StageTime]:
    """Each stage's time: per op max(compute, memory) + launches x overhead, times its count.
    Forward and backward run once per micro-batch."""
    stages = {name: StageTime() for name in PREDICTED_STAGES}
    for o in ops:
        reps = o.count * (grad_accum_steps if o.stage != "optimizer_step" else 1)
        compute = 0.0
        if o.kernel:
            compute = o.work / rates.flop_rate(o.kernel)
        if o.exps:
            compute = max(compute, o.exps / rates.exps_per_s)
        memory = o.bytes / rates.bytes_per_s(o.bytes) if o.bytes else 0.0
        overhead = o.launches * rates.overhead_s["autograd" if o.stage == "backward" else "op"]
        st = stages[o.stage]
        if o.streams and o.kernel in rates.matmul:  # a measured kernel whose time is memory traffic
            memory, compute = compute, 0.0
        if compute >= memory:
            st.compute_ms += 1000 * reps * compute
        else:
            st.memory_ms += 1000 * reps * memory
        st.overhead_ms += 1000 * reps * overhead
    return stages


def _stage_times(ops: list[Op], rates: Rates, shape: Shape) -> dict[str, StageTime]:
    accum = shape.grad_accum_steps
    stages = predict_ops(ops, rates, accum)
    if accum > 1:  # the later micro-batches add each gradient into the held one, a tensor at a time
        adds = [
            Op("backward", "gradient accumulation", bytes=12 * n, count=accum - 1)
            for n in shape.param_sizes()
        ]
        for name, st in predict_ops(adds, rates).items():
            stages[name].memory_ms += st.memory_ms
            stages[name].compute_ms += st.compute_ms
            stages[name].overhead_ms += st.overhead_ms
    return stages


def predict_step(
    shape: Shape,
    amp_dtype: str,
    device: str,
    cache: bool = True,
    measure: bool = True,
    remeasure: bool = False,
) -> TimePrediction:
    """The predicted stage times of one optimizer step of this shape: every kernel at the geometric
    mean of its in-cache and out-of-cache rates, and the range between the two."""
    ops = step_ops(shape, amp_dtype, device)
    rates = step_rates(device, amp_dtype, kernels(ops), cache=cache, measure=measure, remeasure=remeasure)
    stages = _stage_times(ops, rates, shape)
    low, high = (_stage_times(ops, rates.at_bound(i), shape) for i in (0, 1))
    # the flags first, then the shape: the order --json prints
    flags = {k: getattr(shape, k) for k in ("grad_accum_steps", "activation_checkpoint", "chunked_loss")}
    config = {"amp_dtype": amp_dtype, **flags, **asdict(shape)}
    spans = {k: (low[k].ms, high[k].ms) for k in stages} if rates.kernel_bounds else {}
    return TimePrediction(
        stages, shape.tokens * shape.grad_accum_steps, shape.grad_accum_steps, rates, config, spans
    )


DROPOUT_NOTE = "  dropout is not modelled (its masks and the math attention it needs on the CPU)"


def format_prediction(pred: TimePrediction) -> str:
    c, r = pred.config, pred.rates
    mark = "" if r.tested else " (UNTESTED: from the data sheet; no GPU has checked this model yet)"
    extras = [
        *([f"{pred.grad_accum_steps} accumulation steps"] if pred.grad_accum_steps > 1 else []),
        *(["activation checkpointing"] if c.get("activation_checkpoint") else []),
        *(["chunked loss"] if c.get("chunked_loss") else []),
    ]
    lines = [
        f"Step time prediction: {c['n_layers']} layers, d_model {c['d_model']}, {c['n_heads']} heads, "
        f"d_ff {c['d_ff']}, vocab {c['vocab_size']}",
        f"  batch {c['batch_size']} x seq {c['seq_len']}; {', '.join([c['amp_dtype'], *extras])}",
        *([DROPOUT_NOTE] if c.get("dropout") else []),
        f"Device {r.device}{mark}",
        f"  rates: {r.source}",
        *([f"  {r.under_load}"] if r.under_load else []),
        f"  {'stage':16s}{'predicted ms':>14s}{'in cache - out of it':>22s}  {'bound':9s}  "
        "compute / memory / overhead ms",
    ]
    spans = {k: f"{lo:.1f} - {hi:.1f}" for k, (lo, hi) in pred.range_ms.items()}
    for name, st in pred.stages.items():
        lines.append(
            f"  {name:16s}{st.ms:14.1f}{spans.get(name, ''):>22s}  {st.bound:9s}  "
            f"{st.compute_ms:.1f} / {st.memory_ms:.1f} / {st.overhead_ms:.1f}"
        )
    lines.append(f"  {'step':16s}{pred.step_ms:14.1f}  -> {pred.tokens_per_s:,.0f} tokens/s")
    if spans:
        lines.append(
            "  (each kernel at the geometric mean of its rates on operands in cache and out of it; "
            "the range: all at one or the other)"
        )
    return "\n".join(lines)


def time_report(shape: Shape, device: str, amp_dtype: str, as_json: bool, remeasure: bool = False) -> str:
    """What `python -m minigpt estimate --time [--json] [--remeasure]` prints for a step of this
    shape. --remeasure forgets this machine's cached rates and MFU peak and measures both again
    (the peak as the trainer finds it: peak.device_peak)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--time --device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    peak_line = ""
    if remeasure:
        from minigpt.instruments import peak

        keys = [machine_key(device, d) for d in peak.peak_dtypes(device)]
        update_cache(cache_dir() / peak.PEAK_CACHE_FILE, lambda entries: [entries.pop(k, None) for k in keys])
        print("[peak] measuring the MFU peak", file=sys.stderr, flush=True)
        peak_line = peak.device_peak(None, device).describe() + "\n"
    pred = predict_step(shape, amp_dtype, device, remeasure=remeasure)
    return json.dumps(pred.to_record(), indent=1) if as_json else peak_line + format_prediction(pred)


def run_prediction(cfg, vocab_size: int, amp_dtype: str, device: str) -> dict | str:
    """A trainer run's predicted step for config.json and its last lines, from cached rates only
    (measuring would lengthen the run); where there is none, why, in words."""
    try:
        step = predict_step(shape_of(cfg, vocab_size), amp_dtype, device, measure=False)
    except NoRates as e:
        return str(e)
    except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as e:
        return f"the rates cache {cache_dir() / STEP_RATES_FILE} is damaged ({type(e).__name__}); delete it"
    return {k: v for k, v in step.to_record().items() if k != "config"}
