"""Open a run in TensorBoard's PyTorch Profiler tab in headless Chromium, check what it shows, and
save screenshots (the ones in docs/img/ come from here).

    python docs/tensorboard_screenshots.py RUN_DIR [--out docs/img] [--expect-steps 5,6] [--scalars-dir RUN]

Starts `tensorboard --logdir RUN_DIR` on 127.0.0.1 (a free port), opens the PyTorch Profiler tab,
checks that the side panel lists the run, its views and its worker, and that the Overview lists
the profiled steps (`--expect-steps`, default: the ProfilerStep numbers in the trace file), then
saves tb_scalars.png, and tb_profiler.png where the tab's charts drew (online). Exit status 1 with
a message if the page does not show what it should.

Offline, torch-tb-profiler's views never render: its page loads Google Charts from
www.gstatic.com. The script then says so and checks the Overview's steps in the data the plugin
serves to the page instead of in the drawn table. Another reason the traces also open in Perfetto
and in `python -m minigpt traces`.

Needs Debian's Chromium (`apt-get install chromium`, /usr/bin/chromium) and the Python package
`playwright` (pip; its own browser download is not needed: we point it at the system Chromium).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import shutil
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tbserve import get_json, serve_tensorboard  # docs/tbserve.py, beside this script

PROFILER_PNG = "tb_profiler.png"  # the Profiler tab's screenshot: only where its charts drew (online)

# --no-sandbox: Chromium refuses to start as root without it (CI and containers run as root).
# The rest keep an offline machine quiet: without them Chromium keeps dialling Google's services
# for updates, sync and field trials, and each refused connection is a line of noise.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def trace_steps(run_dir: Path) -> list[str]:
    """The ProfilerStep numbers of the run's trace(s), as the Overview's step column shows them."""
    steps = set()
    for path in (run_dir / "traces").glob("*.pt.trace.json*"):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            for e in json.load(f)["traceEvents"]:
                m = re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", ""))
                if m:
                    steps.add(int(m.group(1)))
    return [str(s) for s in sorted(steps)]


def profiler_frame(page):
    """The PyTorch Profiler tab lives in an iframe served by the plugin."""
    for frame in page.frames:
        if "pytorch_profiler" in frame.url and frame is not page.main_frame:
            return frame
    raise RuntimeError("the PyTorch Profiler tab did not load (no plugin frame)")


def screenshot_scalars(page, url: str, path: Path) -> None:
    """The SCALARS tab filtered to the per-stage device times, every point drawn as logged: no
    smoothing, and no outliers cut off the y-axis (both TensorBoard's defaults otherwise; they are
    kept in the page's storage and read when it loads, hence the reload)."""
    page.goto(f"{url}/#scalars&tagFilter=stage_device_ms")
    page.wait_for_selector("text=stage_device_ms", timeout=60_000)
    page.get_by_text("Ignore outliers in chart scaling").click()
    smoothing = page.locator("input[type=number]")
    smoothing.fill("0")
    smoothing.press("Enter")
    page.wait_for_timeout(500)
    page.reload()
    page.wait_for_selector("text=stage_device_ms", timeout=60_000)
    page.wait_for_timeout(4000)  # let the charts draw
    page.screenshot(path=str(path))


def overview_steps(frame, url: str, blocked: list[str]) -> tuple[list[str], str]:
    """The steps the Overview lists, and how they were seen: in the drawn page, or (offline, where
    the plugin's charts never draw) in the data the plugin serves to the page."""
    # The Overview: its "Step Time Breakdown" lists one row per profiled step. The plugin's
    # pages draw with Google Charts, loaded from www.gstatic.com: offline they never render.
    # Offline, the failed request to gstatic.com says so at once: no 30 s wait for a chart that
    # cannot come.
    deadline = time.monotonic() + 30
    while not (drawn := frame.locator("text=Step Time Breakdown").count() > 0):
        if any("gstatic.com" in u for u in blocked) or time.monotonic() > deadline:
            break
        frame.wait_for_timeout(250)
    if drawn:
        frame.wait_for_timeout(2000)  # let the charts draw
        how = "rendered in the page"
    else:
        if not any("gstatic.com" in u for u in blocked):
            raise RuntimeError("the Overview did not draw its Step Time Breakdown in 30 s")
        print(
            "note: torch-tb-profiler's charts need www.gstatic.com (Google "
            "Charts), unreachable here: "
            "its views stay on a spinner offline. Checking the Overview's "
            "data as the page fetches it."
        )
        how = "served to the page (charts blocked offline)"
    # The steps: the rows of the Overview's step table, from the data the page draws it with
    # (a rendered page's text is full of digits; its table rows are not addressable here).
    spans = get_json(f"{url}/data/plugin/pytorch_profiler/spans?run=traces&worker=rank0_dp0")
    overview = get_json(
        f"{url}/data/plugin/pytorch_profiler/overview?run=traces&worker=rank0_dp0"
        f"&span={urllib.parse.quote(str(spans[0]))}"
    )
    shown = [str(row[0]) for row in overview["steps"]["rows"]]
    return shown, how


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    p.add_argument("--expect-steps", help="comma-separated step numbers (default: read from the trace)")
    p.add_argument(
        "--scalars-dir",
        type=Path,
        help="take tb_scalars.png from this run instead (a longer run has more points to show)",
    )
    args = p.parse_args()

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print(
            "error: Chromium not found; install Debian's chromium (apt-get install chromium)", file=sys.stderr
        )
        return 2
    if not list((args.run_dir / "traces").glob("*.pt.trace.json*")):
        print(
            f"error: {args.run_dir}/traces holds no trace; run the trainer with --use-profiler",
            file=sys.stderr,
        )
        return 2
    expected = args.expect_steps.split(",") if args.expect_steps else trace_steps(args.run_dir)
    from playwright.sync_api import sync_playwright

    with serve_tensorboard([sys.executable, "-m", "tensorboard.main", "--logdir", str(args.run_dir)]) as url:
        args.out.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1000})
            blocked: list[str] = []  # requests the browser could not make (offline)
            page.on("requestfailed", lambda r: blocked.append(r.url))
            page.goto(f"{url}/#pytorch_profiler")
            page.wait_for_selector("iframe", timeout=60_000)
            frame = profiler_frame(page)
            # The side panel: the run, its views and its worker, as the plugin found them.
            frame.wait_for_selector("text=rank0_dp0", timeout=60_000)
            frame.click('div[role=button]:has-text("Overview")', force=True)
            frame.wait_for_selector("li[role=option]", timeout=30_000)
            views = frame.locator("li[role=option]").all_inner_texts()
            page.keyboard.press("Escape")
            if not {"Overview", "Operator", "Trace"} <= set(views):
                print(f"error: the PyTorch Profiler tab offers views {views}", file=sys.stderr)
                return 1
            shown, how = overview_steps(frame, url, blocked)
            if any("gstatic.com" in u for u in blocked):  # offline: a spinner is no picture of the tab
                print(f"offline: the Profiler tab's charts did not draw, so no {PROFILER_PNG} is saved")
            else:
                page.screenshot(path=str(args.out / PROFILER_PNG))
            if shown != expected:
                print(f"error: the Overview lists steps {shown}, expected {expected}", file=sys.stderr)
                return 1
            if args.scalars_dir:
                with serve_tensorboard(
                    [sys.executable, "-m", "tensorboard.main", "--logdir", str(args.scalars_dir)],
                    wait_for_profiler=False,
                ) as scalars_url:
                    screenshot_scalars(page, scalars_url, args.out / "tb_scalars.png")
            else:
                screenshot_scalars(page, url, args.out / "tb_scalars.png")
            browser.close()
        print(
            f"TensorBoard: the PyTorch Profiler tab lists the run (views {', '.join(views)}); the Overview's "
            f"steps {', '.join(expected)} were {how}; screenshots in {args.out}"
        )
        return 0


if __name__ == "__main__":
    sys.exit(main())
