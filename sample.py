"""
Text from a trained minigpt checkpoint.

    python sample.py                                         # the newest run in runs/ that has a checkpoint
    python sample.py --out-dir runs/RUN                      # that run's checkpoints/ckpt.pt
    python sample.py --checkpoint runs/RUN/checkpoints/ckpt.pt --prompt "The list type"
    python sample.py --out-dir runs/RUN --prompt FILE:prompt.txt --num-samples 5 --max-new-tokens 100
    python sample.py --out-dir runs/RUN --temperature 0.6 --top-k 40 --seed 7
    python sample.py --out-dir runs/RUN --top-k 1            # greedy: the likeliest token every time
    python sample.py --out-dir runs/TOY --prompt "3 5 7"     # a --use-toy-data run: token ids in and out
    python sample.py --init-from gpt2 --prompt "Hello"       # a Hugging Face GPT-2 folder, such as OpenAI's:
    hf download openai-community/gpt2 config.json model.safetensors --local-dir gpt2   # once, online

The checkpoint is read as data (weights_only); the model is rebuilt from the shape it records, so
no training flags are needed. A GPT-2 folder (config.json and model.safetensors) is read as
train_minimal.py --init-from reads it. Runs on real text decode with the run's tokenizer (GPT-2's,
offline); --use-toy-data runs have no text, so their prompt and output are token ids. Decoding
keeps each layer's keys and values (a KV cache): the prompt is run once, then each new token costs
one position, not the whole context again (once the context is full, the cropped window runs
again: its learned positions shift). The samples go to stdout, one at a time as each is
drawn; what it is doing (the checkpoint loaded, sample i of n) goes to stderr, with a progress bar
over the new tokens on a terminal.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

if __name__ == "__main__":
    from minigpt.config import exit_on_ctrl_c

    exit_on_ctrl_c("sample.py")  # a Ctrl-C while torch imports: one line, status 130

import torch

from minigpt.config import CHECKPOINT_FILE, INTERRUPTED, INTERRUPTED_LINE, RUNS_ROOT, UsageError, imports_done
from minigpt.core.checkpoint import latest_run
from minigpt.core.gpt2 import load_folder
from minigpt.core.progress import Progress, progress_enabled
from minigpt.core.sample import Draw, generate, load_model, utf8_text, vocab_in_use
from minigpt.core.tokens import encoding
from minigpt.fileio import UnreadableFile, check_names, file_kind, format_bytes, path_arg, read_bounded

FILE_PREFIX = "FILE:"  # --prompt FILE:path reads the prompt from a file
PROMPT_LIMIT = 1 << 20  # bytes: far more text than any model's context, which crops the prompt anyway
TOY_PROMPT = "0 2 4 6"  # a toy run's task is arithmetic sequences: the stride is in the prompt
SEPARATOR = "-" * 40
# Below this the draw is greedy to float precision, and far below it logits / temperature
# overflows to inf (softmax then returns NaN): --top-k 1 asks for greedy decoding exactly.
MIN_TEMPERATURE = 1e-3
# One command's output: each new token is a forward pass (of one position, with the KV cache), so
# 10^14 tokens would never finish.
MAX_SAMPLES, MAX_NEW_TOKENS = 10_000, 100_000
# Without a terminal's bar (stderr to a pipe or a log file), a line this often while a sample is
# drawn: 100,000 tokens take minutes on a CPU, and minutes of silence look like a hang.
PULSE_S = 10.0


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not a usage block
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every default in --help, and the docstring's commands as written. A default of None or ""
    is not printed: those flags' help says in words what happens without them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, ""):
            return action.help or ""
        return super()._get_help_string(action)


def log(message: str) -> None:
    """What the script is doing, on stderr: stdout holds only the samples."""
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="sample.py", description=__doc__, formatter_class=HelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--out-dir",
        type=path_arg,
        help=f"a run directory: its {CHECKPOINT_FILE} "
        f"(default: the run in {RUNS_ROOT}/ whose checkpoint is newest)",
    )
    where.add_argument("--checkpoint", type=path_arg, help="a checkpoint file")
    where.add_argument(
        "--init-from",
        type=path_arg,
        metavar="DIR",
        help="a Hugging Face GPT-2 folder (config.json and model.safetensors), as for train_minimal.py",
    )
    p.add_argument(
        "--prompt",
        default="",
        help=f"the text to continue, or {FILE_PREFIX}path to read it "
        "from a file (default: the start of a document; toy runs: token ids, "
        f"default {TOY_PROMPT!r})".replace("%", "%%"),
    )
    p.add_argument("--num-samples", type=int, default=3, help="how many samples to draw")
    p.add_argument(
        "--max-new-tokens", type=int, default=200, help="tokens to draw after the prompt, per sample"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="below 1: safer text; above 1: wilder")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest tokens (1: greedy)")
    p.add_argument("--seed", type=int, default=1337, help="the same seed draws the same samples")
    p.add_argument(
        "--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when there is one"
    )
    # fp32 by default: on a CPU without native bf16, bf16 autocast is emulated and slower.
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16"],
        help="bf16: autocast, fast on a GPU; on a CPU without native bf16 it is emulated and slower",
    )
    args = p.parse_args(argv)
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise UsageError(f"--temperature {args.temperature}: give a positive finite number, such as 0.8")
    if args.temperature < MIN_TEMPERATURE:
        raise UsageError(
            f"--temperature {args.temperature}: give at least {MIN_TEMPERATURE:g}; "
            "for the likeliest token every time use --top-k 1"
        )
    if args.top_k < 1:
        raise UsageError(f"--top-k {args.top_k}: give at least 1 (1 is greedy decoding)")
    if args.num_samples < 1 or args.max_new_tokens < 0:
        raise UsageError("--num-samples must be at least 1 and --max-new-tokens at least 0")
    if args.num_samples > MAX_SAMPLES or args.max_new_tokens > MAX_NEW_TOKENS:
        raise UsageError(
            f"--num-samples {args.num_samples}, --max-new-tokens {args.max_new_tokens}: give at most "
            f"{MAX_SAMPLES:,} samples of at most {MAX_NEW_TOKENS:,} tokens"
        )
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed {args.seed}: give a number in [0, 2^32)")
    return args


# What a refusal of a checkpoint offers besides an earlier one: sample.py's own flags, not the trainer's.
INSTEAD = "give another to --checkpoint (or a run folder to --out-dir)"


def checkpoint_path(args: argparse.Namespace) -> Path:
    check_names((args.checkpoint, "--checkpoint"), (args.out_dir, "--out-dir"))
    if args.checkpoint:
        if args.checkpoint.is_dir():
            fix = (
                f"pass it as --out-dir {args.checkpoint}"
                if (args.checkpoint / CHECKPOINT_FILE).is_file()
                else f"give a checkpoint file (a run's {CHECKPOINT_FILE}), or a run folder to --out-dir"
            )
            raise UsageError(f"--checkpoint {args.checkpoint} is a folder, not a checkpoint file; {fix}")
        if not args.checkpoint.exists():
            raise UsageError(
                f"--checkpoint {args.checkpoint}: no such file; give a checkpoint file (a run's "
                f"{CHECKPOINT_FILE}), or a run folder to --out-dir"
            )
        # a FIFO would block, /dev/zero never ends
        if not stat.S_ISREG(mode := args.checkpoint.stat().st_mode):
            raise UsageError(
                f"--checkpoint {args.checkpoint} is {file_kind(mode)}, not a checkpoint file; give a "
                f"checkpoint file (a run's {CHECKPOINT_FILE}), or a run folder to --out-dir"
            )
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
    run = latest_run(RUNS_ROOT, CHECKPOINT_FILE, "sample.py", "--checkpoint", "to sample from")
    print(f"sampling from {run}, the run with the newest checkpoint", file=sys.stderr)
    return run / CHECKPOINT_FILE


def read_prompt(prompt: str) -> str:
    """The prompt, or with FILE:path the text of that file: a regular file of at most PROMPT_LIMIT
    bytes (a FIFO would block, /dev/zero would never end)."""
    if not prompt.startswith(FILE_PREFIX):
        return prompt
    path = Path(prompt[len(FILE_PREFIX) :])
    try:
        path.stat()
        return read_bounded(path, PROMPT_LIMIT).decode("utf-8")
    except OSError as e:
        raise UsageError(f"--prompt {prompt}: cannot read {path} ({e.strerror})") from None
    except UnicodeDecodeError:
        raise UsageError(f"--prompt {prompt}: cannot read {path} (not UTF-8 text)") from None
    except UnreadableFile as e:
        raise UsageError(
            f"--prompt {prompt}: {e}; give a regular text file of at most {format_bytes(PROMPT_LIMIT)}"
        ) from None


def resolve_device(device: str) -> str:
    """--device: auto is cuda where a GPU is visible; cuda without one is one line."""
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    return "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"


def encode(prompt: str, toy: bool, vocab: int | None, enc=None) -> list[int]:
    """Token ids of the prompt: the ids of the text (`enc`: the run's tokenizer, GPT-2's by
    default), or a toy run's ids as written."""
    if toy:
        try:
            ids = [int(t) for t in (prompt or TOY_PROMPT).replace(",", " ").split()]
        except ValueError:
            raise UsageError(
                f"--prompt {prompt!r}: a --use-toy-data run takes token ids, such as {TOY_PROMPT!r}"
            ) from None
    else:
        enc = enc or encoding("gpt2")
        ids = enc.encode_ordinary(prompt) if prompt else [enc.eot_token]  # a document's start
    bad = [i for i in ids if not 0 <= i < (vocab or 2**63)]
    if bad:
        raise UsageError(f"--prompt holds token ids {bad[:5]} outside this model's vocabulary of {vocab}")
    if not ids:
        raise UsageError("--prompt is empty after tokenising; give some text")
    return ids


def sample_text(row: list[int], toy: bool, from_document_start: bool, enc=None) -> str:
    """What a sample prints: a toy run's token ids, or the text of the tokens decoded all at once
    (utf8_text: no U+FFFD for a character whose bytes are split over tokens). A sample that
    starts a document starts at <|endoftext|>, which is not printed."""
    if toy:
        return " ".join(map(str, row))
    enc = enc or encoding("gpt2")
    return utf8_text(enc.decode_bytes(row[1 if from_document_start else 0 :]))


def pulse(bar: Progress, total: int, desc: str) -> Callable[[], None]:
    """What to call after each new token: the bar's update on a terminal; elsewhere a line on
    stderr every PULSE_S seconds saying how far the sample is and how long the rest will take."""
    if bar.enabled:
        return bar.update
    start = last = time.monotonic()
    done = 0

    def tick() -> None:
        nonlocal done, last
        done += 1
        now = time.monotonic()
        if now - last >= PULSE_S and done < total:
            last, rate = now, done / max(now - start, 1e-9)
            left = (total - done) / rate
            log(f"{desc}: {done:,} of {total:,} tokens, {rate:,.1f} tokens/s, about {left:,.0f} s left")

    return tick


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    # Nothing on stderr before the inputs are checked (the checkpoint, the prompt against its
    # vocabulary): a mistake is then the only line there. Loading takes seconds; sampling, minutes.
    if args.init_from is not None:
        check_names((args.init_from, "--init-from"))
        path = args.init_from
        model, train_cfg = load_folder(path, device)
    else:
        path = checkpoint_path(args)
        model, train_cfg = load_model(path, device, INSTEAD)
    toy = bool(train_cfg.get("use_toy_data"))
    enc = None if toy else encoding(train_cfg.get("tokenizer_name", "gpt2"))  # the run's own
    vocab = vocab_in_use(train_cfg, enc and enc.n_vocab, model.cfg.vocab_size, path)
    prompt = read_prompt(args.prompt)
    ids = encode(prompt, toy, vocab, enc)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext()
    idx = torch.tensor([ids], dtype=torch.long, device=device)
    params = sum(p.numel() for p in model.parameters())
    log(
        f"loaded {path} ({params / 1e6:.1f}M parameters) on {device}; drawing {args.num_samples} "
        f"sample(s) of {args.max_new_tokens} tokens after a {len(ids)}-token prompt"
    )
    # One sample at a time: each is printed as soon as it is drawn, not after all of them.
    for i in range(args.num_samples):
        log(f"generating sample {i + 1} of {args.num_samples}")
        with Progress(args.max_new_tokens, progress_enabled(), desc=f"sample {i + 1}", unit="tok") as bar:
            with autocast:
                out = generate(
                    model,
                    idx,
                    args.max_new_tokens,
                    Draw(args.temperature, args.top_k, vocab),
                    generator,
                    pulse(bar, args.max_new_tokens, f"sample {i + 1}"),
                )
        text = sample_text(out[0].tolist(), toy, from_document_start=not prompt, enc=enc)
        try:
            print(f"{SEPARATOR}\n{text}" if i else text, flush=True)
        except OSError as e:  # a pipe closed early (| head), a full disk (> /dev/full)
            raise DeadOutput(e) from None
    return 0


class DeadOutput(Exception):
    """stdout cannot take the samples (its OSError in args[0])."""


def drop_stdout() -> None:
    """stdout onto /dev/null, so what is still buffered for it goes nowhere at exit, quietly."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, AttributeError, ValueError):  # no stdout at all, or not a file descriptor
        pass


def cli(argv: list[str] | None = None) -> int:
    try:
        return main(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: {INTERRUPTED_LINE}", file=sys.stderr)
        return INTERRUPTED
    except DeadOutput as e:  # the reader of a pipe had what it wanted: quiet; else one line
        drop_stdout()
        if isinstance(error := e.args[0], BrokenPipeError):
            return 0
        line = f"error: the samples cannot be written to stdout ({error.strerror}); redirect it"
        print(line, file=sys.stderr)
        return 1


if __name__ == "__main__":
    imports_done()  # a Ctrl-C from here on is KeyboardInterrupt (cli() says it in one line)
    sys.exit(cli())
