"""`python -m bench.decode_graphs`: captured decode against eager decode and transformers, in one run.

- Batch 1, greedy, 128-token prompt, 64 new tokens, on the transformers copy of configs/tiny's weights
  (score-only sparse layers: what transformers runs): our eager engine (`--disable-cuda-graph`), our
  captured engine, and transformers `generate`; interleaved runs, medians. Roofline: the measured read
  bandwidth of a buffer the size of the weights one token reads, summed again and again (from cache where it
  fits) and eight such buffers in turn (from memory), and the copy bandwidth.
- Batched decode steps at 1, 8, 32 and 64 rows (configs/tiny, `engine.step()` of a full decode batch,
  sampler and scheduler included): eager against captured, each built twice (eager, captured, captured, eager),
  their steps interleaved.
- Startup: `python -m server` until /health is 200, with an empty inductor cache (cold) and again
  with the cache it left (warm).

Writes docs/benchmarks/decode_graphs.json. About 10 minutes on 2 idle cores; run nothing beside it.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.hf_copy import write_hf_copy
from bench.hf_gen import generate_timed
from bench.machine import code_version, machine_info, measure_bandwidth
from bench.models import load_transformers
from bench.ours import make_engine, timed_generate
from bench.roofline import decode_bytes_per_token
from engine.model.loader import load_model
from engine.runtime.decode_graph import CPU_MAX_BS
from engine.runtime.request import NewRequest
from engine.runtime.sampling_params import SamplingParams
from tests.server_utils import start_server

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny"
OUT = ROOT / "docs" / "benchmarks" / "decode_graphs.json"
PROMPT, NEW, RUNS = 128, 64, 5


def read_bandwidth(nbytes: int, repeats: int = 20, buffers: int = 1) -> float:
    """Bytes/s of summing a float32 buffer of `nbytes` (a read-only pass, as a decode step's weights). One buffer,
    summed again and again, is read from cache where it fits (the roofline of the >= 50% target). `buffers` of them
    summed in turn (`repeats` rounds; 8 x 31 MB for configs/tiny) are read from memory, as a decode step meets its
    routed experts, which change from token to token (configs/tiny: 59 MB of fp32 weights, the embedding aside, for
    a 32 MB L3). A pessimistic bound: the weights every token reads (attention, the shared expert, the dense MLPs)
    may stay in cache in part."""
    bufs = [torch.ones(max(1, int(nbytes) // 4)) for _ in range(buffers)]
    for b in bufs:
        b.sum()
    times = []
    for i in range(repeats * buffers):
        t = time.perf_counter()
        bufs[i % buffers].sum()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def batch1(copy_dir: Path) -> dict:
    ids = torch.randint(5, 4000, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    eager = make_engine(copy_dir, disable_radix_cache=True, disable_cuda_graph=True)
    graphs = make_engine(copy_dir, disable_radix_cache=True, cuda_graph_bs=[1])
    hf = load_transformers(copy_dir)
    systems = {"eager": lambda: timed_generate(eager, ids, NEW), "captured": lambda: timed_generate(graphs, ids, NEW),
               "transformers": lambda: generate_timed(hf, ids, NEW)}
    runs: dict[str, list] = {k: [] for k in systems}
    for fn in systems.values():
        fn()  # warm
    for _ in range(RUNS):
        for name, fn in systems.items():
            runs[name].append(fn())
    ms = {k: 1000 / statistics.median(r.decode_tok_s for r in v) for k, v in runs.items()}
    same = runs["captured"][0].output_ids == runs["eager"][0].output_ids == runs["transformers"][0].output_ids
    b = decode_bytes_per_token(graphs.cfg, PROMPT + NEW / 2, 4)
    read_bw, copy_bw = read_bandwidth(b["total"]), measure_bandwidth().copy_bytes_per_s
    cold_bw = read_bandwidth(b["total"], repeats=5, buffers=8)

    def share(bw: float) -> float:  # the captured step's share of a roofline: the time to move its bytes at bw
        return (b["total"] / bw) * 1000 / ms["captured"]

    return {"ms_per_token": ms, "same_tokens": same, "bytes_per_token": b["total"],
            "read_bandwidth_gb_s": read_bw / 1e9, "copy_bandwidth_gb_s": copy_bw / 1e9,
            "cold_read_bandwidth_gb_s": cold_bw / 1e9, "fraction_of_cold_read_roofline": share(cold_bw),
            "captured_vs_transformers": ms["transformers"] / ms["captured"],
            "captured_vs_eager": ms["eager"] / ms["captured"],
            "fraction_of_read_roofline": share(read_bw), "fraction_of_copy_roofline": share(copy_bw)}


def step_ms(engines: tuple, rows: int, steps: int = 32) -> list[float]:
    """Median time of a decode step with `rows` running requests (prompts of PROMPT tokens), for each engine.
    The engines' steps are interleaved (one step of each in turn), so that all of them see the same machine:
    this one's speed swings by tens of percent within a minute. NOTE: an A/A (two engines alike, both graphs loaded
    from disk) gave the one built second 1.04-1.07x at 8-64 rows, whichever stepped first: for effects that small,
    build each form twice, in the order A B B A, and compare their sums."""
    params = SamplingParams(max_new_tokens=steps + 4, temperature=0, ignore_eos=True)
    for engine in engines:
        engine.add_requests([NewRequest([5 + (r + j) % 4000 for j in range(PROMPT)], params) for r in range(rows)])
        decoding: set[str] = set()
        while len(decoding) < rows:  # until every request has its first token (prefill done)
            decoding |= {o.rid for o in engine.step() if o.new_ids}
        engine.step()  # the first all-decode step (a new key bucket may be compiled here)
    times: list[list[float]] = [[] for _ in engines]
    for _ in range(steps):
        for engine, ts in zip(engines, times):
            t = time.perf_counter()
            engine.step()
            ts.append(time.perf_counter() - t)
    for engine in engines:
        while engine.has_work():
            engine.step()
    return [1000 * statistics.median(ts) for ts in times]


def batched() -> dict:
    """Eager against captured steps: each engine built twice, in the order eager, captured, captured, eager (see
    step_ms' NOTE), a side's time its two engines' mean."""
    engines = tuple(make_engine(TINY, disable_radix_cache=True, disable_cuda_graph=not graphs)
                    for graphs in (False, True, True, False))
    out = {}
    for rows in (1, 8, 32, 64):
        ms = step_ms(engines, rows)
        e, g = (ms[0] + ms[3]) / 2, (ms[1] + ms[2]) / 2
        out[rows] = {"eager_ms": e, "captured_ms": g, "speedup": e / g}
        print(f"decode step at {rows} rows: eager {e:.1f} ms, captured {g:.1f} ms ({e / g:.2f}x)", flush=True)
    return out


def startup(cache: Path) -> float:
    """Seconds from starting `python -m server` as `make serve` does (default buckets) to /health 200."""
    t = time.perf_counter()
    srv = start_server("--model-path", str(TINY), "--cuda-graph-max-bs", str(CPU_MAX_BS), wait=900,
                       env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    seconds = time.perf_counter() - t
    srv.terminate()
    return seconds


def main() -> int:
    torch.set_num_threads(2)
    res: dict = {"machine": machine_info(measure_bandwidth()), "code": code_version(ROOT)}
    with tempfile.TemporaryDirectory() as d:
        write_hf_copy(load_model(TINY), Path(d), TINY)
        res["batch1"] = batch1(Path(d))
    print(json.dumps(res["batch1"], indent=1), flush=True)
    res["batched"] = batched()
    with tempfile.TemporaryDirectory() as cache:
        res["startup_s"] = {"cold": startup(Path(cache)), "warm": startup(Path(cache))}
    print(f"startup: cold {res['startup_s']['cold']:.0f} s, warm {res['startup_s']['warm']:.0f} s")
    OUT.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
