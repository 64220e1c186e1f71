"""Fixtures shared by the live-server test modules: each module defines its own `srv`."""

from __future__ import annotations

import pytest

from tests.reliability_utils import reference_ids


@pytest.fixture(scope="module")
def client(srv):
    """An httpx client on the module's live server."""
    with srv.client() as c:
        yield c


@pytest.fixture(scope="module")
def reference(client) -> list[int]:
    """The fixed greedy request's tokens before any scenario (reliability checks compare against it)."""
    return reference_ids(client)
