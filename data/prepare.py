"""
Tokenise text files ahead of training and print their token counts.

    python data/prepare.py                     # writes data/train.txt from the built-in corpus
    python data/prepare.py my.txt other.txt    # tokenises these files into the token cache

Token files are uint16 arrays of GPT-2 ids (little-endian) after a 64-byte header (magic, count,
SHA-256 of the ids, checked on every load), memory-mapped by the trainer and cached under the
SHA-256 of the text (MINIGPT_CACHE_DIR, default ~/.cache/minigpt): an edited file is tokenised
again, an unchanged one is read from the cache.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from minigpt.config import UsageError
from minigpt.core.tokens import builtin_corpus, tokenize_file

DEFAULT_OUT = Path(__file__).resolve().parent / "train.txt"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Tokenise text files into the trainer's token cache.")
    p.add_argument(
        "files", nargs="*", help="text files (default: copy the built-in corpus to data/train.txt)"
    )
    p.add_argument("--tokenizer-name", default="gpt2")
    args = p.parse_args(argv)
    files = args.files
    if not files:
        DEFAULT_OUT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(builtin_corpus(), DEFAULT_OUT)
        print(f"wrote the built-in corpus (Python's pydoc_data topics) to {DEFAULT_OUT}")
        files = [DEFAULT_OUT]
    try:
        total = 0
        for f in files:
            tokens = tokenize_file(f, args.tokenizer_name)
            total += len(tokens)
            where = getattr(tokens, "filename", None) or "memory (the cache could not be written)"
            print(f"{f}: {len(tokens):,} tokens -> {where}")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if len(files) > 1:
        print(f"total: {total:,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
