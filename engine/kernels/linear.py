"""`minimax::linear`: x @ w.T for a few rows (a batched decode step's weight products), through linear.c, for the
batched decode graph to call in place of MKL's GEMM (`graph_passes.WeightProductsThroughKernel`).

NOTE: [M, K] x [K, N] at the shapes of configs/tiny (K 256 or 1,024; N 256-4,096), 2 threads, AVX-512 AMD,
weights cycled out of cache, against MKL (through F.linear) and oneDNN: at 8 rows 1.8-4.3x faster than MKL and
1.5-2.6x than oneDNN; at 32 rows 1.4-2.2x and 1.2-1.4x; at 64 rows 1.3-1.6x and 1.0-1.4x. MKL takes a slow
path for so few rows on this CPU; each of this kernel's weight blocks stays in L1 while every row reads it.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.kernels import build
from engine.kernels.operator import operator

SOURCE = Path(__file__).with_suffix(".c")


@functools.cache  # NOTE: one build and load per process, of an immutable library: nothing else is kept
def kernel() -> ctypes.CDLL | None:
    return build.load_or_warn(SOURCE, "weight products stay MKL's", bind)


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """`lib` (linear.c, built) with its function's argument types set."""
    lib.linear.restype = None
    lib.linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    return lib


def fits(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes x [M, K] @ w [N, K].T: CPU, float32, N and K positive multiples of 16, w
    contiguous (what a graph pass can tell from shapes alone; `linear` also needs the kernel built, or falls
    back)."""
    return (x.device.type == w.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and x.dim() == w.dim() == 2
            and x.shape[1] == w.shape[1] > 0 and w.shape[0] % build.WIDEST == 0 and w.shape[1] % build.WIDEST == 0
            and w.is_contiguous())


def _fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@operator("linear(Tensor x, Tensor w) -> Tensor", _fake)
def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T (as F.linear without bias). An opaque op: a compiled graph calls it as it is."""
    lib = kernel()
    if lib is None or not fits(x, w):
        return F.linear(x, w)
    x = x.contiguous()
    out = x.new_empty(x.shape[0], w.shape[0])
    lib.linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], w.shape[0], x.shape[1])
    return out
