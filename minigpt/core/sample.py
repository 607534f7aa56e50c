"""Text from a trained checkpoint (or a Hugging Face GPT-2 folder): the model rebuilt from the
checkpoint's own shape, and the sampling loop (temperature, top-k, a seeded generator) decoded with
a cache of each layer's keys and values. sample.py at the repository root is the command line
around it."""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from minigpt.config import UsageError
from minigpt.core.checkpoint import INSTEAD, load_checkpoint
from minigpt.core.model import GPT, GPTConfig


def load_model(path: str | Path, device: str = "cpu", instead: str = INSTEAD) -> tuple[GPT, dict]:
    """The GPT of a checkpoint (loaded as data, weights_only) in eval mode, and the run's
    training config (which tokenizer, toy data or not). A checkpoint edited by hand into a shape
    no GPT has, or a config of the wrong types, is refused in one line before anything is built.
    `instead`: what a refusal of a damaged file offers besides an earlier checkpoint (the caller's flags)."""
    state = load_checkpoint(path, instead)
    known = {f.name for f in fields(GPTConfig)}
    cfg = GPTConfig(**{k: v for k, v in state["model_config"].items() if k in known})
    if cfg.d_model % cfg.n_heads:
        raise UsageError(
            f"checkpoint {path}: its model_config has n_heads {cfg.n_heads}, which does not divide "
            f"d_model {cfg.d_model}; the file was edited or damaged"
        )
    check_train_config(state["config"], path)
    if problem := weights_problem(cfg, state["model"]):
        raise UsageError(
            f"checkpoint {path}: its weights do not fit its model_config ({problem}); "
            "the file was edited or damaged"
        )
    cfg.dropout, cfg.activation_checkpoint = 0.0, False  # sampling: no dropout, no backward to save for
    model = GPT(cfg)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise UsageError(
            f"checkpoint {path}: its weights do not fit its model_config "
            f"({str(e).splitlines()[0]}); the file was edited or damaged"
        ) from None
    return model.to(device).eval(), state["config"]


def weights_problem(cfg: GPTConfig, weights: dict) -> str | None:
    """What in a checkpoint's weights does not fit its model_config, found before the model is
    built: the number of blocks first (a config edited to n_layers 100000 would otherwise build
    100000 blocks, minutes and gigabytes, before load_state_dict compared anything), then every
    tensor's name and shape against a one-block model on the meta device (shapes, no memory)."""
    blocks = {k.split(".")[1] for k in weights if k.startswith("blocks.")}
    if len(blocks) != cfg.n_layers:
        return f"they hold {len(blocks)} blocks, its model_config says n_layers {cfg.n_layers}"
    expected = expected_shapes(cfg)
    for name, shape in expected.items():
        if name not in weights:
            return f"{name} is missing"
        if tuple(weights[name].shape) != shape:
            return f"{name} has shape {list(weights[name].shape)}, its model_config makes {list(shape)}"
    extra = sorted(set(weights) - set(expected))
    return f"{extra[0]} is no weight of this model" if extra else None


def expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every weight `cfg` makes, by name, and its shape: one block built on the meta device (shapes,
    no memory) stands for all. Bound n_layers first: the names are listed for every block."""
    with torch.device("meta"):
        one = GPT(replace(cfg, n_layers=1)).state_dict()
    block = {k.split(".", 2)[2]: tuple(t.shape) for k, t in one.items() if k.startswith("blocks.")}
    expected = {k: tuple(t.shape) for k, t in one.items() if not k.startswith("blocks.")}
    for i in range(cfg.n_layers):
        expected |= {f"blocks.{i}.{k}": shape for k, shape in block.items()}
    return expected


def check_train_config(train_config: dict, path: str | Path) -> None:
    """The training config's fields that sampling and export read, of the types the trainer wrote them."""
    toy, vocab = train_config.get("use_toy_data", False), train_config.get("vocab_size")
    tokenizer, dropout = train_config.get("tokenizer_name", "gpt2"), train_config.get("dropout", 0.0)
    problem = (
        f"dropout holds {dropout!r}, not a probability"
        if not (isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and 0 <= dropout < 1)
        else f"use_toy_data holds {toy!r}, not true or false"
        if not isinstance(toy, bool)
        else f"vocab_size holds {vocab!r}, not a positive int"
        if vocab is not None and not (isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0)
        else f"tokenizer_name holds {tokenizer!r}, not a name"
        if not isinstance(tokenizer, str)
        else None
    )
    if problem:
        raise UsageError(f"checkpoint {path}: its config's {problem}; the file was edited or damaged")


def vocab_in_use(train_config: dict, n_vocab: int | None, model_vocab: int, path: str | Path) -> int | None:
    """The ids the model was trained to produce: the tokenizer's (the embedding is padded past
    them to a multiple of 64) or the toy task's vocabulary. Ids beyond it are never sampled; a
    vocabulary larger than the model's embedding (a config edited by hand, a toy run's flag
    flipped) is refused."""
    toy = train_config.get("use_toy_data")
    vocab = train_config.get("vocab_size") if toy else n_vocab
    if vocab is not None and vocab > model_vocab:
        what = f"the toy task's vocabulary of {vocab} does" if toy else f"the tokenizer's {vocab} ids do"
        raise UsageError(
            f"checkpoint {path}: {what} not fit its model's embedding of {model_vocab} rows; "
            "the file was edited or damaged"
        )
    return vocab


@dataclass(frozen=True)
class Draw:
    """How each new token is drawn. Logits are divided by temperature (below 1: sharper; above:
    flatter); top_k keeps only the k likeliest tokens (top_k=1 is greedy decoding); ids >=
    vocab_size (the embedding's padding) are never drawn."""

    temperature: float = 1.0
    top_k: int | None = None
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a positive finite number, not {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, not {self.top_k}")

    def next_token(self, logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """Each row's next token (batch, 1), drawn from its last position's logits (batch, vocab):
        softmax(logits / temperature) over the top_k likeliest ids (every id without top_k). With
        top_k the draw is among those k only: a softmax and a draw over 50,257 entries cost more
        than a small model's forward of one token."""
        logits = logits[:, : self.vocab_size].float() / self.temperature
        if self.top_k is not None and self.top_k < logits.size(-1):
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return ids.gather(-1, torch.multinomial(F.softmax(top, dim=-1), 1, generator=generator))
        return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)


class KVCache:
    """The model's forward, one new token at a time: each block's keys and values are kept, so a
    new token attends to them instead of the whole context being computed again (prefill the
    prompt in one pass, then one token a step). It runs the model's own modules and weights
    (wte, wpe, each block's ln_1, attn.qkv, attn.proj, ln_2, mlp, then ln_f and the head's weight),
    and computes attention as model.py does: the same numbers, to float rounding.

    One thing is laid out anew: the head's weight (the embedding, vocab x d_model), copied once
    as d_model x vocab. A new token's logits are one row times that matrix, most of a small
    model's work per token, and a row times a (d, V) matrix reads it in the order it is stored,
    which the CPU's BLAS streams faster than the (V, d) product nn.Linear asks for (1.37x the
    tokens/s: benchmarks/results/sample-speed.md). It costs one more copy of the embedding in memory.

    The positions are learned and absolute: a key is made for its position. Once the context
    fills the position table, the window slides by one each token and every position changes, so
    nothing kept is valid any more: `generate` then prefills the cropped context again (reset())."""

    def __init__(self, model: GPT):
        self.model, self.length = model, 0
        # (d_model, vocab): the docstring. Under autocast in the dtype it would cast to: autocast
        # caches its cast of a parameter, never of a copy, so an fp32 copy would be cast every token.
        # A cache is made and used under one autocast setting (generate's).
        weight, device = model.lm_head.weight, model.lm_head.weight.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        self.head = weight.detach().t().to(dtype).contiguous()
        self.keys: list[torch.Tensor] = []  # per block: (batch, heads, max_position_embeddings, head dim)
        self.values: list[torch.Tensor] = []

    def reset(self) -> None:
        self.length = 0  # the buffers stay: they are overwritten from position 0

    @torch.no_grad()
    def forward(self, idx: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Logits (batch, time, vocab) for the tokens `idx` (batch, time) that follow the cached
        ones, at positions length.. length + time; only the last position's unless `all_logits`
        (the head's V x d product is most of a small model's work per token)."""
        model, start = self.model, self.length
        (B, T), end = idx.shape, self.length + idx.size(1)
        if end > model.cfg.max_position_embeddings or self.keys and self.keys[0].size(0) != B:
            raise ValueError(
                f"{B} rows at positions {start}..{end - 1}: a cache holds one batch, and "
                f"{model.cfg.max_position_embeddings} positions"
            )
        x = model.drop(model.wte(idx) + model.wpe(torch.arange(start, end, device=idx.device)))
        for i, block in enumerate(model.blocks):
            attn = block.attn
            qkv = attn.qkv(block.ln_1(x))
            width, C = qkv.size(-1) // 3, x.size(-1)
            q, k, v = (t.view(B, T, -1, C // attn.n_heads).transpose(1, 2) for t in qkv.split(width, dim=2))
            if i == len(self.keys):  # the first pass: room for the whole position table
                shape = (B, k.size(1), model.cfg.max_position_embeddings, k.size(3))
                self.keys.append(k.new_empty(shape))
                self.values.append(v.new_empty(shape))
            self.keys[i][:, :, start:end] = k
            self.values[i][:, :, start:end] = v
            k, v = self.keys[i][:, :, :end], self.values[i][:, :, :end]
            mask = None  # one new token (or the whole prompt, causal) sees every kept position
            if start and T > 1:  # several new tokens after kept ones: each sees those before it
                mask = torch.ones(T, end, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=not start and T > 1,
                dropout_p=attn.dropout * attn.training,
            )
            x = x + attn.resid_dropout(attn.proj(y.transpose(1, 2).reshape(B, T, width)))
            x = x + block.mlp(block.ln_2(x))
        self.length = end
        return model.ln_f(x if all_logits else x[:, -1:]) @ self.head


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    draw: Draw = Draw(),
    generator: torch.Generator | None = None,
    on_token: Callable[[], None] | None = None,
) -> torch.Tensor:
    """Extend each row of idx (batch, time) by max_new_tokens tokens, each drawn as `draw` says.

    Decoded with a KVCache: the prompt in one pass, then one token at a time. The context is
    cropped to the model's max_position_embeddings (its position table ends there); past it the
    window slides each token and the cropped context is prefilled again (KVCache's docstring).
    The draw uses `generator`, so a seed fixes the text. `on_token` is called after each new token
    (a progress bar's update)."""
    context = model.cfg.max_position_embeddings
    if not max_new_tokens:
        return idx
    cache = KVCache(model)
    logits = cache.forward(idx[:, -context:])
    for n in range(max_new_tokens):
        nxt = draw.next_token(logits[:, -1, :], generator)
        idx = torch.cat([idx, nxt], dim=1)
        if on_token is not None:
            on_token()
        if n + 1 == max_new_tokens:
            break  # no forward for a token that will not be drawn
        if cache.length == context:  # the window slides: every position changes
            cache.reset()
            logits = cache.forward(idx[:, -context:])
        else:
            logits = cache.forward(nxt)
    return idx


def utf8_text(data: bytes) -> str:
    """The text of a sample's bytes, decoded all at once: GPT-2's byte-level tokens split many
    characters (CJK, emoji, accented letters) over two or three tokens, and a token decoded alone
    shows its half of a character as U+FFFD. An incomplete character at the very end (the sample
    stopped before its last bytes were drawn) is left out, not shown as U+FFFD. Bytes that are no
    UTF-8 at all (a lone continuation byte, as an undertrained model draws) still show as U+FFFD:
    there is no character to show."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)
