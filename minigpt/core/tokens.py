"""The tokens of --train-data/--val-data's files, and of the built-in corpus under another
--tokenizer-name. Loaded only by those flags: a default run reads the built-in corpus's GPT-2 tokens
(data.builtin_tokens) and never this file.

- A token file is read as it comes, memory-mapped: never copied nor tokenised. nanoGPT's `.bin`
  (raw little-endian uint16 ids, as its data/openwebtext/prepare.py writes them) or llm.c's shard
  (a header of 256 int32: magic 20240520, version 1, the token count; then uint16 ids, as its
  dev/data/fineweb.py writes them): one file, several, a folder of shards or a pattern
  ('fineweb10B/fineweb_train_*.bin'). Header and size are checked at start-up, the ids against the
  vocabulary as each window is drawn: a 10 GB file is not read through before the first step.
- A text file is tokenised once into data.py's token cache (keyed by the text's SHA-256 and the
  tokenizer), streamed: read in pieces cut where GPT-2's pre-tokeniser always splits (a letter,
  digit or visible character, then a space or a newline), so the pieces' ids are the whole text's
  and memory stays bounded; how far it got is said every 10 s.
- Several files are one sequence, an <|endoftext|> between two (Tokens: a view over their arrays).
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import functools
import glob
import hashlib
import io
import os
import re
import stat
import struct
import sys
import time
from pathlib import Path

import numpy as np

from minigpt.config import EOT, GPT2_VOCAB, UsageError
from minigpt.core.data import HEADER, HEADER_SIZE, MAGIC, builtin_split, cache_dir, cached_tokens, read_tokens

MAX_IDS = 1 << 16  # a token file holds uint16 ids
LLMC_MAGIC, LLMC_HEADER = 20240520, 256 * 4  # llm.c's shards: 256 int32, then the ids
PIECE = 8 << 20  # bytes of text tokenised at a time (~100 MB of Python objects in flight)
SAY_EVERY_S = 10.0
# Where a text may be cut without changing its ids: between a character that is no space (visible
# ASCII, a letter, a digit) and a space or newline. No token of GPT-2's pattern runs from the one into
# the other, a token starts at the space in the whole text as in the piece, and BPE merges within a
# token only. (GPT-2's pattern, which p50k_base shares; larger encodings do not fit uint16 ids.)
SAFE_CUT = re.compile(r"(?<=[!-~\w])(?=[ \n])")


@functools.cache
def registry_tokenizer(name: str):
    """A tiktoken Encoding from tiktoken's registry (which downloads its files once); one line
    where it cannot be had, or has more ids than a token file holds."""
    import tiktoken

    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # noqa: BLE001 - an unknown name (ValueError), no network to fetch its files
        why = str(e).splitlines()[0][:120] if str(e).strip() else type(e).__name__
        fix = "--tokenizer-name gpt2 works offline"
        raise UsageError(f"tokenizer {name!r} is not available ({why}); {fix}") from None
    if enc.n_vocab > MAX_IDS:
        why = f"more than the {MAX_IDS:,} a token file holds (uint16)"
        raise UsageError(f"tokenizer {name} has {enc.n_vocab:,} ids, {why}; use --tokenizer-name gpt2")
    return enc


def encoding(name: str):
    """The tokenizer by name: GPT-2's built offline (data.gpt2_tokenizer), any other from the registry."""
    from minigpt.core.data import gpt2_tokenizer

    return gpt2_tokenizer() if name == "gpt2" else registry_tokenizer(name)


def vocabulary(name: str) -> tuple[int, int]:
    """(ids, <|endoftext|>'s id) of a tokenizer, GPT-2's without building it."""
    if name == "gpt2":
        return GPT2_VOCAB, EOT
    return registry_tokenizer(name).n_vocab, registry_tokenizer(name).eot_token


class Tokens:
    """Several id arrays as one sequence, nothing copied: a slice is a view, and np.asarray of one
    joins its pieces, checking them against the vocabulary (a window of a batch, as drawn)."""

    def __init__(self, parts: list, names: list[str], n_vocab: int):
        self.parts, self.names, self.n_vocab = parts, names, n_vocab
        self.starts = [0]
        for p in parts:
            self.starts.append(self.starts[-1] + len(p))

    def __len__(self) -> int:
        return self.starts[-1]

    def __getitem__(self, s: slice) -> Tokens:
        start, stop, _ = s.indices(len(self))
        parts, names, i = [], [], max(bisect.bisect_right(self.starts, start) - 1, 0)
        while start < stop and i < len(self.parts):
            lo, hi = start - self.starts[i], min(stop - self.starts[i], len(self.parts[i]))
            parts.append(self.parts[i][lo:hi])
            names.append(self.names[i])
            start, i = start + hi - lo, i + 1
        return Tokens(parts, names, self.n_vocab)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        ids = np.concatenate(self.parts) if len(self.parts) != 1 else np.asarray(self.parts[0])
        for part, name in zip(self.parts, self.names):
            if len(part) and int(part.max()) >= self.n_vocab:
                raise UsageError(
                    f"{name} holds id {int(part.max()):,}, past the tokenizer's {self.n_vocab:,} ids"
                )
        return ids if dtype is None else ids.astype(dtype)


def data_files(paths: list[str], flag: str) -> list[str]:
    """The files `paths` name: a folder's *.bin shards and a pattern's matches, sorted."""
    out = []
    for p in paths:
        if glob.has_magic(p) and not os.path.lexists(p):
            if not (hits := sorted(glob.glob(p))):
                raise UsageError(f"{flag} {p} matches no file; check the pattern")
            out += hits
        elif os.path.isdir(p):
            if not (shards := sorted(glob.glob(os.path.join(glob.escape(p), "*.bin")))):
                raise UsageError(f"data folder {p} holds no .bin token files; pass {flag} its files")
            check_split(p, shards, flag)
            out += shards
        else:
            out.append(p)
    return out


SPLIT_WORDS = {"train": "train", "val": "val", "valid": "val", "validation": "val", "test": "val"}


def check_split(folder: str, files: list[str], flag: str) -> None:
    """A folder of token files as nanoGPT and llm.c lay them out (train.bin beside val.bin,
    fineweb_train_*.bin beside fineweb_val_*.bin) is refused whole: its validation files would
    train. A split is a word of the name (`val`, not `interval`); the patterns offered select each
    side's files exactly, or the line asks for the files by name."""
    sides: dict[str, list[str]] = {"train": [], "val": []}
    for f in files:
        words = set(re.split(r"[^a-z]+", os.path.basename(f).lower()))
        for side in {SPLIT_WORDS[w] for w in words & SPLIT_WORDS.keys()}:
            sides[side].append(f)
    if not (sides["train"] and sides["val"]):
        return
    at = os.path.join(folder, "")
    exact = all([f for f in files if side in os.path.basename(f)] == sides[side] for side in sides)  # *side*
    fix = (
        f"e.g. --train-data '{at}*train*.bin' --val-data '{at}*val*.bin'"
        if exact
        else "give --train-data and --val-data their files"
    )
    raise UsageError(
        f"{flag} {folder} holds training and validation files ({os.path.basename(sides['val'][0])}): {fix}"
    )


def open_data(path: str, flag: str):
    """A data file opened for reading, checked on the opened descriptor to be a regular file (a
    FIFO would block, /dev/zero never ends); else one line naming `flag`."""
    fix = f"pass {flag} an existing file"
    if path.replace(os.sep, "/").endswith("data/train.txt"):
        fix += "; in the repository, python data/prepare.py writes data/train.txt from the built-in corpus"
    try:
        f = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb")
    except FileNotFoundError:
        raise UsageError(f"data file {path} does not exist; {fix}") from None
    except OSError as e:
        from minigpt.fileio import name_problem

        if problem := name_problem(path):
            raise UsageError(f"{flag}: the path {problem}; choose a shorter one") from None
        raise UsageError(f"cannot read data file {path} ({e.strerror}); check its permissions") from None
    mode = os.fstat(f.fileno()).st_mode
    if not stat.S_ISREG(mode):
        from minigpt.fileio import file_kind

        f.close()
        raise UsageError(f"data file {path} is {file_kind(mode)}, not a regular file; {fix}")
    return f


def token_file(f, path: str, flag: str) -> np.ndarray | None:
    """An opened file's ids if it is a token file, memory-mapped; None for text. One line for a
    header or a size that lies."""
    size, head = os.fstat(f.fileno()).st_size, f.read(12).ljust(12, b"\0")
    magic, version, count = struct.unpack("<3i", head)
    f.seek(0)
    if magic == LLMC_MAGIC:
        if version != 1:
            raise UsageError(
                f"{flag} {path}: an llm.c shard of version {version}; version 1 (uint16 ids) is read"
            )
        if count <= 0:
            raise UsageError(
                f"{flag} {path}: an llm.c shard whose header says {count:,} tokens: empty or damaged"
            )
        if size != LLMC_HEADER + 2 * count:
            held = f"its {size:,} bytes hold {(size - LLMC_HEADER) / 2:,.1f}"
            raise UsageError(f"{flag} {path}: its header says {count:,} tokens, {held}")
        return np.memmap(f, "<u2", "r", LLMC_HEADER, (count,))
    if not path.endswith(".bin"):
        return None
    if size == 0 or size % 2:
        raise UsageError(f"{flag} {path}: {size:,} bytes are not uint16 ids (a .bin is read as nanoGPT's)")
    return np.memmap(f, "<u2", "r")


def text_tokens(f, path: str, name: str, say: bool) -> np.ndarray:
    """An opened text file's ids from the token cache; on a miss tokenised into it, in pieces (into
    memory, said in one line, where the cache cannot be written)."""
    digest, size = hashlib.sha256(), os.fstat(f.fileno()).st_size
    for chunk in iter(lambda: f.read(PIECE), b""):
        digest.update(chunk)
    digest.update(name.encode())
    key, n_vocab = digest.digest(), vocabulary(name)[0]
    cached = cache_dir() / "tokens" / f"{Path(path).stem[:100]}-{key.hex()[:20]}.tok"
    if (ids := read_tokens(cached, key, n_vocab)) is not None:
        return ids
    if size == 0:
        raise UsageError(f"data file {path} is empty; give a file with some text")
    if os.path.isdir(cached) and not os.path.islink(cached):  # os.replace cannot take its name: one note
        note = f"note: {cached} is a folder, not this text's tokens: the ids are kept in memory"
        print(note, file=sys.stderr)
        return in_memory(f, path, size, name, say)
    if os.path.lexists(cached):
        print(f"note: {cached} is not this text's tokens (damaged): tokenised again", file=sys.stderr)
    elif say and size > PIECE:  # a text that takes a while
        print(f"note: tokenising {path} with {name}, once: later runs read the cache", file=sys.stderr)
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.part")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as out:
            out.write(b"\0" * HEADER_SIZE)
            count = tokenise(f, out, path, size, encoding(name), say)
            out.seek(0)
            out.write(HEADER.pack(MAGIC, count, key))
            out.flush()
            os.fsync(out.fileno())  # the header last, and on disk before the name: no file that lies
        os.replace(tmp, cached)
        return read_tokens(cached, key, n_vocab)
    except OSError as e:
        why = f"{e.strerror}; set $MINIGPT_CACHE_DIR"
        print(f"note: no token cache in {cached.parent} ({why}): the ids are kept in memory", file=sys.stderr)
    finally:
        with contextlib.suppress(OSError):  # gone, or no folder to be in
            tmp.unlink()
    return in_memory(f, path, size, name, say)


def in_memory(f, path: str, size: int, name: str, say: bool) -> np.ndarray:
    out = io.BytesIO()
    tokenise(f, out, path, size, encoding(name), say)
    return np.frombuffer(out.getbuffer(), "<u2")


def last_cut(text: str) -> int | None:
    """Where the last SAFE_CUT of the text is (looked for in its last 64 Ki characters first)."""
    for start in (max(len(text) - (1 << 16), 0), 0):
        if cut := max((m.start() for m in SAFE_CUT.finditer(text, start)), default=0):
            return cut
    return None


def tokenise(src, out, path: str, size: int, enc, say: bool) -> int:
    """Tokenises src into out as uint16 ids, a piece at a time; returns the count."""
    src.seek(0)
    decoder, count, rest, t0 = codecs.getincrementaldecoder("utf-8")(), 0, "", time.monotonic()
    said = t0
    while True:
        raw, pending = src.read(PIECE), len(decoder.getstate()[0])  # bytes of a character cut short
        try:
            text = rest + decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as e:
            at = src.tell() - len(raw) - pending + e.start
            raise UsageError(f"data file {path} is not UTF-8 text (near byte {at:,}); convert it") from None
        cut = last_cut(text) if raw else len(text)  # the end: all of it
        if cut is None:  # no safe cut yet: read on
            rest = text
        else:
            text, rest = text[:cut], text[cut:]
            ids = np.array(enc.encode_ordinary(text), dtype="<u2")
            out.write(ids.tobytes())
            count += len(ids)
        if not raw:
            return count
        if say and time.monotonic() - said >= SAY_EVERY_S:  # read on or not: never silent
            said = time.monotonic()
            line = f"tokenising {path}: {src.tell() / size:.0%} of {size / 2**20:,.0f} MiB, {said - t0:.0f} s"
            print(line, file=sys.stderr, flush=True)


def load_files(paths: list[str], flag: str, name: str, say: bool) -> Tokens:
    """The ids of the files, in order, an <|endoftext|> between two."""
    n_vocab, eot = vocabulary(name)
    parts, names = [], []
    for path in data_files(paths, flag):
        with open_data(path, flag) as f:
            ids = token_file(f, path, flag)
            ids = text_tokens(f, path, name, say) if ids is None else ids
        if parts:
            parts.append(np.array([eot], dtype="<u2"))
            names.append("<|endoftext|>")
        parts.append(ids)
        names.append(f"{flag} {path}")
    return Tokens(parts, names, n_vocab)


def user_tokens(cfg, is_main: bool) -> tuple:
    """(training ids, validation ids, vocabulary). --val-data's files validate and all of the
    training text trains (the built-in corpus's whole text, without --train-data); without it the
    last tenth of --train-data's ids is held out, contiguous (a text sorted by topic or date makes
    that tenth unlike the rest: --val-data then says what is held out); without either, the
    built-in corpus's own split under --tokenizer-name. --max-tokens caps the training ids."""
    name, n_vocab = cfg.tokenizer_name, vocabulary(cfg.tokenizer_name)[0]
    if not cfg.train_data:
        train, val = builtin_split(pieces=1 if cfg.val_data else 100)
        train = cached_tokens(train.encode(), "pydoc_topics" + "_train" * (not cfg.val_data), encoding(name))
        if not cfg.val_data:
            return train, cached_tokens(val.encode(), "pydoc_topics_val", encoding(name)), n_vocab
    else:
        train = load_files(cfg.train_data, "--train-data", name, is_main)
    if cfg.val_data:
        return train, load_files(cfg.val_data, "--val-data", name, is_main), n_vocab
    train = train[: cfg.max_tokens] if cfg.max_tokens else train  # the tenth held out of what trains
    cut = len(train) - len(train) // 10
    if len(train) - cut <= cfg.seq_len < cut:  # not "the validation data": the user gave none
        raise UsageError(
            f"--train-data's last tenth, held out to validate, is {len(train) - cut:,} tokens; --seq-len "
            f"{cfg.seq_len} needs {cfg.seq_len + 1:,}: give --val-data, or "
            + ("raise --max-tokens" if cfg.max_tokens else "more --train-data")
        )
    return train[:cut], train[cut:], n_vocab
