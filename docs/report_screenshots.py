"""Open a run's report.html in headless Chromium, check it offline, and take a screenshot.

    python -m minigpt report runs/main && python docs/report_screenshots.py runs/main/report.html \\
        --out docs/img/report_main.png
    python docs/report_screenshots.py runs/prof/report.html --sections timeline operators \\
        --out docs/img/report_profiler.png          # those sections of the page only

Every request the page makes is routed: anything but file:// is refused and counted, so a chart
that would load a script from a CDN fails here. The check also reads the DOM: each section of
minigpt.analysis.report.SECTIONS must hold a drawn chart (an svg or canvas inside a plotly div), a table, or
its one-line "no data" note. Needs Debian's Chromium (`apt-get install chromium`) and the Python
package playwright (its own browser download is not needed: we point it at the system Chromium).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from contextlib import contextmanager, suppress
from pathlib import Path

PROBLEMS = ("error", "warning", "trace", "assert")  # console message types that fail the check
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-dev-shm-usage"]  # root in a container; small /dev/shm

# What each section holds once drawn, counted in the page (JavaScript run by the browser).
SECTION_STATE_JS = """
ids => ids.map(id => {
  const s = document.getElementById(id);
  if (!s) return {id, present: false};
  const plots = [...s.querySelectorAll('.plotly-graph-div')];
  return {id, present: true, plots: plots.length,
          drawn: plots.filter(p => p.querySelector('svg.main-svg, canvas')).length,
          tables: s.querySelectorAll('table').length, nodata: s.querySelectorAll('.nodata').length,
          slices: s.querySelectorAll('.sunburstlayer path.surface').length,
          text: s.innerText.slice(0, 200)};
})
"""


# Whether every chart of the page has drawn (an svg or a canvas in each plotly div).
ALL_DRAWN_JS = """
() => [...document.querySelectorAll('.plotly-graph-div')].every(p => p.querySelector('svg.main-svg, canvas'))
"""


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@contextmanager
def chromium():
    """One headless Chromium for the pages checked with it: a launch costs seconds of CPU."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def check_page(
    report: Path,
    screenshot: Path | None = None,
    full_page: bool = False,
    width: int = 1400,
    height: int = 1000,
    sections: tuple[str, ...] = (),
    browser=None,
) -> dict:
    """Load the report; return {"errors": [console errors, warnings and traces, page errors],
    "outside": [non-file URLs requested], "sections": [per-section state], "slices": sunburst
    sectors drawn in the page}. Takes a screenshot when asked: of `sections` (ids of
    minigpt.analysis.report.SECTIONS), from the first one's top to the last one's bottom, if given.
    `browser`: one of `chromium()` (a page of its own in it), or None for a Chromium of its own."""
    if browser is None:
        with chromium() as browser:
            return check_page(report, screenshot, full_page, width, height, sections, browser)
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    from minigpt.analysis.report import SECTIONS

    errors: list[str] = []
    outside: list[str] = []

    def route(r):
        if r.request.url.startswith(("file://", "data:", "blob:", "about:")):
            r.continue_()
        else:
            outside.append(r.request.url)
            r.abort()

    page = browser.new_page(viewport={"width": width, "height": height})  # a context of its own
    try:
        page.route("**/*", route)
        # Plotly reports a chart it could not build (a sunburst parent that is missing) as a
        # console trace beginning "WARN:" and draws nothing: a warning or a trace fails as an error does.
        page.on("console", lambda m: errors.append(f"{m.type}: {m.text}") if m.type in PROBLEMS else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(Path(report).resolve().as_uri(), wait_until="load", timeout=120_000)
        # plotly draws each chart in the script beside its div, so at "load" they are drawn; a chart
        # that is not gets a few seconds more, and is then counted as not drawn.
        with suppress(PlaywrightTimeout):
            page.wait_for_function(ALL_DRAWN_JS, timeout=5000)
        drawn = page.evaluate(SECTION_STATE_JS, [sid for sid, _ in SECTIONS])
        slices = page.evaluate("document.querySelectorAll('.sunburstlayer path.surface').length")
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            clip = None
            if sections:  # the box from the first section's top to the last one's bottom
                boxes = [page.locator(f"#{sid}").bounding_box() for sid in sections]
                top, bottom = boxes[0]["y"], boxes[-1]["y"] + boxes[-1]["height"]
                clip = {"x": 0, "y": top, "width": width, "height": bottom - top}
            page.screenshot(path=str(screenshot), full_page=full_page or bool(clip), clip=clip)
    finally:
        page.context.close()
    return {"errors": errors, "outside": outside, "sections": drawn, "slices": slices}


def shrink(png: Path) -> None:
    """256 colours are plenty for charts and text, and make a committed screenshot 3-4x smaller."""
    from PIL import Image

    Image.open(png).convert("RGB").quantize(256).save(png, optimize=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path)
    p.add_argument("--out", type=Path, help="screenshot file (PNG)")
    p.add_argument("--full-page", action="store_true", help="the whole page, not the first screen")
    p.add_argument("--height", type=int, default=1000)
    from minigpt.analysis.report import SECTIONS

    ids = [sid for sid, _ in SECTIONS]
    p.add_argument("--sections", nargs="+", default=(), choices=ids, metavar="ID", help=f"only these: {ids}")
    args = p.parse_args()
    if chromium_path() is None:
        print(
            "error: Chromium not found; install Debian's chromium (apt-get install chromium)", file=sys.stderr
        )
        return 2
    if not args.report.is_file():
        print(
            f"error: {args.report} does not exist; write it with python -m minigpt report RUN",
            file=sys.stderr,
        )
        return 2
    sections = tuple(args.sections)
    state = check_page(args.report, args.out, args.full_page, height=args.height, sections=sections)
    if args.out is not None:
        shrink(args.out)
    for s in state["sections"]:
        print(
            f"{s['id']:<12} plots {s.get('plots', 0)} drawn {s.get('drawn', 0)} tables {s.get('tables', 0)} "
            f"no-data notes {s.get('nodata', 0)}"
        )
    bad = state["errors"] or state["outside"]
    for e in state["errors"]:
        print(f"console error: {e}", file=sys.stderr)
    for u in state["outside"]:
        print(f"request outside file://: {u}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
