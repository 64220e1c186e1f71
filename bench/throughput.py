"""`throughput`: a seeded mixed workload; output tokens/s of our engine offline, our server over HTTP,
transformers one request at a time, and transformers on equal-length batches."""

from __future__ import annotations

import random
import time

from tqdm import tqdm

from bench.context import BenchContext
from bench.hf_gen import generate_batch, generate_timed
from bench.http_load import post_all
from bench.models import load_transformers
from bench.ours import make_llm, offline_generate
from bench.timing import median, ratio
from bench.workload import Request, random_ids, requests
from tests.server_utils import live_server


def equal_length_batches(reqs: list[Request], batch: int, seed: int, vocab: int) -> list[tuple[list[list[int]], int]]:
    """Group by sorted prompt length; every prompt of a group gets the group's median length (cut, or
    extended with seeded random ids) and the group's max output length: no padding needed."""
    rng = random.Random(seed)
    ordered = sorted(reqs, key=lambda r: len(r.prompt_ids))
    groups = []
    for a in range(0, len(ordered), batch):
        group = ordered[a:a + batch]
        length = int(median([len(r.prompt_ids) for r in group]))
        prompts = [list(r.prompt_ids[:length]) + random_ids(rng, max(0, length - len(r.prompt_ids)), vocab)
                   for r in group]
        groups.append((prompts, max(r.max_new_tokens for r in group)))
    return groups


def _hf_one_at_a_time(hf, reqs: list[Request]) -> tuple[float, int]:
    start, tokens = time.perf_counter(), 0
    for r in tqdm(reqs, desc="transformers 1-at-a-time"):
        tokens += generate_timed(hf, list(r.prompt_ids), r.max_new_tokens).n
    return time.perf_counter() - start, tokens


def _hf_batches(hf, groups: list[tuple[list[list[int]], int]]) -> tuple[float, int]:
    seconds, tokens = 0.0, 0
    for prompts, new in tqdm(groups, desc="transformers batches"):
        s, n = generate_batch(hf, prompts, new)
        seconds, tokens = seconds + s, tokens + n
    return seconds, tokens


def run(ctx: BenchContext) -> dict:
    s = ctx.scale
    model = ctx.models.hf_copy
    llm = make_llm(model, max_running_requests=s.tp_requests)
    vocab = llm.cfg.vocab_size
    reqs = requests(ctx.seed, s.tp_requests, s.tp_prompt, s.tp_output, vocab)
    prompts, news = [list(r.prompt_ids) for r in reqs], [r.max_new_tokens for r in reqs]
    warm = requests(ctx.seed + 1, 2, (16, 32), (4, 4), vocab)
    offline_generate(llm, [list(r.prompt_ids) for r in warm], [4, 4])
    llm.engine.flush_cache()
    systems: dict[str, dict] = {}

    secs, toks = offline_generate(llm, prompts, news)
    systems["ours_offline"] = {"seconds": secs, "output_tokens": toks, "tok_s": toks / secs}
    del llm

    flags = ("--model-path", str(model), "--max-running-requests", str(s.tp_requests), "--dtype", "float32",
             "--device", "cpu", "--log-level", "warning", "--cuda-graph-max-bs", str(s.tp_requests))  # (captured)
    with live_server(*flags, log_dir=ctx.workdir, wait=600) as srv:
        post_all(srv.url, warm)
        secs, toks, errors = post_all(srv.url, reqs)
    systems["ours_server_http"] = {"seconds": secs, "output_tokens": toks, "tok_s": toks / secs, "errors": errors}

    hf = load_transformers(model)
    generate_timed(hf, prompts[0][:32], 4)  # warm-up
    secs, toks = _hf_one_at_a_time(hf, reqs)
    systems["transformers_one_at_a_time"] = {"seconds": secs, "output_tokens": toks, "tok_s": toks / secs}
    groups = equal_length_batches(reqs, s.tp_batch, ctx.seed + 2, vocab)
    secs, toks = _hf_batches(hf, groups)
    systems[f"transformers_batches_of_{s.tp_batch}"] = {
        "seconds": secs, "output_tokens": toks, "tok_s": toks / secs,
        "batches": [{"size": len(p), "prompt_len": len(p[0]), "new_tokens": n} for p, n in groups]}

    base = systems["ours_offline"]["tok_s"]
    out = {
        "params": {"requests": s.tp_requests, "prompt_len_range": list(s.tp_prompt),
                   "output_len_range": list(s.tp_output), "seed": ctx.seed, "model": "hf_copy",
                   "workload_output_tokens": sum(news), "workload_prompt_tokens": sum(len(p) for p in prompts)},
        "systems": systems,
        "ratios": {"offline_vs_transformers_one_at_a_time": ratio(base, systems["transformers_one_at_a_time"]["tok_s"]),
                   f"offline_vs_transformers_batches_of_{s.tp_batch}":
                       ratio(base, systems[f"transformers_batches_of_{s.tp_batch}"]["tok_s"]),
                   "server_vs_offline": ratio(systems["ours_server_http"]["tok_s"], base)},
    }
    print("\n== throughput ==")
    for name, r in systems.items():
        print(f"  {name:32s} {r['tok_s']:8.1f} output tok/s  ({r['output_tokens']} tokens in {r['seconds']:.1f} s)")
    for k, v in out["ratios"].items():
        print(f"  {k:44s} {v:6.2f}x")
    return out
