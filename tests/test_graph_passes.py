"""The batch-1 decode graph's rewrite (engine/runtime/graph_passes.py): one-row weight products become inductor's
own sums, with the same numbers; products of more rows stay MKL's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from engine.runtime.graph_passes import BatchOneForms


@pytest.mark.parametrize("bias", [False, True])
def test_one_row_weight_products_become_inductor_sums(bias):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g) if bias else None

    def f(x: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.relu(x), w, b)  # (an input computed in the graph, as the norms before projections)

    for rows, rewritten in ((1, True), (3, False)):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, options={"post_grad_custom_post_pass": BatchOneForms()})
        x = torch.randn(rows, 64, generator=g)
        with torch.no_grad():
            got, code = run_and_get_code(compiled, x)
        assert (("extern_kernels.mm" in code[0] or "extern_kernels.addmm" in code[0]) is not rewritten)
        torch.testing.assert_close(got, f(x), rtol=1e-5, atol=1e-5)


def test_a_scaled_one_row_addmm_keeps_its_scales():
    """An addmm with beta and alpha (as inductor may make of `torch.add(product, y, alpha=)`) is not rewritten: the
    sums written for it would drop both."""
    g = torch.Generator().manual_seed(1)
    w, c = torch.randn(300, 64, generator=g), torch.randn(1, 300, generator=g)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(c, torch.relu(x), w.t(), beta=2.0, alpha=3.0)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, options={"post_grad_custom_post_pass": BatchOneForms()})
    x = torch.randn(1, 64, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), f(x), rtol=1e-5, atol=1e-4)
