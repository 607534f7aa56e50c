"""Predicting memory from the flags alone: what one training step of minigpt's GPT holds, with no
model built and nothing allocated. Its measured counterpart is minigpt/memory.py; docs/memory.md
derives the formulas.

    python -m minigpt.estimate                                # the default job (the trainer's flags)
    python -m minigpt.estimate --preset gpt2 --batch-size 4 --device-memory-gb 24
    python train_minimal.py --estimate-memory --preset gpt2   # the same, from the trainer
    python -m minigpt.estimate --time [--json]                # the step's stage times (minigpt/predict.py)
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass, field

import torch

from minigpt.memory import MB, GiB

# ---------------------------------------------------------------------------- the estimator (GPT)


@dataclass
class MemoryEstimate:
    """Predicted bytes of one training step of the GPT in minigpt/model.py; see estimate_gpt and
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
    logits: int  # the logits the model returns: live until the loss's forward returns (the loop keeps only the loss)
    recompute: int  # checkpointing: one block's activations, rebuilt during backward
    grad_accum_steps: int = 1
    chunked_loss: bool = False
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


def estimate_gpt(
    *,
    n_layers: int,
    d_model: int,
    n_heads: int,
    d_ff: int,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    max_position_embeddings: int,
    amp_dtype: str = "fp32",
    activation_checkpoint: bool = False,
    dropout: float = 0.0,
    device: str = "cpu",
    grad_accum_steps: int = 1,
    chunked_loss: bool = False,
    loss_chunk_elements: int = 2**24,
    loss_rows: int = 8,
) -> MemoryEstimate:
    """Bytes of one training step of minigpt's GPT (plain numbers in, no model built), with fused
    AdamW, the step shaped as train_minimal.py runs it (the loop keeps the loss, not the logits). docs/memory.md derives every term and checks it against the measurement.

    What persists: parameters, fp32 gradients, AdamW's two fp32 moments and a step per tensor.
    What the forward saves: Korthikanti et al.'s per-layer count redone for this model (fp32
    LayerNorm inputs, flash attention, no dropout masks), and what the cross-entropy saves, chosen
    as model.cross_entropy() chooses: on the CPU (not fp16) CrossEntropy's gradient in the logits'
    dtype, p*bsV; elsewhere F.cross_entropy's fp32 log-probabilities 4bsV. The peak is the largest of
    a few moments: the loss itself (CrossEntropy's forward: the logits, the gradient it fills and
    fp32 blocks of loss_rows rows; F.cross_entropy's backward: the logits, the log-probabilities and
    two fp32 bsV gradients at once), the end of backward (the tied embedding's three V x h
    gradients), a checkpointed block rebuilt, the optimizer step, and with chunked_loss a chunk of
    the loss in the forward (the fp32 gradient accumulators, one chunk's fp32 logits twice over, and
    the chunk weight gradients in the matmuls' dtype: bf16 under AMP).
    """
    L, h, a, f, s, b, V, P = (
        n_layers,
        d_model,
        n_heads,
        d_ff,
        seq_len,
        batch_size,
        vocab_size,
        max_position_embeddings,
    )
    amp = amp_dtype != "fp32"
    p = 2 if amp else 4
    sbh, bs = s * b * h, b * s
    cuda = device == "cuda"
    # model.cross_entropy(): CrossEntropy on the CPU unless the logits are fp16, F.cross_entropy else
    fused_loss = device == "cpu" and amp_dtype != "fp16"

    n_block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    params = 4 * (V * h + P * h + L * n_block + 2 * h)
    optimizer = 2 * params + 4 * (2 + 12 * L + 2)

    def mask(dtype_bytes: int) -> int:  # a dropout mask over an (s, b, h) tensor
        return 0 if dropout == 0 else sbh * (1 if cuda else dtype_bytes)

    flash = dropout == 0 or cuda  # the CPU flash kernel has no dropout: the math path takes over
    layer_norm = 4 * sbh + 8 * bs
    weight_copies = p * (4 * h * h + 2 * h * f) if amp else 0
    if flash:
        attention = p * sbh + 3 * p * sbh + p * sbh + 4 * a * b * s
    else:
        attention = p * sbh + 3 * 4 * sbh + 3 * 4 * a * b * s * s + p * sbh
    mlp = p * sbh + 2 * p * b * s * f
    full_block = 2 * layer_norm + attention + mlp + weight_copies + 2 * mask(p)
    block = 4 * sbh if activation_checkpoint else full_block
    embeddings = 8 * bs + 8 * s + mask(4)
    E = 4 * V * h  # the tied embedding / LM head weight, and each of its fp32 gradients
    if chunked_loss:  # ChunkedCrossEntropy saves the gradients it made: for x (fp32 N x h) and the weight
        head, loss, head_copy, logits = layer_norm + 4 * sbh + E, 0, 0, 0
    else:
        head_copy = p * V * h if amp else 0
        head = layer_norm + p * sbh + head_copy
        # CrossEntropy saves its gradient in the logits' dtype; F.cross_entropy the fp32
        # log-probabilities and the targets (with the weight total)
        loss = p * bs * V if fused_loss else 4 * bs * V + 8 * bs + 4
        logits = p * bs * V
    est = MemoryEstimate(
        amp_dtype=amp_dtype,
        activation_checkpoint=activation_checkpoint,
        attention="flash" if flash else "math",
        params=params,
        grads=params,
        optimizer=optimizer,
        block=block,
        n_layers=L,
        embeddings=embeddings,
        head=head,
        loss=loss,
        weight_copies=(0 if activation_checkpoint else L * weight_copies) + head_copy,
        logits=logits,
        recompute=full_block if activation_checkpoint else 0,
        grad_accum_steps=grad_accum_steps,
        chunked_loss=chunked_loss,
    )
    # Gradients from the earlier micro-batches are there when the last one runs.
    grads_before = params if grad_accum_steps > 1 else 0
    base = {"params": params, "optimizer": optimizer, "grads": grads_before}
    acts = est.activations

    def moment(grads: int = 0, activations: int = 0, temporaries: int = 0) -> dict[str, int]:
        return {
            **base,
            "grads": base["grads"] + grads,
            "activations": activations,
            "temporaries": temporaries,
            "held": 0,
        }

    moments = {}
    if chunked_loss:
        rows = max(1, loss_chunk_elements // V)  # as ChunkedCrossEntropy: 2^24 logits a chunk
        G = p * V * h  # a chunk's weight gradient: its matmul runs in autocast's dtype (fp32 without)

        def in_chunk(r: int, previous: int) -> int:
            """A chunk of r rows: logsumexp, with the fp32 logits and its own shifted copy of them;
            or the weight-gradient matmul, with the probabilities (in the logits' memory), their
            low-precision copy under autocast and the new gradient. `previous`: the last chunk's
            weight gradient, which the loop's variable holds until this chunk returns."""
            return max(8 * r * V + previous, 4 * r * V + (p * r * V if amp else 0) + G + previous)

        # The gradients for x (4sbh) and the weight (fp32, E) fill during the forward and are saved
        # only at its end: inside a chunk they are the op's temporaries, not saved activations yet.
        filling = 4 * sbh + E
        chunk = max(in_chunk(min(bs, rows), 0), in_chunk(min(rows, bs - rows), G) if bs > rows else 0)
        moments["loss forward (a chunk)"] = moment(activations=acts - filling, temporaries=filling + chunk)
    elif fused_loss:
        # CrossEntropy's forward, at its second block: the logits, the gradient it fills (saved only
        # at its end: a temporary until then), the last block of fp32 rows (held by its variable) and
        # the new one, and per row: log-sum-exp, scale (fp32), targets clamped (int64), mask (bool).
        first, second = min(bs, loss_rows), min(loss_rows, max(0, bs - loss_rows))
        in_loss = loss + 4 * V * (first + second) + 17 * bs
        # Until the forward returns: under autocast the fp32 output of ln_f (lm_head saved its copy)
        # and, with checkpointing, autocast's cached weight copies (saved by no block).
        in_forward = (4 * sbh + (L * weight_copies if activation_checkpoint else 0)) if amp else 0
        loss_forward = moment(activations=acts - loss, temporaries=logits + in_loss + in_forward)
        moments["loss forward"] = loss_forward
        # Its backward returns the saved gradient itself, or, when the loss was scaled (accumulation),
        # a scaled copy of it.
        moments["loss backward"] = moment(
            activations=acts, temporaries=loss if grad_accum_steps > 1 else 0
        )
    else:
        # LogSoftmaxBackward: the saved log-probabilities (in acts), the gradient NllLossBackward
        # made (fp32 bsV) and its own output (fp32 bsV); the logits died with the forward
        moments["loss backward"] = moment(activations=acts, temporaries=2 * 4 * bs * V)
    if not chunked_loss:
        # The LM head's backward: the loss's gradient arrives (the bytes of what the loss saved:
        # CrossEntropy's own gradient, or its scaled copy), the weight's gradient and the input's
        # are made in the matmul's dtype. A low-precision matmul on the CPU (oneDNN) also packs the
        # V x h weight copy into a scratch buffer of its size while it makes the input's gradient.
        pack = p * V * h if amp and device == "cpu" else 0
        moments["lm head backward"] = moment(
            activations=acts, temporaries=p * V * h + p * sbh + pack
        )
    if activation_checkpoint:
        # the last block rebuilt, with the LM head's weight gradient kept for the tied weight's sum;
        # what the loss, ln_f and the LM head saved is freed by then
        moments["block recompute"] = moment(
            activations=acts + full_block - (0 if chunked_loss else loss + head),
            temporaries=0 if chunked_loss else E,
        )
    # The tied weight's gradient: the LM head's (held since the start of backward), the
    # embedding's (dense V x h), and their sum, with every other gradient made by then. Under
    # autocast the LM head's is a fresh fp32 copy of its low-precision gradient, which autograd
    # adds the embedding's into in place: no third V x h tensor.
    tied = 2 * E if amp and not chunked_loss else 3 * E
    moments["tied embedding backward"] = moment(
        grads=params - E if grad_accum_steps == 1 else 0, temporaries=tied
    )
    moments["optimizer step"] = moment(grads=params if grad_accum_steps == 1 else 0)
    est.moments = moments
    return est


# ---------------------------------------------------------------------------- the estimate report


def device_memory(device: str, given_gb: float | None) -> tuple[int | None, str]:
    """(bytes the run may use, where the figure comes from)."""
    if given_gb is not None:
        return int(given_gb * GiB), "--device-memory-gb"
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"the GPU's memory ({props.name})"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf(
            "SC_PHYS_PAGES"
        ), "this machine's RAM: the CPU trains in RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no CUDA, and the RAM size is not readable here); pass --device-memory-gb"


def _moment_total(moment: str):
    """The bytes live at `moment` of an estimate, None when the estimate has no such moment."""
    return lambda e: sum(e.moments[moment].values()) if moment in e.moments else None


def format_estimate(
    shape: dict,
    amp_dtype: str,
    activation_checkpoint: bool,
    device: str,
    memory: int | None,
    memory_source: str,
    note: str = "",
    **options,
) -> str:
    """The estimator's table: columns for the run's AMP dtype (and fp32) without and with
    activation checkpointing; the run's own configuration is marked with *."""
    dtypes = [amp_dtype] + (["fp32"] if amp_dtype != "fp32" else [])
    columns = [(d, c) for d in dtypes for c in (False, True)]
    est = {
        col: estimate_gpt(**shape, amp_dtype=col[0], activation_checkpoint=col[1], device=device, **options)
        for col in columns
    }
    chosen = (amp_dtype, activation_checkpoint)
    names = [("*" if col == chosen else "") + col[0] + (" + ckpt" if col[1] else "") for col in columns]
    e0 = est[columns[0]]
    gib = lambda n: "-" if n is None else f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MB:.1f} MiB"  # noqa: E731
    rows = [
        ("parameters (fp32)", lambda e: e.params),
        ("gradients (fp32)", lambda e: e.grads),
        ("AdamW state (exp_avg, exp_avg_sq fp32, step)", lambda e: e.optimizer),
        ("activations per block (ckpt: its input)", lambda e: e.block),
        (f"  x {shape['n_layers']} blocks", lambda e: e.n_layers * e.block),
        ("embeddings (ids, dropout mask)", lambda e: e.embeddings),
        ("ln_f + lm_head (input, weight copy)", lambda e: e.head),
        ("cross-entropy (saved gradient or log-probs)", lambda e: e.loss),
        ("activations saved for backward", lambda e: e.activations),
        ("  of which autocast weight copies", lambda e: e.weight_copies),
        ("total: params+grads+optimizer+activations", lambda e: e.total),
        ("logits (live until the loss returns)", lambda e: e.logits),
        *((f"at the {m}", _moment_total(m)) for m in MOMENT_STAGES),
        ("peak estimate (the largest moment)", lambda e: e.peak),
    ]
    width = max(14, *(len(n) + 2 for n in names))
    s = shape
    lines = [
        f"Memory estimate: {s['n_layers']} layers, d_model {s['d_model']}, "
        f"{s['n_heads']} heads, d_ff {s['d_ff']}, "
        f"vocab {s['vocab_size']}, positions {s['max_position_embeddings']}; batch {s['batch_size']} x seq "
        f"{s['seq_len']}; AdamW; {e0.params // 4 / 1e6:.2f}M parameters",
        f"Device {device}; AMP {amp_dtype}"
        + (f" ({note})" if note else "")
        + "; attention: "
        + (
            "flash/memory-efficient SDPA (no s x s scores)"
            if e0.attention == "flash"
            else "math SDPA (s x s scores saved)"
        ),
        f"  {'':46s}" + "".join(f"{n:>{width}s}" for n in names),
    ]
    for label, get in rows:
        lines.append(f"  {label:46s}" + "".join(f"{gib(get(est[c])):>{width}s}" for c in columns))
    if memory is None:
        lines.append(f"Device memory: {memory_source}")
    else:
        fits = []
        for name, col in zip(names, columns):
            use = est[col].peak / memory
            fits.append(
                f"{name} {'fits' if use <= 0.9 else 'is tight' if use <= 1 else 'does NOT fit'} "
                f"({100 * use:.0f}% of it)"
            )
        lines.append(f"Device memory: {memory / GiB:.1f} GiB ({memory_source}). " + "; ".join(fits))
        lines.append(
            "  (peak estimate against device memory; above 90% counts as tight: on CUDA the context, "
            "workspaces and the caching allocator's rounding come on top, see docs/memory.md)"
        )
    return "\n".join(lines)


def gpt_shape(cfg, vocab_size: int) -> dict:
    """The estimator's numbers from a TrainConfig (minigpt.config) and the padded vocabulary."""
    return dict(
        n_layers=cfg.n_layers,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        d_ff=cfg.d_ff,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        vocab_size=vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        dropout=cfg.dropout,
    )


def estimate_report(
    cfg, device: str, amp_dtype: str, amp_note: str = "", vocab_size: int | None = None
) -> str:
    """What `python -m minigpt.memory` and `train_minimal.py --estimate-memory` print. Builds no
    model: the vocabulary comes from --vocab-size or the tokenizer, padded to a multiple of 64 as
    the trainer does."""
    if vocab_size is None:
        if cfg.vocab_size is not None:
            vocab_size = cfg.vocab_size
        else:
            from minigpt.data import get_tokenizer

            vocab_size = get_tokenizer(cfg.tokenizer_name).n_vocab
        vocab_size = (
            -(-vocab_size // 64) * 64
        )  # as model.pad_vocab (not imported: this module is model-agnostic)
    memory, source = device_memory(device, cfg.device_memory_gb)
    options = dict(grad_accum_steps=cfg.grad_accum_steps, chunked_loss=getattr(cfg, "chunked_loss", False))
    return format_estimate(
        gpt_shape(cfg, vocab_size),
        amp_dtype,
        cfg.use_activation_checkpoint,
        device,
        memory,
        source,
        amp_note,
        **options,
    )


def main(argv: list[str] | None = None) -> int:
    """The estimator's command line: the trainer's flags (minigpt.config), nothing allocated."""
    from minigpt.config import UsageError, parse_args, resolve_amp, resolve_device
    from minigpt.predict import split_flags, time_report

    try:
        argv, timing, as_json = split_flags(argv)
        cfg = parse_args(argv, prog="python -m minigpt.estimate")
        device = resolve_device(cfg.device)
        _, amp_dtype, amp_note = resolve_amp(cfg, device)
        if timing:  # --time [--json]: the step's stage times, predicted (minigpt/predict.py)
            print(time_report(cfg, device, amp_dtype, as_json))
            return 0
        print(estimate_report(cfg, device, amp_dtype, amp_note))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
