"""`prefix_cache`: time to first token of a request sharing a long prefix with a finished one (radix
hit) vs the same request cold (after flush_cache), same engine."""

from __future__ import annotations

from tqdm import tqdm

from bench.context import BenchContext
from bench.ours import make_engine, timed_generate
from bench.timing import median, ratio
from bench.workload import prompt


def run(ctx: BenchContext) -> dict:
    s = ctx.scale
    engine = make_engine(ctx.models.tiny)  # radix cache on (the default)
    vocab = engine.cfg.vocab_size
    timed_generate(engine, prompt(ctx.seed, 64, vocab), 2)  # warm-up
    cold, warm, cached = [], [], []
    for i in tqdm(range(s.prefix_runs), desc="prefix_cache"):
        prefix = prompt(ctx.seed + 100 + i, s.prefix_len, vocab)
        first = prefix + prompt(ctx.seed + 200 + i, s.prefix_suffix, vocab)
        second = prefix + prompt(ctx.seed + 300 + i, s.prefix_suffix, vocab)
        assert engine.flush_cache(), "flush_cache refused on an idle engine"
        cold.append(timed_generate(engine, first, 1).ttft_s)  # cold: nothing cached; then `first` is cached
        hit = timed_generate(engine, second, 1)  # shares the prefix with the finished `first`
        warm.append(hit.ttft_s)
        cached.append(hit.cached_tokens)
    out = {"params": {"prefix_tokens": s.prefix_len, "suffix_tokens": s.prefix_suffix, "runs": s.prefix_runs,
                      "model": "configs/tiny", "statistic": "median",
                      "cold": "after flush_cache", "warm": "prefix shared with a finished request"},
           "cold_ttft_s": median(cold), "warm_ttft_s": median(warm), "cold_runs_s": cold, "warm_runs_s": warm,
           "cached_tokens_reported": cached,
           "ratio_warm_over_cold": ratio(median(warm), median(cold))}
    print("\n== prefix_cache ==")
    print(f"  cold TTFT {out['cold_ttft_s'] * 1000:.1f} ms, warm TTFT {out['warm_ttft_s'] * 1000:.1f} ms, "
          f"warm/cold = {out['ratio_warm_over_cold']:.3f}x (cached tokens reported: {cached})")
    return out

