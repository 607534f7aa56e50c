"""The one copy of plotly.js a run folder's pages share (paths.PLOTLY_JS_FILE, about 4.6 MB):
report.html and the memory profiler's sunburst charts each used to inline their own. A page loads
it by a relative <script src>, so the folder works offline, moved or copied whole; a page with no
chart loads nothing. Standard library only until a page is written (plotly is imported then)."""

from __future__ import annotations

import os
from pathlib import Path

from minigpt.fileio import ELSEWHERE, atomic_write
from minigpt.paths import PLOTLY_JS_FILE


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
