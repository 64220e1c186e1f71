"""Start a real `python -m server` on 127.0.0.1 (a free port) for black-box HTTP tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)


def start_server(*args: str, log_dir: Path | None = None, wait: float = 90, module: str = "server",
                 port: int | None = None, env: dict[str, str] | None = None) -> LiveServer:
    """Start a server (on a free port unless given; `env`: extra environment variables) and wait (up to
    `wait` s, 0: not at all) until /health is 200. Decode runs eager (no graph compile) unless the flags
    name the graph buckets."""
    port = port or free_port()
    log = (log_dir or Path("/tmp")) / f"server-{port}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    if "--model-path" not in args:  # seeded random weights (the shipped ones: test_shipped_model, CI's smoke)
        cmd += ["--model-path", TINY] + ([] if "--load-format" in args else ["--load-format", "dummy"])
    if not {"--cuda-graph-bs", "--cuda-graph-max-bs"} & set(args):
        cmd.append("--disable-cuda-graph")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    if wait == 0:
        return LiveServer(proc, url, log)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return LiveServer(proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


@contextmanager
def live_server(*args: str, log_dir: Path | None = None, module: str = "server",
                wait: float = 90) -> Iterator[LiveServer]:
    srv = start_server(*args, log_dir=log_dir, module=module, wait=wait)
    try:
        yield srv
    finally:
        srv.terminate()
