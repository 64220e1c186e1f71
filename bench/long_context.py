"""`long_context`: prefill time and decode tokens/s at growing contexts; ours (block-sparse), the same
weights with every layer dense, and transformers (each case in a capped subprocess)."""

from __future__ import annotations

import json
import math

from tqdm import tqdm

from bench.context import BenchContext
from bench.ours import make_engine, timed_generate
from bench.subproc import run_worker
from bench.timing import TokenTimes, ratio
from bench.workload import prompt


def _ours(tt: TokenTimes) -> dict:
    return {"prefill_s": tt.ttft_s, "decode_tok_s": tt.decode_tok_s, "ms_per_token": 1000 / tt.decode_tok_s,
            "tokens": list(tt.output_ids)}


def _hf_case(ctx: BenchContext, ids: list[int], n: int) -> dict:
    s = ctx.scale
    if n > s.lc_hf_max_context:
        return {"cut": "not run in quick mode"}
    prompt_file = ctx.workdir / f"prompt_{n}.json"
    prompt_file.write_text(json.dumps(ids))
    res = run_worker("bench.hf_worker", [str(ctx.models.hf_copy), str(prompt_file), str(s.lc_new + 1),
                                         str(s.lc_mem_cap_bytes)], s.lc_timeout_s)
    rec = res.records
    out: dict = {"prefill_s": rec.get("prefill_s"), "decode_tok_s": None, "ms_per_token": None}
    if "prefill_cut" in rec:
        out["prefill_cut"] = rec["prefill_cut"]
    if "decode_s" in rec:
        out["decode_tok_s"] = rec["decode_steps"] / rec["decode_s"]
        out["ms_per_token"] = 1000 / out["decode_tok_s"]
        out["synthetic_cache"] = rec["synthetic_cache"]
        if not rec["synthetic_cache"]:
            out["tokens"] = rec["tokens"]
    if res.cut:
        out["cut"] = res.cut
        if out["prefill_s"] is None and "prefill_cut" not in out:
            out["prefill_cut"] = res.cut
    return out


def run(ctx: BenchContext) -> dict:
    s = ctx.scale
    args = dict(disable_radix_cache=True, max_total_tokens=s.lc_pool_tokens, chunked_prefill_size=s.lc_chunked_prefill,
                cuda_graph_bs=[1])  # one request at a time: the batch-1 graph only
    engines = {"ours_sparse": make_engine(ctx.models.hf_copy, **args),
               "ours_dense": make_engine(ctx.models.hf_copy_dense, **args)}
    vocab = engines["ours_sparse"].cfg.vocab_size
    for e in engines.values():  # warm-up
        timed_generate(e, prompt(ctx.seed, 64, vocab), 4)
    cases = []
    for n in tqdm(s.lc_contexts, desc="long_context"):
        ids = prompt(ctx.seed + n, n, vocab)
        case: dict = {"context": n}
        for name, e in engines.items():
            case[name] = _ours(timed_generate(e, ids, s.lc_new + 1))
        case["transformers"] = _hf_case(ctx, ids, n)
        hf, sp, de = case["transformers"], case["ours_sparse"], case["ours_dense"]
        hf_tokens = hf.get("tokens")
        case["ratios"] = {
            "prefill_speedup_vs_transformers": ratio(hf["prefill_s"], sp["prefill_s"]),
            "decode_speedup_vs_transformers": ratio(sp["decode_tok_s"], hf["decode_tok_s"]),
            "prefill_speedup_sparse_vs_dense": ratio(de["prefill_s"], sp["prefill_s"]),
            "decode_speedup_sparse_vs_dense": ratio(sp["decode_tok_s"], de["decode_tok_s"]),
        }
        case["greedy_tokens_match_transformers"] = None if hf_tokens is None else hf_tokens == sp["tokens"]
        cases.append(case)
        _print_case(case)
    return {"params": {"contexts": list(s.lc_contexts), "new_tokens": s.lc_new, "model": "hf_copy",
                       "max_total_tokens": s.lc_pool_tokens, "chunked_prefill_size": s.lc_chunked_prefill,
                       "transformers_timeout_s": s.lc_timeout_s, "transformers_mem_cap_bytes": s.lc_mem_cap_bytes,
                       "transformers_prefill": "one forward of the whole prompt (as generate does)",
                       "transformers_decode": "greedy loop over its DynamicCache; when the prefill ran out of "
                                              "memory, over a cache of the same size holding random K/V"},
            "cases": cases}


def _fmt(x: float | None, unit: str) -> str:
    return "cut" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g} {unit}"


def _print_case(c: dict) -> None:
    print(f"\n== long_context {c['context']} tokens ==")
    for name in ("ours_sparse", "ours_dense", "transformers"):
        r = c[name]
        why = f"  [{r.get('prefill_cut') or r.get('cut')}]" if r.get("prefill_cut") or r.get("cut") else ""
        print(f"  {name:14s} prefill {_fmt(r['prefill_s'], 's'):>10s}   decode {_fmt(r['decode_tok_s'], 'tok/s'):>12s}{why}")
    for k, v in c["ratios"].items():
        print(f"  {k:36s} {'—' if math.isnan(v) else f'{v:.2f}x':>7s}")
