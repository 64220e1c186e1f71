"""`python -m bench.neighbour`: batch-1 decode quiet, and beside a busy core, for each OpenMP thread setting.

Each setting runs in a child process (OpenMP reads its environment when torch loads it): the captured engine
(configs/tiny, batch-1 graph) decodes 128 tokens after a 128-token prompt, alternately quiet and with one core
busy from a spinning process that the child starts and stops itself; medians of the time a token. The server's
default (`--num-threads 0`: torch's threads less the cores busy at start) is run twice: started quiet, and
started beside the spinning process. Writes docs/benchmarks/neighbour.json and prints each setting's busy/quiet
ratio, and the default's figure: started beside a busy core against started quiet. Run nothing beside it.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks" / "neighbour.json"
ROUNDS, NEW = 5, 128
SETTINGS = {  # name -> (environment, --num-threads, the spinner running when the engine starts)
    "2 threads (torch's default), OpenMP spins": ({}, 2, False),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": ({"OMP_WAIT_POLICY": "PASSIVE"}, 2, False),
    "2 threads, GOMP_SPINCOUNT=10000": ({"GOMP_SPINCOUNT": "10000"}, 2, False),
    "1 thread": ({}, 1, False),
    "default (--num-threads 0), started quiet": ({}, 0, False),
    "default (--num-threads 0), started beside the busy core": ({}, 0, True),
}


def spin() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def stop(spinner: subprocess.Popen | None) -> None:
    if spinner is not None:
        spinner.kill()
        spinner.wait()


def child(threads: int, spin_at_start: bool) -> None:
    from bench.ours import make_engine, timed_generate
    from bench.workload import greedy, prompt
    from engine.runtime.engine import Engine  # noqa: F401  (imports torch after the environment is set)

    spinner = spin() if spin_at_start else None
    try:
        time.sleep(0.5 if spinner else 0)
        engine = make_engine(ROOT / "configs" / "tiny", cuda_graph_bs=[1], max_total_tokens=4096, num_threads=threads)
    finally:
        stop(spinner)
    ids = prompt(0, 128, 4000)
    timed_generate(engine, ids, 32, greedy)  # warm
    quiet, busy = [], []
    for _ in range(ROUNDS):
        for times, neighbour in ((quiet, False), (busy, True)):
            spinner = spin() if neighbour else None
            try:
                time.sleep(0.5 if spinner else 0)  # (the spinner at full speed first)
                times.append(1e3 / timed_generate(engine, ids, NEW, greedy).decode_tok_s)
            finally:
                stop(spinner)
    import torch
    print(json.dumps({"threads": torch.get_num_threads(), "quiet_ms": statistics.median(quiet),
                      "busy_ms": statistics.median(busy), "quiet_all": quiet, "busy_all": busy}))


def main() -> None:
    results = {}
    for name, (env, threads, spin_at_start) in SETTINGS.items():
        argv = ["--child", str(threads), str(int(spin_at_start))]
        p = subprocess.run([sys.executable, "-m", "bench.neighbour", *argv], env=os.environ | env, cwd=ROOT,
                           capture_output=True, text=True, timeout=1800)
        if p.returncode:
            results[name] = {"error": p.stderr[-2000:]}
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        r["busy_over_quiet"] = round(r["busy_ms"] / r["quiet_ms"], 2)
        results[name] = r
        print(f"{name}: {r['threads']} threads, quiet {r['quiet_ms']:.2f} ms, busy {r['busy_ms']:.2f} ms "
              f"({r['busy_over_quiet']}x)", flush=True)
    base = results.get("2 threads (torch's default), OpenMP spins", {}).get("quiet_ms")
    for r in results.values():
        if base and "quiet_ms" in r:
            r["quiet_over_2_threads"] = round(r["quiet_ms"] / base, 2)
    quiet = results.get("default (--num-threads 0), started quiet", {})
    busy = results.get("default (--num-threads 0), started beside the busy core", {})
    target = (round(busy["busy_ms"] / quiet["quiet_ms"], 2) if "busy_ms" in busy and "quiet_ms" in quiet else None)
    print(f"default: started beside a busy core {busy.get('busy_ms')} ms a token, started quiet {quiet.get('quiet_ms')} "
          f"ms: {target}x (target <= 1.5x)")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results,
                               "default_busy_over_quiet": target}, indent=1) + "\n")


if __name__ == "__main__":
    child(int(sys.argv[2]), sys.argv[3] == "1") if sys.argv[1:2] == ["--child"] else main()
