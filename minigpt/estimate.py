"""Predicting memory from the flags alone: what one training step of minigpt's GPT holds, with no
model built and nothing allocated. Its measured counterpart is minigpt/memory.py; docs/memory.md
derives the formulas.

    python -m minigpt.estimate                                # the default job (the trainer's flags)
    python -m minigpt.estimate --preset gpt2 --batch-size 4 --device-memory-gb 24
    python train_minimal.py --estimate-memory --preset gpt2   # the same, from the trainer
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass

import torch

from minigpt.memory import MB, GiB

# ---------------------------------------------------------------------------- the estimator (GPT)

@dataclass
class MemoryEstimate:
    """Predicted bytes of one training step of the GPT in minigpt/model.py; see estimate_gpt."""

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
    logits: int  # the logits the model returns: held by the caller, not saved
    recompute: int  # checkpointing: one block's activations, rebuilt during backward

    @property
    def activations(self) -> int:
        return self.n_layers * self.block + self.embeddings + self.head + self.loss

    @property
    def total(self) -> int:
        """Same definition as MemoryBreakdown.total: comparable with the measurement."""
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def peak(self) -> int:
        """What must fit: the total, the returned logits, and a recomputed block."""
        return self.total + self.logits + self.recompute

    def to_record(self) -> dict:
        return {**asdict(self), "activations": self.activations, "total": self.total, "peak": self.peak}


def estimate_gpt(*, n_layers: int, d_model: int, n_heads: int, d_ff: int, seq_len: int, batch_size: int,
                 vocab_size: int, max_position_embeddings: int, amp_dtype: str = "fp32",
                 activation_checkpoint: bool = False, dropout: float = 0.0, device: str = "cpu") -> MemoryEstimate:
    """Bytes of one training step of minigpt's GPT (plain numbers in, no model built), with AdamW.

    Notation: L layers, h = d_model, f = d_ff, a heads, s = seq_len, b = batch, V = vocab (padded),
    P = positions; p = bytes per element of the autocast dtype (2 for bf16/fp16, 4 without AMP).

    Parameters: V*h (wte, tied with lm_head) + P*h (wpe) + L*(4h + 3h^2+3h + h^2+h + hf+f + fh+h)
    + 2h (ln_f), 4 bytes each. Gradients: the same. AdamW: exp_avg and exp_avg_sq in fp32 (2x the
    parameters) plus one 4-byte `step` tensor per parameter tensor (2 + 12L + 2 tensors).

    Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models" (2022), who count sbh(34 + 5as/h) bytes per layer in 16-bit training: attention 11sbh
    (QKV input 2, Q and K 4, V 2, projection input 2, dropout mask 1) + 5as^2b (softmax output 2,
    its dropout mask 1, dropped probabilities 2), MLP 19sbh (input 2, GELU input 8, projection
    input 8, dropout mask 1), two LayerNorm inputs 4sbh. What this model saves instead (storages,
    counted once; read off the saved-tensor hooks):

        ln_1, ln_2   input, fp32 even under autocast (the residual stream: fp32 embeddings plus
                     low-precision branch outputs promote to fp32)        2 x (4sbh + mean/rstd 8bs)
        attn.qkv     input, the autocast copy of ln_1's output            p*sbh
        attention    q, k, v: three views of the qkv output               3p*sbh
                     F.scaled_dot_product_attention's flash / memory-efficient kernel saves its
                     output and the fp32 logsumexp, not the s x s scores: p*sbh + 4abs
        attn.proj    input: the attention output, whose (B, T, heads, hd) memory layout makes
                     .transpose(1, 2).contiguous() a no-op: already counted   0
        mlp.fc       input (autocast copy of ln_2's output)               p*sbh
        mlp.gelu     input (fc output)                                    p*bsf
        mlp.proj     input (GELU output)                                  p*bsf
        autocast     the low-precision weight copies the matmuls save      p*(4h^2 + 2hf)

    Per block: sbh(8 + 6p) + 2p*bsf + 16bs + 4abs (+ weight copies). With f = 4h that is 36sbh in
    bf16 against Korthikanti's 34sbh: +4 for the fp32 LayerNorm inputs, -2 without dropout masks
    (dropout 0), and no 5as^2b. (The flash output the attention backward keeps is the same storage
    as attn.proj's input, which the paper already counts.)
    In fp32: 64sbh. Dropout > 0 adds a mask per dropout (1 byte per element on CUDA, the tensor's
    dtype on the CPU), and on the CPU sends attention down the math path, which saves fp32 copies
    of q, k and v and three fp32 s x s tensors (probabilities, mask, dropped probabilities) in
    place of the q, k, v views and the flash output (on CUDA the flash kernel handles dropout).

    Outside the blocks: token and position ids (8bs + 8s); ln_f's input (4sbh + 8bs); lm_head's
    input (p*sbh) and, under autocast, its weight copy (p*Vh); the cross-entropy runs in fp32
    (autocast's fp32 list) and saves the fp32 log-probabilities 4bsV, the targets 8bs and a scalar.
    The logits themselves (p*bsV) are not saved, but the caller holds them until the next step.

    Activation checkpointing (non-reentrant) saves only each block's input, 4sbh, during the
    forward; during backward one block at a time is recomputed, its full activations (as above)
    alive on top of the rest: `recompute`.

    Not included: the ops' temporary buffers (the backward's gradient of the logits, 4bsV, is the
    largest), library workspaces, the allocator's rounding and the CUDA context.
    """
    L, h, a, f, s, b, V, P = n_layers, d_model, n_heads, d_ff, seq_len, batch_size, vocab_size, max_position_embeddings
    amp = amp_dtype != "fp32"
    p = 2 if amp else 4
    sbh, bs = s * b * h, b * s
    cuda = device == "cuda"

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
    head_copy = p * V * h if amp else 0
    head = layer_norm + p * sbh + head_copy
    loss = 4 * bs * V + 8 * bs + 4
    return MemoryEstimate(
        amp_dtype=amp_dtype, activation_checkpoint=activation_checkpoint, attention="flash" if flash else "math",
        params=params, grads=params, optimizer=optimizer, block=block, n_layers=L, embeddings=embeddings,
        head=head, loss=loss, weight_copies=(0 if activation_checkpoint else L * weight_copies) + head_copy,
        logits=p * bs * V, recompute=full_block if activation_checkpoint else 0,
    )


# ---------------------------------------------------------------------------- the estimate report

def device_memory(device: str, given_gb: float | None) -> tuple[int | None, str]:
    """(bytes the run may use, where the figure comes from)."""
    if given_gb is not None:
        return int(given_gb * GiB), "--device-memory-gb"
    if device == "cuda":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return props.total_memory, f"the GPU's memory ({props.name})"
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM: the CPU trains in RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown (no CUDA, and the RAM size is not readable here); pass --device-memory-gb"


def format_estimate(shape: dict, amp_dtype: str, activation_checkpoint: bool, device: str,
                    memory: int | None, memory_source: str, note: str = "") -> str:
    """The estimator's table: columns for the run's AMP dtype (and fp32) without and with
    activation checkpointing; the run's own configuration is marked with *."""
    dtypes = [amp_dtype] + (["fp32"] if amp_dtype != "fp32" else [])
    columns = [(d, c) for d in dtypes for c in (False, True)]
    est = {col: estimate_gpt(**shape, amp_dtype=col[0], activation_checkpoint=col[1], device=device) for col in columns}
    chosen = (amp_dtype, activation_checkpoint)
    names = [("*" if col == chosen else "") + col[0] + (" + ckpt" if col[1] else "") for col in columns]
    e0 = est[columns[0]]
    gib = lambda n: f"{n / GiB:.3f} GiB" if n >= GiB else f"{n / MB:.1f} MiB"  # noqa: E731
    rows = [
        ("parameters (fp32)", lambda e: e.params),
        ("gradients (fp32)", lambda e: e.grads),
        ("AdamW state (exp_avg, exp_avg_sq fp32, step)", lambda e: e.optimizer),
        ("activations per block (ckpt: its input)", lambda e: e.block),
        (f"  x {shape['n_layers']} blocks", lambda e: e.n_layers * e.block),
        ("embeddings (ids, dropout mask)", lambda e: e.embeddings),
        ("ln_f + lm_head (input, weight copy)", lambda e: e.head),
        ("cross-entropy (fp32 log-probs, targets)", lambda e: e.loss),
        ("activations saved for backward", lambda e: e.activations),
        ("  of which autocast weight copies", lambda e: e.weight_copies),
        ("total: params+grads+optimizer+activations", lambda e: e.total),
        ("logits returned (held by the caller)", lambda e: e.logits),
        ("a block recomputed in backward", lambda e: e.recompute),
        ("peak estimate", lambda e: e.peak),
    ]
    width = max(14, *(len(n) + 2 for n in names))
    s = shape
    lines = [
        f"Memory estimate: {s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, d_ff {s['d_ff']}, "
        f"vocab {s['vocab_size']}, positions {s['max_position_embeddings']}; batch {s['batch_size']} x seq "
        f"{s['seq_len']}; AdamW; {e0.params // 4 / 1e6:.2f}M parameters",
        f"Device {device}; AMP {amp_dtype}" + (f" ({note})" if note else "")
        + "; attention: " + ("flash/memory-efficient SDPA (no s x s scores)" if e0.attention == "flash"
                             else "math SDPA (s x s scores saved)"),
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
            fits.append(f"{name} {'fits' if use <= 0.9 else 'is tight' if use <= 1 else 'does NOT fit'} "
                        f"({100 * use:.0f}% of it)")
        lines.append(f"Device memory: {memory / GiB:.1f} GiB ({memory_source}). " + "; ".join(fits))
        lines.append("  (peak estimate against device memory; above 90% counts as tight: the ops' temporary "
                     "buffers, workspaces and allocator overhead are not in the estimate)")
    return "\n".join(lines)


def gpt_shape(cfg, vocab_size: int) -> dict:
    """The estimator's numbers from a TrainConfig (minigpt.config) and the padded vocabulary."""
    return dict(n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads, d_ff=cfg.d_ff,
                seq_len=cfg.seq_len, batch_size=cfg.batch_size, vocab_size=vocab_size,
                max_position_embeddings=cfg.max_position_embeddings, dropout=cfg.dropout)


def estimate_report(cfg, device: str, amp_dtype: str, amp_note: str = "", vocab_size: int | None = None) -> str:
    """What `python -m minigpt.memory` and `train_minimal.py --estimate-memory` print. Builds no
    model: the vocabulary comes from --vocab-size or the tokenizer, padded to a multiple of 64 as
    the trainer does."""
    if vocab_size is None:
        if cfg.vocab_size is not None:
            vocab_size = cfg.vocab_size
        else:
            from minigpt.data import get_tokenizer
            vocab_size = get_tokenizer(cfg.tokenizer_name).n_vocab
        vocab_size = -(-vocab_size // 64) * 64  # as model.pad_vocab (not imported: this module is model-agnostic)
    memory, source = device_memory(device, cfg.device_memory_gb)
    return format_estimate(gpt_shape(cfg, vocab_size), amp_dtype, cfg.use_activation_checkpoint, device,
                           memory, source, amp_note)


def main(argv: list[str] | None = None) -> int:
    """The estimator's command line: the trainer's flags (minigpt.config), nothing allocated."""
    from minigpt.config import UsageError, parse_args, resolve_amp, resolve_device

    try:
        cfg = parse_args(argv, prog="python -m minigpt.estimate")
        device = resolve_device(cfg.device)
        _, amp_dtype, amp_note = resolve_amp(cfg, device)
        print(estimate_report(cfg, device, amp_dtype, amp_note))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
