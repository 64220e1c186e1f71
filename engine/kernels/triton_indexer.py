"""The lightning indexer's decode step on CUDA as Triton kernels (model.md §3.2-§3.3): a row's block scores over its
own keys (their count read from `lengths`, as triton_decode's attention reads it), then its top-k blocks, chosen by
triton_decode's block attention kernel as it attends. Elsewhere, and for good after a failed launch, indexer.py's
forms serve (`block_scores` over the gathered keys, `select_blocks`)."""

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


def decode_sparse_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_slots: torch.Tensor,
                            scores: torch.Tensor, q_pos: torch.Tensor, masks: tuple | None, block_size: int, topk: int,
                            init: int, local: int, scale: float) -> torch.Tensor:
    """`block_attention` of q [B, H, G, D] over the blocks `select_blocks` picks from a decode step's block scores
    [B, H, nb] (queries at q_pos [B]): one Triton kernel where it runs, its programs selecting as they attend; else
    under `masks`, the step's `block_masks` (made here if a launch failed this step)."""
    if triton_decode.usable(q, k_buf, block_size):
        return _select_attend(q, k_buf, v_buf, key_slots, scores, q_pos, block_size, topk, init, local, scale)
    return _selected_attention(q, k_buf, v_buf, key_slots, scores, q_pos, block_size, topk, init, local, scale, masks)


def _gathered_scores(iq, ik_buf, key_slots, lengths, block_size):
    visible = torch.arange(key_slots.shape[1], device=iq.device) < lengths[:, None]
    return block_scores(iq[:, None], ik_buf[key_slots][:, :, 0], visible[:, None], block_size)[:, :, 0]


def _selected_attention(q, k_buf, v_buf, key_slots, scores, q_pos, block_size, topk, init, local, scale, masks=None):
    masks = block_masks(q_pos[:, None], scores.shape[-1], block_size, topk, init, local) if masks is None else masks
    blocks = select_blocks(scores[:, :, None], masks)[:, :, 0]
    return triton_decode.paged_block_attention(q, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale)


@kernel_op("(Tensor iq, Tensor ik_buf, Tensor key_slots, Tensor lengths, int block_size) -> Tensor", _gathered_scores,
           fake=lambda iq, ik, slots, lengths, bs: iq.new_empty(*iq.shape[:2], -(-slots.shape[1] // bs),
                                                                dtype=torch.float32))
def _scores(iq, ik_buf, key_slots, lengths, block_size):
    (b, h, d), nb = iq.shape, -(-key_slots.shape[1] // block_size)
    out = torch.empty(b, h, nb, device=iq.device)
    _scores_kernel[(b, max(1, min(nb, _programs(iq.device) // b)))](iq.contiguous(), ik_buf, key_slots, lengths, out,
                                                                    key_slots.stride(0), nb, H=h, D=d, BS=block_size,
                                                                    HP=max(16, triton.next_power_of_2(h)), FILL=64)
    return out


@kernel_op("(Tensor q, Tensor k_buf, Tensor v_buf, Tensor key_slots, Tensor scores, Tensor q_pos, int block_size, "
           "int topk, int init, int local, float scale) -> Tensor", _selected_attention)
def _select_attend(q, k_buf, v_buf, key_slots, scores, q_pos, block_size, topk, init, local, scale):
    return triton_decode.launch_blocks(q, k_buf, v_buf, key_slots, scores, q_pos, block_size, scale, (topk, init, local))


if triton is not None:
    @triton.jit
    def _scores_kernel(iq, ik, slots, lengths, out, slot_stride, nb, H: tl.constexpr, HP: tl.constexpr,
                       D: tl.constexpr, BS: tl.constexpr, FILL: tl.constexpr):
        """Row r's blocks with keys dealt round its programs (a short context's few over many: a block each), then the
        rest, -inf, a run a program, FILL blocks a store (64 rows x 65,536 keys: 4 programs a row, 1,024 blocks)."""
        r, s, p = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.num_programs(1)  # (r * slot_stride: int64)
        n = tl.load(lengths + r).to(tl.int32)
        h, d, j = tl.arange(0, HP), tl.arange(0, D), tl.arange(0, BS)
        qv = tl.load(iq + (r * H + h[:, None]) * D + d[None, :], mask=h[:, None] < H, other=0.0)
        keyed = tl.minimum(tl.cdiv(n, BS), nb)  # (never past the table, whatever `lengths` holds)
        lo = keyed + s * tl.cdiv(nb - keyed, p)  # (a run of the rest each)
        hi = tl.minimum(lo + tl.cdiv(nb - keyed, p), nb)
        for first in range(lo, hi, FILL):  # (blocks past the row's keys)
            c = first + tl.arange(0, FILL)[None, :]
            tl.store(out + (r * H + h[:, None]) * nb + c, float("-inf"), mask=(h[:, None] < H) & (c < hi))
        for blk in range(s, keyed, p):
            pos = blk * BS + j
            ok = pos < n
            at = tl.load(slots + r * slot_stride + pos, mask=ok, other=0).to(tl.int64)[:, None] * D + d[None, :]
            kv = tl.load(ik + at, mask=ok[:, None], other=0.0)
            sc = tl.where(ok[None, :], tl.dot(qv, tl.trans(kv), input_precision="ieee"), float("-inf"))  # [HP, BS]
            tl.store(out + (r * H + h) * nb + blk, tl.max(sc, 1), mask=h < H)
