"""Test-only async helpers: wait for a condition by polling (bounded), never by sleeping blindly."""
from __future__ import annotations

import asyncio
import time


async def eventually(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)
