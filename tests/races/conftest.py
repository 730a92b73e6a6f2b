"""Fixtures of the race scenarios: the demo system of record on the test database."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.sor_support import start_sor
from tools.restaurant.sor import SystemOfRecord


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db)
    try:
        yield sor
    finally:
        sor.release()
        await sor.stop()
