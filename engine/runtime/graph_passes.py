"""A rewrite inductor applies to the CPU batch-1 decode graph (`post_grad_custom_post_pass`).

MatVecAsReduction: every one-row weight product (matrix-vector: the projections, MLPs and
the LM head of a batch-1 step) written as a multiply-and-sum, which inductor generates itself and runs on every
thread. NOTE: MKL's sgemv ran them on one
thread (the other spun idle): a batch-1 step 10.1 -> 6.5 ms and 9.5 -> 6.2 ms on an AVX2 machine, 2 threads,
interleaved. Inductor's own decompose_mm_pass does this too, but also rewrites batch-1 bmm, whose sums over the
key length then guard it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import (
    CallFunction,
    KeywordArg,
    Match,
    PatternMatcherPass,
    register_graph_pattern,
)

aten = torch.ops.aten
_PATTERNS = PatternMatcherPass(pass_name="matvec_as_reduction")


def _one_row(match: Match) -> bool:
    a, b = match.kwargs["a"].meta.get("val"), match.kwargs["b"].meta.get("val")
    return (a is not None and b is not None and a.device.type == "cpu" and a.dim() == 2
            and isinstance(a.shape[0], int) and a.shape[0] == 1)


def _realized(*nodes: torch.fx.Node) -> None:
    """Each input computed once into a buffer, not recomputed inside the sum for every output element."""
    for n in nodes:
        n.meta["inductor_realize_to_strides"] = True


@register_graph_pattern(CallFunction(aten.mm, KeywordArg("a"), KeywordArg("b")), extra_check=_one_row,
                        pass_dict=_PATTERNS)
def _mm(match: Match, a: torch.fx.Node, b: torch.fx.Node) -> None:
    match.replace_by_example(lambda a, b: (a[:, :, None] * b[None]).sum(dim=1), [a, b])
    _realized(a, b)


@register_graph_pattern(CallFunction(aten.addmm, KeywordArg("bias"), KeywordArg("a"), KeywordArg("b")),
                        extra_check=_one_row, pass_dict=_PATTERNS)
def _addmm(match: Match, bias: torch.fx.Node, a: torch.fx.Node, b: torch.fx.Node) -> None:
    match.replace_by_example(lambda bias, a, b: (a[:, :, None] * b[None]).sum(dim=1) + bias, [bias, a, b])
    _realized(bias, a, b)


class MatVecAsReduction(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))  # (inductor's compile cache keys on this file's text)
