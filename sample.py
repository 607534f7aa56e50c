"""
Text from a trained minigpt checkpoint.

    python sample.py                                         # the newest run in runs/ that has a checkpoint
    python sample.py --out-dir runs/RUN                      # that run's checkpoints/ckpt.pt
    python sample.py --checkpoint runs/RUN/checkpoints/ckpt.pt --prompt "The list type"
    python sample.py --out-dir runs/RUN --prompt FILE:prompt.txt --num-samples 5 --max-new-tokens 100
    python sample.py --out-dir runs/RUN --temperature 0.6 --top-k 40 --seed 7
    python sample.py --out-dir runs/RUN --top-k 1            # greedy: the likeliest token every time
    python sample.py --out-dir runs/TOY --prompt "3 5 7"     # a --use-toy-data run: token ids in and out

The checkpoint is read as data (weights_only); the model is rebuilt from the shape it records, so
no training flags are needed. Runs on real text decode with the GPT-2 tokenizer; --use-toy-data
runs have no text, so their prompt and output are token ids.
"""

from __future__ import annotations

import argparse
import math
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

from minigpt.config import UsageError, resolve_device
from minigpt.data import EOT, get_tokenizer
from minigpt.paths import CHECKPOINT_FILE, RUNS_ROOT
from minigpt.runs import latest_run
from minigpt.sample import generate, load_model, vocab_in_use

FILE_PREFIX = "FILE:"  # --prompt FILE:path reads the prompt from a file
TOY_PROMPT = "0 2 4 6"  # a toy run's task is arithmetic sequences: the stride is in the prompt
SEPARATOR = "-" * 40


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="sample.py", description="Text from a trained minigpt checkpoint.")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--out-dir",
        type=Path,
        help=f"a run directory: its {CHECKPOINT_FILE} "
        f"(default: the run in {RUNS_ROOT}/ whose checkpoint is newest)",
    )
    where.add_argument("--checkpoint", type=Path, help="a checkpoint file")
    p.add_argument(
        "--prompt",
        default="",
        help=f"the text to continue, or {FILE_PREFIX}path to read it "
        "from a file (default: the start of a document; toy runs: token ids, "
        f"default {TOY_PROMPT!r})",
    )
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: safer text; above 1: wilder")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest tokens (1: greedy)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    # fp32 by default: on a CPU without native bf16, bf16 autocast is emulated and slower.
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    args = p.parse_args(argv)
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UsageError(f"--temperature {args.temperature}: give a positive finite number, such as 0.8")
    if args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: give at least 1 (1 is greedy decoding)")
    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise UsageError("--num-samples must be at least 1 and --max-new-tokens at least 0")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed {args.seed}: give a number in [0, 2^32)")
    return args


def checkpoint_path(args: argparse.Namespace) -> Path:
    if args.checkpoint:
        return args.checkpoint
    if args.out_dir:
        if not args.out_dir.is_dir():
            raise UsageError(f"run directory {args.out_dir} does not exist; pass a folder under {RUNS_ROOT}/")
        path = args.out_dir / CHECKPOINT_FILE
        if not path.is_file():
            raise UsageError(
                f"{args.out_dir} has no {CHECKPOINT_FILE} (trained with --no-checkpoint, or "
                "still before its first save?); pass --checkpoint to name one"
            )
        return path
    run = latest_run(RUNS_ROOT, CHECKPOINT_FILE)
    print(f"sampling from {run}, the run with the newest checkpoint", file=sys.stderr)
    return run / CHECKPOINT_FILE


def read_prompt(prompt: str) -> str:
    if not prompt.startswith(FILE_PREFIX):
        return prompt
    path = Path(prompt[len(FILE_PREFIX) :])
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise UsageError(f"--prompt {prompt}: cannot read {path} ({reason})") from None


def encode(prompt: str, toy: bool, vocab: int | None) -> list[int]:
    """Token ids of the prompt: GPT-2 ids of the text, or a toy run's ids as written."""
    if toy:
        try:
            ids = [int(t) for t in (prompt or TOY_PROMPT).replace(",", " ").split()]
        except ValueError:
            raise UsageError(
                f"--prompt {prompt!r}: a --use-toy-data run takes token ids, such as {TOY_PROMPT!r}"
            ) from None
    else:
        ids = get_tokenizer().encode_ordinary(prompt) if prompt else [EOT]  # a document's start
    bad = [i for i in ids if not 0 <= i < (vocab or 2**63)]
    if bad:
        raise UsageError(f"--prompt holds token ids {bad[:5]} outside this model's vocabulary of {vocab}")
    if not ids:
        raise UsageError("--prompt is empty after tokenising; give some text")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    model, train_cfg = load_model(checkpoint_path(args), device)
    toy = bool(train_cfg.get("use_toy_data"))
    if not toy and train_cfg.get("tokenizer_name", "gpt2") != "gpt2":
        raise UsageError(
            f"this run used the {train_cfg['tokenizer_name']} tokenizer; sample.py decodes gpt2 only"
        )
    vocab = vocab_in_use(train_cfg, None if toy else get_tokenizer().n_vocab)
    prompt = read_prompt(args.prompt)
    ids = encode(prompt, toy, vocab)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    idx = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    with autocast:
        out = generate(model, idx, args.max_new_tokens, args.temperature, args.top_k, generator, vocab)
    for i, row in enumerate(out.tolist()):
        if i:
            print(SEPARATOR)
        # An empty prompt starts at <|endoftext|>, the start of a document: not printed.
        print(" ".join(map(str, row)) if toy else get_tokenizer().decode(row[0 if prompt else 1 :]))
    return 0


def cli(argv: list[str] | None = None) -> int:
    try:
        return main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
