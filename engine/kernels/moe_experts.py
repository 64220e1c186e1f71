"""`minimax::moe_experts`: an MoE layer's routed experts, each expert's weights read for its own tokens only.

CPU and float32 only (`on_kernel` says whether it runs here): moe_experts.c groups the tokens by expert inside
the kernel, so there is no host sync and a compiled graph calls it as it is. Elsewhere MoE.forward keeps its
PyTorch forms.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine.kernels import build
from engine.kernels.operator import operator

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache  # NOTE: one build and load per process, of an immutable library: nothing else is kept
def kernel() -> ctypes.CDLL | None:
    return build.load_or_warn(SOURCE, "MoE layers keep their PyTorch forms", bind)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (moe_experts.c, built) with its function's argument types set."""
    lib.moe_experts.restype = None
    lib.moe_experts.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_float] * 2
    return lib


def on_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether `moe_experts` can run here: CPU, float32, hidden and intermediate sizes multiples of 16 (the
    kernel's widest vector, AVX-512's), a compiler at hand."""
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (x, w13, w2))
            and w2.shape[1] % build.WIDEST == 0 and w2.shape[2] % build.WIDEST == 0 and built())


@torch.compiler.assume_constant_result  # (a compiled graph asks too: a constant there, nothing traced)
def built() -> bool:
    return kernel() is not None


@operator("moe_experts(Tensor x, Tensor ids, Tensor w, Tensor w13, Tensor w2, float alpha, float limit) -> Tensor")
def moe_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                alpha: float, limit: float) -> torch.Tensor:
    """sum_s w[t, s] * W2_e swiglu_oai(W13_e x[t]) with e = ids[t, s]: x [T, H], ids and w [T, k], w13
    [E, 2I, H] (gate rows first), w2 [E, H, I]. An opaque op: a compiled graph calls it as it is."""
    assert on_kernel(x, w13, w2), "moe_experts runs on CPU float32 with the C kernel built (see on_kernel)"
    return run(kernel(), x, ids, w, w13, w2, alpha, limit)


def run(lib: ctypes.CDLL, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        alpha: float, limit: float) -> torch.Tensor:
    """`moe_experts` through the library `lib` (CPU, float32, sizes checked by the caller)."""
    x, ids, w = x.contiguous(), ids.contiguous(), w.to(torch.float32).contiguous()
    assert ids.dtype == torch.int64 and w13.is_contiguous() and w2.is_contiguous()
    (t, k), (e, i2, h) = ids.shape, w13.shape
    pairs, out = torch.empty(t * k, h, dtype=torch.float32), torch.empty(t, h, dtype=torch.float32)
    lib.moe_experts(x.data_ptr(), ids.data_ptr(), w.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                    pairs.data_ptr(), out.data_ptr(), t, k, e, h, i2 // 2, alpha, limit)
    return out
