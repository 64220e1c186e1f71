"""Machine facts for results.json and the memory copy bandwidth the rooflines use."""

from __future__ import annotations

import ctypes
import datetime
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from bench.context import Bandwidth


def measure_bandwidth(tensor_bytes: int = 256 << 20, repeats: int = 7) -> Bandwidth:
    """Best-of-`repeats` copy of a `tensor_bytes` float32 tensor into another (torch's threaded copy)."""
    src = torch.ones(tensor_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return Bandwidth(copy_bytes_per_s=tensor_bytes / best, stream_bytes_per_s=2 * tensor_bytes / best,
                     tensor_bytes=tensor_bytes, repeats=repeats)


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def mkl_intel_path() -> bool | None:
    """Whether torch's MKL takes its Intel code path (None: no MKL symbol to ask). On other vendors' CPUs it takes a
    generic one, slow for products of few rows (README, "Hierarchical KV cache"): a figure of the batched CPU graph
    depends on which. A symbol preloaded over MKL's own (a measurement stub) is found first, as MKL finds it."""
    own = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    for lib in (None, own):
        try:
            return bool(ctypes.CDLL(lib).mkl_serv_intel_cpu_true())
        except (OSError, AttributeError):
            continue
    return None


def code_version(root: Path) -> dict:
    """The commit measured, and which engine/server files differed from it (others edit them concurrently)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    dirty = [line for line in git("status", "--porcelain", "--", "engine", "server", "mem_cache").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD").strip(), "uncommitted_engine_server_files": [line[3:] for line in dirty]}


def machine_info(bw: Bandwidth) -> dict:
    import transformers

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # (AVX2 or AVX512: the kernels' vector width)
        "mkl_intel_path": mkl_intel_path(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
        "memory_bytes": _mem_total_bytes(),
        "load_average_at_start": list(os.getloadavg()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "bandwidth": {"copy_bytes_per_s": bw.copy_bytes_per_s, "stream_bytes_per_s": bw.stream_bytes_per_s,
                      "tensor_bytes": bw.tensor_bytes, "repeats": bw.repeats,
                      "definition": "copy = bytes copied per second (primary); stream = bytes read + written"},
    }
