"""minigpt's trainer beside karpathy/nanoGPT's own train.py: same shape, same machine, same hour.

    git clone https://github.com/karpathy/nanoGPT ../nanoGPT            # once: its files are not shipped
    python benchmarks/nanogpt_shape.py --nanogpt ../nanoGPT             # 3 rounds, fp32 and bf16, small shape
    MINIGPT_NANOGPT_DIR=../nanoGPT python benchmarks/nanogpt_shape.py   # the clone named by the environment
    python benchmarks/nanogpt_shape.py --nanogpt ../nanoGPT --shape tiny --repeats 1 --steps 2 --warmup 1
    python benchmarks/nanogpt_shape.py --nanogpt ../nanoGPT --shape gpt2 --dtypes bf16 --compile \
        --steps 20 --warmup 10 --repeats 2          # on a GPU: "is my speed normal?" on your own card

nanoGPT is not part of this repository and is never imported or copied into it. Its train.py,
model.py and configurator.py (MIT) are read from the clone of karpathy/nanoGPT that --nanogpt names
(default: $MINIGPT_NANOGPT_DIR) and copied at run time into a temporary folder, where its data is
written in its own format: data/minigpt/train.bin and val.bin, uint16 GPT-2 tokens of minigpt's
built-in corpus (minigpt.core.data.builtin_tokens). It runs there as `python train.py --key=value
...` (configurator.py's syntax) with the settings that give minigpt's shape: n_layer, n_head,
n_embd, block_size, batch_size as the shape says, vocabulary 50304 (no meta.pkl: nanoGPT's default),
tied embeddings (always, in nanoGPT), dropout 0, bias=True (minigpt's Linear and LayerNorm layers
have biases), gradient_accumulation_steps=1, compile=False (both sides compiled with --compile),
device=cpu (or cuda: --device, default the trainer's choice; on a GPU nanoGPT runs its fp32 matmuls
in TF32, so minigpt's fp32 rows there take --tf32), an eval_interval beyond the run (only iteration
0 evaluates, with eval_iters=1, and it is a warm-up iteration), always_save_checkpoint False, wandb
off. Its per-iteration lines `iter N: loss X, time Yms, mfu Z%` are parsed; tokens/s is batch_size *
block_size / time. (nanoGPT's mfu is against an A100's 312 TFLOP/s bf16, so on a CPU it is recorded
but not compared.)

bf16 on the CPU: nanoGPT's train.py line 112 reads

    ctx = nullcontext() if device_type == 'cpu' else \
          torch.amp.autocast(device_type=device_type, dtype=ptdtype)        (one line in the file)

so on a CPU it never autocasts, whatever --dtype says (on a GPU it does: there train.py runs
unchanged). For the CPU's bf16 rows that one line is replaced,
in the temporary copy only, by

    ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)

and --dtype=bfloat16 is passed (dtype is a config key, so its line needs no change). That is
nanoGPT's own autocast context, the one it uses on a GPU, now also on the CPU. The fp32 rows run
the file unchanged with --dtype=float32. minigpt runs its preset of the same shape with --no-amp
and --amp (bf16 autocast). Remaining differences, none of which changes a matrix shape: nanoGPT's
MLP uses exact GELU, minigpt's the tanh form; nanoGPT's optimizer groups decay only matrices.

nanoGPT runs as it comes, with glibc's default malloc, while minigpt's trainer tells glibc to keep
freed memory for the next step (train_minimal.keep_freed_memory: mallopt M_MMAP_MAX=0,
M_TRIM_THRESHOLD=2 GiB). So on a CPU nanoGPT also runs a second time under that setting, given
through glibc's environment variables of the same names (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_);
--no-malloc-variant leaves it out: the gap between the two nanoGPT rows is the allocator's, not the
trainer's. Each run is a fresh process; the rounds interleave every
variant, so a drift of the machine spreads over all of them; the table gives each round's figure
(the spread), each row's tokens/s against nanoGPT's in the same dtype with its 95% interval, the
A/A check (the first variant run twice a round; --noisy as in ablation.py) and the load average at
the start and the end. Writes
benchmarks/results/<device>-nanogpt.json and .md (-nanogpt-tiny for --shape tiny), and refuses to
write there when the load at the start is above half the cores: --busy writes anyway, and the
table then says the machine was busy.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import common as bench

from minigpt.config import PRESETS

NANOGPT_FILES = ("train.py", "model.py", "configurator.py", "LICENSE")
NANOGPT_URL = "https://github.com/karpathy/nanoGPT"
CPU_CTX_LINE = (
    "ctx = nullcontext() if device_type == 'cpu' else "
    "torch.amp.autocast(device_type=device_type, dtype=ptdtype)"
)
AUTOCAST_CTX_LINE = "ctx = torch.amp.autocast(device_type=device_type, dtype=ptdtype)"
ITER_LINE = re.compile(r"^iter (\d+): loss ([-\d.naif]+), time ([\d.]+)ms, mfu (-?[\d.]+)%$")
PARAMS_LINE = re.compile(r"^number of parameters: ([\d.]+)M$")


# train_minimal.keep_freed_memory's mallopt (M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB) as glibc's own
# start-up variables, for a process that is not minigpt's.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}
NANOGPT_ENV = "MINIGPT_NANOGPT_DIR"  # a clone of karpathy/nanoGPT, where --nanogpt is not given


# (layers, heads, width, block, batch): the shape of minigpt's preset of the same name.
SHAPES = {
    name: tuple(PRESETS[name][k] for k in ("n_layers", "n_heads", "d_model", "seq_len", "batch_size"))
    for name in ("small", "tiny", "gpt2")
}
DATASET = "minigpt"


def short_env(env: str) -> str:
    """The environment as a table prints it: a preloaded library by its file name (its folder is
    the measuring machine's virtual environment, of no use to a reader)."""
    return re.sub(r"LD_PRELOAD=\S*/", "LD_PRELOAD=.../", env)


def nanogpt_dir(flag: Path | None) -> tuple[Path | None, str]:
    """nanoGPT's clone, and what named it: --nanogpt, else $MINIGPT_NANOGPT_DIR."""
    if flag is not None:
        return flag, "--nanogpt"
    return (Path(os.environ[NANOGPT_ENV]) if os.environ.get(NANOGPT_ENV) else None), f"${NANOGPT_ENV}"


def nanogpt_missing(given: Path | None, named_by: str = "--nanogpt") -> str | None:
    """The one line that says why nanoGPT's files cannot be read, or None when they can."""
    if given is None:
        return (
            "error: this benchmark runs nanoGPT's own train.py, which minigpt does not ship: "
            f"git clone {NANOGPT_URL} and pass --nanogpt DIR (or set ${NANOGPT_ENV})"
        )
    missing = [f for f in NANOGPT_FILES[:3] if not (given / f).is_file()]
    if missing:
        return (
            f"error: {named_by} {given} has no {', '.join(missing)}: name a clone of {NANOGPT_URL} "
            f"(--nanogpt DIR or ${NANOGPT_ENV})"
        )
    return None


def prepare(src: Path, work: Path) -> int:
    """nanoGPT's files and data in `work`; train_bf16.py is train.py with the ctx line patched.
    Returns the line number patched."""
    for name in NANOGPT_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, work / name)
    lines = (work / "train.py").read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == CPU_CTX_LINE]
    if len(hits) != 1:
        raise SystemExit(
            f"error: nanoGPT's train.py in {src} has {len(hits)} lines `{CPU_CTX_LINE}`, expected "
            "one: this script knows a different train.py"
        )
    lines[hits[0]] = AUTOCAST_CTX_LINE + "\n"
    (work / "train_bf16.py").write_text("".join(lines))

    import numpy as np

    from minigpt.core.data import builtin_tokens

    train, val, _ = builtin_tokens()  # the trainer's own split of its built-in corpus
    (work / "data" / DATASET).mkdir(parents=True)
    np.asarray(train).astype(np.uint16).tofile(work / "data" / DATASET / "train.bin")
    np.asarray(val).astype(np.uint16).tofile(work / "data" / DATASET / "val.bin")
    return hits[0] + 1


@dataclass(frozen=True)
class Run:
    """What one variant's process runs: the shape, the steps, the device and torch.compile."""

    shape: str
    warmup: int
    steps: int
    device: str = "cpu"
    compile: bool = False


def run_nanogpt(work: Path, dtype: str, run: Run, keep_freed: bool) -> dict:
    """One fresh nanoGPT process; its measured iterations (after `warmup`, iteration 0 included)."""
    shape, warmup, steps = run.shape, run.warmup, run.steps
    layers, heads, width, block, batch = SHAPES[shape]
    overrides = dict(
        dataset=DATASET,
        device=run.device,
        compile=run.compile,
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        block_size=block,
        batch_size=batch,
        dropout=0.0,
        bias=True,
        gradient_accumulation_steps=1,
        eval_interval=10**9,
        eval_iters=1,
        log_interval=1,
        always_save_checkpoint=False,
        wandb_log=False,
        init_from="scratch",
        max_iters=warmup + steps - 1,
        dtype="bfloat16" if dtype == "bf16" else "float32",
        out_dir=str(work / "out"),
    )
    script = "train_bf16.py" if dtype == "bf16" and run.device == "cpu" else "train.py"  # a GPU autocasts
    cmd = [sys.executable, script, *(f"--{k}={v}" for k, v in overrides.items())]
    env = {**os.environ, **(MALLOC_ENV if keep_freed else {})}
    out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"nanoGPT failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    iters = [m.groups() for m in map(ITER_LINE.match, out.stdout.splitlines()) if m]
    params = [float(m.group(1)) for m in map(PARAMS_LINE.match, out.stdout.splitlines()) if m]
    rows = [
        {"iter": int(i), "loss": float(loss), "time_ms": float(t), "mfu_pct": float(mfu)}
        for i, loss, t, mfu in iters
        if int(i) >= warmup
    ]
    if len(rows) != steps:
        raise RuntimeError(
            f"nanoGPT printed {len(rows)} measured iterations, expected {steps}:\n{out.stdout[-2000:]}"
        )
    return {"rows": rows, "params_m": params[0] if params else None, "command": " ".join(cmd[1:])}


def run_minigpt(dtype: str, run: Run) -> dict:
    flags = ["--preset", run.shape, "--dropout", "0", "--amp" if dtype == "bf16" else "--no-amp"]
    flags += ["--device", run.device] + (["--compile"] if run.compile else [])
    if run.device == "cuda" and dtype == "fp32":  # as nanoGPT's train.py: allow_tf32 = True
        flags.append("--tf32")
    out = bench.run_variant(flags, run.warmup, run.steps)
    return {
        "rows": [
            {"step": r["step"], "loss": r["loss"], "time_ms": 1000 * r["step_time_s"]} for r in out["rows"]
        ],
        "params_m": out["config"]["params"] / 1e6,
        "amp": out["config"]["amp"],
    }


def parser() -> argparse.ArgumentParser:
    p = bench.Parser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--shape", default="small", choices=sorted(SHAPES), help="minigpt preset and nanoGPT shape"
    )
    p.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16 (default both)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-malloc-variant", action="store_true", help="leave out nanoGPT with minigpt's malloc setting"
    )
    p.add_argument(
        "--nanogpt",
        dest="nanogpt_dir",
        type=Path,
        metavar="DIR",
        help=f"a clone of {NANOGPT_URL} (its train.py, model.py, configurator.py); default ${NANOGPT_ENV}",
    )
    p.add_argument(
        "--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto: a GPU where one is visible"
    )
    p.add_argument("--compile", action="store_true", help="add both trainers under torch.compile")
    bench.output_flags(p, "measure nothing: rewrite the .md")
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.render:
        return bench.render(
            p, args.render, lambda d: bench.write_md(args.render.with_suffix(".md"), markdown(d))
        )
    dtypes = args.dtypes.split(",")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda, but no CUDA GPU is visible to PyTorch; use --device cpu")
    if min(args.steps, args.repeats, args.warmup) < 1:
        p.error("--steps, --repeats and --warmup must be at least 1")
    if not dtypes or set(dtypes) - {"fp32", "bf16"}:
        p.error(f"--dtypes takes fp32 and/or bf16, got {args.dtypes!r}")
    given, named_by = nanogpt_dir(args.nanogpt_dir)
    if why := nanogpt_missing(given, named_by):
        print(why, file=sys.stderr)
        return 2
    src = given.resolve()
    bench.check_out_dir(p, args.out_dir)
    load = bench.refuse_if_busy(args.out_dir, args.busy)
    with tempfile.TemporaryDirectory(prefix="minigpt-nanogpt-") as tmp:
        work = Path(tmp)
        patched_line = prepare(src, work)
        runs = measure(variants(work, args, dtypes), args.repeats)
    results = summarise(runs, args.shape)
    meta = {
        **bench.stamp(sys.argv),
        **load,
        "load_end": bench.load_average(),
        "noisy": args.noisy,
        "aa": [aa_of(results)],
        "shape": args.shape,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "nanogpt_dir": str(src),
        "patched_line": patched_line,
        "device": args.device,
        "compile": args.compile,
        "extra_flags": os.environ.get("MINIGPT_ARGS", ""),
        "malloc_env": " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items()),
    }
    data = {"meta": meta, "results": results}
    name = f"{bench.device_slug(meta['machine'])}-nanogpt{'' if args.shape == 'small' else f'-{args.shape}'}"
    return bench.publish(args.out_dir, name, meta, data, markdown(data), "nanogpt_shape.py")


def aa_of(results: dict) -> dict:
    """The A/A check: the first variant against its copy (which leaves the results here)."""
    copy = next(n for n in results if n.endswith(bench.AA))
    base = copy.removesuffix(bench.AA)
    check = bench.aa_check(
        base,
        results[base]["tokens_per_s_rounds"],
        results.pop(copy)["tokens_per_s_rounds"],
        "tokens/s of each round",
    )
    print(f"[A/A] {base} against itself: {bench.ratio_text(check)}", flush=True)
    return check


def against(name: str, results: dict) -> str:
    """A row's tokens/s against nanoGPT's own train.py in the same dtype (and compiled or not), with
    its interval."""
    base = "nanoGPT train.py, " + name.split(", ", 1)[1].replace(", minigpt's malloc", "")
    if name == base or base not in results:
        return "baseline" if name == base else "-"
    return bench.ratio_text(
        bench.ratio(results[base]["tokens_per_s_rounds"], results[name]["tokens_per_s_rounds"])
    )


def variants(work: Path, args, dtypes: list[str]) -> dict:
    """Each variant's name and the call that runs it once, in a fresh process: per dtype nanoGPT,
    nanoGPT under minigpt's malloc (CPU), minigpt; and with --compile both again, compiled."""
    out = {}
    for compiled in (False, True) if args.compile else (False,):
        run = Run(args.shape, args.warmup, args.steps, args.device, compiled)
        for dtype in dtypes:
            tag = f"{dtype}, compiled" if compiled else dtype
            out[f"nanoGPT train.py, {tag}"] = lambda d=dtype, r=run: run_nanogpt(work, d, r, False)
            if not args.no_malloc_variant and args.device == "cpu":
                out[f"nanoGPT train.py, {tag}, minigpt's malloc"] = lambda d=dtype, r=run: run_nanogpt(
                    work, d, r, True
                )
            out[f"minigpt train_minimal.py, {tag}"] = lambda d=dtype, r=run: run_minigpt(d, r)
    return out


def measure(variants: dict, repeats: int) -> dict[str, list[dict]]:
    """Every variant once per round, the rounds interleaved: a drift of the machine spreads over all.
    Each round ends with the first variant's copy, for the A/A check."""
    runs: dict[str, list[dict]] = {name: [] for name in bench.with_aa(list(variants))}
    for r in range(repeats):
        for name in runs:
            print(f"[{name}] round {r + 1}/{repeats}", flush=True)
            runs[name].append(variants[name.removesuffix(bench.AA)]())
    return runs


def summarise(runs: dict[str, list[dict]], shape: str) -> dict:
    """Per variant: each round's median step time, and tokens/s from it."""
    _, _, _, block, batch = SHAPES[shape]
    results = {}
    for name, rs in runs.items():
        medians = [statistics.median(row["time_ms"] for row in run["rows"]) for run in rs]
        results[name] = {
            "step_ms": statistics.median(medians),
            "step_ms_rounds": medians,
            "tokens_per_s": batch * block * 1000 / statistics.median(medians),
            "tokens_per_s_rounds": [batch * block * 1000 / m for m in medians],
            "params_m": rs[0]["params_m"],
            "rounds": rs,
        }
    return results


def markdown(data: dict) -> str:
    meta, results = data["meta"], data["results"]
    layers, heads, width, block, batch = SHAPES[meta["shape"]]
    lines = [
        *bench.header("minigpt beside nanoGPT's own train.py", meta),
        *bench.load_lines(meta),
        *bench.aa_lines(meta),
        f"Shape: {layers} layers, {heads} heads, {width} wide, block {block}, batch {batch}, "
        "vocabulary 50304, "
        "tied embeddings, biases, no dropout, no gradient accumulation"
        + (", torch.compile in the rows that say so" if meta.get("compile") else ", no torch.compile")
        + ("" if meta.get("device", "cpu") == "cpu" else f", on {meta['device']}")
        + ". Each round runs "
        f"every variant in a fresh process; a run's figure is the median of {meta['steps']} steps after "
        f"{meta['warmup']} (nanoGPT's iteration 0, which evaluates, is always a warm-up). nanoGPT's files: "
        f"a clone of {NANOGPT_URL} (`--nanogpt`), copied to a temporary folder at run time.",
        "",
        "| variant | tokens/s (median of rounds) | step ms | each round (tokens/s) | vs nanoGPT, same dtype "
        "| params (M) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rounds = ", ".join(f"{t:,.0f}" for t in r["tokens_per_s_rounds"])
        params = "-" if r["params_m"] is None else f"{r['params_m']:.2f}"
        vs = against(name, results)
        lines.append(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:,.0f} | {rounds} | {vs} | {params} |"
        )
    lines += [
        "",
        "vs nanoGPT: tokens/s against nanoGPT's train.py in the same dtype, from the rounds' figures, with "
        "the 95% interval (minigpt.analysis.stats); an interval that holds 1.0 reads "
        '"no difference within noise".',
        "",
        "Params: nanoGPT prints them without the position embeddings, minigpt's config.json with them.",
        "",
        (
            f"bf16 rows: nanoGPT's train.py line {meta['patched_line']}, "
            f"`{CPU_CTX_LINE}`, never autocasts on a CPU; in the temporary copy it became "
            f"`{AUTOCAST_CTX_LINE}` (nanoGPT's own autocast context, as on a GPU), with --dtype=bfloat16. "
            "The fp32 rows run train.py unchanged with --dtype=float32."
            if meta.get("device", "cpu") == "cpu"
            else "nanoGPT's train.py runs unchanged (on a GPU it autocasts to its --dtype itself)."
        )
        + " minigpt's rows: --no-amp and --amp (bf16)"
        + (", the fp32 ones with --tf32 as nanoGPT's." if meta.get("device", "cpu") == "cuda" else "."),
    ]
    if meta.get("device", "cpu") == "cpu":
        lines += [
            "",
            "\"minigpt's malloc\": nanoGPT under minigpt's CPU malloc setting (the trainer's "
            "keep_freed_memory), through its environment: "
            f"`{short_env(meta.get('malloc_env', 'not recorded'))}`.",
        ]
    if meta["extra_flags"]:
        lines += ["", f"Flags from $MINIGPT_ARGS, applied to the minigpt rows only: `{meta['extra_flags']}`"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
