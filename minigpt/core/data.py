"""Text in, batches out.

- Texts are tokenised once (minigpt/core/tokens.py: GPT-2's exact ids, offline) into uint16 token
  files, memory-mapped and cached under the hash of their bytes. A token file's header (magic,
  length, SHA-256 of the ids) is checked on every load: a damaged one is tokenised again.
- Batches are random windows of seq_len + 1 tokens. Batch i of rank r is drawn from a generator
  seeded with (data_seed, r, i), so the data position is one integer and resume is exact.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minigpt.core.config import GPT2_VOCAB, TrainConfig, UsageError

CACHE_ENV = "MINIGPT_CACHE_DIR"  # where token files live; default ~/.cache/minigpt
# A token file: this header, then the ids (uint16, little-endian). 64 bytes keeps the ids aligned.
TOKEN_MAGIC = b"MINIGPT-TOKENS-1"
TOKEN_HEADER = struct.Struct("<16sQ32s")  # magic, number of ids, SHA-256 of the ids' bytes
TOKEN_HEADER_SIZE = 64
TOKEN_SUFFIX = "tok"
# The built-in corpus's held-out text (builtin_split): the last of every VAL_EVERY of SPLIT_PIECES
# stretches of whole paragraphs. Its last tenth alone (typesseq's tables...) was 42% whitespace-only
# tokens against 18-31% elsewhere, and the validation loss sat ~1 nat under the training loss; every
# 10th topic held 2% of the tokens. Stretches spread over the corpus hold 10%, 24% whitespace-only
# against training's 26%.
SPLIT_PIECES, VAL_EVERY = 100, 10


def tokenizer_vocab(name: str = "gpt2") -> int:
    """How many ids a tokenizer has. GPT-2's is known without building its encoder, which takes
    about 50 MiB of memory for the whole run and time at start-up: a run that reads its tokens from
    the cache never needs it."""
    if name == "gpt2":
        return GPT2_VOCAB
    from minigpt.core.tokens import get_tokenizer

    return get_tokenizer(name).n_vocab


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "minigpt")


def builtin_split() -> tuple[str, str]:
    """The built-in corpus as the trainer splits it: (training text, held-out text). The corpus is
    cut at paragraph breaks into SPLIT_PIECES stretches of about equal length, and the last of
    every ten is held out: a tenth of the text, spread evenly over it. Each is tokenised and
    cached under the hash of its own text: a changed split is a changed text, never a stale
    token file."""
    text = "\n\n".join(builtin_topics())
    starts = [text.find("\n\n", k * len(text) // SPLIT_PIECES) for k in range(1, SPLIT_PIECES)]
    cuts = [0, *(c for c in starts if c > 0), len(text)]
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    held = [k % VAL_EVERY == VAL_EVERY - 1 for k in range(len(pieces))]
    return "".join(p for p, h in zip(pieces, held) if not h), "".join(p for p, h in zip(pieces, held) if h)


def builtin_topics() -> list[str]:
    """The topics' texts, in their names' alphabetical order (what the corpus file holds)."""
    import pydoc_data.topics

    return [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]


def read_token_file(path: Path, n_vocab: int | None = None) -> np.ndarray | None:
    """The ids of a cached token file, memory-mapped, or None when the file is missing, not a
    regular file (a FIFO would block the run), truncated, not a token file, its ids do not match
    the hash in its header, or (given n_vocab) an id is not below n_vocab: a self-consistent file
    holding id 65535 would otherwise end in an IndexError inside the embedding."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        head, size = os.read(fd, TOKEN_HEADER_SIZE), st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < TOKEN_HEADER.size:
        return None
    magic, count, digest = TOKEN_HEADER.unpack_from(head)
    if magic != TOKEN_MAGIC or count == 0 or size != TOKEN_HEADER_SIZE + 2 * count:
        return None
    ids = np.memmap(path, dtype="<u2", mode="r", offset=TOKEN_HEADER_SIZE, shape=(count,))
    if hashlib.sha256(memoryview(ids).cast("B")).digest() != digest:
        return None
    if n_vocab is not None and int(ids.max()) >= n_vocab:
        return None
    return ids


def cached_tokens(
    raw: bytes, stem: str, tokenizer_name: str, source: str | Path, show_progress: bool | None = None
) -> np.ndarray:
    """The ids of a text's bytes `raw`, from the verified cache file named after `stem` and the
    bytes' hash, tokenised (and cached) on a miss. `source` names the text in messages."""
    digest = hashlib.sha256(raw + tokenizer_name.encode()).hexdigest()[:20]
    cached = cache_dir() / "tokens" / f"{stem}-{digest}.{tokenizer_name}.{TOKEN_SUFFIX}"
    n_vocab = tokenizer_vocab(tokenizer_name)
    ids = read_token_file(cached, n_vocab)
    if ids is not None:
        return ids
    from minigpt.core.tokens import tokenize_into  # a miss: the only time text is tokenised

    return tokenize_into(cached, raw, tokenizer_name, n_vocab, source, show_progress)


def split_tokens(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, validation tokens): of --train-data/--val-data (minigpt/core/tokens.py's
    user_tokens), else of the built-in corpus, a tenth held out in stretches spread over it
    (builtin_split). --max-tokens caps the training text."""
    name = cfg.tokenizer_name
    if cfg.train_data or cfg.val_data:  # the user's text files (minigpt/core/tokens.py)
        from minigpt.core.tokens import user_tokens

        return user_tokens(cfg)
    train, val = builtin_split()  # the built-in corpus: its texts' tokens, cached under their hashes
    train_ids = cached_tokens(train.encode(), "pydoc_topics_train", name, "the built-in corpus")
    val_ids = cached_tokens(val.encode(), "pydoc_topics_val", name, "its held-out text")
    return train_ids[: cfg.max_tokens], val_ids


def check_enough_tokens(tokens: np.ndarray, seq_len: int, what: str) -> None:
    need = seq_len + 1
    if len(tokens) < need:
        raise UsageError(
            f"{what} has {len(tokens)} tokens, but --seq-len {seq_len} needs at least "
            f"{need}; give more text or lower --seq-len"
        )


@dataclass(eq=False)
class Batches:
    """Random windows of seq_len + 1 tokens: x is the first seq_len, y the same shifted by one.

    `position` counts the batches drawn; batch i depends only on (seed, rank, stream, i), so
    saving `position` is all a checkpoint needs to continue the same sequence of batches.
    """

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    rank: int = 0
    stream: int = 0
    pin_memory: bool = False  # page-locked host memory lets the copy to the GPU be async
    position: int = 0

    def _windows(self, rng: np.random.Generator) -> np.ndarray:
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.rank, self.stream, self.position])
        self.position += 1
        w = torch.from_numpy(self._windows(rng))
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        if self.pin_memory:
            x, y = x.pin_memory(), y.pin_memory()
        return x, y


class ToyBatches(Batches):
    """A synthetic task that a tiny model learns in a few dozen steps: arithmetic sequences
    (start + k * stride) mod vocab, with a random start and stride 1..4 per row. Predicting the
    next token needs the stride, which only the context reveals."""

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, seed: int, **kw):
        super().__init__(np.zeros(0, dtype=np.uint16), batch_size, seq_len, seed, **kw)
        self.vocab_size = vocab_size

    def _windows(self, rng: np.random.Generator) -> np.ndarray:
        start = rng.integers(0, self.vocab_size, size=(self.batch_size, 1))
        stride = rng.integers(1, 5, size=(self.batch_size, 1))
        return (start + stride * np.arange(self.seq_len + 1)) % self.vocab_size


@dataclass
class Data:
    """The batches a run draws, and what the log says of them."""

    train: Batches
    make_val: Callable[[], Batches]  # a fresh iterator over the same validation batches each time
    name: str
    vocab_size: int
    train_tokens: int | None  # None for toy data, which has no epochs
    val_tokens: int | None


def load_data(cfg: TrainConfig, rank: int, pin: bool) -> Data:
    """Read and check everything before the run directory is touched: a mistake costs nothing.
    `rank`: the data-parallel rank (the ranks of a tp group share batches); `pin`: page-locked
    batches make the host-to-device copy asynchronous (CUDA)."""
    if cfg.use_toy_data:
        v = cfg.vocab_size
        return Data(
            ToyBatches(v, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin),
            functools.partial(
                ToyBatches, v, cfg.batch_size, cfg.seq_len, cfg.data_seed, stream=1, pin_memory=pin
            ),
            "toy sequences",
            v,
            None,
            None,
        )
    train_tokens, val_tokens = split_tokens(cfg)
    name = ", ".join(map(str, cfg.train_data)) if cfg.train_data else "built-in corpus (pydoc_data topics)"
    check_enough_tokens(train_tokens, cfg.seq_len, "the training data")
    check_enough_tokens(val_tokens, cfg.seq_len, "the validation data")
    n_vocab = tokenizer_vocab(cfg.tokenizer_name)
    if cfg.vocab_size is not None and cfg.vocab_size < n_vocab:
        raise UsageError(
            f"--vocab-size {cfg.vocab_size} is smaller than the {cfg.tokenizer_name} "
            f"tokenizer's {n_vocab} ids; drop --vocab-size or raise it"
        )
    return Data(
        Batches(train_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed, rank=rank, pin_memory=pin),
        functools.partial(
            Batches, val_tokens, cfg.batch_size, cfg.seq_len, cfg.data_seed, stream=1, pin_memory=pin
        ),
        name,
        cfg.vocab_size or n_vocab,
        len(train_tokens),
        len(val_tokens),
    )
