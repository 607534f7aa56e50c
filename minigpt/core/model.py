"""GPT-2 in plain PyTorch: token and learned position embeddings, pre-LayerNorm blocks (causal
self-attention through F.scaled_dot_product_attention, a GELU MLP), a final LayerNorm and an LM
head tied to the token embedding. Nothing here knows of profilers or logging: read it on its own."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50,257 ids, padded to a multiple of 64
    max_position_embeddings: int = 1024
    n_layers: int = 12
    n_heads: int = 12
    d_model: int = 768
    d_ff: int = 3072
    dropout: float = 0.0
    activation_checkpoint: bool = False
    chunked_loss: bool = False  # the LM head and loss over chunks of rows (chunked_loss.py): no full logits


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads, self.dropout = cfg.n_heads, cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.residual_projection = True  # scaled at init (GPT._init_weights)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Under tensor parallelism (parallel.py) this rank's qkv holds only its own heads, [q | k | v].
        qkv = self.qkv(x)
        width = qkv.size(-1) // 3
        q, k, v = (t.view(B, T, -1, C // self.n_heads).transpose(1, 2) for t in qkv.split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout * self.training)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(B, T, width)))


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
        self.ln_1, self.attn = nn.LayerNorm(cfg.d_model), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

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
        # Tied to wte, as in GPT-2. Made on the meta device, its own V x d weight is never allocated.
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2: N(0, 0.02); projections into the residual stream scaled by 1/sqrt(2 * n_layers),
        # so the stream's variance does not grow with depth.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            residual = getattr(module, "residual_projection", False)
            nn.init.normal_(module.weight, std=0.02 / math.sqrt(2 * self.cfg.n_layers) if residual else 0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """(logits, loss): the loss is the mean cross-entropy when targets are given. With
        cfg.chunked_loss and targets, the logits are never made whole: (None, loss)."""
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device)))
        for block in self.blocks:
            if self.cfg.activation_checkpoint and self.training:  # keep the block's input; recompute the rest
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        if targets is not None and self.cfg.chunked_loss:
            from minigpt.core.chunked_loss import ChunkedCrossEntropy

            return None, ChunkedCrossEntropy.apply(x.flatten(0, 1), self.lm_head.weight, targets.flatten())
        logits = self.lm_head(x)
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied head once; without the position embeddings (they cost no FLOPs)."""
        return sum(p.numel() for p in self.parameters()) - non_embedding * self.wpe.weight.numel()
