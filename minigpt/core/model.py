"""GPT-2 in plain PyTorch.

Token and learned position embeddings, pre-LayerNorm blocks (causal self-attention through
``F.scaled_dot_product_attention`` and a GELU MLP), a final LayerNorm and an LM head tied to
the token embedding. Nothing here knows about profilers or logging: read it on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # already padded
    max_position_embeddings: int = 1024
    n_layers: int = 12
    n_heads: int = 12
    d_model: int = 768
    d_ff: int = 3072
    dropout: float = 0.0
    activation_checkpoint: bool = False
    # The LM head and the cross-entropy over chunks of rows (minigpt/core/chunked_loss.py): the full
    # fp32 logits and their gradient never exist. Off by default: the plain path is the one to read.
    chunked_loss: bool = False


# Rows of logits per pass of the CPU's loss: 8 rows of a 50304-token vocabulary are 1.6 MiB in
# fp32, so the passes over them (max, exp, sum, scale) stay in a core's L2 cache. Wider blocks spill
# to memory; narrower ones add Python calls.
LOSS_ROWS = 8


class CrossEntropy(torch.autograd.Function):
    """F.cross_entropy(logits, targets) (mean over targets not -100, softmax in fp32), with less
    memory traffic. Under the CPU's autocast F.cross_entropy copies all N x V logits to fp32, saves
    fp32 log-probabilities, and in backward writes a dense fp32 gradient and converts it: on a CPU
    these passes cost more than the LM head's matmul. Here LOSS_ROWS rows at a time are made fp32,
    in cache, and the forward computes the loss and its gradient, softmax - one-hot (a loss ends the
    graph), kept in the logits' dtype, rounded once as F.cross_entropy's is."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != -100
        safe = targets.clamp(min=0).unsqueeze(1)
        n_valid = valid.sum().clamp(min=1).float()  # a tensor: no device sync
        row_scale = (valid / n_valid).unsqueeze(1)  # d(mean loss) / d(row loss)
        lse = torch.empty(logits.size(0), 1, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        for i in range(0, logits.size(0), LOSS_ROWS):
            rows = slice(i, i + LOSS_ROWS)
            x = logits[rows].to(torch.float32, copy=True)  # a copy even of fp32 logits: changed in place
            top = x.amax(dim=1, keepdim=True)
            total = x.sub_(top).exp_().sum(dim=1, keepdim=True)  # x = exp(logit - top)
            lse[rows] = total.log() + top
            if grad is not None:
                x.mul_(row_scale[rows] / total)  # the softmax, times the row's share of the mean
                x.scatter_add_(1, safe[rows], -row_scale[rows])  # minus the one-hot target
                grad[rows] = x
        ctx.save_for_backward(grad)
        target_logits = logits.gather(1, safe).float()
        return ((lse - target_logits) * row_scale).sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        (grad,) = ctx.saved_tensors
        if grad_loss.item() == 1.0:  # the usual case (no accumulation): spare a pass over N x V
            return grad, None  # (.item() syncs nothing: cross_entropy() uses this on the CPU only)
        return grad * grad_loss, None  # the scalar is applied in fp32


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy: CrossEntropy on the CPU; F.cross_entropy on a GPU, for fp16 (its
    gradient needs the loss scale before it is rounded) and under torch.compile, which fuses the
    passes itself: CrossEntropy's grad_loss.item() is a graph break, whose output alias AOTAutograd's
    warm cache (torch 2.13) replayed with a corrupt shape ("shape '[2430212884928, 64, 50304]' is
    invalid") in a second `--compile` run."""
    compiling = torch.compiler.is_compiling()
    if logits.device.type == "cpu" and logits.dtype != torch.float16 and not compiling:
        return CrossEntropy.apply(logits, targets)
    return F.cross_entropy(logits, targets)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.residual_projection = True  # scaled at init, see GPT._init_weights
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(x)
        # Under tensor parallelism (minigpt/core/parallel.py) this rank's qkv holds only its own heads:
        # width 3 * C / tp, laid out [q | k | v] of those heads. Without it, all heads: 3 * C.
        width = qkv.size(-1) // 3
        heads = width // (C // self.n_heads)
        q, k, v = qkv.split(width, dim=2)
        # (B, T, width) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, width)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.proj.residual_projection = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        # Weight tying, as in GPT-2: the head reads wte's weight. Made on the meta device, its own
        # V x d weight is never allocated (a CPU process would keep those pages for the whole run).
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2: N(0, 0.02) everywhere; projections that write into the residual stream are
        # scaled by 1/sqrt(2 * n_layers) so the stream's variance does not grow with depth.
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_projection", False):
                std /= math.sqrt(2 * self.cfg.n_layers)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (logits, loss); loss is the mean cross-entropy when targets are given. With
        cfg.chunked_loss and targets, the logits are never made whole: (None, loss)."""
        T = idx.size(1)
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            if self.cfg.activation_checkpoint and self.training:
                # Keep only the block's input; recompute its insides during backward.
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.cfg.chunked_loss:  # no logits: (None, loss)
            from minigpt.core.chunked_loss import ChunkedCrossEntropy  # --chunked-loss's own file

            loss = ChunkedCrossEntropy.apply(x.view(-1, x.size(-1)), self.lm_head.weight, targets.reshape(-1))
            return None, loss
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            loss = cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position embeddings are left out by default (they cost no FLOPs)."""
        n = sum(p.numel() for p in self.parameters())  # the tied head is counted once
        if non_embedding:
            n -= self.wpe.weight.numel()
        return n


def flops_per_token(model: GPT, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the matrix products of forward and backward, plus
    12 * L * d * T for attention scores and their use (PaLM appendix B; nanoGPT's estimate_mfu)."""
    c = model.cfg
    return 6 * model.num_params(non_embedding=True) + 12 * c.n_layers * c.d_model * seq_len
