"""`minimax::moe_experts`: an MoE layer's routed experts, each expert's weights read for its own tokens only. CPU and
float32 only (`on_kernel` says whether it runs here): moe_experts.c groups the tokens by expert inside the kernel, so
there is no host sync and a compiled graph calls it as it is. Elsewhere MoE.forward keeps its PyTorch forms."""

import ctypes
import functools
from pathlib import Path

import torch

from engine.kernels import build
from engine.kernels.operator import operator, require

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache  # NOTE: one build and load per process, of an immutable library: nothing else is kept
def kernel() -> ctypes.CDLL | None:
    return build.load_or_warn(SOURCE, "MoE layers keep their PyTorch forms", bind)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.moe_experts.restype = ctypes.c_int64
    lib.moe_experts.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2
    return lib


def on_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, w13, w2))
            and w2.shape[1] % build.WIDEST == 0 and w2.shape[2] % build.WIDEST == 0 and built())


def built() -> bool:  # (a compiled graph asks too: precompiled.py marks it a constant there, nothing traced)
    return kernel() is not None


@operator("moe_experts(Tensor x, Tensor ids, Tensor w, Tensor w13, Tensor w2, float alpha, float limit) -> Tensor")
def moe_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                alpha: float, limit: float) -> torch.Tensor:
    """sum_s w[t, s] * W2_e swiglu_oai(W13_e x[t]) with e = ids[t, s]: x [T, H], ids and w [T, k], w13
    [E, 2I, H] (gate rows first), w2 [E, H, I]. An opaque op: a compiled graph calls it as it is."""
    if not all(t.device.type == "cpu" for t in (x, ids, w, w13, w2)) or (lib := kernel()) is None:
        raise ValueError("moe_experts runs on CPU with the C kernel built (see on_kernel)")
    return run(lib, x, ids, w, w13, w2, alpha, limit)


def run(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts` through `lib`: a shape or dtype it cannot read is a ValueError, an id outside [0, E) IndexError."""
    x, ids, w = x.contiguous(), ids.contiguous(), w.to(torch.float32).contiguous()
    (t, k), (e, i2, h) = ids.shape if ids.dim() == 2 else (-1, -1), w13.shape if w13.dim() == 3 else (-1, -1, -1)
    require(x.dtype == w13.dtype == w2.dtype == torch.float32 and ids.dtype == torch.int64 and w13.is_contiguous()
            and w2.is_contiguous() and x.shape == (t, h) and w.shape == (t, k) and k >= 1
            and w2.shape == (e, h, i2 // 2) and h % build.WIDEST == i2 % (2 * build.WIDEST) == 0,
            "moe_experts: x [T, H], ids int64 and w [T, k >= 1], w13 [E, 2I, H], w2 [E, H, I], float32, H and I "
            "multiples of 16 (build.WIDEST)", x, ids, w, w13, w2)
    pairs, out = torch.empty(t * k, h, dtype=torch.float32), torch.empty(t, h, dtype=torch.float32)
    status = lib.moe_experts(x.data_ptr(), ids.data_ptr(), w.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                             pairs.data_ptr(), out.data_ptr(), t, k, e, h, i2 // 2, alpha, limit)
    if status:
        raise (IndexError(f"moe_experts: an expert id outside [0, {e})") if status == 1
               else MemoryError("moe_experts: the C kernel could not allocate its scratch memory"))
    return out
