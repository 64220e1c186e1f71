"""`python -m bench.simulated_gpu`: the engine and the server on a simulated device, on a machine with no GPU.

The model is replaced by a stand-in device: a step's launch returns at once (fixed logits), the device runs the
steps back to back (an extend --extend-ms, a decode step --step-ms), and reading a step's tokens back waits until
that step is done, as an event on a pinned copy does on CUDA; the overlap schedule is on, as on CUDA. Everything
else is the real engine and server. It says what the host side makes of a GPU's step time: the offline steady
step (at most the device's when the host keeps up) and the server's throughput against it at a burst of clients
(the GPU issue's server target: at least 0.8x). Host timings are this machine's; a GPU host's CPU differs.
Not a measurement of any GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def install(step_s: float, extend_s: float) -> None:
    """Replace the model runner's forward and read-back with the stand-in device, and turn the overlap on."""
    import engine.runtime.engine as engine_mod
    import engine.runtime.model_runner as runner_mod

    free = [0.0]  # when the device finishes the work launched so far
    logits: dict = {}

    class Done:
        def __init__(self, at: float) -> None:
            self.at = at

        def synchronize(self) -> None:
            time.sleep(max(0.0, self.at - time.monotonic()))

    def forward(self, batch, table, rows):
        if "x" not in logits:
            logits["x"] = torch.randn(512, self.model.cfg.vocab_size)
        cost = step_s if all(len(x) == 1 for x in batch.new_ids) else extend_s
        free[0] = self.done_at = max(time.monotonic(), free[0]) + cost
        return logits["x"][:len(rows)]

    def sampled(self, tokens, out=None):
        self._tokens = tokens
        return (tokens if out is None else out), Done(self.done_at)

    runner_mod.ModelRunner.forward, runner_mod.ModelRunner.sampled = forward, sampled
    init = engine_mod.Engine.__init__

    def overlapped(self, args):
        init(self, args)
        self._overlap = True

    engine_mod.Engine.__init__ = overlapped


def offline(clients: int, new: int) -> float:
    """Tokens/s of the steady decode steps of `clients` requests (the target's baseline)."""
    from bench.workload import prompt
    from engine.runtime.engine import Engine
    from engine.runtime.engine_args import EngineArgs
    from engine.runtime.request import NewRequest
    from engine.runtime.sampling_params import SamplingParams

    e = Engine(EngineArgs(load_format="dummy", disable_cuda_graph=True, max_running_requests=clients,
                          max_total_tokens=clients * (128 + new + 64)))
    params = SamplingParams.from_dict({"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True})
    e.add_requests([NewRequest(prompt(i, 128, 4000), params) for i in range(clients)])
    times = []
    while e.has_work():
        steady = e.stats().num_running == clients and e.stats().num_waiting == 0
        t = time.perf_counter()
        e.step()
        if steady:
            times.append(time.perf_counter() - t)
    return clients / statistics.median(times[len(times) // 4:])


def healthy(port: int, srv: subprocess.Popen) -> None:
    import httpx

    for _ in range(600):
        if srv.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("no /health 200 within 120 s")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.simulated_gpu")
    p.add_argument("--step-ms", type=float, default=2.0)
    p.add_argument("--extend-ms", type=float, default=12.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)  # (the server's own process: its port)
    a, rest = p.parse_known_args()
    install(a.step_ms / 1e3, a.extend_ms / 1e3)
    if a.serve:
        from server.__main__ import main as serve
        sys.exit(serve(["--port", str(a.serve), "--load-format", "dummy", "--disable-cuda-graph",
                        "--max-running-requests", str(a.clients), "--max-total-tokens",
                        str(a.clients * (128 + a.new + 64)), "--log-level", "warning", *rest]))
    from bench.gpu import load  # (the GPU check's burst of clients, here against the stand-in device)

    torch.set_num_threads(1)
    out: dict = {"step_ms": a.step_ms, "extend_ms": a.extend_ms, "offline_tok_s": round(offline(a.clients, a.new))}
    port = 31998
    srv = subprocess.Popen([sys.executable, "-m", "bench.simulated_gpu", *sys.argv[1:], "--serve", str(port)], cwd=ROOT,
                           env=os.environ | {"OMP_NUM_THREADS": "1"})
    try:
        healthy(port, srv)
        # (greedy only: a temperature's sampling would run on this CPU, where on a GPU it is device time)
        runs = [asyncio.run(load(a.clients, a.new, 0.0, port))["tok_s"] for _ in range(a.runs)]
        out["server_tok_s"] = [round(r) for r in runs]  # (the first: a fresh server's first traffic)
        out["server_first_over_offline"] = round(runs[0] / out["offline_tok_s"], 3)
        out["server_median_over_offline"] = round(statistics.median(runs) / out["offline_tok_s"], 3)
    finally:
        srv.terminate()
        srv.wait(30)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
