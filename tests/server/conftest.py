"""The server folder's fixtures: its async tests run on asyncio (anyio's pytest plugin)."""

import pytest


@pytest.fixture
def anyio_backend():
    return "asyncio"
