"""The lightning indexer's decode step on CUDA as Triton kernels (model.md §3.2-§3.3): a row's block scores over its
own keys (their count read from `lengths`, as triton_decode's attention reads it), then its top-k blocks. Elsewhere,
and for good after a failed launch, indexer.py's forms serve (`block_scores` over the gathered keys, `select_blocks`)."""

import torch

from engine.kernels import triton_decode
from engine.kernels.triton_decode import _programs, kernel_op, tl, triton
from engine.model.indexer import block_masks, block_scores, select_blocks


def decode_block_scores(iq: torch.Tensor, ik_buf: torch.Tensor, key_slots: torch.Tensor, lengths: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """`block_scores` of iq [B, H, D] over row r's keys j < lengths[r] (index keys ik_buf [slots, 1, D]) -> [B, H,
    ceil(N / block_size)] float32, -inf past a row's last block: Triton's kernel where it runs, else gathered keys."""
    scores = _scores if triton_decode.usable(iq, ik_buf, block_size) else _gathered_scores
    return scores(iq, ik_buf, key_slots, lengths, block_size)


def decode_select(scores: torch.Tensor, q_pos: torch.Tensor, masks: tuple | None, block_size: int, topk: int,
                  init: int, local: int) -> torch.Tensor:
    """`select_blocks` of a decode step's block scores [B, H, nb] (queries at q_pos [B]) -> [B, H, topk]: Triton's
    kernel where it runs, else under `masks`, the step's `block_masks` (made here if a launch failed this step)."""
    if triton_decode.serves(scores.device):
        return _select(scores, q_pos, block_size, topk, init, local)
    return _selected(scores, q_pos, block_size, topk, init, local, masks)


def _gathered_scores(iq, ik_buf, key_slots, lengths, block_size):
    visible = torch.arange(key_slots.shape[1], device=iq.device) < lengths[:, None]
    return block_scores(iq[:, None], ik_buf[key_slots][:, :, 0], visible[:, None], block_size)[:, :, 0]


def _selected(scores, q_pos, block_size, topk, init, local, masks=None):
    masks = block_masks(q_pos[:, None], scores.shape[-1], block_size, topk, init, local) if masks is None else masks
    return select_blocks(scores[:, :, None], masks)[:, :, 0]


@kernel_op("(Tensor iq, Tensor ik_buf, Tensor key_slots, Tensor lengths, int block_size) -> Tensor", _gathered_scores,
           fake=lambda iq, ik, slots, lengths, bs: iq.new_empty(*iq.shape[:2], -(-slots.shape[1] // bs),
                                                                dtype=torch.float32))
def _scores(iq, ik_buf, key_slots, lengths, block_size):
    (b, h, d), nb = iq.shape, -(-key_slots.shape[1] // block_size)
    per = -(-nb // max(1, min(nb, _programs(iq.device) // b)))  # (blocks a program)
    out = torch.empty(b, h, nb, device=iq.device)
    _scores_kernel[(b, -(-nb // per))](iq.contiguous(), ik_buf, key_slots, lengths, out, key_slots.stride(0), nb, per,
                                       H=h, HP=max(16, triton.next_power_of_2(h)), D=d, BS=block_size)
    return out


@kernel_op("(Tensor scores, Tensor q_pos, int block_size, int topk, int init, int local) -> Tensor", _selected,
           fake=lambda s, q_pos, bs, topk, *_: s.new_empty(*s.shape[:2], topk, dtype=torch.int64))
def _select(scores, q_pos, block_size, topk, init, local):
    (b, h, nb), k = scores.shape, topk
    out = torch.empty(b, h, k, dtype=torch.int64, device=scores.device)
    _select_kernel[(b, h)](scores.contiguous(), q_pos.contiguous(), out, nb, init, local, H=h, K=k, BS=block_size,
                           NB=triton.next_power_of_2(nb))
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["per"])
    def _scores_kernel(iq, ik, slots, lengths, out, slot_stride, nb, per, H: tl.constexpr, HP: tl.constexpr,
                       D: tl.constexpr, BS: tl.constexpr):
        r, s = tl.program_id(0), tl.program_id(1)
        n = tl.load(lengths + r).to(tl.int32)
        h, d, j = tl.arange(0, HP), tl.arange(0, D), tl.arange(0, BS)
        qv = tl.load(iq + (r * H + h[:, None]) * D + d[None, :], mask=h[:, None] < H, other=0.0)
        last, keyed = tl.minimum(s * per + per, nb), tl.minimum(s * per + per, tl.cdiv(n, BS))
        for blk in range(tl.maximum(keyed, s * per), last):  # (blocks past the row's keys)
            tl.store(out + (r * H + h) * nb + blk, tl.full([HP], float("-inf"), tl.float32), mask=h < H)
        for blk in range(s * per, keyed):
            pos = blk * BS + j
            ok = pos < n
            at = tl.load(slots + r * slot_stride + pos, mask=ok, other=0).to(tl.int64)[:, None] * D + d[None, :]
            kv = tl.load(ik + at, mask=ok[:, None], other=0.0)
            sc = tl.where(ok[None, :], tl.dot(qv, tl.trans(kv), input_precision="ieee"), float("-inf"))  # [HP, BS]
            tl.store(out + (r * H + h) * nb + blk, tl.max(sc, 1), mask=h < H)

    @triton.jit
    def _select_kernel(scores, q_pos, out, nb, init, local, H: tl.constexpr, K: tl.constexpr, BS: tl.constexpr,
                       NB: tl.constexpr):
        """`select_blocks` of one row and head: the K best keys one at a time (tl.argmax: ties to the lower block),
        forced blocks' keys +inf, blocks past the query's own (v) -inf, slots from v on -1."""
        r, h, b = tl.program_id(0), tl.program_id(1), tl.arange(0, NB)
        v = tl.load(q_pos + r) // BS + 1
        key = tl.load(scores + (r * H + h) * nb + b, mask=b < v, other=float("-inf"))
        key = tl.where((b < v) & ((b < init) | (b >= v - local)), float("inf"), key)
        for i in tl.static_range(K):
            best = tl.argmax(key, 0)
            tl.store(out + (r * H + h) * K + i, tl.where(i < v, best.to(tl.int64), -1))
            key = tl.where(b == best, float("-inf"), key)
