"""Rewrites inductor applies to the CPU decode graphs (`post_grad_custom_post_pass`).

MatMulThroughOneDNN (the batched graph): its wide weight products through oneDNN's GEMM (see the class).
MatVecAsReduction (the batch-1 graph): every one-row weight product (matrix-vector: the projections, MLPs and
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

from engine.kernels.onednn_linear import onednn_linear

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


_ONEDNN = PatternMatcherPass(pass_name="matmul_through_onednn")
WIDE = 2048  # output features from which a weight product goes through oneDNN (see MatMulThroughOneDNN)


def _weight_t(match: Match) -> bool:
    a, w = match.kwargs["a"].meta.get("val"), match.kwargs["w"].meta.get("val")
    return (a is not None and w is not None and a.device.type == "cpu" and a.dtype == w.dtype == torch.float32
            and a.dim() == w.dim() == 2 and list(match.kwargs["dims"]) == [1, 0] and w.is_contiguous()
            and w.shape[0] >= WIDE)


_W_T = CallFunction(aten.permute, KeywordArg("w"), KeywordArg("dims"))


@register_graph_pattern(CallFunction(aten.mm, KeywordArg("a"), _W_T), extra_check=_weight_t, pass_dict=_ONEDNN)
def _mm_onednn(match: Match, a: torch.fx.Node, w: torch.fx.Node, dims: Any) -> None:
    match.replace_by_example(lambda a, w: onednn_linear(a, w), [a, w])


@register_graph_pattern(CallFunction(aten.addmm, KeywordArg("bias"), KeywordArg("a"), _W_T), extra_check=_weight_t,
                        pass_dict=_ONEDNN)
def _addmm_onednn(match: Match, bias: torch.fx.Node, a: torch.fx.Node, w: torch.fx.Node, dims: Any) -> None:
    match.replace_by_example(lambda bias, a, w: onednn_linear(a, w) + bias, [bias, a, w])


class MatMulThroughOneDNN(CustomGraphPass):
    """The batched decode graph's wide weight products (at least WIDE outputs: the LM head, the dense MLPs'
    gate|up) through oneDNN's GEMM instead of MKL's. NOTE: on a 2-core AVX-512 AMD, where MKL takes a slower path
    than on Intel: a [64, 256] x [256, 4096] product 0.74-0.83 vs 1.0-2.0 ms, [32, 256] x [256, 2048] 0.21-0.24
    vs 0.27-0.42 ms; narrower ones no faster (at 8 rows slower), so they stay MKL's. Captured steps, interleaved
    with the plain graph's in one process: 1.04x / 1.02-1.04x / 1.02-1.03x at 8 / 32 / 64 rows. Not measured on
    Intel."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        _ONEDNN.apply(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


class MatVecAsReduction(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _PATTERNS.apply(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))  # (inductor's compile cache keys on this file's text)
