"""The tokens of --train-data/--val-data's text files, or of the built-in corpus under another
--tokenizer-name: each text tokenised once into data.py's token cache (keyed by the text and the
tokenizer), memory-mapped by every later run. Loaded only by those flags: a default run reads the
built-in corpus's GPT-2 tokens (data.builtin_tokens) and never this file."""

from __future__ import annotations

import errno
import functools
import os
import stat
import sys
from pathlib import Path

import numpy as np

from minigpt.config import EOT, GPT2_VOCAB, UsageError
from minigpt.core.data import builtin_split, cached_tokens, gpt2_tokenizer

# The largest text file taken: it is tokenised in memory, its bytes, its text and its ids (a Python
# int each) at once, about 12 GiB for 1 GiB of text. Above it: split the file.
MAX_TEXT_BYTES = 1 << 30
MAX_IDS = 1 << 16  # a token file holds uint16 ids
BUILTIN = "the built-in corpus"


@functools.cache
def registry_tokenizer(name: str):
    """A tiktoken Encoding by name: GPT-2's built offline (data.gpt2_tokenizer), any other from
    tiktoken's registry, which downloads its files once. One line where it cannot be had, or has
    more ids than a token file holds."""
    if name == "gpt2":
        return gpt2_tokenizer()
    import tiktoken

    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - an unknown name (ValueError), no network to fetch its files
        why = str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"tokenizer {name!r} is not available ({why}): tiktoken's registry needs the network "
            "the first time; --tokenizer-name gpt2 works offline"
        ) from None
    if enc.n_vocab > MAX_IDS:
        raise UsageError(
            f"tokenizer {name} has {enc.n_vocab:,} ids, more than the {MAX_IDS:,} a token file holds "
            "(uint16); use --tokenizer-name gpt2"
        )
    return enc


class Encoder:
    """What data.cached_tokens asks of an encoding (name, n_vocab, encode_ordinary), the encoder
    itself built on a cache's miss only: GPT-2's costs about 50 MiB that a run whose tokens are
    cached never needs. `say`: a miss is said on stderr (rank 0), since a big text takes a while."""

    def __init__(self, name: str, say: bool):
        self.name, self.say = name, say
        self.n_vocab = GPT2_VOCAB if name == "gpt2" else registry_tokenizer(name).n_vocab
        self.eot = EOT if name == "gpt2" else registry_tokenizer(name).eot_token
        self.source = ""

    def encode_ordinary(self, text: str) -> list[int]:
        if self.say and len(text) > 1 << 20:
            line = f"note: tokenising {self.source} with {self.name}, once: later runs read the cache"
            print(line, file=sys.stderr, flush=True)
        return registry_tokenizer(self.name).encode_ordinary(text)

    def tokens(self, raw: bytes, stem: str, source: str) -> np.ndarray:
        """The ids of a text's bytes, from the cache or tokenised into it: one line for bytes that
        are not UTF-8, or none."""
        if not raw:
            raise UsageError(f"{source} is empty; give a file with some text")
        self.source = source
        try:
            return cached_tokens(raw, stem[:100], self)
        except UnicodeDecodeError as e:
            raise UsageError(f"{source} is not UTF-8 text (byte {e.start}); convert it first") from None


def text_bytes(path: str, flag: str) -> bytes:
    """A data file's bytes: a regular file (a FIFO would block, /dev/zero never ends) of at most
    MAX_TEXT_BYTES, read through the descriptor that was checked; else one line naming `flag`."""
    fix = f"pass {flag} an existing text file"
    if path.replace(os.sep, "/").endswith("data/train.txt"):
        fix += "; in the repository, python data/prepare.py writes data/train.txt from the built-in corpus"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"data file {path} does not exist; {fix}") from None
    except OSError as e:
        if e.errno == errno.ENAMETOOLONG:
            from minigpt.fileio import name_problem

            problem = name_problem(path) or "is too long"
            raise UsageError(f"{flag}: the path {problem}; choose a shorter one") from None
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise UsageError(f"data file {path} is a directory; pass {flag} the text files inside it")
        if not stat.S_ISREG(st.st_mode):
            from minigpt.fileio import file_kind

            raise UsageError(f"data file {path} is {file_kind(st.st_mode)}, not a regular file; {fix}")
        if st.st_size > MAX_TEXT_BYTES:
            raise UsageError(
                f"data file {path} is {st.st_size / 2**30:.1f} GiB, above the {MAX_TEXT_BYTES >> 30} GiB a "
                "text file may be (it is tokenised in memory); split it into smaller files"
            )
        with open(fd, "rb", closefd=False) as f:
            return f.read(MAX_TEXT_BYTES)
    except OSError as e:
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    finally:
        os.close(fd)


def file_tokens(paths: list[str], flag: str, enc: Encoder) -> np.ndarray:
    """The ids of the files, in order, joined by <|endoftext|> (a document's end)."""
    parts = [enc.tokens(text_bytes(p, flag), Path(p).stem, f"data file {p}") for p in paths]
    if len(parts) == 1:
        return parts[0]
    sep = np.array([enc.eot], dtype="<u2")
    return np.concatenate([x for part in parts for x in (sep, part)][1:])


def user_tokens(cfg, is_main: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """(training ids, validation ids, vocabulary). --val-data's files validate and all of the
    training text trains (the built-in corpus's whole text, without --train-data); without it the
    last tenth of --train-data's ids is held out, contiguous (a text sorted by topic or date makes
    that tenth unlike the rest: --val-data then says what is held out); without either, the
    built-in corpus's own split. --max-tokens caps the training ids (load_data)."""
    enc = Encoder(cfg.tokenizer_name, is_main)
    if cfg.val_data:
        if cfg.train_data:
            train = file_tokens(cfg.train_data, "--train-data", enc)
        else:
            whole = builtin_split(pieces=1)[0]  # one piece, none held out
            train = enc.tokens(whole.encode(), "pydoc_topics", BUILTIN)
        return train, file_tokens(cfg.val_data, "--val-data", enc), enc.n_vocab
    if cfg.train_data:
        ids = file_tokens(cfg.train_data, "--train-data", enc)
        ids = ids[: cfg.max_tokens] if cfg.max_tokens else ids  # the tenth held out of what trains
        cut = len(ids) - len(ids) // 10
        return ids[:cut], ids[cut:], enc.n_vocab
    train, val = builtin_split()
    train = enc.tokens(train.encode(), "pydoc_topics_train", BUILTIN)
    return train, enc.tokens(val.encode(), "pydoc_topics_val", f"{BUILTIN}'s held-out text"), enc.n_vocab
