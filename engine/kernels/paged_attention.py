"""`minimax::paged_attention`: attention of a few queries per row over keys read through slot indices, and
`minimax::paged_block_attention`: the same over the keys of selected blocks (block-sparse). On CPU in float32 they run
paged_attention.c, reading keys and values in place from the pool; elsewhere (CUDA, other dtypes, no C compiler) SDPA
over gathered keys and values. NOTE: C kernel vs gather + SDPA, 64 rows x 2 KV heads x 256 keys: 0.48 vs 1.36 ms."""

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import build
from engine.kernels.operator import operator, require

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache  # NOTE: one build and load per process, of an immutable library: nothing else is kept
def kernel() -> ctypes.CDLL | None:
    return build.load_or_warn(SOURCE, "gathering and calling SDPA instead", bind)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.paged_decode_attention.restype = lib.paged_block_attention.restype = i
    lib.paged_decode_attention.argtypes = [p] * 6 + [i] * 6 + [f, i]
    lib.paged_block_attention.argtypes = [p, p, p, p, i, p, p, p] + [i] * 6 + [f, i, i]
    return lib


def _on_cpu_kernel(*xs: torch.Tensor) -> ctypes.CDLL | None:
    return kernel() if all(x.device.type == "cpu" and x.dtype == torch.float32 for x in xs) else None


def block_rows(key_slots: torch.Tensor, blocks: torch.Tensor, q_pos: torch.Tensor,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffer rows (slot * H + h) [R, H, K*B] of the keys of the selected blocks blocks [R, H, K] (-1:
    unused), and whether each is kept: in a selected block, at a position up to q_pos[r] (model.md §3.4)."""
    h = blocks.shape[1]
    pos = blocks[..., None] * block_size + torch.arange(block_size, device=blocks.device)  # [R, H, K, B]
    keep = ((blocks >= 0)[..., None] & (pos <= q_pos[:, None, None, None])).flatten(-2)
    slots = key_slots.gather(1, pos.flatten(1).clamp(0, key_slots.shape[1] - 1)).view(keep.shape)  # (dropped: any)
    return slots * h + torch.arange(h, device=blocks.device)[None, :, None], keep


@operator("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor rows, Tensor keep, float scale) -> Tensor")
def paged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor,
                    keep: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax_j(q . k_j * scale) v_j over the kept keys, read straight from the pool. q [B, H, G, D]: the G query heads
    of KV head h act as G queries over its keys (GQA); rows [B, H, N]: each key's row of a buffer viewed as [slots *
    heads, D] (slot * heads + head); keep [B, H or 1, 1, N]. An opaque op: a compiled graph calls it as it is."""
    if (lib := _on_cpu_kernel(q, k_buf, v_buf)) is None:
        return gather_sdpa(q, k_buf, v_buf, rows, keep, scale)
    return in_place(lib.paged_decode_attention, q, k_buf, v_buf, rows, keep, scale)


def gather_sdpa(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor,
                scale: float) -> torch.Tensor:
    d = q.shape[-1]
    k, v = (buf.view(-1, d).index_select(0, rows.flatten()).view(*rows.shape, d) for buf in (k_buf, v_buf))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)


def fits(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether q [B, H, G, D] and buffers [..., D] are float32, buffers alike and contiguous, and G fits the C stack."""
    return (q.dim() == 4 and q.dtype == k_buf.dtype == v_buf.dtype == torch.float32 and k_buf.shape == v_buf.shape
            and k_buf.shape[-1:] == q.shape[-1:] and k_buf.is_contiguous() and v_buf.is_contiguous()
            and q.shape[2] * (q.shape[3] + 64) <= 1 << 16)


def in_place(fn: ctypes._CFuncPtr, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, rows: torch.Tensor,
             keep: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention.c (float32, CPU): the keys and values read in place (a query with no kept key gets zeros).
    A shape or dtype it cannot read is a ValueError, a row outside the buffers an IndexError."""
    q, rows, keep = q.contiguous(), rows.contiguous(), keep.contiguous()
    (b, h, g, d), n = q.shape if q.dim() == 4 else (0, 0, 0, 0), rows.shape[-1] if rows.dim() == 3 else -1
    require(fits(q, k_buf, v_buf) and rows.dtype == torch.int64 and keep.dtype == torch.bool and rows.shape == (b, h, n)
            and keep.shape in ((b, h, 1, n), (b, 1, 1, n)), "paged_attention: q [B, H, G, D] and k_buf, v_buf [..., D] "
            "float32, rows int64 [B, H, N], keep bool [B, H or 1, 1, N]", q, k_buf, v_buf, rows, keep)
    out, buf_rows = torch.empty_like(q), k_buf.numel() // max(d, 1)
    if fn(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), rows.data_ptr(), keep.data_ptr(), out.data_ptr(),
          b, h, g, d, n, keep.shape[1], scale, buf_rows):
        raise IndexError(f"paged_attention: a key's row is outside the k/v buffers' rows [0, {buf_rows})")
    return out


@operator("paged_block_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor key_slots, Tensor blocks, "
          "Tensor q_pos, int block_size, float scale) -> Tensor")
def paged_block_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_slots: torch.Tensor,
                          blocks: torch.Tensor, q_pos: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """`paged_attention` of q [R, H, G, D] over the keys of row r's selected blocks blocks[r, h] [K] (-1: unused) at
    positions up to q_pos[r]; key j of row r is slot key_slots[r, j] ([R, N]; rows may share one sequence's). NOTE: the
    C kernel walks the blocks itself: no [R, H, K*B] rows or mask built (a 256-query extend chunk: 0.95 of 3.5 ms)."""
    if (lib := _on_cpu_kernel(q, k_buf, v_buf)) is None:
        rows, keep = block_rows(key_slots, blocks, q_pos, block_size)
        return gather_sdpa(q, k_buf, v_buf, rows, keep[:, :, None], scale)
    q, blocks, q_pos = q.contiguous(), blocks.contiguous(), q_pos.contiguous()
    (b, h, g, d), n = q.shape if q.dim() == 4 else (0, 0, 0, 0), key_slots.shape[-1] if key_slots.dim() == 2 else -1
    require(fits(q, k_buf, v_buf) and key_slots.dtype == blocks.dtype == q_pos.dtype == torch.int64 and block_size > 0
            and key_slots.shape == (b, n) and key_slots.stride(1) == 1 and blocks.dim() == 3
            and blocks.shape[:2] == (b, h) and q_pos.shape == (b,),  # (the kernel reads the indices as int64_t)
            "paged_block_attention: q [B, H, G, D] and k_buf, v_buf [..., D] float32, key_slots int64 [B, N] (unit "
            "stride along N), blocks int64 [B, H, K], q_pos int64 [B], block_size > 0", q, k_buf, v_buf, key_slots,
            blocks, q_pos, block_size)
    out, buf_slots = torch.empty_like(q), k_buf.numel() // max(h * d, 1)
    status = lib.paged_block_attention(q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), key_slots.data_ptr(),
                                       key_slots.stride(0), blocks.data_ptr(), q_pos.data_ptr(), out.data_ptr(), b,
                                       h, g, d, blocks.shape[-1], block_size, scale, buf_slots, n)
    if status:
        raise IndexError(f"paged_block_attention: a key slot read is outside the k/v buffers' slots [0, {buf_slots})"
                         if status == 1 else f"paged_block_attention: a q_pos is outside the key range [0, {n})")
    return out
