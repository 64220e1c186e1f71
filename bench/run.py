"""`python -m bench.run [--quick] [--only NAME ...]`: run the benchmarks side by side with their baselines
and write docs/benchmarks/ (or docs/benchmarks/quick/ with --quick): results.json, results.md, PNG plots.

Each benchmark runs in its own fresh process (bench.child); the model copies and the bandwidth figure are
made once here. With --only, the named benchmarks replace their entries in an existing results.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.benches import BENCHES
from bench.context import FULL, QUICK, BenchContext, context_to_json
from bench.machine import code_version, machine_info, measure_bandwidth
from bench.models import prepare_model_dirs
from bench.plots import write_plots
from bench.report import render
from bench.targets import evaluate

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (~2 minutes); writes docs/benchmarks/quick/")
    p.add_argument("--only", nargs="+", choices=list(BENCHES), metavar="NAME",
                   help=f"run only these: {', '.join(BENCHES)}")
    p.add_argument("--threads", type=int, default=0,
                   help="torch/OpenMP threads for every system, subprocesses included (default 0 = torch's "
                        "default, all cores; use 1 on a shared machine, where parallel regions stall on busy cores)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default docs/benchmarks[/quick])")
    return p.parse_args(argv)


def set_threads(n: int) -> None:
    """Same thread count here and in every subprocess (server, transformers workers) via the environment."""
    if n <= 0:
        return
    torch.set_num_threads(n)
    for var in THREAD_ENV:
        os.environ[var] = str(n)


def _jsonable(x):
    """NaN/inf -> None, tuples -> lists, so results.json is strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = args.out or ROOT / "docs" / "benchmarks" / ("quick" if args.quick else "")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = args.only or list(BENCHES)
    results_path = out_dir / "results.json"
    results = json.loads(results_path.read_text()) if args.only and results_path.is_file() else {}
    random.seed(SEED)
    torch.manual_seed(SEED)
    set_threads(args.threads)

    bw = measure_bandwidth()
    results.update({"quick": args.quick, "threads": args.threads, "machine": machine_info(bw),
                    "code": code_version(ROOT)})
    results.setdefault("benchmarks", {})
    print(f"memory bandwidth: copy {bw.copy_bytes_per_s / 1e9:.2f} GB/s, "
          f"STREAM-style {bw.stream_bytes_per_s / 1e9:.2f} GB/s")
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        workdir = Path(tmp)
        models = prepare_model_dirs(ROOT / "configs" / "tiny", workdir)
        ctx = BenchContext(quick=args.quick, scale=QUICK if args.quick else FULL, seed=SEED, models=models,
                           bandwidth=bw, workdir=workdir)
        ctx_file = workdir / "context.json"
        ctx_file.write_text(context_to_json(ctx))
        for name in names:
            start = time.perf_counter()
            res = _run_child(name, ctx_file, workdir)
            res["run_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
            res["commit"] = results["code"]["commit"]  # (with --only, the others keep the commit they ran at)
            res["wall_s"] = time.perf_counter() - start
            results["benchmarks"][name] = _jsonable(res)
            print(f"[{name}: {res['wall_s']:.0f} s]")
            _write(results, out_dir)
    targets = _write(results, out_dir)
    print("\n== targets ==")
    for t in targets:
        v = "—" if t["value"] is None else f"{t['value']:.3g}"
        print(f"  {t['status']:8s} {t['target']} = {v} (target {t['threshold']}) {t['note']}")
    print(f"\nwrote {out_dir}")
    return 0 if all("error" not in r for r in results["benchmarks"].values()) else 1


def _run_child(name: str, ctx_file: Path, workdir: Path) -> dict:
    """Run one benchmark in a fresh process (bench.child); its stdout/stderr pass straight through."""
    out_file = workdir / f"result_{name}.json"
    proc = subprocess.run([sys.executable, "-m", "bench.child", name, str(ctx_file), str(out_file)], cwd=ROOT)
    if out_file.is_file():
        return json.loads(out_file.read_text())
    return {"error": f"benchmark process exited with {proc.returncode} and wrote no result"}


def _write(results: dict, out_dir: Path) -> list[dict]:
    """results.json, results.md and the plots, from everything measured so far."""
    targets = evaluate(results["benchmarks"])
    results["targets"] = _jsonable(targets)
    (out_dir / "results.json").write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    (out_dir / "results.md").write_text(render(results, targets))
    results["plots"] = write_plots(results["benchmarks"], out_dir)
    (out_dir / "results.json").write_text(json.dumps(_jsonable(results), indent=2) + "\n")
    return targets


if __name__ == "__main__":
    sys.exit(main())
