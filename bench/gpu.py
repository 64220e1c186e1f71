"""`make bench-gpu` (`python -m bench.gpu`): the whole GPU check in one command, about 8 minutes on one GPU.

1. Offline steady state (configs/tiny, bf16): a decode step of 64 rows greedy and at temperature 0.8 (again with
   --disable-overlap-schedule: the overlap's gain), and of 1 and 256 rows; then the kernels of a step (profiled), a
   trace of steady engine steps (GPU busy share, host waits; the traces, gzipped, into $OUT), long contexts.
2. Ours captured and eager against transformers `generate`, batch 1 and 64 (the transformers copy of the weights).
3. A mid-size MiniMax-M3-shaped model (dummy weights, ~1.5B parameters, 64 experts top-4): its capture time and
   its batch-1 time a token against its weight bytes read at the HBM bandwidth measured in the same run, and
   the kernels of its batch-1 step (profiled).
4. Startup: `python -m server --device cuda` on configs/tiny until /health is 200, twice (cold, then warm); the
   server at 1, 64 and 256 clients, greedy and temperature 0.8, each run twice (first traffic, warm).
5. tests/test_cuda.py and the Triton kernels' tests, in the time left.

Writes docs/benchmarks/gpu.json (and $OUT/gpu.json; named sections: gpu_<names>.json) after every section, so a run
cut short keeps what it measured, and prints the ratios against the targets at the end. A section that fails is recorded with its error and the rest
still run; one that would start past BENCH_GPU_DEADLINE_S (480 s from the start) is skipped. Sections named on the
command line run alone; four run only when named: `cpu_small_batch` (bench/small_batch.py on the host's CPU: the
CPU-only candidates measured on a second kind of CPU), `moe_forms` (the MoE's pair kernels against its grouped
matmuls, 1-128 rows: where PAIR_BYTES should sit), and two experiments for the next design step: `startup_phases` (a
start's seconds by phase) and `compiled_capture` (--enable-torch-compile: the step compiled by inductor, then
captured, against the eager step's capture: ready seconds cold and warm, replay ms and kernels, steps, greedy
tokens; the mid-size model compiled: its ready seconds and roofline fraction).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import httpx
import torch

from bench.machine import code_version
from bench.workload import prompt
from engine.runtime.engine import Engine
from engine.runtime.engine_args import EngineArgs
from engine.runtime.request import NewRequest
from engine.runtime.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny"
OUT = ROOT / "docs" / "benchmarks" / "gpu.json"
PORT = 31999
STARTED, DEADLINE_S = time.perf_counter(), float(os.environ.get("BENCH_GPU_DEADLINE_S", 480))


def section(results: dict, name: str, fn, *args) -> None:
    """Run one section into results[name] (its error instead, if it raises) and save the results so far: a run cut
    short (the device's command limit, a crash no section can catch) keeps what it measured. Past the run's
    DEADLINE_S a section is skipped, so that the file is written in time."""
    from engine.kernels import triton_decode

    t = time.perf_counter()
    if t - STARTED > DEADLINE_S:
        results[name] = {"skipped": f"past the run's {DEADLINE_S} s (BENCH_GPU_DEADLINE_S)"}
        return save(results)
    try:
        results[name] = fn(*args)
    except Exception as e:  # (one failed section must not lose the others' figures)
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    results[name]["section_s"] = round(time.perf_counter() - t, 1)
    if triton_decode._failed:  # (a failed launch turns Triton off for good: this section's figures are the fallbacks')
        results[name]["triton_failed"] = [repr(e)[:300] for e in triton_decode._failed]
    print(f"== {name} ({results[name]['section_s']} s)\n{json.dumps(results[name], indent=1)[:3000]}", flush=True)
    save(results)


def save(results: dict) -> None:
    """Into docs/benchmarks/gpu.json (and $OUT); a run of named sections into gpu_<their names>.json beside it, so
    that it never replaces a whole run's figures."""
    text, name = json.dumps(results, indent=1) + "\n", "_".join(["gpu", *sorted(sys.argv[1:])]) + ".json"
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_name(name).write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(text)


def left(cap: float) -> float:
    """Seconds a child process may take: `cap`, or less, what the run has left before its deadline (at least 60)."""
    return max(60.0, min(cap, DEADLINE_S - (time.perf_counter() - STARTED)))


def child(args: list[str], cap: float, env: dict | None = None) -> subprocess.CompletedProcess | dict:
    """`python args` in the repository, within `left(cap)` seconds; past them, the error to record instead."""
    try:
        return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=left(cap))
    except subprocess.TimeoutExpired as e:
        return {"error": f"{' '.join(args)[:80]}: not done in {e.timeout:.0f} s"}


def child_json(args: list[str], cap: float, env: dict | None = None) -> dict:
    """The JSON a child process prints last, or what went wrong."""
    r = child(args, cap, env)
    if isinstance(r, dict):
        return r
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-2500:]}


def run_tests() -> dict:
    """tests/test_cuda.py and the Triton kernels' tests, in the time the run has left (they run last: the sections
    before them have filled Triton's cache)."""
    p = child(["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_cuda.py", "tests/test_triton_decode.py",
               "tests/test_triton_pointwise.py"], 400)
    return p if isinstance(p, dict) else {"rc": p.returncode, "tail": (p.stdout + p.stderr)[-2500:]}


# ---- the engine offline ----------------------------------------------------------------------------------------
def engine(model: Path | str, graphs: bool, **kw) -> Engine:
    args = dict(model_path=str(model), device="cuda", dtype="bfloat16", max_total_tokens=256 * 1024,
                max_running_requests=256, disable_cuda_graph=not graphs)
    e = Engine(EngineArgs(**(args | kw)))
    e.warm_up()
    return e


def decode_steps(e: Engine, rows: int, new: int, temperature: float, prompt_len: int = 128) -> dict:
    """Median seconds of a decode step with `rows` requests all decoding (prefills excluded): each `step()`'s host
    time, with no sync of ours (a step waits for its own tokens, or overlapped for the last step's: the GPU's pace)."""
    params = SamplingParams.from_dict({"max_new_tokens": new, "temperature": temperature, "ignore_eos": True})
    e.add_requests([NewRequest(prompt(i, prompt_len, 4000), params) for i in range(rows)])
    times, made = [], 0
    while e.has_work():
        decoding = e.stats().num_running == rows and e.stats().num_waiting == 0
        t = time.perf_counter()
        outs = e.step()
        if decoding:
            times.append(time.perf_counter() - t)
        made += sum(len(o.new_ids) for o in outs)
    steady = times[len(times) // 4:]  # (the first steps of a run warm caches and allocators)
    return {"step_ms": round(1e3 * statistics.median(steady), 3), "steps": len(steady), "tokens": made,
            "tok_s": round(rows / statistics.median(steady), 1)}


def prefill_ms(e: Engine, rows: int, prompt_len: int) -> float:
    """Milliseconds from `rows` new prompts to their first tokens, offline: the extend steps (eager; several requests
    within the top-k budget take decode attention's kernel, a query a row, one launch an attention call, else an SDPA
    call a request; the first burst of the server test pays this), then one token each."""
    params = SamplingParams.from_dict({"max_new_tokens": 1, "temperature": 0.0})
    e.flush_cache()
    torch.cuda.synchronize()
    t = time.perf_counter()
    e.add_requests([NewRequest(prompt(5000 + i, prompt_len, 4000), params) for i in range(rows)])
    while e.has_work():
        e.step()
    torch.cuda.synchronize()
    return round(1e3 * (time.perf_counter() - t), 2)


def replay_ms(e: Engine, rows: int) -> float:
    """Milliseconds of one replay of the (rows, shortest keys) graph alone, its rows at CONTEXT keys (`context`): the
    step's GPU time, no host work."""
    graphs = e._runner.graphs
    context(e, rows)
    return graph_ms(graphs._cuda.graphs[(rows, graphs.key_buckets[0])])


CONTEXT = 320  # (keys a row in replay_ms and kernel_profile: the key bucket 28210f6's figures replayed)


def context(e: Engine, rows: int):
    """The (rows, shortest keys) graph's static inputs with every row at CONTEXT keys (slots 1..CONTEXT, written to
    the padding slot): the kernels read each row's key count, and warm-up leaves one key a row (position 0)."""
    g = e._runner.graphs
    batch = g._cuda.view(rows, g.key_buckets[0])
    keys = min(CONTEXT, batch.key_slots.shape[1])
    batch.positions.fill_(keys - 1)
    batch.key_slots[:, :keys] = torch.arange(1, keys + 1, device=batch.key_slots.device)
    batch.out_cache_loc.zero_()
    return batch


def graph_ms(graph: torch.cuda.CUDAGraph) -> float:
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t) / 50 * 1e3, 4)


def tried(fn, *args) -> dict:
    """fn(*args), or its error: a part of a section that fails (a profiler, a long context) keeps the others."""
    try:
        return fn(*args)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-1500:]}


def kernel_profile(e: Engine, rows: int, steps: int = 5) -> dict:
    """Where a captured step's GPU time goes: the eager step its (rows, shortest keys) graph replays, profiled: its
    kernels and their summed time a step, the heaviest by name, and the replay's ms (kernel time well under the
    replay: the step is bound by kernel launches and gaps; near it, by the kernels themselves)."""
    from torch.profiler import ProfilerActivity, profile

    g, batch = e._runner.graphs, context(e, rows)
    with torch.no_grad():
        g._cuda.step(batch)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                g._cuda.step(batch)
            torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_time_total > 0 and k.device_type.name == "CUDA"]
    kernels.sort(key=lambda k: -k.device_time_total)
    return {"kernels": round(sum(k.count for k in kernels) / steps), "replay_ms": replay_ms(e, rows),
            "kernel_ms": round(sum(k.device_time_total for k in kernels) / steps / 1e3, 4),
            "top": [[k.key[:70], round(k.count / steps), round(k.device_time_total / steps, 1)] for k in kernels[:15]]}


def step_trace(e: Engine, rows: int, temperature: float, steps: int = 12) -> dict:
    """Where a steady decode step's wall time goes: `steps` engine.step() calls with `rows` requests all decoding,
    profiled (host and GPU): the GPU's busy share of the window (its kernels' summed time), the host's waits (event
    and stream syncs, copies) and its heaviest ops; the trace itself, gzipped, into $OUT for chrome://tracing. A step
    well above the GPU's busy time with little host waiting says the host bounds it; a GPU busy throughout, the
    kernels. (The offline figures above measure the same steps without the profiler's overhead.) Its requests are
    finished whatever happens, so that a failure leaves no rows to the next measurement."""
    try:
        return _step_trace(e, rows, temperature, steps)
    finally:
        while e.has_work():
            e.step()


def _step_trace(e: Engine, rows: int, temperature: float, steps: int) -> dict:
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams.from_dict({"max_new_tokens": steps + 8, "temperature": temperature, "ignore_eos": True})
    e.add_requests([NewRequest(prompt(i, 128, 4000), params) for i in range(rows)])
    while not (e.stats().num_running == rows and e.stats().num_waiting == 0):
        e.step()
    for _ in range(3):  # (steady, overlapped)
        e.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            e.step()
        wall = time.perf_counter() - t
    avg = prof.key_averages()
    gpu_us = sum(k.device_time_total for k in avg if k.device_type.name == "CUDA")
    waits = {k.key: [k.count, round(k.self_cpu_time_total / 1e3, 2)] for k in avg
             if any(w in k.key for w in ("Synchronize", "Memcpy", "HostAlloc", "cudaGraphLaunch", "cudaLaunchKernel"))}
    host = sorted((k for k in avg if k.device_type.name == "CPU"), key=lambda k: -k.self_cpu_time_total)[:15]
    out = {"rows": rows, "temperature": temperature, "step_ms": round(wall / steps * 1e3, 3),
           "gpu_busy_ms_per_step": round(gpu_us / steps / 1e3, 3), "gpu_busy_share": round(gpu_us / 1e6 / wall, 3),
           "host_calls_ms_per_window": waits,
           "host_top_self_ms": [[k.key[:60], k.count, round(k.self_cpu_time_total / 1e3, 2)] for k in host]}
    if os.environ.get("OUT"):
        raw = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(Path(os.environ["OUT"], f"trace_{rows}_t{temperature}.json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
    return out


def offline() -> dict:
    t = time.perf_counter()
    e = engine(TINY, graphs=True)
    out = {"engine_ready_s": round(time.perf_counter() - t, 1), "graphs": e._runner.graphs.info(),
           "replay_only_ms": {rows: replay_ms(e, rows) for rows in (1, 64, 256)}}
    decode_steps(e, 64, 32, 0.0)  # warm
    for name, rows, temp in (("rows64_greedy", 64, 0.0), ("rows64_t08", 64, 0.8), ("rows1_greedy", 1, 0.0),
                             ("rows256_greedy", 256, 0.0)):
        out[name] = decode_steps(e, rows, 128, temp)
    out["graphs_after"] = e._runner.graphs.info()
    out["temp_over_greedy_64"] = round(out["rows64_t08"]["step_ms"] / out["rows64_greedy"]["step_ms"], 3)
    # (the parts below each on their own: one that fails keeps the figures above; the profilers after the timings)
    out["profile"] = {rows: tried(kernel_profile, e, rows) for rows in (1, 64)}
    out["prefill_ms"] = tried(prefills, e)
    out["trace"] = {f"{rows}_t{temp}": tried(step_trace, e, rows, temp) for rows, temp in ((64, 0.0), (64, 0.8),
                                                                                          (1, 0.0))}
    out["long_context_step_ms"] = tried(long_contexts, e)
    out["long_context_graphs"] = e._runner.graphs.info()
    del e
    out["overlap_off"] = tried(overlap_off, out)
    return out


def prefills(e: Engine) -> dict:
    return {f"{r}x{n}": [prefill_ms(e, r, n) for _ in range(3)] for r, n in ((1, 128), (64, 128), (1, 2048))}


def long_contexts(e: Engine) -> dict:
    """Steps over long contexts on the graphs: a step's cost grows with its rows' keys, the graph is the same (before
    the Triton decode kernels a context past 8,192 keys ran eager)."""
    return {f"rows{r}_keys{n}": decode_steps(e, r, 64, 0.0, prompt_len=n)["step_ms"]
            for r, n in ((1, 500), (1, 8000), (1, 60000), (8, 30000))}


def overlap_off(on: dict) -> dict:
    """The 64-row steps again with --disable-overlap-schedule (each step read back before the next is launched)."""
    off, out = engine(TINY, graphs=True, cuda_graph_bs=[64], disable_overlap_schedule=True), {}
    decode_steps(off, 64, 32, 0.0)
    for name, temp in (("rows64_greedy", 0.0), ("rows64_t08", 0.8)):
        out[f"{name}_ms"] = decode_steps(off, 64, 128, temp)["step_ms"]
        out[f"{name}_overlap_gain"] = _ratio(out[f"{name}_ms"], on[name]["step_ms"])
    return out


# ---- against transformers --------------------------------------------------------------------------------------
def hf_generate(model, prompts: list[list[int]], new: int) -> float:
    """Seconds a token (per step) of transformers' greedy `generate` over equal-length prompts."""
    ids = torch.tensor(prompts, device="cuda")
    with torch.inference_mode():
        for n in (2, new):
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - t
    return elapsed / new


def versus_transformers() -> dict:
    from bench.hf_copy import write_hf_copy
    from engine.model.loader import load_model

    work = Path(tempfile.mkdtemp())
    write_hf_copy(load_model(TINY), work / "copy", TINY)
    import transformers
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM
    transformers.logging.set_verbosity_error()
    hf = MiniMaxM3VLForCausalLM.from_pretrained(work / "copy", dtype=torch.bfloat16).cuda().eval()
    out: dict = {"transformers": transformers.__version__}
    for rows in (1, 64):
        prompts = [prompt(i, 128, 4000) for i in range(rows)]
        out[f"transformers_b{rows}_ms"] = round(1e3 * hf_generate(hf, prompts, 64), 3)
    del hf
    torch.cuda.empty_cache()
    for name, graphs in (("captured", True), ("eager", False)):
        e = engine(work / "copy", graphs, max_total_tokens=64 * 1024, cuda_graph_max_bs=64, max_running_requests=64)
        for rows in (1, 64):
            out[f"{name}_b{rows}_ms"] = decode_steps(e, rows, 64 if graphs else 16, 0.0)["step_ms"]
        del e
        torch.cuda.empty_cache()
    for rows in (1, 64):
        out[f"captured_vs_transformers_b{rows}"] = round(out[f"transformers_b{rows}_ms"] / out[f"captured_b{rows}_ms"], 2)
        out[f"captured_vs_eager_b{rows}"] = round(out[f"eager_b{rows}_ms"] / out[f"captured_b{rows}_ms"], 2)
    return out


# ---- the server ------------------------------------------------------------------------------------------------
def start(log: Path) -> tuple[subprocess.Popen, float]:
    t = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "server", "--device", "cuda", "--port", str(PORT),
                          "--max-running-requests", "256", "--max-total-tokens", str(256 * 1024)],
                         cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)
    while time.perf_counter() - t < 120:
        try:
            if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=2).status_code == 200:
                return p, time.perf_counter() - t
        except httpx.HTTPError:
            pass
        if p.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    stop(p)
    raise RuntimeError("no /health 200 within 120 s")


def stop(p: subprocess.Popen) -> None:
    """Stop a server, killed if it has not exited 30 s after SIGTERM (else it keeps the port and its GPU memory)."""
    p.terminate()
    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


async def load(clients: int, new: int, temperature: float, port: int = PORT, seed: int = 1000) -> dict:
    """`clients` concurrent clients, one /generate each (256 new tokens): tokens/s over the wall time. Prompts from
    `seed` on: a run with seeds of its own finds none of its prompts in the prefix cache (its extend runs whole)."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120,
                                 limits=httpx.Limits(max_connections=clients + 8)) as c:
        async def one(i: int) -> int:
            r = await c.post("/generate", json={"input_ids": prompt(seed + i, 128, 4000), "sampling_params": {
                "max_new_tokens": new, "temperature": temperature, "ignore_eos": True}})
            return r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else 0

        t = time.perf_counter()
        made = await asyncio.gather(*(one(i) for i in range(clients)))
        elapsed = time.perf_counter() - t
    return {"tok_s": round(sum(made) / elapsed, 1), "s": round(elapsed, 2), "ok": sum(m == new for m in made)}


def server() -> dict:
    log = Path(tempfile.mkdtemp()) / "server.log"
    out: dict = {}
    p, out["startup_cold_s"] = start(log)
    try:
        # ("first": a setting's prompts new to the server; "warm": the same prompts again, their prefill cached)
        for n, (clients, temp) in enumerate(itertools.product((1, 64, 256), (0.0, 0.8))):
            for run in ("first", "warm"):
                out[f"c{clients}_t{temp}_{run}"] = asyncio.run(load(clients, 256, temp, seed=1000 * (n + 1)))
        info = httpx.get(f"http://127.0.0.1:{PORT}/server_info", timeout=30).json()
        out["server_info_graphs"] = {k: v for k, v in info.items() if "graph" in k}
    finally:
        stop(p)
    p, out["startup_warm_s"] = start(log)
    stop(p)
    out["log_tail"] = log.read_text()[-1500:]
    return out


# ---- the mid-size model ----------------------------------------------------------------------------------------
MID = {"hidden_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
       "head_dim": 128, "rotary_dim": 64, "partial_rotary_factor": 0.5, "intermediate_size": 256,
       "dense_intermediate_size": 4096, "shared_intermediate_size": 256, "num_local_experts": 64,
       "num_experts_per_tok": 4, "vocab_size": 32768, "moe_layer_freq": [0] + [1] * 11}
MID_SPARSE = {"sparse_attention_freq": [0, 0] + [1] * 10, "sparse_disable_index_value": [0, 0] + [0, 1] * 5,
              "sparse_num_index_heads": 4, "sparse_index_dim": 128}


def hbm_read_bandwidth() -> float:
    x = torch.ones(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    x.sum()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        x.sum()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return x.numel() * 2 / statistics.median(times)


def midsize(compiled: bool = False) -> dict:
    work = Path(tempfile.mkdtemp())
    cfg = json.loads((TINY / "config.json").read_text())
    cfg.update(MID)
    cfg["sparse_attention_config"].update(MID_SPARSE)
    (work / "config.json").write_text(json.dumps(cfg))
    t = time.perf_counter()
    e = engine(work, graphs=True, load_format="dummy", skip_tokenizer_init=True, max_total_tokens=64 * 1024,
               cuda_graph_max_bs=64, max_running_requests=64, enable_torch_compile=compiled)
    ready = time.perf_counter() - t
    m = e._runner.model
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    experts = sum(mod.w13.numel() * mod.w13.element_size() + mod.w2.numel() * mod.w2.element_size()
                  for mod in m.modules() if hasattr(mod, "w13"))
    per_token = total - experts * (1 - MID["num_experts_per_tok"] / MID["num_local_experts"]) \
        - m.embed_tokens.weight.numel() * m.embed_tokens.weight.element_size()  # (the embedding: one row read)
    bw = hbm_read_bandwidth()
    step = decode_steps(e, 1, 128, 0.0, prompt_len=512)
    roof_ms = per_token / bw * 1e3
    return {"params": sum(p.numel() for p in m.parameters()), "ready_s": round(ready, 1),
            "graphs": e._runner.graphs.info(), "bytes_per_token": per_token, "hbm_read_gb_s": round(bw / 1e9, 1),
            "roofline_ms": round(roof_ms, 4), "batch1_ms": step["step_ms"],
            "fraction_of_roofline": round(roof_ms / step["step_ms"], 3), "profile_batch1": kernel_profile(e, 1)}


# ---- experiments for the next design step (opt-in) ---------------------------------------------------------------
PHASES = """
import json, sys, time
t = [time.perf_counter()]
import torch
t.append(time.perf_counter())
import server.app  # noqa: F401  (what `python -m server` imports)
t.append(time.perf_counter())
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t.append(time.perf_counter())
from engine.runtime.engine import Engine
from engine.runtime.engine_args import EngineArgs
e = Engine(EngineArgs(model_path=sys.argv[1], device="cuda", dtype="bfloat16", max_running_requests=256,
                      max_total_tokens=256 * 1024))
t.append(time.perf_counter())
e.warm_up()
t.append(time.perf_counter())
names = ("import_torch", "import_server", "cuda_init", "engine_build", "capture")
out = {n: round(b - a, 2) for n, a, b in zip(names, t, t[1:])}
try:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:  # (the capture again: its host time)
        e._runner.graphs._cuda.capture()
    top = sorted(p.key_averages(), key=lambda k: -k.self_cpu_time_total)[:20]
    out["capture_again_host_top"] = [[k.key[:60], k.count, round(k.self_cpu_time_total / 1e3, 1)] for k in top]
except Exception as err:  # (the phases' figures are kept whatever the profiler does)
    out["capture_again_host_top"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


def startup_phases() -> dict:
    """Where a start's seconds go (configs/tiny, as `python -m server --device cuda` builds it), twice; and the
    host time of a second capture of every graph, by function (ms: aten ops, CUDA API calls, graph instantiation)."""
    return {f"run{i}": child_json(["-c", PHASES, str(TINY)], 300) for i in range(2)}


def compiled_capture() -> dict:
    """--enable-torch-compile (the step compiled by inductor, then captured by our CUDA graphs) against the eager
    step's capture as served, configs/tiny, each engine in a process of its own: seconds to ready (compile and
    capture into an empty compile cache: cold; then a new process loading the saved graphs: warm), one replay's ms
    and kernels, steady steps at 1 and 64 rows, greedy tokens (bf16: fused kernels may round a token apart); and the
    mid-size model compiled (ready seconds, fraction of the roofline: the `midsize` section's, eager)."""
    cache, out = tempfile.mkdtemp(), {}
    for name in ("eager", "compiled", "compiled_again", "midsize_compiled"):  # (the cold runs in an empty cache)
        env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": cache if "again" in name or name == "compiled"
                            else tempfile.mkdtemp()}
        out[name] = child_json(["-m", "bench.gpu", "--child", name], 500, env)
    runs = [out[n].get("greedy_tokens") for n in ("eager", "compiled", "compiled_again")]
    out["same_greedy_tokens"] = all(runs) and runs[0] == runs[1] == runs[2]
    out["compiled_over_eager"] = {k: _ratio(out["compiled"].get(k), out["eager"].get(k))
                                  for k in ("rows1_greedy_ms", "rows64_greedy_ms")}
    return out


def compiled_child(name: str) -> dict:
    """One engine of `compiled_capture`, in this process."""
    if name == "midsize_compiled":
        return midsize(compiled=True)
    t = time.perf_counter()
    e = engine(TINY, graphs=True, cuda_graph_bs=[1, 2, 64], enable_torch_compile=name != "eager")
    out = {"ready_s": round(time.perf_counter() - t, 1), "graphs": e._runner.graphs.info(),
           "profile": {rows: kernel_profile(e, rows) for rows in (1, 64)},
           "rows1_greedy_ms": decode_steps(e, 1, 64, 0.0)["step_ms"],
           "rows64_greedy_ms": decode_steps(e, 64, 64, 0.0)["step_ms"]}
    params = SamplingParams.from_dict({"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True})
    e.add_requests([NewRequest(prompt(7, 300, 4000), params)])
    out["greedy_tokens"] = [tok for _ in iter(e.has_work, False) for o in e.step() for tok in o.new_ids]
    return out


def moe_forms() -> dict:
    """The MoE's two CUDA forms for one layer, bf16 (its input float32, as the norm before it writes it), at 1-128
    rows: each (token, expert) pair's Triton kernels against the grouped matmuls, each form captured in a CUDA graph
    and replayed (ms a layer), for configs/tiny's experts (8, top-2, 256 x 256) and the mid-size model's (64, top-4,
    2048 x 256): where `layers.PAIR_BYTES` should sit (the pairs run while they read at most that much more than the
    grouped form); the pairs also at other `EXPERT_TILE`s (at batch 1 the mid-size up kernel runs 5 pairs x 256 / tile
    programs, 40 at 32: fewer than an H200's 132 SMs)."""
    import dataclasses

    from engine.kernels import triton_pointwise
    from engine.model import layers
    from engine.model.config_json import load_config

    out, real, tile = {}, layers.PAIR_BYTES, triton_pointwise.EXPERT_TILE
    forms = [("pairs", 1 << 62, tile), ("grouped", -(1 << 62), tile), *((f"pairs_tile{t}", 1 << 62, t) for t in (16, 64))]
    for name, shape in (("tiny", {}), ("midsize", {"hidden_size": 2048, "num_experts": 64, "num_experts_per_tok": 4})):
        moe = layers.MoE(dataclasses.replace(load_config(TINY), **shape)).to("cuda")
        with torch.no_grad():
            for name_, p in moe.named_parameters():  # (the router stays float32, as the loader keeps it)
                p.data = (torch.randn_like(p) * p.shape[-1] ** -0.5).to(p.dtype if "router" in name_ else torch.bfloat16)
            for rows in (1, 4, 8, 16, 32, 64, 128):
                x, times = torch.randn(rows, moe.w13.shape[-1], device="cuda", dtype=layers.MoE.input_dtype), {}
                for form, limit, form_tile in forms:
                    layers.PAIR_BYTES, triton_pointwise.EXPERT_TILE = limit, form_tile
                    moe(x)  # (kernels built before the capture)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        moe(x)
                    times[form] = graph_ms(graph)
                layers.PAIR_BYTES, triton_pointwise.EXPERT_TILE = real, tile
                out[f"{name}_rows{rows}"] = times | {"pairs_over_grouped": _ratio(times["pairs"], times["grouped"])}
    return out


def cpu_small_batch() -> dict:
    r = child(["-m", "bench.small_batch"], 500)
    if isinstance(r, dict):  # (past its time)
        return r
    if r.returncode:
        return {"error": r.stderr[-2500:]}
    return json.loads((ROOT / "docs" / "benchmarks" / "small_batch.json").read_text())


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # (one engine of compiled_capture, in a process of its own)
        print(json.dumps(compiled_child(sys.argv[2])))
        return
    results: dict = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code_version(ROOT),
                     "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    only = set(sys.argv[1:])
    for name, fn in (("offline", offline), ("versus_transformers", versus_transformers), ("midsize", midsize),
                     ("server", server), ("tests", run_tests)):
        if not only or name in only:
            section(results, name, fn)
    for name, fn in (("moe_forms", moe_forms), ("startup_phases", startup_phases),
                     ("compiled_capture", compiled_capture), ("cpu_small_batch", cpu_small_batch)):
        if name in only:  # (opt-in, the quick ones first: the MoE's forms; the design experiments; the host's CPU)
            section(results, name, fn)
    off, srv = results.get("offline", {}), results.get("server", {})
    vs, mid = results.get("versus_transformers", {}), results.get("midsize", {})
    results["targets"] = {
        "server_c64_t08_first_over_offline_greedy (>= 0.8)": _ratio(srv.get("c64_t0.8_first", {}).get("tok_s"),
                                                                    off.get("rows64_greedy", {}).get("tok_s")),
        "step_64_rows_ms (<= 2.0)": off.get("rows64_greedy", {}).get("step_ms"),
        "temperature_over_greedy (<= 1.1)": off.get("temp_over_greedy_64"),
        "batch1_vs_transformers (>= 20)": vs.get("captured_vs_transformers_b1"),
        "startup_cold_s (<= 20)": srv.get("startup_cold_s"), "startup_warm_s (<= 5)": srv.get("startup_warm_s"),
        "midsize_ready_s (<= 60)": mid.get("ready_s"), "midsize_fraction_of_roofline (>= 0.3)": mid.get("fraction_of_roofline"),
    }
    print(json.dumps(results["targets"], indent=1))
    save(results)


def _ratio(a, b):
    return None if not a or not b else round(a / b, 3)


if __name__ == "__main__":
    main()
