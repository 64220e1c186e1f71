"""`python -m bench.small_batch`: the CPU decode step at a few rows, the batch-dynamic graph as it is (its weight
products MKL's) against the same graph with its weight products in one of two other forms: each built twice, in
mirrored order (A B C C B A: an engine built later runs a few percent faster), their steps interleaved
(bench/decode_graphs.py's `step_ms`), a form's time its two engines' mean:
- rewritten: graph_passes' matvec-as-reduction rewrite applied to it too (as the batch-1 graph has it);
- onednn: each product through oneDNN's float32 GEMM on a prepacked copy of its weight (`mkldnn._linear_pointwise`
  over `_reorder_linear_weight`: the form inductor's own weight prepacking emits, and vLLM's CPU backend uses).
Neither is in the tree: each was measured on one kind of CPU only (README, "Hierarchical KV cache"), and a CPU-only
change needs a second; this measures them on any. Writes docs/benchmarks/small_batch.json (and
$OUT/small_batch.json when OUT is set)."""

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
from bench.machine import code_version, cpu_model, mkl_intel_path
from bench.ours import make_engine
from engine.runtime import graph_passes
from engine.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]
ROWS = (2, 4, 8, 16, 32, 64)
VERSIONS = {"rewritten": "many-rewritten-v2", "onednn": "many-onednn-v2"}  # (name the saved graphs: change with a form)
aten = torch.ops.aten


_FORMS = PatternMatcherPass(pass_name="many_row_matvec_as_reduction")
_ONEDNN = PatternMatcherPass(pass_name="many_row_products_through_onednn")
_PACKED: dict[tuple, torch.Tensor] = {}  # (a weight's address and shape -> its packed copy, made at its first call)


@torch.library.custom_op("small_batch::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T through oneDNN on a copy of the weight w [N, K] packed once (the weights never move under a graph)."""
    key = (w.data_ptr(), tuple(w.shape))
    if (packed := _PACKED.get(key)) is None:
        packed = _PACKED[key] = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


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


def _weight_product(match: Match) -> bool:
    """A product of the batch-dynamic graph's rows by a weight (a graph input, transposed), addmm's unscaled."""
    a, w = match.kwargs["a"].meta.get("val"), match.kwargs["w"]
    return (a is not None and a.device.type == "cpu" and a.dim() == 2 and not isinstance(a.shape[0], int)
            and w.op == "placeholder" and list(match.kwargs["dims"]) == [1, 0]
            and all(match.output_node().kwargs.get(k, 1) == 1 for k in ("beta", "alpha")))


_WEIGHT_T = CallFunction(aten.permute, KeywordArg("w"), KeywordArg("dims"))


@register_graph_pattern(CallFunction(aten.mm, KeywordArg("a"), _WEIGHT_T), extra_check=_weight_product,
                        pass_dict=_ONEDNN)
def _mm_onednn(match: Match, a: torch.fx.Node, w: torch.fx.Node, dims: Any) -> None:
    match.replace_by_example(lambda a, w: packed_linear(a, w), [a, w])


@register_graph_pattern(CallFunction(aten.addmm, KeywordArg("bias"), KeywordArg("a"), _WEIGHT_T),
                        extra_check=_weight_product, pass_dict=_ONEDNN)
def _addmm_onednn(match: Match, bias: torch.fx.Node, a: torch.fx.Node, w: torch.fx.Node, dims: Any) -> None:
    match.replace_by_example(lambda bias, a, w: packed_linear(a, w) + bias, [bias, a, w])


class ManyRowForms(CustomGraphPass):
    def __init__(self, form: str) -> None:
        self.form = form

    def __call__(self, graph: torch.fx.Graph) -> None:
        (_FORMS if self.form == "rewritten" else _ONEDNN).apply(graph)

    def uuid(self) -> Any:
        return VERSIONS[self.form]


def build(form: str | None) -> Engine:
    """An engine whose batch-dynamic graph has its weight products in `form` (None: as it is)."""
    init = dg.DecodeGraphs.__init__

    def patched(self, model, pool, *args, **kwargs) -> None:
        init(self, model, pool, *args, **kwargs)
        if form and hasattr(self, "_many"):
            options = self._many.options | {"post_grad_custom_post_pass": ManyRowForms(form)}  # (as the tree's, with it)
            self._many = dg.PrecompiledStep(dg.decode_step, options, dg.store_path(VERSIONS[form], model, pool),
                                            dg._marked)

    dg.DecodeGraphs.__init__ = patched
    t = time.perf_counter()
    try:
        e = make_engine(ROOT / "configs" / "tiny", disable_radix_cache=True, max_total_tokens=16384,
                        max_running_requests=max(ROWS), cuda_graph_bs=[1, *ROWS])
    finally:
        dg.DecodeGraphs.__init__ = init
    print(f"{form or 'as it is'}: ready in {time.perf_counter() - t:.0f} s", flush=True)
    return e


def main() -> None:
    forms = ["rewritten", *(["onednn"] if torch.backends.mkldnn.is_available() else [])]
    order = [None, *forms, *reversed(forms), None]  # (each form built twice, mirrored: see step_ms' NOTE)
    engines = tuple(build(f) for f in order)
    out: dict = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code_version(ROOT),
                 "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                 "cpu": cpu_model(), "mkl_intel_path": mkl_intel_path(), "rows": {}}
    for rows in ROWS:
        ms = step_ms(engines, rows)  # (the engines' steps interleaved; a form's time: its two engines' mean)
        base, *new = ((ms[i] + ms[-1 - i]) / 2 for i in range(len(forms) + 1))
        out["rows"][rows] = {"as_it_is_ms": round(base, 2)} | {
            k: v for f, t in zip(forms, new) for k, v in ((f"{f}_ms", round(t, 2)), (f"{f}_speedup", round(base / t, 3)))}
        print(f"{rows:3d} rows: as it is {base:6.2f} ms; " + "; ".join(
            f"{f} {t:6.2f} ms ({base / t:.2f}x)" for f, t in zip(forms, new)), flush=True)
    text = json.dumps(out, indent=1) + "\n"
    (ROOT / "docs" / "benchmarks" / "small_batch.json").write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "small_batch.json").write_text(text)


if __name__ == "__main__":
    main()
