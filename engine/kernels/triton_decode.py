"""Decode attention and block-sparse attention on CUDA as Triton kernels (the indexer's: triton_indexer.py). Decode
attention reads each row's key count from a tensor (`lengths`): the key table is as wide as the longest context and a
kernel's work is each row's keys, so one captured graph per batch size serves every context length. Where Triton cannot
run (CPU), and for good once a launch has failed (`kernel_op`, for every Triton kernel), the other forms serve
(`paged_attention`, `paged_block_attention`). `decode_attention` splits a row's keys over programs (flash-decoding:
~two per SM), each writing its part's output and log-sum-exp, one kernel combining them; `block_attention` walks a
query's selected blocks in place. Keys in tiles (TILE, or a block), a KV head's query heads padded to 16 rows (tl.dot's
least), dots in the buffers' dtype (bf16: tensor cores; float32 exact, `ieee`), 8 warps a program (4 spilled registers
at head dim 128: ptxas)."""

import functools
import logging

import torch

from engine.kernels.operator import operator
from engine.kernels.paged_attention import paged_attention, paged_block_attention

try:
    import triton
    import triton.language as tl
except ImportError:  # (CPU builds of torch come without it)
    triton = None

logger = logging.getLogger(__name__)
TILE, SPLITS = 64, 64  # (keys a tile; a row's keys over at most SPLITS programs, combined at once)
_failed: list[BaseException] = []  # (a launch that raised: the other forms from then on)


def serves(device: torch.device, *dims: int) -> bool:
    """Whether the kernels run on `device` for dims `dims` (heads', blocks'): CUDA, Triton, powers of two from 16."""
    return triton is not None and device.type == "cuda" and not _failed and all(d >= 16 and not d & d - 1 for d in dims)


def usable(x: torch.Tensor, buf: torch.Tensor, *dims: int) -> bool:
    return serves(x.device, x.shape[-1], *dims) and buf.shape[-1] == x.shape[-1] and buf.is_contiguous()


def kernel_op(schema: str, fallback, fake=None):
    """Decorate a Triton kernel's host function (it launches the kernel): the op minimax::triton_<its name><schema>.
    A launch that raises is logged and switches every Triton kernel off for good; `fallback(*args)` answers it."""
    def register(launch):
        def op(*args):
            try:
                return launch(*args)
            except Exception as e:  # noqa: BLE001 - serving goes on, on the other forms
                logger.exception("Triton's %s failed: the other forms run from now on (%s)", launch.__name__, e)
                _failed.append(e)
                return fallback(*args)
        return operator(f"triton_{launch.__name__.strip('_')}{schema}", fake)(functools.update_wrapper(op, launch))
    return register


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_slots: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax_j(q . k_j * scale) v_j over keys j < lengths[r] (>= 1) of row r, key j in slot key_slots[r, j]:
    q [B, H, G, D], k_buf and v_buf [slots, H, D], key_slots [B, N] -> [B, H, G, D]. Triton's kernel where it
    runs, else `paged_attention` over every head's buffer rows (on CPU its C kernel)."""
    return (_attention if usable(q, k_buf) else _listed)(q, k_buf, v_buf, key_slots, lengths, scale)


def block_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_slots: torch.Tensor,
                    blocks: torch.Tensor, q_pos: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """`paged_block_attention` (its arguments and result): Triton's kernel where it runs, else that op."""
    attend = _block_attention if usable(q, k_buf, block_size) else paged_block_attention
    return attend(q, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale)


def _listed(q, k_buf, v_buf, key_slots, lengths, scale):
    h, keep = k_buf.shape[1], (torch.arange(key_slots.shape[1], device=q.device) < lengths[:, None])[:, None, None]
    rows = key_slots[:, None, :] * h + torch.arange(h, device=q.device)[None, :, None]  # (slot * heads + head)
    return paged_attention(q, k_buf, v_buf, rows, keep, scale)


@functools.cache
def _programs(device: torch.device) -> int:  # (what a launch aims at: two programs an SM; 64 for the interpreter)
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 64


@kernel_op("(Tensor q, Tensor k_buf, Tensor v_buf, Tensor key_slots, Tensor lengths, float scale) -> Tensor", _listed)
def _attention(q, k_buf, v_buf, key_slots, lengths, scale):
    (b, h, g, d), q = q.shape, q.contiguous()
    splits = max(1, min(SPLITS, _programs(q.device) // (b * h)))  # (a row's keys over this many programs)
    part = torch.empty(b, h, splits, g, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, g, dtype=torch.float32, device=q.device)
    _attend_kernel[(b, h, splits)](q, k_buf, v_buf, key_slots, lengths, part, lse, key_slots.stride(0), scale, splits,
                                   H=h, G=g, GP=max(16, triton.next_power_of_2(g)), D=d, TILE=TILE, num_warps=8)
    if splits == 1:  # (one part a row and head: it is the output)
        return part[:, :, 0].to(q.dtype)
    out = torch.empty_like(q)  # (the parts weighted by their sums: softmax over their log-sum-exps)
    _combine_kernel[(b * h, g)](part, lse, out, splits, g, D=d, SPLITS=SPLITS)
    return out


@kernel_op("(Tensor q, Tensor k_buf, Tensor v_buf, Tensor key_slots, Tensor blocks, Tensor q_pos, int block_size, "
           "float scale) -> Tensor", paged_block_attention)
def _block_attention(q, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale):
    return launch_blocks(q, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale)


def launch_blocks(q, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale, select=None):
    """_block_kernel's launch; with `select` = (topk, init, local), `blocks` are block scores the kernel selects from
    (triton_indexer's `decode_sparse_attention`)."""
    (b, h, g, d), (q, nb) = q.shape, (q.contiguous(), blocks.shape[-1])
    out = torch.empty_like(q)  # (contiguous, as the kernel writes it)
    _block_kernel[(b, h)](q, k_buf, v_buf, key_slots, blocks.contiguous(), q_pos.contiguous(), out,
                          key_slots.stride(0), scale, nb, *(select or (nb, 0, 0)), H=h, G=g, D=d, BS=block_size,
                          GP=max(16, triton.next_power_of_2(g)), NB=triton.next_power_of_2(nb) if select else 0,
                          num_warps=8)
    return out


if triton is not None:  # NOTE: the dots in the buffers' dtype (bf16: tensor cores), summed in float32
    @triton.jit
    def _tile(qv, k, v, at, ok, m, total, acc):
        """Online softmax over a tile of keys (elements `at` of k and v; `ok`: the kept ones): the running max m, sum
        and output acc [G, D] of the queries qv [G, D] after it. A tile with no kept key, before any, changes nothing
        (its base is 0, not -inf: exp(-inf - -inf) would be nan)."""
        kv = tl.load(k + at, mask=ok[:, None], other=0.0)
        sc = tl.where(ok[None, :], tl.dot(qv, tl.trans(kv), input_precision="ieee"), float("-inf"))  # [G, keys]
        top = tl.maximum(m, tl.max(sc, 1))
        base = tl.where(top == float("-inf"), 0.0, top)
        p, fade = tl.exp(sc - base[:, None]), tl.exp(m - base)
        vv = tl.load(v + at, mask=ok[:, None], other=0.0)
        acc = acc * fade[:, None] + tl.dot(p.to(vv.dtype), vv, input_precision="ieee")
        return top, total * fade + tl.sum(p, 1), acc

    @triton.jit(do_not_specialize=["splits", "slot_stride"])  # (an extend's rows: its longest key count)
    def _attend_kernel(q, k, v, slots, lengths, part, lse, slot_stride, scale, splits, H: tl.constexpr,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr):
        r, h, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)  # (r * slot_stride: int64)
        n = tl.load(lengths + r).to(tl.int32)
        per = tl.cdiv(tl.cdiv(n, splits), TILE) * TILE
        lo, hi = s * per, tl.minimum(s * per + per, n)
        g, d = tl.arange(0, GP), tl.arange(0, D)
        qv = tl.load(q + ((r * H + h) * G + g[:, None]) * D + d[None, :], mask=g[:, None] < G, other=0.0)
        qv = (qv.to(tl.float32) * scale).to(k.dtype.element_ty)
        m, total = tl.full([GP], float("-inf"), tl.float32), tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for start in range(lo, hi, TILE):
            j = start + tl.arange(0, TILE)
            ok = j < hi
            at = (tl.load(slots + r * slot_stride + j, mask=ok, other=0).to(tl.int64) * H + h)[:, None] * D + d[None, :]
            m, total, acc = _tile(qv, k, v, at, ok, m, total, acc)
        # (an empty part: zeros, and a log-sum-exp of -inf, its weight 0; a part with keys has a total of at least 1)
        at = ((r * H + h) * splits + s) * G + g
        tl.store(part + at[:, None] * D + d[None, :], acc / tl.maximum(total, 1.0)[:, None], mask=g[:, None] < G)
        tl.store(lse + at, m + tl.log(total), mask=g < G)

    @triton.jit(do_not_specialize=["splits"])
    def _combine_kernel(part, lse, out, splits, g, D: tl.constexpr, SPLITS: tl.constexpr):
        """A query head's parts [splits, D] at once, weighted by exp(log-sum-exp - their max) (empty: -inf, 0)."""
        rh, s, d = tl.program_id(0).to(tl.int64), tl.arange(0, SPLITS), tl.arange(0, D)
        rows = (rh * splits + s) * g + tl.program_id(1)
        weight = tl.load(lse + rows, mask=s < splits, other=float("-inf"))
        weight = tl.exp(weight - tl.max(weight, 0))
        parts = tl.load(part + rows[:, None] * D + d[None, :], mask=(s < splits)[:, None], other=0.0)
        tl.store(out + (rh * g + tl.program_id(1)) * D + d, (tl.sum(weight[:, None] * parts, 0) / tl.sum(weight, 0))
                 .to(out.dtype.element_ty))

    @triton.jit(do_not_specialize=["slot_stride"], do_not_specialize_on_alignment=["slots"])  # (an extend's: any)
    def _block_kernel(q, k, v, slots, blocks, q_pos, out, slot_stride, scale, nb, top, init, local, H: tl.constexpr,
                      G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr):
        """The queries of row r and KV head h over its `top` blocks: `blocks` [nb] selected ones (-1: none); or, with
        NB, from its nb block scores, `select_blocks`' choice made here: the best key at a time (tl.argmax: ties to the
        lower block), forced blocks' keys +inf, blocks past the query's own (seen) -inf, none from the seen-th on."""
        r, h = tl.program_id(0), tl.program_id(1)
        last, slots = tl.load(q_pos + r), slots + r.to(tl.int64) * slot_stride  # (its row of the key table)
        g, d, j = tl.arange(0, GP), tl.arange(0, D), tl.arange(0, BS)
        at = ((r * H + h) * G + g[:, None]) * D + d[None, :]
        qv = (tl.load(q + at, mask=g[:, None] < G, other=0.0).to(tl.float32) * scale).to(k.dtype.element_ty)
        m, total = tl.full([GP], float("-inf"), tl.float32), tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        seen = last // BS + 1
        if NB > 0:
            b = tl.arange(0, NB)
            key = tl.load(blocks + (r * H + h) * nb + b, mask=b < seen, other=float("-inf"))
            key = tl.where((b < seen) & ((b < init) | (b >= seen - local)), float("inf"), key)
        for i in range(0, top):
            if NB > 0:
                blk = tl.argmax(key, 0)
                key, blk = tl.where(b == blk, float("-inf"), key), tl.where(i < seen, blk, -1)
            else:
                blk = tl.load(blocks + (r * H + h) * nb + i)
            pos = blk * BS + j
            ok = (pos >= 0) & (pos <= last)  # (a block of -1: negative positions)
            slot = tl.load(slots + pos, mask=ok, other=0).to(tl.int64)
            m, total, acc = _tile(qv, k, v, (slot * H + h)[:, None] * D + d[None, :], ok, m, total, acc)
        tl.store(out + at, (acc / tl.maximum(total, 1.0)[:, None]).to(out.dtype.element_ty), mask=g[:, None] < G)
