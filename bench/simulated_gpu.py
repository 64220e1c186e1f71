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
import sys
import time

import torch


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
    pool = ["--max-running-requests", str(a.clients), "--max-total-tokens", str(a.clients * (128 + a.new + 64))]
    if a.serve:  # (live_server gives the port, the model, dummy weights and --disable-cuda-graph)
        from server.__main__ import main as serve
        sys.exit(serve([*rest, *pool, "--log-level", "warning"]))
    from bench.gpu import (  # (the GPU check's offline steps and burst, on the stand-in device)
        decode_steps,
        load,
    )
    from engine.runtime.engine import Engine
    from engine.runtime.engine_args import EngineArgs
    from tests.server_utils import live_server

    torch.set_num_threads(1)
    e = Engine(EngineArgs(load_format="dummy", disable_cuda_graph=True, max_running_requests=a.clients,
                          max_total_tokens=a.clients * (128 + a.new + 64)))
    out: dict = {"step_ms": a.step_ms, "extend_ms": a.extend_ms,
                 "offline_tok_s": round(decode_steps(e, a.clients, a.new, 0.0)["tok_s"])}
    os.environ["OMP_NUM_THREADS"] = "1"  # (the server's process)
    with live_server("--serve", "1", *sys.argv[1:], module="bench.simulated_gpu") as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        # (greedy only: a temperature's sampling would run on this CPU, where on a GPU it is device time)
        runs = [asyncio.run(load(a.clients, a.new, 0.0, port, seed=1000 * (j + 1)))["tok_s"] for j in range(a.runs)]
        out["server_tok_s"] = [round(r) for r in runs]  # (the first: a fresh server's first traffic)
        out["server_first_over_offline"] = round(runs[0] / out["offline_tok_s"], 3)
        out["server_median_over_offline"] = round(statistics.median(runs) / out["offline_tok_s"], 3)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
