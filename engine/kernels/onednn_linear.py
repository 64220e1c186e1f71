"""`minimax::onednn_linear`: x @ w.T through oneDNN's float32 GEMM (CPU), for the batched decode graph to call
in place of MKL's (`graph_passes.MatMulThroughOneDNN`).

NOTE: inductor lowers oneDNN's linear only for weights frozen into the graph as constants; ours stay arguments
(a saved graph holds no weights), so the graph calls this operator, which calls oneDNN with the weight as it is.
"""

from __future__ import annotations

import torch

from engine.kernels.operator import operator


def available() -> bool:
    return torch.backends.mkldnn.is_available()


def _fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@operator("onednn_linear(Tensor x, Tensor w) -> Tensor", _fake)
def onednn_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T, float32 on CPU."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
