"""results.md: the targets (met / not met) and one table per benchmark, ratios first."""

from __future__ import annotations

import math
from collections.abc import Callable

GB = 1e9


def _f(x, fmt: str = ".3g", unit: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:{fmt}}{unit}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _targets(rows: list[dict]) -> list[str]:
    body = []
    for r in rows:
        v = r["value"]
        shown = "—" if v is None or math.isnan(v) else (f"{v:.2f}{r['unit']}" if r["unit"] else f"{100 * v:.1f}%")
        body.append([r["target"], shown, r["threshold"], f"**{r['status']}**", r["note"]])
    return ["## Targets", "", *_table(["target", "measured", "target", "status", "note"], body)]


def _decode(d: dict) -> list[str]:
    p = d["params"]
    rows = [[k, _f(v["decode_tok_s"], ".1f"), _f(v["e2e_tok_s"], ".1f"), _f(v["ms_per_token"], ".2f"),
             _f(1000 * v["ttft_s"], ".1f")] for k, v in d["systems"].items()]
    out = [f"## decode (batch 1, prompt {p['prompt_tokens']}, {p['new_tokens']} new tokens, greedy, "
           f"median of {p['runs']})", "",
           *_table(["system", "decode tok/s", "end-to-end tok/s", "ms/token", "TTFT ms"], rows),
           *_table(["ratio", "value"], [[k, _f(v, ".2f", "x")] for k, v in d["ratios"].items()]),
           f"Greedy tokens identical, ours on the copy vs transformers: **{d['greedy_tokens_identical']}**"
           + ("" if d["greedy_tokens_identical"] else f" (first mismatch at token {d['first_mismatch_index']})"), ""]
    r = d["roofline"]
    out += [f"Roofline at the mean decode context ({r['mean_context']:.1f} tokens). Bandwidth measured in this run: "
            f"copy {r['copy_bytes_per_s'] / GB:.2f} GB/s (bytes copied per second; **used for the roofline**), "
            f"STREAM-style read+write {r['stream_bytes_per_s'] / GB:.2f} GB/s.", ""]
    rows = []
    for name in ("ours_hf_copy", "ours_tiny"):
        x = r[name]
        b = x["bytes_per_token"]
        rows.append([name, _f(b["weights_total"] / 1e6, ".3f"), _f(b["kv_total"] / 1e6, ".4f"),
                     _f(b["total"] / 1e6, ".3f"), _f(x["roofline_tok_s_copy"], ".0f"),
                     _f(100 * x["fraction_of_roofline_copy"], ".1f", "%"), _f(x["roofline_tok_s_stream"], ".0f"),
                     _f(100 * x["fraction_of_roofline_stream"], ".1f", "%")])
    out += _table(["model", "weights MB/token", "KV MB/token", "total MB/token", "roofline tok/s (copy)",
                   "ours / roofline (copy)", "roofline tok/s (stream)", "ours / roofline (stream)"], rows)
    b = r["ours_hf_copy"]["bytes_per_token"]
    out += ["Breakdown (ours on the copy, bytes per token):", "",
            *_table(["part", "bytes"], [[k, f"{v:,.0f}"] for k, v in {**b["weights"], **b["kv"]}.items()])]
    return out


def _throughput(d: dict) -> list[str]:
    p = d["params"]
    rows = [[k, _f(v["tok_s"], ".1f"), str(v["output_tokens"]), _f(v["seconds"], ".1f")] for k, v in d["systems"].items()]
    return [f"## throughput ({p['requests']} requests, prompts {p['prompt_len_range']}, outputs "
            f"{p['output_len_range']}, seed {p['seed']})", "",
            *_table(["system", "output tok/s", "output tokens", "seconds"], rows),
            *_table(["ratio", "value"], [[k, _f(v, ".2f", "x")] for k, v in d["ratios"].items()])]


def _long_context(d: dict) -> list[str]:
    rows = []
    for c in d["cases"]:
        hf = c["transformers"]
        cut = hf.get("prefill_cut") or hf.get("cut") or ""
        if hf.get("synthetic_cache"):
            cut += "; decode timed over a random cache of that size"
        rows.append([str(c["context"]), _f(c["ours_sparse"]["prefill_s"], ".2f"), _f(c["ours_dense"]["prefill_s"], ".2f"),
                     _f(hf["prefill_s"], ".2f"), _f(c["ours_sparse"]["decode_tok_s"], ".1f"),
                     _f(c["ours_dense"]["decode_tok_s"], ".1f"), _f(hf["decode_tok_s"], ".1f"),
                     _f(c["ratios"]["prefill_speedup_vs_transformers"], ".2f", "x"),
                     _f(c["ratios"]["decode_speedup_vs_transformers"], ".2f", "x"),
                     _f(c["ratios"]["prefill_speedup_sparse_vs_dense"], ".2f", "x"),
                     _f(c["ratios"]["decode_speedup_sparse_vs_dense"], ".2f", "x"), cut])
    p = d["params"]
    return [f"## long_context ({p['new_tokens']} new tokens; transformers in a subprocess, "
            f"{p['transformers_timeout_s']:.0f} s timeout, {p['transformers_mem_cap_bytes'] / 2**30:.0f} GiB cap)", "",
            *_table(["context", "prefill s: sparse", "dense", "transformers", "decode tok/s: sparse", "dense",
                     "transformers", "prefill vs HF", "decode vs HF", "prefill sparse/dense", "decode sparse/dense",
                     "transformers cut / note"], rows),
            f"transformers prefill: {p['transformers_prefill']}; decode: {p['transformers_decode']}.", ""]


def _prefix(d: dict) -> list[str]:
    p = d["params"]
    return [f"## prefix_cache ({p['prefix_tokens']}-token shared prefix + {p['suffix_tokens']} new tokens, "
            f"median of {p['runs']})", "",
            *_table(["cold TTFT ms", "warm TTFT ms", "warm / cold", "cached tokens reported"],
                    [[_f(1000 * d["cold_ttft_s"], ".1f"), _f(1000 * d["warm_ttft_s"], ".1f"),
                      _f(d["ratio_warm_over_cold"], ".3f", "x"), str(d["cached_tokens_reported"])]])]


def _server_load(d: dict) -> list[str]:
    rows = [[str(x["clients"]), str(x["requests"]), _f(x["tok_s"], ".1f"), _f(1000 * x["ttft_p50_s"], ".0f"),
             _f(1000 * x["ttft_p99_s"], ".0f"), _f(1000 * x["itl_p50_s"], ".1f"), _f(1000 * x["itl_p99_s"], ".1f"),
             str(x["errors"])] for x in d["levels"]]
    o = d["offline_same_requests"]
    p = d["params"]
    return [f"## server_load (streaming, prompts {p['prompt_len_range']}, {p['new_tokens_range']} new tokens)", "",
            *_table(["clients", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                     "errors"], rows),
            f"Offline engine on the same {o['requests']} requests: {o['tok_s']:.1f} tok/s; server at "
            f"{d['top_level']} clients = **{d['ratio_top_level_vs_offline']:.2f}x** of it.", ""]


def _kv(d: dict) -> list[str]:
    rows = []
    for key, r in d["models"].items():
        per = ", ".join(f"{k}: {v}" for k, v in r["bytes_per_token_per_layer"].items())
        rows.append([key, per, str(r["bytes_per_token_total"]), "yes" if r["matches_spec"] else "NO",
                     "yes" if r["allocated_matches_accounting"] else "NO",
                     f"{r['k_only_saves_bytes_per_token']} B ({100 * r['k_only_saves_fraction']:.1f}%)",
                     f"{r['tokens_per_gib']:,}", f"{r['tokens_per_gib_if_every_sparse_layer_had_index_v']:,}"])
    return ["## kv_memory (bytes per token, from the pool's accounting)", "",
            *_table(["model/dtype", "per layer by kind", "total", "= model.md §5", "allocated = accounting",
                     "K-only sub-pool saves", "tokens per GiB", "tokens per GiB if all had index V"], rows)]


SECTIONS: tuple[tuple[str, Callable[[dict], list[str]]], ...] = (
    ("decode", _decode), ("throughput", _throughput), ("long_context", _long_context),
    ("prefix_cache", _prefix), ("server_load", _server_load), ("kv_memory", _kv))


def _code(code: dict | None) -> str:
    if not code:
        return ""
    dirty = code["uncommitted_engine_server_files"]
    return (f"Code measured: commit `{code['commit'][:12]}` (the newest run; each section names its own)"
            + (f", with uncommitted edits in {len(dirty)} "
            "engine/server files (listed in results.json; the engine is being optimized concurrently)." if dirty else "."))


NOTES = (
    "Threads: every process (this one, the server, the transformers workers) runs with the same torch/OpenMP "
    "thread count (`--threads`; 0 = torch's default, every core). On a shared machine use `--threads 1`: a "
    "2-thread OpenMP region waits for a busy core, and small ops then take 15-60 ms instead of microseconds.",
    "Interleaving: decode runs alternate ours / transformers, so load from other processes hits both alike.",
    "Greedy identity: ours runs with min_new_tokens = max_new_tokens (EOS suppressed), like transformers' "
    "`generate(min_new_tokens=...)`; throughput and server requests use ignore_eos.",
    "Roofline: weights a decode step reads per token (only the routed experts used) + KV at the mean decode "
    "context (sparse layers: top-k x block keys, index K over the whole context, index V on index-value layers). "
    "Primary bandwidth: bytes copied per second by a 256 MiB tensor copy (best of 7); STREAM-style counts read + "
    "write and is twice that.",
    "transformers long context: one forward of the whole prompt (as generate does) in a subprocess with a "
    "timeout and an address-space cap; when that runs out of memory the prefill is recorded as cut and decode is "
    "timed over a DynamicCache of the same length filled with random K/V (a step's cost does not depend on the "
    "values; its tokens are then not compared).",
    "transformers equal-length batches: every prompt of a batch gets the batch's median length and every request "
    "the batch's max output length; their tok/s counts the tokens actually produced (more than the workload's).",
)


def render(results: dict, targets: list[dict]) -> str:
    m = results["machine"]
    bw = m["bandwidth"]
    lines = [f"# Benchmarks{' (quick run)' if results.get('quick') else ''}", "",
             f"Run {m['date']} on {m['cpu']}: {m['cores']} cores, "
             f"{(m['memory_bytes'] or 0) / 2**30:.1f} GiB memory, load average at start "
             f"{', '.join(f'{x:.2f}' for x in m['load_average_at_start'])}; torch {m['torch']}, transformers "
             f"{m['transformers']}, float32 on CPU, {m['torch_threads']} thread(s) per process (`--threads`). Memory bandwidth measured in this run: copy "
             f"{bw['copy_bytes_per_s'] / GB:.2f} GB/s, STREAM-style {bw['stream_bytes_per_s'] / GB:.2f} GB/s.",
             "", _code(results.get("code")),
             "", "Every figure is measured in the same run as its baseline (ratios, not absolute claims). "
             "Models: `configs/tiny` (its trained weights) and a transformers `save_pretrained` copy of the same "
             "weights (`hf_copy`: every sparse layer K-only, no init blocks) that both systems load.", "",
             *_targets(targets)]
    for name, fn in SECTIONS:
        res = results["benchmarks"].get(name)
        if res is None:
            continue
        if "error" in res:
            lines += [f"## {name}", "", "Failed:", "", "```", res["error"].strip()[-2000:], "```", ""]
            continue
        lines += fn(res)
        if res.get("run_at"):
            at = f", commit `{res['commit'][:12]}`" if res.get("commit") else ""
            lines += [f"_{name} measured at {res['run_at']}{at}._", ""]
    lines += ["## Method notes", "", *(f"- {n}" for n in NOTES), ""]
    return "\n".join(lines) + "\n"
