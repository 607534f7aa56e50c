"""Property: whatever values a user types for the flags, the trainer ends in exit 0, or in exit 2
with one line on stderr; never a traceback; and nothing outside the run directory changes.

Each example is a tiny toy (or tiny text) run of 1-2 steps plus 1-3 flags with generated values:
small valid-looking ones, edge values, NaN, inf, negatives, numbers too large for any machine, and
strings. The generators are derived from TrainConfig's fields, so a new flag is covered the day it
is added. Where a valid value would make a run long (a million steps, a ten-minute sleep), the
generator keeps valid values small and leaves the huge ones to those the checks must refuse; those
flags are listed in BOUNDED. --compile is left out: compiling takes a minute on this CPU and is not
an input-checking path. Flags that need CUDA or torchrun refuse here (exit 2), as they should.

A diverged loss (e.g. --lr 1e300) ends by design in exit 1 with one line (NonFiniteLoss in
train_minimal.py): that too is a clean end, and is accepted.

The examples are the same on every run (derandomized), so the suite is not flaky. To explore:
MINIGPT_PROPERTY_RANDOM=1 MINIGPT_PROPERTY_EXAMPLES=500 pytest tests/test_property_cli.py
"""

import dataclasses
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from conftest import TINY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import train_minimal
from minigpt import config
from minigpt.config import RUNS_ROOT, TrainConfig, UsageError

OUT = "run"  # the run directory, relative to each example's working directory
CORPUS = "corpus.txt"  # a small text file in each example's working directory
# --peak-tflops: no GEMM timed per run for the MFU denominator (6 s on this CPU in fp32, and
# minutes in --amp's emulated bf16).
TOY_BASE = [*TINY, "--peak-tflops", "1"]
TEXT_BASE = [a for a in TINY if a != "--use-toy-data"] + ["--peak-tflops", "1", "--train-data", CORPUS]

# Printable text without control characters: an argument holding a newline could make any message
# two lines, and no user types one.
TEXT = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=12)
WORDS = st.sampled_from(["", "abc", "nan", "inf", "-inf", "1e1", "1.5", "-1", "0x10", "1_000", "none", "all"])
HUGE_INTS = [2**31 - 1, 2**32, 2**63 - 1, 2**63, 10**13, 10**30, -(2**63), -1, 0]
HUGE_FLOATS = [0.0, -0.0, -1.0, 1e-320, 1e-12, 1e300, 1e308, -1e308]


def ints(lo: int, hi: int, huge: list[int] = HUGE_INTS) -> st.SearchStrategy[str]:
    return st.one_of(st.integers(lo, hi).map(str), st.sampled_from(huge).map(str), WORDS, TEXT)


def floats() -> st.SearchStrategy[str]:
    return st.one_of(
        st.floats(0, 2).map(repr),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.sampled_from(HUGE_FLOATS).map(repr),
        WORDS,
        TEXT,
    )


def paths(kind: str) -> st.SearchStrategy[str]:
    """Inside the run directory, or places that cannot work: /proc, under a file, a directory."""
    inside = {
        "checkpoint_path": f"{OUT}/ck/ckpt.pt",
        "memory_snapshot_path": f"{OUT}/snap.pickle",
        "out_dir": f"{OUT}/inner",
    }[kind]
    return st.sampled_from([inside, "/proc/minigpt/x", f"{CORPUS}/x", ".", "", OUT])


# Flags whose valid values are kept small (a huge valid value means a long run, not a bad input);
# their out-of-range values stay in: beyond 64 bits, negative, zero, text.
BOUNDED = {
    "num_steps": ints(-1, 3, huge=[2**63, 10**30, -1, 0]),
    "eval_iters": ints(-1, 3, huge=[2**63, 10**30, -1, 0]),
    "grad_accum_steps": ints(-1, 3, huge=[2**63, 10**30, -1, 0]),
    "simulate_slow_rank": st.one_of(
        st.sampled_from(
            [
                "0:1",
                "0:2:forward",
                "0:1:backward",
                "1:5",
                "0:0",
                "0:-5",
                "0:nan",
                "0:inf",
                "a:b",
                "0:5:lunch",
                "0",
            ]
        ),
        TEXT,
    ),
    "tokenizer_name": st.one_of(st.just("gpt2"), TEXT.map(lambda s: "nosuch" + s)),  # others download
    "train_data": st.sampled_from([CORPUS, "missing.txt", "", ".", "/dev/null"]),
    "val_data": st.sampled_from([CORPUS, "missing.txt", "", ".", "/dev/null"]),
    "profile_ranks": st.one_of(st.sampled_from(["0", "all", "0,1", "-1", "1", " ", "0,,1"]), TEXT),
    "checkpoint_path": paths("checkpoint_path"),
    "memory_snapshot_path": paths("memory_snapshot_path"),
    "out_dir": paths("out_dir"),
}
LEFT_OUT = {"compile"}  # a minute of compiling per example on this CPU

# Values this test found ending in a traceback, in code this file's author does not own; each is fixed
# on another branch (issue 14). Remove an entry when its fix is merged: the test then covers it.


def values(f: dataclasses.Field) -> st.SearchStrategy[list[str]]:
    """The arguments that give field f a generated value."""
    name, kind, meta = config.flag_name(f.name), config.KINDS[f.name], f.metadata
    if meta.get("action") in ("store_true", "store_false"):
        return st.just([name])
    if meta.get("action") not in (None, "extend"):  # BooleanOptionalAction
        return st.sampled_from([[name], ["--no-" + name[2:]]])
    if f.name in BOUNDED:
        strategy = BOUNDED[f.name]
    elif meta.get("choices"):
        strategy = st.one_of(st.sampled_from(meta["choices"]), TEXT)
    elif kind is int:
        strategy = ints(-2, 9)
    elif kind is float:
        strategy = floats()
    else:
        strategy = TEXT
    # --flag=value, so a value that starts with '-' is a value, not a flag
    return strategy.map(lambda v: [f"{name}={v}"])


FLAGS = {f.name: values(f) for f in dataclasses.fields(TrainConfig) if f.name not in LEFT_OUT}


@st.composite
def command_lines(draw) -> list[str]:
    base = draw(st.sampled_from([TOY_BASE, TEXT_BASE]))
    steps = draw(st.sampled_from(["1", "2"]))
    chosen = draw(st.lists(st.sampled_from(sorted(FLAGS)), min_size=1, max_size=3, unique=True))
    extra = [arg for name in chosen for arg in draw(FLAGS[name])]
    return [*base, "--num-steps", steps, "--out-dir", OUT, *extra]


def snapshot(root: Path, skip: set[Path] = frozenset()) -> dict[str, str]:
    """Every file and folder under root (but the skipped ones) with a digest of its content."""
    seen = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if (here / d).resolve() not in skip]
        for d in dirnames:
            seen[str((here / d).relative_to(root)) + "/"] = "dir"
        for name in filenames:
            path = here / name
            if path.resolve() in skip:
                continue
            seen[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return seen


def run_directories(args: list[str], cwd: Path) -> set[Path]:
    """The run directory: the last --out-dir wins; an empty one means the default, runs/<date-time>.
    A relative one's first folder with it: the run makes the folders above its own (run/inner)."""
    out = OUT
    for arg in args:
        if arg.startswith("--out-dir="):
            out = arg.split("=", 1)[1] or str(RUNS_ROOT)
    parts = Path(out).parts
    top = parts[0] if parts and not Path(out).is_absolute() and parts[0] != ".." else out
    return {(cwd / out).resolve(), (cwd / top).resolve()}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("property")
    (root / CORPUS).write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return root


RUN_EXAMPLES = int(os.environ.get("MINIGPT_PROPERTY_EXAMPLES", 60))


@settings(
    max_examples=RUN_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=not os.environ.get("MINIGPT_PROPERTY_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(args=command_lines())
def test_any_flag_values_end_cleanly(capsys, workspace, args):
    cwd = Path(tempfile.mkdtemp(dir=workspace))
    shutil.copy(workspace / CORPUS, cwd / CORPUS)
    cache = Path(os.environ["MINIGPT_CACHE_DIR"])
    runs = run_directories(args, cwd)
    before, cache_before = snapshot(cwd, skip=runs), snapshot(cache)
    if os.environ.get("MINIGPT_PROPERTY_LOG"):
        with open(os.environ["MINIGPT_PROPERTY_LOG"], "a") as log:
            print(args[len(TINY) :], file=log, flush=True)
    old_cwd, t0 = os.getcwd(), time.perf_counter()
    os.chdir(cwd)
    try:
        try:
            status = train_minimal.cli(list(args))
        except SystemExit as e:  # argparse's own errors and --help
            status = e.code
    finally:
        os.chdir(old_cwd)
    err = capsys.readouterr().err
    if os.environ.get("MINIGPT_PROPERTY_LOG"):
        with open(os.environ["MINIGPT_PROPERTY_LOG"], "a") as log:
            print(f"  -> {status} in {time.perf_counter() - t0:.2f} s: {err.strip()[-200:]}", file=log)
    lines = err.strip().splitlines()
    assert "Traceback" not in err, (args, err)
    if status == 2:
        assert len(lines) == 1, (args, err)
    elif status == 1:
        assert len(lines) == 1 and "loss" in err, (args, err)  # a diverged run: NonFiniteLoss
    else:
        assert status == 0, (args, status, err)
    assert snapshot(cwd, skip=runs) == before, args
    cache_after = snapshot(cache)
    # The token cache may gain a file (it is a cache); what it held stays as it was.
    assert {k: cache_after.get(k) for k in cache_before} == cache_before, args
    shutil.rmtree(cwd, ignore_errors=True)


# ---------------------------------------------------------------------------- every trainer flag, parse only

QUICK = dict(  # the hypothesis settings of the parse-only and the tools' tests
    deadline=None,
    database=None,
    derandomize=not os.environ.get("MINIGPT_PROPERTY_RANDOM"),
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Values a hostile user types: edges, non-numbers, huge, NUL, empty, whitespace.
HOSTILE_TEXT = st.sampled_from(
    ["", " ", "\0", "nan", "-nan", "inf", "-inf", "1e99", "-1e99", "1e308", "1e-320", "0", "-0", "-1",
     "2**63", "9" * 30, "0x10", "1_000", "None", "null", "all", "0,,1", "a:b", "0:1e99", "../..", "/dev/zero",
     "\u00e9", "1e18", "1e9", "65537", "-9223372036854775809", "1.5", "true"]
)  # fmt: skip
ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\n\r"), max_size=20)


def hostile_values(f) -> st.SearchStrategy[list[str]]:
    name, meta = config.flag_name(f.name), f.metadata
    if meta.get("action") in ("store_true", "store_false"):
        return st.sampled_from([[name], [f"{name}=x"]])
    if meta.get("action") not in (None, "extend"):  # BooleanOptionalAction
        return st.sampled_from([[name], ["--no-" + name[2:]], [f"{name}=1"]])
    return st.one_of(HOSTILE_TEXT, ANY_TEXT, st.integers().map(str), st.floats().map(repr)).map(
        lambda v: [f"{name}={v}"]
    )


HOSTILE_FLAGS = {f.name: hostile_values(f) for f in config.fields(TrainConfig)}
PARSE_EXAMPLES = int(os.environ.get("MINIGPT_HOSTILE_EXAMPLES", 400))


@settings(max_examples=PARSE_EXAMPLES, **QUICK)
@given(
    chosen=st.lists(st.sampled_from(sorted(HOSTILE_FLAGS)), min_size=1, max_size=3, unique=True),
    data_=st.data(),
)
def test_every_trainer_flag_with_hostile_values_parses_or_is_one_line(capsys, chosen, data_):
    """Parse only, in-process: a valid TrainConfig, or exit 2 with one line. What a parsed value
    does in a run is test_property_cli's (slow) business; here every flag meets every kind of
    hostile value quickly."""
    args = [a for name in chosen for a in data_.draw(HOSTILE_FLAGS[name])]
    try:
        cfg = config.parse_args(args)
    except UsageError as e:
        assert "\n" not in str(e) and str(e), (args, e)
        return
    except SystemExit as e:
        err = capsys.readouterr().err.strip()
        assert e.code in (0, 2), (args, e.code)
        assert e.code == 0 or len(err.splitlines()) == 1, (args, err)
        return
    # Accepted: then within the bounds a run can survive.
    assert cfg.grad_accum_steps <= config.INNER and cfg.eval_iters <= config.INNER
    assert cfg.out_dir is None or cfg.out_dir.strip()
    assert cfg.checkpoint_path is None or cfg.checkpoint_path.strip()


# ---------------------------------------------------------------------------- the tools and sample.py
# Their flags are read off their own --help, so a new flag is covered the day it is added. Values:
# the hostile strings above; positional arguments: a real run, a run with a damaged config.json,
# a FIFO, /dev/zero, a missing path, a plain file, a folder that is not a run.

# sample.py findings in code this file's author does not own (issue 23; for sample.py's owner):
# --num-samples 100000000000 ends in a MemoryError traceback, and --max-new-tokens 99999999999
# or --temperature 1e308 run for minutes with no output. Until they are bounded, these two flags
# get hostile values that are not huge counts.
SAMPLE_SMALL = {"--max-new-tokens", "--num-samples"}
SMALL_TEXT = st.sampled_from(["", " ", "0", "-1", "x", "nan", "1.5", "1", "2", "\0", "1e3"])
TOOL_EXAMPLES = int(os.environ.get("MINIGPT_TOOL_EXAMPLES", 100))


def tool_flags(main) -> list[str]:
    import contextlib
    import io
    import re

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        try:
            main(["--help"])
        except SystemExit:
            pass
    return sorted(set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text.getvalue())) - {"--help"})


@pytest.fixture(scope="module")
def tool_places(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tools")
    run = root / "run"
    assert train_minimal.cli([*TOY_BASE, "--num-steps", "2", "--no-report", "--out-dir", str(run)]) == 0
    bad = root / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"world_size": NaN, "model": "x"}')
    os.mkfifo(root / "fifo")
    (root / "file.txt").write_text("hello")
    (root / "folder").mkdir()
    places = {"run": run, "bad": bad, "fifo": root / "fifo", "zero": "/dev/zero", "missing": root / "nope"}
    places |= {"file": root / "file.txt", "folder": root / "folder"}
    return {k: str(v) for k, v in places.items()}


def tool_command(draw, places: dict[str, str]) -> tuple[str, list[str]]:
    import sample
    from minigpt.analysis import compare, report, traces

    tools = {
        "report": (report.main, 1),
        "compare": (compare.main, 2),
        "traces": (traces.main, 1),
        "sample": (sample.cli, 0),
    }
    name = draw(st.sampled_from(sorted(tools)))
    main, positionals = tools[name]
    place = st.sampled_from(sorted(places.values()))
    args = [draw(place) for _ in range(positionals)]
    if name == "sample":
        args += ["--out-dir", draw(place)]
    flags = tool_flags(sample.parse_args if name == "sample" else main)
    for flag in draw(st.lists(st.sampled_from(flags), max_size=3, unique=True)):
        value = SMALL_TEXT if name == "sample" and flag in SAMPLE_SMALL else st.one_of(HOSTILE_TEXT, place)
        args.append(f"{flag}={draw(value)}")
    return name, args


@settings(max_examples=TOOL_EXAMPLES, **QUICK)
@given(data_=st.data())
def test_tools_and_sample_with_hostile_arguments_end_cleanly(capsys, tmp_path_factory, tool_places, data_):
    """Every flag of report, compare, traces and sample.py, in-process, in a scratch folder (their
    outputs may be written to generated names): exit 0, or 2 with one line; never a traceback."""
    import sample
    from minigpt.analysis import compare, report, traces

    mains = {"report": report.main, "compare": compare.main, "traces": traces.main, "sample": sample.cli}
    name, args = tool_command(data_.draw, tool_places)
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("scratch"))
    try:
        try:
            status = mains[name](args)
        except SystemExit as e:
            status = e.code
    finally:
        os.chdir(old)
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, (name, args, err)
    assert status in (0, 2), (name, args, status, err)
    assert status == 0 or len(err.splitlines()) == 1, (name, args, err)
