"""`python -m bench.small_batch`: the CPU decode step at a few rows, the batch-dynamic graph as it is (its weight
products MKL's) against the same graph with graph_passes' matvec-as-reduction rewrite applied to it too (as the
batch-1 graph has it), their steps interleaved (bench/decode_graphs.py's `step_ms`). The rewrite is not in the
tree: it was measured on one kind of CPU only (README, "Hierarchical KV cache"), and a CPU-only change needs a
second; this measures it on any. Writes docs/benchmarks/small_batch.json (and $OUT/small_batch.json when OUT is
set)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

import engine.runtime.decode_graph as dg
from bench.decode_graphs import step_ms
from bench.machine import code_version
from bench.ours import make_engine
from engine.runtime import graph_passes
from engine.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
ROWS = (2, 4, 8, 16, 32, 64)
VERSION = "many-rewritten-v1"  # (names the saved graph: change it with the rewrite)
aten = torch.ops.aten


_FORMS = PatternMatcherPass(pass_name="many_row_matvec_as_reduction")


def _decode_rows(match: Match) -> bool:
    """One row (as in the tree), or the batch-dynamic graph's rows (a symbolic count)."""
    a = match.kwargs["a"].meta.get("val")
    return (a is not None and a.device.type == "cpu" and a.dim() == 2
            and (not isinstance(a.shape[0], int) or a.shape[0] == 1))


# graph_passes' own handlers (the same rewrite), registered under the wider check
register_graph_pattern(CallFunction(aten.mm, KeywordArg("a"), KeywordArg("b")), extra_check=_decode_rows,
                       pass_dict=_FORMS)(graph_passes._mm)
register_graph_pattern(CallFunction(aten.addmm, KeywordArg("bias"), KeywordArg("a"), KeywordArg("b")),
                       extra_check=_decode_rows, pass_dict=_FORMS)(graph_passes._addmm)


class ManyRowForms(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _FORMS.apply(graph)

    def uuid(self) -> Any:
        return VERSION


def build(rewrite: bool) -> Engine:
    init = dg.DecodeGraphs.__init__

    def patched(self, model, pool, *args, **kwargs) -> None:
        init(self, model, pool, *args, **kwargs)
        if rewrite and hasattr(self, "_many"):
            self._many = dg.PrecompiledStep(dg.decode_step, {"post_grad_custom_post_pass": ManyRowForms()},
                                            dg.store_path(VERSION, model, pool), dg._marked)

    dg.DecodeGraphs.__init__ = patched
    t = time.perf_counter()
    try:
        e = make_engine(ROOT / "configs" / "tiny", disable_radix_cache=True, max_total_tokens=16384,
                        max_running_requests=max(ROWS), cuda_graph_bs=[1, *ROWS])
    finally:
        dg.DecodeGraphs.__init__ = init
    print(f"{'rewritten' if rewrite else 'as it is'}: ready in {time.perf_counter() - t:.0f} s", flush=True)
    return e


def main() -> None:
    engines = (build(False), build(True))
    out: dict = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code_version(ROOT),
                 "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "rows": {}}
    for rows in ROWS:
        base, new = step_ms(engines, rows)  # (the two engines' steps interleaved)
        out["rows"][rows] = {"as_it_is_ms": round(base, 2), "rewritten_ms": round(new, 2),
                             "speedup": round(base / new, 3)}
        print(f"{rows:3d} rows: {base:6.2f} -> {new:6.2f} ms ({base / new:.2f}x)", flush=True)
    text = json.dumps(out, indent=1) + "\n"
    (ROOT / "docs" / "benchmarks" / "small_batch.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "small_batch.json").write_text(text)


if __name__ == "__main__":
    main()
