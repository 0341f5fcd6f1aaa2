"""A llama-server on loopback for the tests, and JSON requests to it."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(bins: Path, model: Path, *extra: str, log: Path | None = None,
           env: dict[str, str] | None = None) -> Iterator[str]:
    """A llama-server on a free loopback port; yields its base URL. Its output goes to `log`;
    `env` adds to its environment."""
    port = free_port()
    with contextlib.ExitStack() as stack:
        out = stack.enter_context(log.open("w")) if log else subprocess.DEVNULL
        proc = subprocess.Popen([str(bins / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port",
                                 str(port), "-t", "2", *extra], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **(env or {})})
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 120
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None, "llama-server exited during start-up"
                assert time.time() < deadline, "llama-server did not become healthy"
                time.sleep(0.5)
            yield url
            assert proc.poll() is None, "llama-server exited"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        result: dict[str, object] = json.loads(r.read())
        return result


def get(url: str) -> tuple[int, str]:
    """Status and body of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
