"""`server_load`: concurrent streaming clients against our server; throughput, TTFT and inter-token
latency per concurrency, and the top level's throughput against the offline engine on the same requests."""

from __future__ import annotations

from bench.context import BenchContext
from bench.http_load import post_all, stream_closed_loop
from bench.ours import make_llm, offline_generate
from bench.timing import percentile, ratio
from bench.workload import requests
from tests.server_utils import live_server


def run(ctx: BenchContext) -> dict:
    s = ctx.scale
    model = ctx.models.hf_copy
    top = max(s.load_levels)
    llm = make_llm(model, max_running_requests=top)
    vocab = llm.cfg.vocab_size
    workloads = {c: requests(ctx.seed + c, max(c, s.load_min_requests), s.load_prompt, s.load_new, vocab)
                 for c in s.load_levels}
    warm = requests(ctx.seed + 1, 2, (16, 32), (4, 4), vocab)
    offline_generate(llm, [list(r.prompt_ids) for r in warm], [4, 4])
    llm.engine.flush_cache()
    top_reqs = workloads[top]
    secs, toks = offline_generate(llm, [list(r.prompt_ids) for r in top_reqs], [r.max_new_tokens for r in top_reqs])
    offline = {"seconds": secs, "output_tokens": toks, "tok_s": toks / secs, "requests": len(top_reqs)}
    del llm

    flags = ("--model-path", str(model), "--max-running-requests", str(top), "--dtype", "float32",
             "--device", "cpu", "--log-level", "warning", "--cuda-graph-max-bs", str(top))  # (captured)
    levels = []
    with live_server(*flags, log_dir=ctx.workdir, wait=600) as srv:
        post_all(srv.url, warm)
        for c in s.load_levels:
            secs, st = stream_closed_loop(srv.url, workloads[c], c)
            levels.append({
                "clients": c, "requests": len(workloads[c]), "seconds": secs, "output_tokens": st.tokens,
                "tok_s": st.tokens / secs,
                "ttft_p50_s": percentile(st.ttft_s, 50), "ttft_p99_s": percentile(st.ttft_s, 99),
                "itl_p50_s": percentile(st.itl_s, 50), "itl_p99_s": percentile(st.itl_s, 99),
                "errors": len(st.errors), "error_samples": st.errors[:5]})
    out = {"params": {"levels": list(s.load_levels), "prompt_len_range": list(s.load_prompt),
                      "new_tokens_range": list(s.load_new), "stream": True, "greedy": True, "ignore_eos": True,
                      "requests_per_level": f"max(clients, {s.load_min_requests}), closed loop",
                      "model": "hf_copy"},
           "offline_same_requests": offline, "levels": levels,
           "ratio_top_level_vs_offline": ratio(levels[-1]["tok_s"], offline["tok_s"]), "top_level": top}
    print("\n== server_load (streaming) ==")
    print(f"  {'clients':>7s} {'tok/s':>8s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'ITL p50':>8s} {'ITL p99':>8s} errors")
    for lv in levels:
        print(f"  {lv['clients']:7d} {lv['tok_s']:8.1f} {lv['ttft_p50_s'] * 1000:7.0f}ms {lv['ttft_p99_s'] * 1000:7.0f}ms "
              f"{lv['itl_p50_s'] * 1000:6.1f}ms {lv['itl_p99_s'] * 1000:6.1f}ms {lv['errors']:6d}")
    print(f"  offline engine, same {len(top_reqs)} requests: {offline['tok_s']:.1f} tok/s; "
          f"server at {top} clients = {out['ratio_top_level_vs_offline']:.2f}x of it")
    return out
