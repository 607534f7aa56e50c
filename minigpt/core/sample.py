"""Text from a trained checkpoint: the model rebuilt from the checkpoint's own shape, and the
sampling loop (temperature, top-k, a seeded generator). sample.py at the repository root is the
command line around it."""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from minigpt.config import UsageError
from minigpt.core.checkpoint import load_checkpoint
from minigpt.core.model import GPT, GPTConfig


def load_model(path: str | Path, device: str = "cpu") -> tuple[GPT, dict]:
    """The GPT of a checkpoint (loaded as data, weights_only) in eval mode, and the run's
    training config (which tokenizer, toy data or not). A checkpoint edited by hand into a shape
    no GPT has, or a config of the wrong types, is refused in one line before anything is built."""
    state = load_checkpoint(path)
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
    with torch.device("meta"):
        one = GPT(replace(cfg, n_layers=1)).state_dict()
    expected = {k: tuple(t.shape) for k, t in one.items() if not k.startswith("blocks.")}
    for i in range(cfg.n_layers):
        expected.update(
            {
                f"blocks.{i}.{k.split('.', 2)[2]}": tuple(t.shape)
                for k, t in one.items()
                if k.startswith("blocks.")
            }
        )
    for name, shape in expected.items():
        if name not in weights:
            return f"{name} is missing"
        if tuple(weights[name].shape) != shape:
            return f"{name} has shape {list(weights[name].shape)}, its model_config makes {list(shape)}"
    extra = sorted(set(weights) - set(expected))
    return f"{extra[0]} is no weight of this model" if extra else None


def check_train_config(train_config: dict, path: str | Path) -> None:
    """The training config's fields that sampling reads, of the types the trainer wrote them."""
    toy, vocab = train_config.get("use_toy_data", False), train_config.get("vocab_size")
    tokenizer = train_config.get("tokenizer_name", "gpt2")
    problem = (
        f"use_toy_data holds {toy!r}, not true or false"
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

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution to draw from, given the last position's logits (batch, vocab)."""
        logits = logits.float() / self.temperature
        if self.vocab_size is not None and self.vocab_size < logits.size(-1):
            logits[:, self.vocab_size :] = -math.inf
        if self.top_k is not None and self.top_k < logits.size(-1):
            kth = torch.topk(logits, self.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, -math.inf)
        return F.softmax(logits, dim=-1)


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

    The context is cropped to the model's max_position_embeddings (its position table ends
    there). The draw uses `generator`, so a seed fixes the text. `on_token` is called after each
    new token (a progress bar's update)."""
    context = model.cfg.max_position_embeddings
    for _ in range(max_new_tokens):
        logits, _ = model(idx[:, -context:])
        nxt = torch.multinomial(draw.probabilities(logits[:, -1, :]), num_samples=1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
        if on_token is not None:
            on_token()
    return idx


def utf8_text(data: bytes) -> str:
    """The text of a sample's bytes, decoded all at once: GPT-2's byte-level tokens split many
    characters (CJK, emoji, accented letters) over two or three tokens, and a token decoded alone
    shows its half of a character as U+FFFD. An incomplete character at the very end (the sample
    stopped before its last bytes were drawn) is left out, not shown as U+FFFD. Bytes that are no
    UTF-8 at all (a lone continuation byte, as an undertrained model draws) still show as U+FFFD:
    there is no character to show."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=False)
