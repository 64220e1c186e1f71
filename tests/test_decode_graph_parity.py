"""Captured decode against the same step run eager for every transformers parity configuration (their
models built by transformers, saved and loaded by our engine): greedy tokens equal and logits within 1e-5 at
batch 1, 3 and 4, over steps that cross a block boundary. Each captures one bucket (4: batches 1 and 3 are
padded to it), which keeps the compiles few; configs/tiny's graphs are tested in test_decode_graph.py."""

from __future__ import annotations

import pytest
from hf_models import HF_CONFIGS, build_hf_model

from engine.model.loader import load_model
from tests.forward_utils import PagedModel, assert_captured_equals_eager


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def paged(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    build_hf_model(request.param, path)
    return PagedModel(load_model(path), graph_buckets=[4])


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_captured_decode_equals_eager(paged, rows):
    assert_captured_equals_eager(paged, rows)
