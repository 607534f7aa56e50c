"""Predicting memory from the flags alone: what one training step of minigpt's GPT holds, with no
model built and nothing allocated. Its measured counterpart is minigpt/instruments/breakdown.py;
docs/memory.md derives the formulas.

    python -m minigpt estimate                                # the default job (the trainer's flags)
    python -m minigpt estimate --preset gpt2 --batch-size 4 --device-memory-gb 24
    python train_minimal.py --estimate-memory --preset gpt2   # the same, from the trainer
    python -m minigpt estimate --time [--json]                # the step's stage times (predict.py)
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field, replace
from functools import partial

import torch

from minigpt.config import GPT2_VOCAB, UsageError, parse_args
from minigpt.core.chunked_loss import LOSS_CHUNK_ELEMENTS
from minigpt.core.shape import Shape, shape_of

MiB, GiB = 2**20, 2**30  # the units the estimates are printed in (memory.log's "MiB")

# ---------------------------------------------------------------------------- the estimator (GPT)


@dataclass
class MemoryEstimate:
    """Predicted bytes of one training step of the GPT in minigpt/core/model.py; see estimate_gpt and
    docs/memory.md."""

    amp_dtype: str
    activation_checkpoint: bool
    attention: str  # "flash" (no s x s scores saved) or "math"
    params: int
    grads: int
    optimizer: int
    block: int  # saved per block (with checkpointing: the block input the checkpoint keeps)
    n_layers: int
    embeddings: int  # saved by wte, wpe and the embedding dropout
    head: int  # saved by ln_f and lm_head
    loss: int  # saved by the cross-entropy
    weight_copies: int  # of the above: autocast's low-precision weight copies that matmuls save
    logits: int  # the logits the model returns: live until the loss's forward returns
    recompute: int  # checkpointing: one block's activations, rebuilt during backward
    grad_accum_steps: int = 1
    chunked_loss: bool = False
    workspaces: int = 0  # CUDA: cuBLAS workspaces, live in every moment (a temporary of no op)
    # The candidate moments of the peak, {moment: {part: bytes}} with the parts of memory.PEAK_PARTS;
    # the largest is the predicted peak (docs/memory.md).
    moments: dict = field(default_factory=dict)

    @property
    def activations(self) -> int:
        return self.n_layers * self.block + self.embeddings + self.head + self.loss

    @property
    def total(self) -> int:
        """Same definition as MemoryBreakdown.total: comparable with the measurement."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def peak_moment(self) -> str:
        return max(self.moments, key=lambda m: sum(self.moments[m].values()))

    @property
    def peak(self) -> int:
        """The predicted allocator peak of the step (MemoryBreakdown.peak): its highest moment."""
        return sum(self.moments[self.peak_moment].values())

    @property
    def peak_stage(self) -> str:
        return MOMENT_STAGES[self.peak_moment]

    def peak_parts(self) -> dict[str, int]:
        return dict(self.moments[self.peak_moment])

    def to_record(self) -> dict:
        record = asdict(self)
        record.update(
            activations=self.activations,
            total=self.total,
            peak=self.peak,
            peak_moment=self.peak_moment,
            peak_stage=self.peak_stage,
            moments={m: sum(parts.values()) for m, parts in self.moments.items()},
        )
        return record


# The moments the estimator compares, and the stage each falls in (minigpt.stages' names).
MOMENT_STAGES = {
    "loss forward (a chunk)": "forward",
    "loss forward": "forward",
    "loss backward": "backward",
    "lm head backward": "backward",
    "block recompute": "backward",
    "tied embedding backward": "backward",
    "optimizer step": "optimizer_step",
}


@dataclass(frozen=True)
class _Sizes:
    """The byte sizes every term of the estimate is built from (docs/memory.md's symbols): the
    step's shape, the matmuls' dtype and the device, which picks the loss and the attention."""

    shape: Shape
    amp_dtype: str
    device: str

    @property
    def amp(self) -> bool:
        return self.amp_dtype != "fp32"

    @property
    def p(self) -> int:  # bytes of an autocast activation or weight copy
        return 2 if self.amp else 4

    @property
    def sbh(self) -> int:
        return self.shape.tokens * self.shape.d_model

    @property
    def E(self) -> int:  # the tied embedding / LM head weight, and each of its fp32 gradients
        return 4 * self.shape.vocab_size * self.shape.d_model

    @property
    def lowp_log_softmax(self) -> bool:
        """F.cross_entropy under CUDA autocast: log_softmax runs in the logits' dtype (it is given
        that dtype, so autocast keeps it) and nll_loss, on autocast's fp32 list, on an fp32 copy.
        The CPU's autocast casts the logits to fp32 before log_softmax: one fp32 copy, freed when
        log_softmax has made its fp32 output, the one log-probs storage nll_loss saves."""
        return self.amp and self.device != "cpu"

    @property
    def flash(self) -> bool:
        """The CPU flash kernel has no dropout: the math path takes over."""
        return self.shape.dropout == 0 or self.device == "cuda"

    @property
    def layer_norm(self) -> int:  # its fp32 input and the row statistics
        return 4 * self.sbh + 8 * self.shape.tokens

    @property
    def weight_copies(self) -> int:  # of one block: autocast's low-precision copies the matmuls save
        h, f = self.shape.d_model, self.shape.d_ff
        return self.p * (4 * h * h + 2 * h * f) if self.amp else 0

    def mask(self, dtype_bytes: int) -> int:
        """A dropout mask over an (s, b, h) tensor."""
        return 0 if self.shape.dropout == 0 else self.sbh * (1 if self.device == "cuda" else dtype_bytes)

    @property
    def full_block(self) -> int:
        """What one block saves for backward without checkpointing (Korthikanti et al.'s count
        redone for this model: fp32 LayerNorm inputs, flash attention, no dropout masks)."""
        s, p, sbh = self.shape, self.p, self.sbh
        a, bs = s.n_heads, s.tokens
        if self.flash:
            attention = p * sbh + 3 * p * sbh + p * sbh + 4 * a * bs
        else:
            attention = p * sbh + 3 * 4 * sbh + 3 * 4 * a * bs * s.seq_len + p * sbh
        mlp = p * sbh + 2 * p * bs * s.d_ff
        return 2 * self.layer_norm + attention + mlp + self.weight_copies + 2 * self.mask(p)


def estimate_gpt(
    shape: Shape,
    amp_dtype: str = "fp32",
    device: str = "cpu",
    loss_chunk_elements: int = LOSS_CHUNK_ELEMENTS,
) -> MemoryEstimate:
    """Bytes of one training step of minigpt's GPT (a shape in, no model built), with fused
    AdamW, the step shaped as train_minimal.py runs it (the loop keeps the loss, not the logits).
    docs/memory.md derives every term and checks it against the measurement.

    What persists: parameters, fp32 gradients, AdamW's two fp32 moments and a step per tensor. What
    the forward saves: Korthikanti et al.'s per-layer count redone for this model (fp32 LayerNorm
    inputs, flash attention, no dropout masks), and what F.cross_entropy saves: the fp32 log-
    probabilities 4bsV (under the CPU's autocast too, which casts the logits to fp32 before
    log_softmax), and under CUDA autocast also the bf16/fp16 log-probs p*bsV that log_softmax made
    (nll_loss's fp32 copy is a storage of its own). The peak is the largest of a few moments: the
    loss itself (its forward: the logits, the CPU autocast's fp32 copy of them and the log-probs;
    its backward: every saved tensor and NllLossBackward's fp32 bsV gradient, and with one fp32 log-
    probs storage LogSoftmaxBackward's fp32 output beside it), the end of backward (the tied
    embedding's three V x h gradients), a checkpointed block rebuilt, the optimizer step, and with
    chunked_loss a chunk of the loss in the forward (the fp32 gradient accumulators, one chunk's
    fp32 logits twice over, and the chunk weight gradients in the matmuls' dtype: bf16 under AMP).
    On CUDA every moment also holds the two cuBLAS workspaces (64 MiB), allocated at the first
    matmul.
    """
    z = _Sizes(shape, amp_dtype, device)
    est = _saved(z)
    moment = partial(_moment, est)
    if shape.chunked_loss:
        est.moments["loss forward (a chunk)"] = _chunk_moment(z, est, moment, loss_chunk_elements)
    else:
        est.moments.update(_loss_moments(z, est, moment))
    est.moments.update(_backward_moments(z, est, moment))
    return est


def _saved(z: _Sizes) -> MemoryEstimate:
    """The persistent state and what the forward saves for backward (no moments yet)."""
    s, p, sbh = z.shape, z.p, z.sbh
    h, bs, V, L = s.d_model, s.tokens, s.vocab_size, s.n_layers
    params = 4 * s.params
    optimizer = 2 * params + 4 * (2 + 12 * L + 2)
    block = 4 * sbh if s.activation_checkpoint else z.full_block
    if s.chunked_loss:  # ChunkedCrossEntropy saves the gradients it made: for x (fp32 N x h) and the weight
        head, loss, head_copy, logits = z.layer_norm + 4 * sbh + z.E, 0, 0, 0
    else:
        head_copy = p * V * h if z.amp else 0
        head = z.layer_norm + p * sbh + head_copy
        # F.cross_entropy saves the fp32 log-probabilities and the targets (with the weight
        # total), and under CUDA autocast the low-precision log-probs log_softmax made besides
        # (nll_loss saves its fp32 copy of them)
        loss = 4 * bs * V + 8 * bs + 4
        loss += p * bs * V if z.lowp_log_softmax else 0
        logits = p * bs * V
    return MemoryEstimate(
        amp_dtype=z.amp_dtype,
        activation_checkpoint=s.activation_checkpoint,
        attention="flash" if z.flash else "math",
        params=params,
        grads=params,
        optimizer=optimizer,
        block=block,
        n_layers=L,
        embeddings=8 * bs + 8 * s.seq_len + z.mask(4),
        head=head,
        loss=loss,
        weight_copies=(0 if s.activation_checkpoint else L * z.weight_copies) + head_copy,
        logits=logits,
        recompute=z.full_block if s.activation_checkpoint else 0,
        grad_accum_steps=s.grad_accum_steps,
        chunked_loss=s.chunked_loss,
        workspaces=_workspaces(z),
    )


def _moment(
    est: MemoryEstimate, grads: int = 0, activations: int = 0, temporaries: int = 0
) -> dict[str, int]:
    """The bytes live at one moment, by part (memory.PEAK_PARTS). Gradients from the earlier
    micro-batches are there when the last one runs."""
    before = est.params if est.grad_accum_steps > 1 else 0
    return {
        "params": est.params,
        "optimizer": est.optimizer,
        "grads": before + grads,
        "activations": activations,
        "temporaries": temporaries + est.workspaces,
        "held": 0,
    }


def _chunk_moment(z: _Sizes, est: MemoryEstimate, moment, loss_chunk_elements: int) -> dict[str, int]:
    """--chunked-loss: the peak moment inside a chunk of the loss, in the forward."""
    V, bs, p, amp = z.shape.vocab_size, z.shape.tokens, z.p, z.amp
    rows = max(1, loss_chunk_elements // V)  # as ChunkedCrossEntropy: 2^24 logits a chunk
    G = (
        p * V * z.shape.d_model
    )  # a chunk's weight gradient: its matmul runs in autocast's dtype (fp32 without)

    def in_chunk(r: int, previous: int) -> int:
        """A chunk of r rows: logsumexp, with the fp32 logits and its own shifted copy of them;
        or the weight-gradient matmul, with the probabilities (in the logits' memory), their
        low-precision copy under autocast and the new gradient. `previous`: the last chunk's
        weight gradient, which the loop's variable holds until this chunk returns."""
        return max(8 * r * V + previous, 4 * r * V + (p * r * V if amp else 0) + G + previous)

    # The gradients for x (4sbh) and the weight (fp32, E) fill during the forward and are saved
    # only at its end: inside a chunk they are the op's temporaries, not saved activations yet.
    filling = 4 * z.sbh + z.E
    chunk = max(in_chunk(min(bs, rows), 0), in_chunk(min(rows, bs - rows), G) if bs > rows else 0)
    return moment(activations=est.activations - filling, temporaries=filling + chunk)


def _loss_moments(z: _Sizes, est: MemoryEstimate, moment) -> dict[str, dict]:
    """The moments of F.cross_entropy over whole logits: its forward, at log_softmax, and its
    backward, at NllLossBackward."""
    V, bs, L = z.shape.vocab_size, z.shape.tokens, z.shape.n_layers
    acts, loss, logits = est.activations, est.loss, est.logits
    # The forward at the loss: the logits, the fp32 copy the CPU's autocast makes of them for
    # log_softmax, and the log-probs (the loss's saved tensors, not saved yet; under CUDA autocast
    # the low-precision ones and nll_loss's fp32 copy of them). Until the forward returns, under
    # autocast, the fp32 output of ln_f (lm_head saved its copy) and, with checkpointing,
    # autocast's cached weight copies (saved by no block).
    copy = 4 * bs * V if z.amp and z.device == "cpu" else 0  # CUDA's copy is saved: in `loss`
    checkpointed = L * z.weight_copies if est.activation_checkpoint else 0
    in_forward = (4 * z.sbh + checkpointed) if z.amp else 0
    loss_forward = moment(activations=acts - loss, temporaries=logits + copy + loss + in_forward)
    # NllLossBackward: every saved tensor and the fp32 bsV gradient it makes. With one fp32
    # log-probs storage (fp32, or the CPU's autocast) LogSoftmaxBackward then adds its own fp32
    # output while that gradient and the log-probs are live; the cast back to bf16 (p*bsV) comes
    # after both are freed. Under CUDA autocast nll_loss's fp32 copy is freed with its node, before
    # the casts back to bf16/fp16 (p*bsV each): NllLossBackward is the peak. The logits died with
    # the forward.
    grads = 4 * bs * V if z.lowp_log_softmax else 2 * 4 * bs * V
    return {"loss forward": loss_forward, "loss backward": moment(activations=acts, temporaries=grads)}


def _workspaces(z: _Sizes) -> int:
    """CUDA: the cuBLAS workspaces the caching allocator holds from the first matmul on, one per
    handle: the forward's thread and autograd's backward thread (two 32 MiB blocks live the whole
    H200 run; torch gives Hopper 32 MiB a handle, older GPUs less). The CPU has none."""
    return 2 * 32 * MiB if z.device == "cuda" else 0


def _backward_moments(z: _Sizes, est: MemoryEstimate, moment) -> dict[str, dict]:
    """The LM head's backward, a checkpointed block rebuilt, the tied embedding's gradients and
    the optimizer step."""
    V, h, E = z.shape.vocab_size, z.shape.d_model, z.E
    acts, params, chunked = est.activations, est.params, est.chunked_loss
    one = est.grad_accum_steps == 1
    moments = {}
    if not chunked:
        # The LM head's backward: the logits' gradient arrives in their dtype, the weight's
        # gradient and the input's are made in the matmul's dtype. A low-precision matmul on the
        # CPU (oneDNN) also packs the V x h weight copy into a scratch buffer of its size while it
        # makes the input's gradient.
        pack = z.p * V * h if z.amp and z.device == "cpu" else 0
        moments["lm head backward"] = moment(activations=acts, temporaries=z.p * V * h + z.p * z.sbh + pack)
    if est.activation_checkpoint:
        # the last block rebuilt, with the LM head's weight gradient kept for the tied weight's sum;
        # what the loss, ln_f and the LM head saved is freed by then
        moments["block recompute"] = moment(
            activations=acts + z.full_block - (0 if chunked else est.loss + est.head),
            temporaries=0 if chunked else E,
        )
    # The tied weight's gradient: the LM head's (held since the start of backward), the
    # embedding's (dense V x h), and their sum, with every other gradient made by then. Under
    # autocast the LM head's is a fresh fp32 copy of its low-precision gradient, which autograd
    # adds the embedding's into in place: no third V x h tensor.
    tied = 2 * E if z.amp and not chunked else 3 * E
    moments["tied embedding backward"] = moment(grads=params - E if one else 0, temporaries=tied)
    moments["optimizer step"] = moment(grads=params if one else 0)
    return moments


# ---------------------------------------------------------------------------- the estimate report


def device_memory(device: str, given_gb: float | None) -> tuple[int | None, str]:
    """(bytes the run may use, where the figure comes from)."""
    if given_gb is not None:
        return int(given_gb * GiB), "--device-memory-gb"
    if device == "cuda" and not torch.cuda.is_available():
        return None, "no CUDA GPU here; pass --device-memory-gb (the card's size) to see whether it fits"
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"the GPU's memory ({props.name})"
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return ram, "this machine's RAM: the CPU trains in RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no CUDA, and the RAM size is not readable here); pass --device-memory-gb"


def _moment_total(moment: str):
    """The bytes live at `moment` of an estimate, None when the estimate has no such moment."""
    return lambda e: sum(e.moments[moment].values()) if moment in e.moments else None


def format_estimate(
    shape: Shape, amp_dtype: str, device: str, memory: tuple[int | None, str], note: str = ""
) -> str:
    """The estimator's table: columns for the run's AMP dtype (and fp32) without and with
    activation checkpointing; the run's own configuration is marked with *. `memory`: the bytes
    the run may use and where that figure comes from (device_memory)."""
    dtypes = [amp_dtype] + (["fp32"] if amp_dtype != "fp32" else [])
    columns = [(d, c) for d in dtypes for c in (False, True)]
    est = {col: estimate_gpt(replace(shape, activation_checkpoint=col[1]), col[0], device) for col in columns}
    chosen = (amp_dtype, shape.activation_checkpoint)
    names = [("*" if col == chosen else "") + col[0] + (" + ckpt" if col[1] else "") for col in columns]
    e0 = est[columns[0]]
    gib = lambda n: "-" if n is None else f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"  # noqa: E731
    width = max(13, *(len(n) + 2 for n in names))  # 2 + 42 + 4 x 14 at most: the table fits 100 columns
    s = shape
    # resolve_amp's note names the dtype itself ("AMP on: bf16 autocast"); another note is added to it
    amp = note if note.startswith("AMP ") else f"AMP {amp_dtype}" + (f" ({note})" if note else "")
    attention = (
        "flash SDPA (no s x s scores)" if e0.attention == "flash" else "math SDPA (s x s scores saved)"
    )
    lines = [
        f"Memory estimate: {s.n_layers} layers, d_model {s.d_model}, {s.n_heads} heads, d_ff {s.d_ff}, "
        f"vocab {s.vocab_size}, positions {s.max_position_embeddings}",
        f"  batch {s.batch_size} x seq {s.seq_len}; AdamW; {e0.params // 4 / 1e6:.2f}M parameters; "
        f"attention: {attention}",
        f"Device {device}; {amp}",
        f"  {'':42s}" + "".join(f"{n:>{width}s}" for n in names),
    ]
    for label, get in _rows(shape.n_layers):
        lines.append(f"  {label:42s}" + "".join(f"{gib(get(est[c])):>{width}s}" for c in columns))
    lines.append("  (* the run's own column; ckpt: with --use-activation-checkpoint)")
    return "\n".join(lines + _fits(memory, names, [est[c] for c in columns]))


def _rows(n_layers: int) -> list[tuple]:
    """(label, the figure of an estimate) of each row of the table."""
    return [
        ("parameters (fp32)", lambda e: e.params),
        ("gradients (fp32)", lambda e: e.grads),
        ("AdamW state (2 fp32 moments, a step)", lambda e: e.optimizer),
        ("activations per block (ckpt: its input)", lambda e: e.block),
        (f"  x {n_layers} blocks", lambda e: e.n_layers * e.block),
        ("embeddings (ids, dropout mask)", lambda e: e.embeddings),
        ("ln_f + lm_head (input, weight copy)", lambda e: e.head),
        ("cross-entropy (log-probs, targets)", lambda e: e.loss),
        ("activations saved for backward", lambda e: e.activations),
        ("  of which autocast weight copies", lambda e: e.weight_copies),
        ("total: params+grads+optimizer+activations", lambda e: e.total),
        ("logits (live until the loss returns)", lambda e: e.logits),
        *((f"at the {m}", _moment_total(m)) for m in MOMENT_STAGES),
        ("peak estimate (the largest moment)", lambda e: e.peak),
    ]


def _fits(memory: tuple[int | None, str], names: list[str], estimates: list[MemoryEstimate]) -> list[str]:
    """The table's last lines: each column's peak against the device's memory."""
    size, source = memory
    if size is None:
        return [f"Device memory: {source}"]
    fits = []
    for name, e in zip(names, estimates):
        use = e.peak / size
        fits.append(
            f"{name} {'fits' if use <= 0.9 else 'is tight' if use <= 1 else 'does NOT fit'} "
            f"({100 * use:.0f}%)"
        )
    return [
        f"Device memory: {size / GiB:.1f} GiB ({source}); the peak estimate against it:",
        "  " + "; ".join(fits),
        "  (above 90% is tight: on CUDA the context and the allocator's rounding come on top; "
        "docs/memory.md)",
    ]


def config_shape(cfg) -> Shape:
    """A TrainConfig's step shape with no model built: the vocabulary is --vocab-size or the
    tokenizer's, padded as the trainer pads it."""
    vocab_size = cfg.vocab_size or (GPT2_VOCAB if cfg.tokenizer_name == "gpt2" else None)
    if vocab_size is None:  # another tiktoken encoding: its own size
        from minigpt.core.tokens import vocabulary

        vocab_size = vocabulary(cfg.tokenizer_name)[0]
    return shape_of(cfg, vocab_size)


def estimate_report(cfg, device: str, amp_dtype: str, amp_note: str = "") -> str:
    """What `python -m minigpt estimate` and `train_minimal.py --estimate-memory` print."""
    memory = device_memory(device, cfg.device_memory_gb)
    return format_estimate(config_shape(cfg), amp_dtype, device, memory, amp_note)


def split_flags(argv: list[str] | None) -> tuple[list[str], bool, bool, bool]:
    """(the trainer's flags, --time, --json, --remeasure): those belong to the estimator alone."""
    args = list(sys.argv[1:] if argv is None else argv)
    own = ("--time", "--json", "--remeasure")
    rest = [a for a in args if a not in own]
    timing, as_json, remeasure = (flag in args for flag in own)
    if as_json and not timing:
        raise UsageError("--json goes with --time (the memory estimate prints a table); add --time")
    if remeasure and not timing:
        raise UsageError("--remeasure goes with --time (the memory estimate measures nothing); add --time")
    return rest, timing, as_json, remeasure


def main(argv: list[str] | None = None) -> int:
    """The estimator's command line: the trainer's flags (minigpt.config), nothing allocated."""
    try:
        argv, timing, as_json, remeasure = split_flags(argv)
        # As the trainer's --estimate-memory: nothing is built here, so the flags are refused only
        # above its cap (1 PiB), not against this machine's RAM; the table then judges them against
        # the device's memory (--device-memory-gb, the GPU's, or the RAM on a CPU).
        cfg = parse_args([*argv, "--estimate-memory"], prog="python -m minigpt estimate")
        if cfg.device == "cuda" and not torch.cuda.is_available():
            if timing:
                raise UsageError(
                    "--time measures the GPU's own rates: run it where the GPU is (the memory "
                    "estimate, without --time, answers for --device cuda anywhere)"
                )
            # planning a GPU run without one: the estimate is arithmetic on shapes
            device, amp_dtype = "cuda", "fp32" if cfg.amp is False else cfg.amp_dtype
            amp_note = "planned for a CUDA GPU not visible here" + (
                "; bf16 needs Ampere or newer" if amp_dtype == "bf16" else ""
            )
        else:
            from minigpt.instruments.mfu import resolve_amp

            device = "cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu"
            amp_dtype, amp_note = resolve_amp(cfg, device)
        if timing:  # --time [--json]: the step's stage times, predicted (minigpt/instruments/predict.py)
            from minigpt.instruments.predict import time_report  # torch's timers: only for --time

            print(time_report(config_shape(cfg), device, amp_dtype, as_json, remeasure))
            return 0
        if cfg.auto_batch_size:  # the micro-batch the trainer would choose, and the table for it
            cfg.estimate_memory = False  # (fit_batch_size keeps the flags' batch for the trainer's)
            cfg.batch_size, line = fit_batch_size(cfg, device, amp_dtype)
            print(line)
        print(estimate_report(cfg, device, amp_dtype, amp_note))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


# --auto-batch-size: the predicted peak at most this share of the device. The estimate is within
# 10% of the measured peak (docs/memory.md), and the caching allocator's fragmentation and the
# libraries' workspaces take the rest.
AUTO_BATCH_HEADROOM = 0.8
# ...and at most this many tokens a micro-batch: GPT-2's own batch (0.5M tokens); the presets' learning
# rates were not chosen for more.
AUTO_BATCH_MAX_TOKENS = 2**19


def fit_batch_size(cfg, device: str, amp_dtype: str) -> tuple[int, str | None]:
    """(--batch-size, None) unless --auto-batch-size, whose micro-batch is the largest power-of-two
    multiple of --batch-size whose predicted peak fits in AUTO_BATCH_HEADROOM of the device's
    memory (--device-memory-gb, else the GPU's), with a line for the log naming it. A larger
    micro-batch amortises what a step pays once (the optimizer, launches): on an H200, GPT-2 small
    ran 379,600 tokens/s at batch 16 against 333,800 at 8. It changes the optimisation too (the
    tokens per step): the line says so."""
    if not cfg.auto_batch_size or cfg.estimate_memory:  # --estimate-memory: the flags' batch, as given
        return cfg.batch_size, None
    memory, where = device_memory(device, cfg.device_memory_gb)
    if memory is None:
        raise UsageError(f"--auto-batch-size needs the device's memory: {where}")
    shape = config_shape(cfg)
    fits = [
        b
        for b in (cfg.batch_size * 2**k for k in range(12))
        if b * shape.seq_len <= max(AUTO_BATCH_MAX_TOKENS, shape.tokens)
        and estimate_gpt(replace(shape, batch_size=b), amp_dtype, device).peak <= AUTO_BATCH_HEADROOM * memory
    ]
    if not fits:
        peak = estimate_gpt(shape, amp_dtype, device).peak
        return cfg.batch_size, (
            f"Batch: --auto-batch-size kept --batch-size {cfg.batch_size}: its predicted peak "
            f"{peak / GiB:.1f} GiB is above {AUTO_BATCH_HEADROOM:.0%} of {memory / GiB:.1f} GiB ({where})"
        )
    b = fits[-1]
    peak = estimate_gpt(replace(shape, batch_size=b), amp_dtype, device).peak
    return b, (
        f"Batch: --auto-batch-size chose {b} sequences a micro-batch (from {cfg.batch_size}): predicted "
        f"peak {peak / GiB:.1f} GiB, within {AUTO_BATCH_HEADROOM:.0%} of {memory / GiB:.1f} GiB ({where}); "
        f"{b * shape.seq_len * shape.grad_accum_steps:,} tokens a step: the learning rate was set for "
        f"{shape.tokens * shape.grad_accum_steps:,}"
    )


def memory_estimate(cfg, vocab_size: int, amp_dtype: str, device: str, plan) -> MemoryEstimate:
    """The trainer's --memory-profiler: the predicted memory shown beside the measured one (one
    rank's share under --fsdp/--tp)."""
    shape = shape_of(cfg, vocab_size)
    memory = estimate_gpt(shape, amp_dtype, device)
    if plan.sharded:
        memory = per_rank_memory_estimate(memory, plan.dp, plan.tp, plan.fsdp, shape)
    return memory


# ---------------------------------------------------------------------------- one rank's share


def tp_replicated_params(shape: Shape) -> int:
    """Parameters tensor parallelism leaves whole on every tp rank (TP_PLAN splits the rest): the
    embeddings with the tied head, ln_f, and per block the two LayerNorms and the biases of the
    row-parallel attn.proj and mlp.proj."""
    h = shape.d_model
    return shape.vocab_size * h + shape.max_position_embeddings * h + shape.n_layers * 6 * h + 2 * h


def per_rank_estimate(
    estimate: MemoryEstimate, dp: int, tp: int, fsdp: bool, shape: Shape | None = None
) -> dict:
    """Scale a MemoryEstimate (the whole model in one process) to one rank, as
    minigpt/core/parallel.py splits the model (`python -m minigpt parallel` prints it per plan).

    Parameters, gradients and AdamW state: the blocks' matrices are split by tp; the parts TP
    replicates (tp_replicated_params) are whole on every tp rank; FSDP then shards everything
    along dp (so the matrices by dp*tp; padding to equal shards is ignored). Under DDP nothing is
    sharded. AdamW's scalar `step` counters are never sharded (4 bytes per tensor).

    Activations under TP: a block's saved tensors inside the TP region are split by tp (the qkv
    output, the attention output and its logsumexp, the MLP's two hidden activations, autocast's
    weight copies); the LayerNorm inputs, the replicated inputs of qkv and mlp.fc, the head and
    the loss are whole on every rank. FSDP does not change activations (each rank has its own
    batch). TP needs the `shape` for these splits.

    Returns bytes: params, grads, optimizer, activations, block, total and peak (the same
    definitions as MemoryEstimate's), with dp, tp and fsdp."""
    e = estimate
    step_counters = e.optimizer - 2 * e.params  # the scalar `step` tensors
    if tp > 1 and shape is None:
        raise ValueError("per_rank_estimate needs the model shape under tensor parallelism")
    replicated = 4 * tp_replicated_params(shape) if tp > 1 else 0
    if fsdp:  # FSDP shards along "dp" what TP split along "tp"; the replicated parts only along "dp"
        params = -(-replicated // dp) + -(-(e.params - replicated) // (dp * tp))
    else:
        params = replicated + (e.params - replicated) // tp
    grads = params
    optimizer = 2 * params + step_counters
    block = e.block
    if tp > 1 and not e.activation_checkpoint:
        p = 2 if e.amp_dtype != "fp32" else 4
        sbh, bs = shape.tokens * shape.d_model, shape.tokens
        whole = 2 * (4 * sbh + 8 * bs) + 2 * p * sbh  # LayerNorm inputs; qkv's and mlp.fc's inputs
        block = whole + (e.block - whole) // tp
    activations = e.n_layers * block + e.embeddings + e.head + e.loss
    total = params + grads + optimizer + activations
    return {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "activations": activations,
        "block": block,
        "total": total,
        "peak": total + e.logits + e.recompute,
        "dp": dp,
        "tp": tp,
        "fsdp": fsdp,
    }


def per_rank_memory_estimate(
    estimate: MemoryEstimate, dp: int, tp: int, fsdp: bool, shape: Shape | None = None
) -> MemoryEstimate:
    """per_rank_estimate as a MemoryEstimate (the same class, its fields scaled to one rank), for
    minigpt.instruments.breakdown's table beside a rank's measured breakdown. `recompute` (activation
    checkpointing's rebuilt block) is left whole."""
    r = per_rank_estimate(estimate, dp, tp, fsdp, shape)
    return replace(estimate, params=r["params"], grads=r["grads"], optimizer=r["optimizer"], block=r["block"])
