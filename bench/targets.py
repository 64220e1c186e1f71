"""The suite's targets, each evaluated from the results of the same run: met / not met / n/a."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    bench: str
    threshold: float
    at_least: bool  # True: measured >= threshold; False: measured <= threshold
    unit: str
    measure: Callable[[dict], tuple[float | None, str]]  # bench results -> (value, note)


def _case(res: dict, context: int) -> dict | None:
    return next((c for c in res.get("cases", []) if c["context"] == context), None)


def _long_ctx(context: int, key: str, phase: str) -> Callable[[dict], tuple[float | None, str]]:
    def measure(res: dict) -> tuple[float | None, str]:
        c = _case(res, context)
        if c is None:
            return None, f"{context} tokens not run"
        hf = c["transformers"]
        why = hf.get("prefill_cut") if phase == "prefill" else hf.get("cut")
        if (hf.get("prefill_s") if phase == "prefill" else hf.get("decode_tok_s")) is None:
            return None, f"transformers cut: {why or hf.get('cut')}"
        note = "transformers decoded over a random cache of that size (its prefill did not fit)" \
            if phase == "decode" and hf.get("synthetic_cache") else ""
        return c["ratios"][key], note
    return measure


def _batches(res: dict) -> tuple[float | None, str]:
    key = next((k for k in res["ratios"] if k.startswith("offline_vs_transformers_batches_of_")), None)
    return (res["ratios"][key], key.rsplit("_", 1)[-1] + " per batch") if key else (None, "")


TARGETS: tuple[Target, ...] = (
    Target("decode tok/s vs transformers (batch 1)", "decode", 5.0, True, "x",
           lambda r: (r["ratios"]["ours_copy_vs_transformers_decode"], "ours on the HF copy")),
    Target("decode tok/s as a fraction of the roofline", "decode", 0.40, True, "",
           lambda r: (r["roofline"]["ours_hf_copy"]["fraction_of_roofline_copy"], "copy bandwidth")),
    Target("offline throughput vs transformers one-at-a-time", "throughput", 10.0, True, "x",
           lambda r: (r["ratios"]["offline_vs_transformers_one_at_a_time"], "")),
    Target("offline throughput vs transformers equal-length batches", "throughput", 3.0, True, "x", _batches),
    Target("4k prefill speed-up vs transformers", "long_context", 5.0, True, "x",
           _long_ctx(4096, "prefill_speedup_vs_transformers", "prefill")),
    Target("32k decode speed-up vs transformers", "long_context", 3.0, True, "x",
           _long_ctx(32768, "decode_speedup_vs_transformers", "decode")),
    Target("server throughput at top concurrency vs offline engine", "server_load", 0.70, True, "",
           lambda r: (r["ratio_top_level_vs_offline"], f"{r['top_level']} streaming clients")),
    Target("prefix-hit TTFT vs cold TTFT", "prefix_cache", 0.20, False, "x",
           lambda r: (r["ratio_warm_over_cold"], f"{r['params']['prefix_tokens']}-token shared prefix")),
)


def evaluate(benchmarks: dict) -> list[dict]:
    rows = []
    for t in TARGETS:
        res = benchmarks.get(t.bench)
        if res is None:
            value, note = None, "benchmark not run"
        elif "error" in res:
            value, note = None, "benchmark failed: " + res["error"].strip().splitlines()[-1][:120]
        else:
            value, note = t.measure(res)
        if value is None or math.isnan(value):
            status = "n/a"
        else:
            ok = value >= t.threshold if t.at_least else value <= t.threshold
            status = "met" if ok else "not met"
        rows.append({"target": t.name, "bench": t.bench, "threshold": ("≥ " if t.at_least else "≤ ") +
                     (f"{t.threshold:g}{t.unit}" if t.unit else f"{100 * t.threshold:g}%"),
                     "value": value, "unit": t.unit, "status": status, "note": note})
    return rows
