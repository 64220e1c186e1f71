"""The decode graphs' rewrites (engine/runtime/graph_passes.py): in the batch-1 graph one-row weight products
become inductor's own sums, and in the batched graph weight products go through linear.c, with the same
numbers; those the kernel does not take stay MKL's matrix products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from engine.kernels.linear import kernel
from engine.runtime.graph_passes import MatVecAsReduction, WeightProductsThroughKernel


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_weight_products_become_inductor_sums(bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g) if bias else None

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(x), w, b)  # (an input computed in the graph, as the norms before projections)

    for rows, rewritten in ((1, True), (3, False)):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, options={"post_grad_custom_post_pass": MatVecAsReduction()})
        x = torch.randn(rows, 64, generator=g)
        with torch.no_grad():
            got, code = run_and_get_code(compiled, x)
        assert (("extern_kernels.mm" in code[0] or "extern_kernels.addmm" in code[0]) is not rewritten)
        torch.testing.assert_close(got, f(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(kernel() is None, reason="no C compiler here")
@pytest.mark.parametrize("residual", [False, True, "bias"])
def test_weight_products_go_through_the_kernel(residual):
    g = torch.Generator().manual_seed(1)
    fits, odd = torch.randn(320, 64, generator=g) * 0.1, torch.randn(300, 64, generator=g) * 0.1  # (300: not 16k)

    bias = torch.randn(320, generator=g)

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if residual == "bias" and w.shape[0] == bias.shape[0]:
            return F.linear(torch.relu(x), w, bias)  # (addmm from F.linear itself, a 1-D bias)
        y = F.linear(torch.relu(x), w)
        return y + x.sum(dim=1, keepdim=True) if residual else y  # (an add inductor may fold into addmm)

    for w, rewritten in ((fits, True), (odd, False)):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, dynamic=True,
                                 options={"post_grad_custom_post_pass": WeightProductsThroughKernel()})
        x = torch.randn(24, 64, generator=g)
        with torch.no_grad():
            got, code = run_and_get_code(compiled, x, w)
        assert ("minimax.linear" in code[0]) is rewritten
        assert ("extern_kernels.mm" in code[0] or "extern_kernels.addmm" in code[0]) is not rewritten
        torch.testing.assert_close(got, f(x, w), rtol=1e-5, atol=1e-5)
