"""The C weight-product kernel (engine/kernels/linear.c, `minimax::linear`) beside a float64 matrix product, at
both vector widths, for row counts a decode step has and weights wider than one column pass (mat_rows.h's KC)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import build, linear

SHAPES = [(1, 256, 256), (3, 384, 256), (8, 4096, 256), (64, 256, 1024), (5, 48, 272), (2, 16, 16)]  # (m, n, k)


@pytest.mark.usefixtures("two_threads")  # (the kernel splits the weight's rows between threads)
@pytest.mark.parametrize("lanes", [8, 16])
def test_the_kernel_matches_a_float64_product(lanes):
    lib = linear.bind(build.load(linear.SOURCE, (f"-DLANES={lanes}",)))
    g = torch.Generator().manual_seed(lanes)
    for m, n, k in SHAPES:
        x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5
        out = torch.empty(m, n)
        lib.linear(x.data_ptr(), w.data_ptr(), out.data_ptr(), m, n, k)
        torch.testing.assert_close(out, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-5)


def test_the_operator_falls_back_where_the_kernel_does_not_fit():
    g = torch.Generator().manual_seed(0)
    x, x48 = torch.randn(4, 40, generator=g), torch.randn(4, 48, generator=g)
    for a, w in ((x, torch.randn(24, 40, generator=g)),  # (k not a multiple of 16)
                 (x48, torch.randn(24, 48, generator=g)),  # (n not a multiple of 16)
                 (x48, torch.randn(32, 96, generator=g)[:, ::2])):  # (w not contiguous)
        assert not linear.fits(a, w)
        torch.testing.assert_close(linear.linear(a, w), a @ w.T)
    assert linear.fits(x48, torch.randn(32, 48, generator=g))
    with pytest.raises(RuntimeError):  # (sizes that do not multiply: F.linear's error, not a read out of bounds)
        linear.linear(x48, torch.randn(32, 64, generator=g))
    w = torch.randn(32, 48, generator=g)
    assert linear.fits(x[:, :1].expand(4, 48), w)
    torch.testing.assert_close(linear.linear(x[:, :1].expand(4, 48), w), x[:, :1].expand(4, 48) @ w.T,
                               rtol=1e-5, atol=1e-5)
