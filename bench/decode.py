"""`decode`: batch 1, greedy, fixed prompt and output length; ours (on the transformers copy and on
configs/tiny) vs transformers `generate` on the copy, plus the memory-bandwidth roofline."""

from __future__ import annotations

from tqdm import tqdm

from bench.context import BenchContext
from bench.hf_gen import generate_timed
from bench.models import load_transformers
from bench.ours import make_engine, timed_generate
from bench.roofline import decode_bytes_per_token
from bench.timing import TokenTimes, median, ratio
from bench.workload import greedy_like_transformers, prompt

WARMUP_NEW = 8


def _summary(runs: list[TokenTimes]) -> dict:
    return {"decode_tok_s": median([r.decode_tok_s for r in runs]),
            "e2e_tok_s": median([r.e2e_tok_s for r in runs]),
            "ms_per_token": 1000 / median([r.decode_tok_s for r in runs]),
            "ttft_s": median([r.ttft_s for r in runs]),
            "runs_decode_tok_s": [r.decode_tok_s for r in runs]}


def _first_mismatch(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(ctx: BenchContext) -> dict:
    s = ctx.scale
    ours_copy = make_engine(ctx.models.hf_copy, disable_radix_cache=True, cuda_graph_bs=[1])  # (one request)
    ours_tiny = make_engine(ctx.models.tiny, disable_radix_cache=True, cuda_graph_bs=[1])
    hf = load_transformers(ctx.models.hf_copy)
    ids = prompt(ctx.seed, s.decode_prompt, ours_copy.cfg.vocab_size)
    systems = {"ours_hf_copy": lambda: timed_generate(ours_copy, ids, s.decode_new),
               "ours_tiny": lambda: timed_generate(ours_tiny, ids, s.decode_new),
               "transformers_hf_copy": lambda: generate_timed(hf, ids, s.decode_new)}
    timed_generate(ours_copy, ids, WARMUP_NEW)
    timed_generate(ours_tiny, ids, WARMUP_NEW)
    generate_timed(hf, ids, WARMUP_NEW)
    runs: dict[str, list[TokenTimes]] = {k: [] for k in systems}
    with tqdm(total=s.decode_runs * len(systems), desc="decode") as bar:
        for _ in range(s.decode_runs):  # interleaved, so machine noise hits every system alike
            for name, fn in systems.items():
                runs[name].append(fn())
                bar.update(1)
    res = {name: _summary(r) for name, r in runs.items()}
    ours_tokens, hf_tokens = runs["ours_hf_copy"][0].output_ids, runs["transformers_hf_copy"][0].output_ids
    mismatch = _first_mismatch(ours_tokens, hf_tokens)

    mean_ctx = s.decode_prompt + (s.decode_new - 1) / 2  # the context over the decode steps
    bw = ctx.bandwidth
    roof = {}
    for name, engine in (("ours_hf_copy", ours_copy), ("ours_tiny", ours_tiny)):
        b = decode_bytes_per_token(engine.cfg, mean_ctx, 4)
        roof_tok_s = bw.copy_bytes_per_s / b["total"]
        roof[name] = {"bytes_per_token": b, "roofline_tok_s_copy": roof_tok_s,
                      "roofline_tok_s_stream": bw.stream_bytes_per_s / b["total"],
                      "fraction_of_roofline_copy": res[name]["decode_tok_s"] / roof_tok_s,
                      "fraction_of_roofline_stream": res[name]["decode_tok_s"] * b["total"] / bw.stream_bytes_per_s}
    out = {
        "params": {"batch": 1, "prompt_tokens": s.decode_prompt, "new_tokens": s.decode_new, "runs": s.decode_runs,
                   "statistic": "median", "dtype": "float32",
                   "sampling_ours": greedy_like_transformers(s.decode_new),
                   "sampling_transformers": f"do_sample=False, max_new_tokens=min_new_tokens={s.decode_new}"},
        "systems": res,
        "ratios": {"ours_copy_vs_transformers_decode": ratio(res["ours_hf_copy"]["decode_tok_s"],
                                                             res["transformers_hf_copy"]["decode_tok_s"]),
                   "ours_copy_vs_transformers_e2e": ratio(res["ours_hf_copy"]["e2e_tok_s"],
                                                          res["transformers_hf_copy"]["e2e_tok_s"]),
                   "ours_tiny_vs_transformers_decode": ratio(res["ours_tiny"]["decode_tok_s"],
                                                             res["transformers_hf_copy"]["decode_tok_s"])},
        "greedy_tokens_identical": mismatch is None,
        "first_mismatch_index": mismatch,
        "roofline": {"mean_context": mean_ctx, "bandwidth_definition": "copy (bytes copied per second)",
                     "copy_bytes_per_s": bw.copy_bytes_per_s, "stream_bytes_per_s": bw.stream_bytes_per_s,
                     **roof},
    }
    _print(out)
    return out


def _print(out: dict) -> None:
    print("\n== decode (batch 1) ==")
    for name, r in out["systems"].items():
        print(f"  {name:22s} decode {r['decode_tok_s']:8.1f} tok/s   e2e {r['e2e_tok_s']:8.1f} tok/s   "
              f"TTFT {r['ttft_s'] * 1000:7.1f} ms")
    for k, v in out["ratios"].items():
        print(f"  {k:40s} {v:6.2f}x")
    print(f"  greedy tokens identical (ours on copy vs transformers): {out['greedy_tokens_identical']}")
    r = out["roofline"]
    print(f"  bandwidth: copy {r['copy_bytes_per_s'] / 1e9:.2f} GB/s (primary), "
          f"STREAM-style read+write {r['stream_bytes_per_s'] / 1e9:.2f} GB/s")
    for name in ("ours_hf_copy", "ours_tiny"):
        b = r[name]["bytes_per_token"]
        print(f"  {name}: bytes/token at context {b['context']:.1f} = {b['total'] / 1e6:.3f} MB "
              f"(weights {b['weights_total'] / 1e6:.3f} MB, KV {b['kv_total'] / 1e6:.3f} MB)")
        for part, v in {**b["weights"], **b["kv"]}.items():
            print(f"      {part:16s} {v / 1e3:10.1f} kB")
        print(f"    roofline {r[name]['roofline_tok_s_copy']:.0f} tok/s (copy) / "
              f"{r[name]['roofline_tok_s_stream']:.0f} tok/s (stream); ours = "
              f"{100 * r[name]['fraction_of_roofline_copy']:.1f}% (copy) / "
              f"{100 * r[name]['fraction_of_roofline_stream']:.1f}% (stream)")
