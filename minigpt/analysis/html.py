"""The pages' pieces, shared by the report, compare and the snapshot page: escaping, tables, the
page itself (its head is how a tool knows its own earlier output), its atomic write, and the one
copy of plotly.js a run folder's pages load (config.PLOTLY_JS_FILE, about 4.6 MB) by a relative
<script src>, so the folder works offline, moved or copied whole; a page with no chart loads none.
Standard library only until a page is written (plotly is imported then)."""

from __future__ import annotations

import html
import os
from pathlib import Path

from minigpt.config import PLOTLY_JS_FILE
from minigpt.fileio import ELSEWHERE, atomic_write, check_may_replace


class RunError(Exception):
    """A folder or file that is not what a tool reads, or a page it cannot write: one line."""


def write_plotly_js(folder: Path, elsewhere: str = ELSEWHERE) -> Path:
    """plotly.min.js into `folder` (written atomically; left alone when it is already that text)."""
    import plotly.offline  # imported when a chart is drawn, never by the trainer's loop

    path = Path(folder) / PLOTLY_JS_FILE
    text = plotly.offline.get_plotlyjs()
    if not (path.is_file() and path.stat().st_size == len(text.encode())):
        Path(folder).mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, elsewhere)
    return path


def script_tag(page: Path, js: Path) -> str:
    """The <script> that loads `js` from a page written at `page`, by a path relative to it."""
    rel = Path(os.path.relpath(Path(js).resolve(), Path(page).resolve().parent)).as_posix()
    return f'<script type="text/javascript" src="{rel}"></script>'


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1280px; padding: 0 1.5em 3em;
  color: #222; }
h1 { margin: 0.8em 0 0.2em; } h2 { border-bottom: 1px solid #ccc; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; }
td, th { padding: 2px 10px; border-bottom: 1px solid #eee; text-align: right; } th { background: #f4f4f4; }
td:first-child, th:first-child { text-align: left; }
td.name { text-align: left; font-family: monospace; max-width: 60em; overflow-wrap: anywhere; }
.nodata { color: #777; font-style: italic; } .problem { color: #a40; }
.kv td { text-align: left; } .kv td:first-child { color: #555; }
td.sum { font-weight: bold; border-top: 1px solid #999; } .headline { font-size: 1.15em; }
.new { color: #a40; } .gone { color: #06a; } .grid { display: flex; flex-wrap: wrap; gap: 2em; }
"""


def esc(x) -> str:
    return html.escape(str(x))


def table(headers: list[str], rows: list[list], name_col: int | None = None, cls: str = "") -> str:
    """rows of cells; a cell is text, or (text, css class). `name_col` is left-aligned monospace."""

    def cell(i: int, c) -> str:
        text, klass = c if isinstance(c, tuple) else (c, "")
        klass = (klass + " name").strip() if i == name_col else klass
        return f'<td class="{klass}">{esc(text)}</td>' if klass else f"<td>{esc(text)}</td>"

    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "\n".join("<tr>" + "".join(cell(i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<table class="{cls}"><tr>{head}</tr>\n{body}</table>'


# How every page of minigpt's begins (the report's and compare's, then and now): the mark by which
# a tool knows a file at its output path as its own earlier output, which it may replace.
PAGE_HEAD = '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>minigpt'
# Where a run folder's page loads the folder's one plotly.min.js (write_report fills it in).
SHARED_PLOTLY = "<!-- minigpt: the run folder's plotly.min.js -->"


def page(title: str, body: str, shared_plotly: bool = False) -> str:
    """A whole page; `title` begins with "minigpt" (PAGE_HEAD ends with it). plotly.js, only when
    a figure is drawn: inlined in the head (a page on its own, such as compare's --html), or, with
    `shared_plotly`, a marker that write_report turns into a <script src> of the run folder's one
    copy. No CDN either way."""
    import plotly.offline

    assert title.startswith("minigpt"), title
    js = ""
    if "Plotly.newPlot" in body:
        js = (
            SHARED_PLOTLY
            if shared_plotly
            else f'<script type="text/javascript">{plotly.offline.get_plotlyjs()}</script>'
        )
    return (
        f"{PAGE_HEAD}{esc(title[len('minigpt') :])}</title>\n"
        f"<style>{CSS}</style>\n{js}\n"
        f"</head><body>\n{body}\n</body></html>\n"
    )


def check_page_path(out: Path, elsewhere: str, force: bool = False) -> None:
    """WouldOverwrite (one line) when `out` holds a file that is not a page of minigpt's, unless
    `force`: a tool never replaces a run's config, metrics or checkpoint with a page."""
    flag = "report" if elsewhere == ELSEWHERE else elsewhere  # the trainer's own report has no flag
    check_may_replace(out, PAGE_HEAD.encode(), flag, "minigpt", force)


def write_page(out: Path, text: str, elsewhere: str, force: bool = False) -> None:
    """Write a page atomically. A full disk is DiskFull's one line, naming `elsewhere` (the flags
    that write it elsewhere); a path that cannot be written (no such folder, no permission, a
    read-only file system) is RunError's one line naming the page, not its temporary file. A file
    at `out` that is not a page of minigpt's (a run's config.json, its metrics, a checkpoint) is
    replaced only with `force` (fileio.WouldOverwrite otherwise)."""
    check_page_path(out, elsewhere, force)
    try:
        atomic_write(out, text, elsewhere)
    except OSError as e:
        raise RunError(
            f"cannot write {out} ({e.strerror or type(e).__name__}); write elsewhere ({elsewhere})"
        ) from None
