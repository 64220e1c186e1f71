"""Run a worker module in a subprocess with a wall-clock limit; collect its JSON-lines output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class WorkerResult:
    records: dict = field(default_factory=dict)  # every JSON line, merged
    cut: str | None = None  # why the case did not finish (timeout, crash); None when it did
    seconds: float = 0.0


def run_worker(module: str, args: list[str], timeout_s: float) -> WorkerResult:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    cut = None
    try:
        out, err = proc.communicate(timeout=timeout_s)
        if proc.returncode != 0:
            last = (err.strip().splitlines() or ["?"])[-1]
            cut = f"worker exited with {proc.returncode}: {last[:200]}"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        cut = f"timed out after {timeout_s:.0f} s"
    res = WorkerResult(cut=cut, seconds=time.perf_counter() - start)
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                res.records.update(json.loads(line))
            except json.JSONDecodeError:
                pass
    return res
