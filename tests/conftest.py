"""Fixtures shared by the live-server test modules: each module defines its own `srv`."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # (Triton's kernels run by its interpreter: tests/test_triton_decode.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.reliability_utils import reference_ids


@pytest.fixture
def no_failed_launch():
    """A Triton test fails if a launch raised: the op answered with the PyTorch form its result is compared to."""
    from engine.kernels import triton_decode

    yield
    failed = list(triton_decode._failed)
    triton_decode._failed.clear()
    assert not failed, failed


@pytest.fixture(scope="module")
def client(srv):
    """An httpx client on the module's live server."""
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference(client) -> list[int]:
    """The fixed greedy request's tokens before any scenario (reliability checks compare against it)."""
    return reference_ids(client)


@pytest.fixture
def two_threads():
    """torch, and the C kernels' OpenMP loops, on 2 threads for one test: `make test` runs its two workers at 1
    thread each (OMP_NUM_THREADS=1), and a kernel's split of work between threads needs testing too."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)
