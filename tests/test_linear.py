"""The split few-row matmul (`engine.linear`) against a float64 x @ W^T, and the CPU weight layout."""

from __future__ import annotations

import pytest
import torch

from engine.model.linear import SPLIT_MAX_ROWS, cpu_layout, linear, split_count
from engine.model.loader import load_model
from tests.engine_utils import TINY


def test_split_count_divides_and_respects_threads():
    assert split_count(256, 1) == 1
    assert split_count(256, 2) == 2
    assert split_count(256, 3) == 2
    assert split_count(256, 16) == 4  # slices stay >= 64 columns wide
    assert split_count(96, 2) == 1  # 48-wide slices would be too narrow
    assert split_count(130, 4) == 2  # 65 columns each; 4 does not divide 130


@pytest.mark.parametrize("rows", [1, 3, SPLIT_MAX_ROWS, SPLIT_MAX_ROWS + 5])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("with_residual", [False, True])
def test_linear_matches_float64(rows, threads, with_residual):
    g = torch.Generator().manual_seed(rows * 10 + threads)
    w = cpu_layout(torch.randn(96, 512, generator=g))
    x = torch.randn(rows, 512, generator=g)
    res = torch.randn(rows, 96, generator=g) if with_residual else None
    alpha = 0.75
    got = linear(x, w, res, alpha=alpha, threads=threads)
    want = alpha * (x.double() @ w.double().T) + (res.double() if with_residual else 0)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() < 1e-4


def test_cpu_layout_keeps_values_and_shape():
    w = torch.randn(3, 8, 4)
    laid = cpu_layout(w)
    assert laid.shape == w.shape and torch.equal(laid, w)
    assert laid.mT.is_contiguous() and not laid.is_contiguous()
    # the usual layout still works, through the plain BLAS call
    x = torch.randn(2, 4)
    assert torch.allclose(linear(x, w[0], threads=2), x @ w[0].T, atol=1e-6)


def test_loaded_cpu_model_uses_the_transposed_layout():
    model = load_model(TINY)
    attn, moe = model.layers[0].self_attn, model.layers[2].mlp
    assert attn.qkv_proj.mT.is_contiguous() and moe.w13.mT.is_contiguous() and model.lm_head.mT.is_contiguous()
    assert attn.threads == moe.threads == torch.get_num_threads()
    assert model.state_dict()["layers.0.self_attn.qkv_proj"].shape == attn.qkv_proj.shape
