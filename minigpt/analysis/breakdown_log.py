"""memory.log, the file the memory profiler writes and the report reads: its name and its
neighbours' in memory_trace/rank{R}_dp{R}/, its sections, the tree each category is listed as, the
`layer:` line, and the parser that turns it back into numbers; and the (id, label, parent, bytes)
rows a sunburst chart draws from it. minigpt.instruments.breakdown writes the file from a measured step; the
report reads it back. Standard library only: the analysis tools import it without torch."""

from __future__ import annotations

import calendar
import re
import time
from collections import defaultdict

MiB = MB = 2**20  # memory.log writes "MiB"; InternEvo's logs say "MB" for the same 2^20 bytes

# Every file the memory profiler writes, in <out-dir>/memory_trace/rank{R}_dp{R}/ (InternEvo's names).
MEMORY_LOG = "memory.log"
SUNBURST_FILES = {
    "params": "params_memory_sunburst.html",
    "grads": "grads_memory_sunburst.html",
    "optimizer": "os_memory_sunburst.html",
    "activations": "activation_memory_sunburst.html",
    "peak": "peak_memory_sunburst.html",
    "summary": "summary_sunburst.html",
}
# The root of each category's tree in memory.log, and the section that lists it.
LAYOUT = {
    "params": ("param_mem", "params_layout"),
    "grads": ("grads_mem", "grads_layout"),
    "optimizer": ("os_state_mem", "os_state_layout"),
    "activations": ("activation_mem", "activation_base_layout"),
}
CATEGORIES = tuple(LAYOUT)
# Byte figures of a record's memory_breakdown (and of its "estimate") that the report and TensorBoard show.
MEMORY_BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "activations_peak", "total")
MEMORY_BREAKDOWN_KEYS += ("cuda_max_allocated", "other", "logits", "recompute", "peak")
SUMMARY_DEPTH = 3  # levels under each category in summary_sunburst.html (total > params > blocks > blocks.0)
# The parts of the measured peak, in the order memory.log and the charts list them; they add up to it.
PEAK_PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "held")
PEAK_PART_NAMES = {
    "params": "parameters",
    "grads": "gradients",
    "optimizer": "optimizer state",
    "activations": "saved activations",
    "temporaries": "temporaries of the ops",
    "held": "held from before the step",
}
PEAK_ROOT, PEAK_SECTION = "peak_mem", "peak_layout"  # the measured peak's tree and its section
OWN = "(itself)"  # a node's own bytes beside its children's, drawn as a named slice, not a blank gap


def tree_rows(leaves: dict[str, int], root: str) -> list[tuple[str, int, int, int]]:
    """Depth-first rows (path, depth, own bytes, subtree bytes) for the leaves' paths and every
    prefix of them, under `root`, in the leaves' order (modules in registration order)."""
    own: dict[str, int] = defaultdict(int)
    total: dict[str, int] = defaultdict(int)
    children: dict[str, list[str]] = defaultdict(list)
    total[root] += 0
    for path, nbytes in leaves.items():
        node = root
        total[root] += nbytes
        for part in path.split(".") if path else []:
            child = f"{node}.{part}"
            if child not in total:
                children[node].append(child)
            total[child] += nbytes
            node = child
        own[node] += nbytes
    rows = []

    def walk(node: str, depth: int) -> None:
        rows.append((node, depth, own[node], total[node]))
        for child in children[node]:
            walk(child, depth + 1)

    walk(root, 0)
    return rows


def layer_line(path: str, own: int, total: int) -> str:
    """One node of a layout section: its own and its subtree's bytes, in MiB and exact."""
    return (
        f"layer: {path}, layer_mem: {own / MiB:.2f} MiB, total_mem: {total / MiB:.2f} MiB, "
        f"layer_bytes: {own}, total_bytes: {total}"
    )


# memory.log writes MiB; InternEvo's logs write MB for the same unit: both are read.
# A name may hold commas (a held tensor's shape, "int64[4, 64]"): the path ends at ", layer_mem: ".
_LAYER = re.compile(
    r"^(?P<indent>\s*)layer: (?P<path>.*?), layer_mem: (?P<own>[\d.]+) Mi?B, "
    r"total_mem: (?P<total>[\d.]+) Mi?B"
    r"(?:, layer_bytes: (?P<own_b>\d+), total_bytes: (?P<total_b>\d+))?"
)
_MB_FIELD = re.compile(r"(\w+): (-?[\d.]+) Mi?B\b")


def read_time(text: str) -> float:
    """memory.log's `time:` as a Unix time: minigpt writes "2026-11-28 17:56:39 UTC", InternEvo
    the Unix time itself."""
    try:
        return float(text)
    except ValueError:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%d %H:%M:%S UTC")))


def parse_memory_log(text: str) -> list[dict]:
    """memory.log back into numbers: one dict per `Memory State:` with step, time, summary (bytes;
    exact where the log has a bytes line, else from the MB figures), activation_dtypes (bytes from
    MB), cuda and estimate (bytes from MB, when present) and layouts {section: [rows]}, each row
    {"path", "depth", "layer_bytes", "total_bytes"}. Reads InternEvo's own logs too."""
    states: list[dict] = []
    state: dict = {}
    section = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped == "Memory State:":
            state = {
                "step": None,
                "time": None,
                "summary": {},
                "activation_dtypes": {},
                "cuda": {},
                "estimate": {},
                "layouts": {},
            }
            states.append(state)
            section = None
        elif not stripped or not states or stripped in ("---summary---", "---Layout---"):
            continue
        elif stripped.startswith("step:"):
            value = stripped.split(":", 1)[1].strip()
            state["step"] = None if value == "None" else int(value)
        elif stripped.startswith(("peak_stage:", "peak_where:", "peak_note:")):
            head, rest = stripped.split(":", 1)
            state[head] = rest.strip()
        elif stripped.startswith("time:"):
            state["time"] = read_time(stripped.split(":", 1)[1].strip())
        elif stripped.startswith("bytes:"):
            for item in stripped.split(":", 1)[1].split(","):
                k, v = item.strip().split("=")
                state["summary"][f"{k}_memory"] = int(v)
        elif stripped.startswith(("activation_dtype_memory:", "cuda_memory:", "estimate_memory:")):
            head, rest = stripped.split(":", 1)
            target = {
                "activation_dtype_memory": "activation_dtypes",
                "cuda_memory": "cuda",
                "estimate_memory": "estimate",
            }[head]
            state[target] = {k: round(float(v) * MB) for k, v in _MB_FIELD.findall(rest)}
        elif stripped.endswith("_layout:"):
            section = stripped[:-1]
            state["layouts"][section] = []
        elif (m := _LAYER.match(line)) and section:
            own_b, total_b = m["own_b"], m["total_b"]
            state["layouts"][section].append(
                {
                    "path": m["path"],
                    "depth": len(m["indent"]) // 2 if m["indent"] else m["path"].count("."),
                    "layer_bytes": int(own_b) if own_b else round(float(m["own"]) * MB),
                    "total_bytes": int(total_b) if total_b else round(float(m["total"]) * MB),
                }
            )
        elif section is None:
            for k, v in _MB_FIELD.findall(stripped):
                state["summary"].setdefault(k, round(float(v) * MB))
    return states


def peak_of_state(state: dict) -> dict | None:
    """The measured peak of one parsed memory.log state, for a reader of the run (the report):
    {"peak": bytes, "stage", "where", "parts": {part: {name: bytes}}}, the parts as peak_layout
    lists them (PEAK_PARTS order), which add up to the peak. None when the step's peak was not
    measured (the log then has a peak_note) or the log predates the measured peak."""
    peak = state["summary"].get("peak_memory")
    rows = state["layouts"].get(PEAK_SECTION)
    if peak is None or rows is None:
        return None
    parts: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for row in rows:
        if row["depth"] == 1:
            current = parts.setdefault(row["path"], {})
        elif row["depth"] == 2 and current is not None:
            current[row["path"]] = current.get(row["path"], 0) + row["layer_bytes"]
    return {"peak": peak, "stage": state.get("peak_stage"), "where": state.get("peak_where"), "parts": parts}


def category_leaves(state: dict) -> dict[str, dict[str, int]]:
    """Each category's own bytes per path, {category: {path under its root: bytes}}, read back
    from a parsed memory.log state's layouts: what the breakdown's dicts held."""
    out: dict[str, dict[str, int]] = {}
    for category, (root, section) in LAYOUT.items():
        leaves = out[category] = {}
        for row in state["layouts"].get(section, []):
            if row["layer_bytes"] > 0 and row["path"] != root:
                leaves[row["path"].removeprefix(root + ".")] = row["layer_bytes"]
    return out


def category_rows(
    leaves: dict[str, int], category: str, max_depth: int | None = None, parent: str = ""
) -> list[tuple[str, str, str, int]]:
    """(id, label, parent, bytes) rows of one category's tree (leaves: a MemoryBreakdown's dict of
    that category); ids are memory.log's paths. A node that holds bytes itself and has children
    gets a child "<name> (itself)" for its own bytes, so that no part of a ring is left unnamed."""
    root = LAYOUT[category][0]
    tree = [r for r in tree_rows(leaves, root) if max_depth is None or r[1] <= max_depth]
    has_children = {path.rsplit(".", 1)[0] for path, depth, _, _ in tree if depth}
    rows = []
    for path, depth, own, total in tree:
        parts = path.split(".")
        label = ".".join(parts[-2:]) if parts[-1].isdigit() else parts[-1]  # "blocks.0", not "0"
        rows.append((path, label, ".".join(parts[:-1]) if depth else parent, total))
        if own and path in has_children and (max_depth is None or depth < max_depth):
            rows.append((f"{path} {OWN}", f"{label} {OWN}", path, own))
    return rows


def peak_rows(
    parts: dict[str, dict[str, int]], parent: str = "", label: str = "peak"
) -> list[tuple[str, str, str, int]]:
    """(id, label, parent, bytes) rows of the measured peak: the peak > its parts > their names.
    A node's value is the sum of its drawn children (plotly's branchvalues="total" refuses a parent
    smaller than its children): only positive names are drawn, so on CUDA a negative "(not seen by
    the profiler)" correction leaves the chart, and the root is then the drawn bytes, not the peak.
    With no negative name the root is the measured peak, since the parts add up to it."""
    body: list[tuple[str, str, str, int]] = []
    for part in [p for p in PEAK_PARTS if p in parts] + [p for p in parts if p not in PEAK_PARTS]:
        items = [(name, nbytes) for name, nbytes in parts[part].items() if nbytes > 0]
        if not items:
            continue
        pid = f"{PEAK_ROOT}/{part}"
        body.append((pid, PEAK_PART_NAMES.get(part, part), PEAK_ROOT, sum(v for _, v in items)))
        body += [(f"{pid}/{name}", name, pid, nbytes) for name, nbytes in items]
    return [(PEAK_ROOT, label, parent, sum(r[3] for r in body if r[2] == PEAK_ROOT))] + body


def sunburst(rows: list[tuple[str, str, str, int]], **style):
    """A plotly Sunburst of (id, label, parent, bytes) rows, MiB in its customdata: a parent's
    value is its subtree's (branchvalues="total"), so no parent is inflated. `style`: the
    templates of the page it goes on."""
    import plotly.graph_objects as go  # imported when a chart is drawn, never by the trainer

    return go.Sunburst(
        ids=[r[0] for r in rows],
        labels=[r[1] for r in rows],
        parents=[r[2] for r in rows],
        values=[r[3] for r in rows],
        customdata=[r[3] / MiB for r in rows],
        branchvalues="total",
        **style,
    )
