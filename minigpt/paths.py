"""Every file a run writes, relative to its run directory, in one place. The trainer, the
instruments, the report and the tests import these names; none spells a path again.
`{rank}`, `{worker}` are filled per rank (worker: rank{R}_dp{d}, with _tp{t} under tensor parallelism).
"""

from pathlib import Path

RUNS_ROOT = Path("runs")  # --out-dir's default parent: runs/<date-time>
CONFIG_FILE = "config.json"  # the resolved configuration and versions
LOG_FILE = "train.log"  # the console log
METRICS_FILE = "metrics.jsonl"  # one StepRecord per logged step (minigpt/metrics.py)
STRAGGLERS_FILE = "stragglers.jsonl"  # slow-rank reports (minigpt/straggler.py)
REPORT_FILE = "report.html"  # the run in one offline page (minigpt/report.py)
CHECKPOINT_FILE = Path("checkpoints") / "ckpt.pt"  # written atomically (minigpt/checkpoint.py)
TENSORBOARD_DIR = "tb"
TRACE_DIR = "traces"  # profiler traces: {worker}.*.pt.trace.json.gz
OPS_FILE = "traces/rank{rank}_ops.txt"  # the profiler's top-operator table
SNAPSHOT_FILE = "snapshots/rank{rank}_snapshot.pickle"  # CUDA memory history (pytorch.org/memory_viz)
OOM_SNAPSHOT_FILE = "snapshots/oom_rank{rank}_snapshot.pickle"
MEMORY_TRACE_DIR = "memory_trace/{worker}"  # memory.log and *_sunburst.html (--memory-profiler)
