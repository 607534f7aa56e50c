"""
Tokenise text files ahead of training and print their token counts.

    python data/prepare.py                     # writes data/train.txt from the built-in corpus
    python data/prepare.py my.txt other.txt    # tokenises these files into the token cache

Token files hold uint16 ids after a 64-byte header (magic, count, the SHA-256 of the text and the
tokenizer they were made from), memory-mapped by the trainer and cached under that hash
(MINIGPT_CACHE_DIR, default ~/.cache/minigpt): an edited file is tokenised again, an unchanged one
is read from the cache. `--train-data my.txt` then starts at once. (nanoGPT's .bin files and llm.c's
shards need no preparing: --train-data reads them as they are.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from minigpt.config import ArgParser, UsageError, atomic_write
from minigpt.core.data import builtin_split, cache_dir
from minigpt.core.tokens import load_files

DEFAULT_OUT = Path(__file__).resolve().parent / "train.txt"


def main(argv: list[str] | None = None) -> int:
    p = ArgParser("data/prepare.py", description="Tokenise text files into the trainer's token cache.")
    p.add_argument("files", nargs="*", help="text files (default: the built-in corpus, as data/train.txt)")
    p.add_argument("--tokenizer-name", default="gpt2", help="tiktoken encoding (default: gpt2, offline)")
    args = p.parse_args(argv)
    files = args.files
    try:
        if not files:
            # one piece, none held out: the whole corpus, in the order the trainer reads it
            atomic_write(DEFAULT_OUT, builtin_split(pieces=1)[0])
            print(f"wrote the built-in corpus (Python's pydoc_data topics) to {DEFAULT_OUT}")
            files = [str(DEFAULT_OUT)]
        total = 0
        for f in files:
            n = len(load_files([f], "data/prepare.py", args.tokenizer_name, say=True))
            total += n
            print(f"{f}: {n:,} tokens")
    except (UsageError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"token files in {cache_dir() / 'tokens'}" + (f"; total: {total:,} tokens" if len(files) > 1 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
