"""Start TensorBoard on 127.0.0.1 and a free port, and read its JSON endpoints: what the screenshot
script beside it (tensorboard_screenshots.py) and the tests that check TensorBoard's views share."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_tensorboard(
    argv: list[str], cwd=None, env=None, timeout: float = 120, wait_for_profiler: bool = True
) -> Iterator[str]:
    """Run `argv` (a tensorboard command line) on 127.0.0.1 and a free port; yield its URL once
    it answers and, with `wait_for_profiler`, once the profiler plugin has loaded the traces (it
    parses them in the background); stop it after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*argv, "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{shlex.join(argv)} exited; run it by hand to see why")
            try:
                if not wait_for_profiler:
                    get_json(f"{url}/data/runs")
                    break
                runs = get_json(f"{url}/data/plugin/pytorch_profiler/runs")
                if runs["runs"] and not runs["loading"]:
                    break
            except (OSError, ValueError):
                pass
            if time.time() > deadline:
                raise RuntimeError(f"TensorBoard's profiler plugin listed no run within {timeout:.0f}s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())
