"""Every file a run writes, relative to its run directory, in one place. The trainer, the
instruments, the report and the tests import these names; none spells a path again.
`{rank}`, `{worker}` are filled per rank (worker: rank{R}_dp{d}, with _tp{t} under tensor parallelism).
"""

from pathlib import Path

RUNS_ROOT = Path("runs")  # --out-dir's default parent: runs/<date-time>
LOCK_FILE = ".lock"  # holds the PID of the trainer that owns the run directory
CONFIG_FILE = "config.json"  # the resolved configuration and versions
LOG_FILE = "train.log"  # the console log
METRICS_FILE = "metrics.jsonl"  # one StepRecord per logged step (minigpt/core/runs.py)
STRAGGLERS_FILE = "stragglers.jsonl"  # slow-rank reports (minigpt/instruments/straggler.py)
REPORT_FILE = "report.html"  # the run in one offline page (minigpt/analysis/report.py)
CHECKPOINT_FILE = Path("checkpoints") / "ckpt.pt"  # written atomically (minigpt/core/checkpoint.py)
TENSORBOARD_DIR = "tb"
TRACE_DIR = "traces"  # profiler traces: {worker}.*.pt.trace.json.gz
OPS_FILE = "traces/rank{rank}_ops.txt"  # the profiler's top-operator table
# CUDA memory history; beside each pickle its .txt and its offline page, .html (minigpt.analysis.snapshot)
SNAPSHOT_FILE = "snapshots/rank{rank}_snapshot.pickle"
OOM_SNAPSHOT_FILE = "snapshots/oom_rank{rank}_snapshot.pickle"
MEMORY_TRACE_DIR = "memory_trace/{worker}"  # memory.log and *_sunburst.html (--memory-profiler)
PLOTLY_JS_FILE = "plotly.min.js"  # one copy per run folder, which every page with a chart loads
PSEUDO_FS = (Path("/proc"), Path("/sys"), Path("/dev"))  # the kernel's views: never a place for a run

# The most a reader of a run's files takes (no reader takes more memory than its input's checked
# size). Far above what a real run writes: config.json is a few KiB; metrics.jsonl about 1.5 KiB a
# logged step (a million steps logged every 10: 150 MiB); memory.log a few hundred KiB; a trace of
# a few steps tens of MiB gzipped (traces.TRACE_LIMIT bounds it, decompressed too).
CONFIG_LIMIT = 1 << 20
JSONL_LIMIT = 256 << 20
MEMORY_LOG_LIMIT = 64 << 20
