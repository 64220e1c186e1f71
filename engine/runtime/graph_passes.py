"""The rewrites inductor applies to the CPU batch-1 decode graph (`post_grad_custom_post_pass`, `BatchOneForms`): the
model's ops for one row and its weight products in forms inductor fuses. One row's `paged_attention` and
`paged_block_attention` as gathers and a written-out softmax (the op's dispatch: ~180 us a call, 11 a step), its
`moe_experts` as `gathered_experts` (its k experts' rows read in place), and every matrix-vector product (projections,
MLPs, LM head) as a multiply-and-sum inductor runs on every thread (MKL's sgemv uses one: 10.1 vs 6.5 ms a step).
Inductor's decompose_mm_pass also does it, but rewrites batch-1 bmm too (then guarded on the key length)."""

from typing import Any

import torch
import torch.nn.functional as F
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from engine.kernels import moe_experts, paged_attention
from engine.model import layers
from engine.runtime.decode_graph import SUM_PIECE

aten, minimax = torch.ops.aten, torch.ops.minimax
CallFunction, KeywordArg, Match, PatternMatcherPass = pm.CallFunction, pm.KeywordArg, pm.Match, pm.PatternMatcherPass
_PATTERNS, _OPS = PatternMatcherPass(pass_name="matvec_as_reduction"), PatternMatcherPass(pass_name="one_row_ops")
NEG_INF = float("-inf")
_ARGS = [KeywordArg(n) for n in ("q", "k", "v")]


def one_row_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor,
                      keep: torch.Tensor, scale: float) -> torch.Tensor:
    """`paged_attention` of one query row, written out. NOTE: the max and the sum run in two levels (N/SUM_PIECE x
    SUM_PIECE): inductor's CPU code sums over 4096 floats another way, guarding the length on it, so a one-level sum
    split the graph at 4096 keys (a recompile mid-serving). The batch-1 step: 1.8-2.3 ms, vs 2.6 ms through SDPA."""
    d, n, piece = q.shape[-1], rows.shape[-1], SUM_PIECE
    k, v = k_buf.view(-1, d)[rows], v_buf.view(-1, d)[rows]  # [1, H, N, D]
    s = F.pad((q.float() @ k.float().transpose(-1, -2) * scale).masked_fill(~keep, NEG_INF), (0, -n % piece),
              value=NEG_INF)  # fp32 (model.md §2), as SDPA's softmax; no-ops on fp32
    p = torch.exp(s - s.unflatten(-1, (-1, piece)).amax(-1).amax(-1, keepdim=True))  # [1, H, G, N padded]
    return ((p[..., :n] @ v.float()) / p.unflatten(-1, (-1, piece)).sum(-1).sum(-1, keepdim=True)).to(q.dtype)


def _first_one_row(match: Match) -> bool:
    x = match.kwargs["q"].meta.get("val")
    return x is not None and isinstance(x.shape[0], int) and x.shape[0] == 1


@pm.register_graph_pattern(CallFunction(minimax.paged_attention.default, *_ARGS, KeywordArg("rows"), KeywordArg("keep"),
                                     KeywordArg("scale")), extra_check=_first_one_row, pass_dict=_OPS)
def _attention(match: Match, q, k, v, rows, keep, scale: float) -> None:
    match.replace_by_example(lambda q, k, v, rows, keep: one_row_attention(q, k, v, rows, keep, scale),
                             [q, k, v, rows, keep])


@pm.register_graph_pattern(CallFunction(minimax.paged_block_attention.default, *_ARGS, KeywordArg("slots"),
                                     KeywordArg("blocks"), KeywordArg("q_pos"), KeywordArg("block_size"),
                                     KeywordArg("scale")), extra_check=_first_one_row, pass_dict=_OPS)
def _block_attention(match: Match, q, k, v, slots, blocks, q_pos, block_size: int, scale: float) -> None:
    def one_row(q, k, v, slots, blocks, q_pos):
        rows, keep = paged_attention.block_rows(slots, blocks, q_pos, block_size)
        return one_row_attention(q, k, v, rows, keep[:, :, None], scale)

    match.replace_by_example(one_row, [q, k, v, slots, blocks, q_pos])


@pm.register_graph_pattern(CallFunction(minimax.moe_experts.default, *(KeywordArg(n) for n in ("q", "ids", "w", "w13", "w2")),
                                     KeywordArg("alpha"), KeywordArg("limit")), extra_check=_first_one_row, pass_dict=_OPS)
def _moe(match: Match, q, ids, w, w13, w2, alpha: float, limit: float) -> None:
    match.replace_by_example(lambda x, ids, w, w13, w2: layers.gathered_experts(x, ids, w, w13, w2, alpha, limit),
                             [q, ids, w, w13, w2])


def _one_row(match: Match) -> bool:
    """A product of one row, and an addmm's bias and product unscaled (the forms below drop beta and alpha)."""
    a, b = match.kwargs["a"].meta.get("val"), match.kwargs["b"].meta.get("val")
    return (a is not None and b is not None and a.device.type == "cpu" and a.dim() == 2 and isinstance(a.shape[0], int)
            and a.shape[0] == 1 and all(match.output_node().kwargs.get(k, 1) == 1 for k in ("beta", "alpha")))


def _realized(*nodes: torch.fx.Node) -> None:
    """Each input computed once into a buffer, not recomputed inside the sum for every output element."""
    for n in nodes:
        n.meta["inductor_realize_to_strides"] = True


@pm.register_graph_pattern(CallFunction(aten.mm, KeywordArg("a"), KeywordArg("b")), extra_check=_one_row,
                        pass_dict=_PATTERNS)
def _mm(match: Match, a: torch.fx.Node, b: torch.fx.Node) -> None:
    match.replace_by_example(lambda a, b: (a[:, :, None] * b[None]).sum(dim=1), [a, b])
    _realized(a, b)


@pm.register_graph_pattern(CallFunction(aten.addmm, KeywordArg("bias"), KeywordArg("a"), KeywordArg("b")),
                        extra_check=_one_row, pass_dict=_PATTERNS)
def _addmm(match: Match, bias: torch.fx.Node, a: torch.fx.Node, b: torch.fx.Node) -> None:
    match.replace_by_example(lambda bias, a, b: (a[:, :, None] * b[None]).sum(dim=1) + bias, [bias, a, b])
    _realized(bias, a, b)


class BatchOneForms(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _OPS.apply(graph)
        _PATTERNS.apply(graph)

    def uuid(self) -> Any:  # (inductor's compile cache keys on these files' text: the pass and the forms it writes)
        return get_hash_for_files((__file__, layers.__file__, paged_attention.__file__, moe_experts.__file__))
