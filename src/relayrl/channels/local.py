"""A bounded channel inside the controller's event loop.

Items are small (metadata plus Ray object references); the tensors themselves stay in Ray's
object store and move directly from the producing executor to the consuming one. ``put`` waits
while the channel is full, which is the back-pressure that stops a fast producer.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar

T = TypeVar("T")


class ChannelClosed(Exception):
    """Raised by ``get`` on a closed, empty channel and by ``put`` on a closed one."""


class Channel(Generic[T]):
    """Bounded FIFO with back-pressure and close."""

    def __init__(self, capacity: int, name: str = "channel"):
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        self.name = name
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=capacity)
        self._closed = False
        self.put_wait_s = 0.0
        self.get_wait_s = 0.0

    async def put(self, item: T) -> None:
        """Append ``item``, waiting while the channel is full."""
        if self._closed:
            raise ChannelClosed(self.name)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await self._queue.put(item)
        self.put_wait_s += loop.time() - start

    async def get(self) -> T:
        """Remove and return the oldest item, waiting while the channel is empty."""
        if self._closed and self._queue.empty():
            raise ChannelClosed(self.name)
        loop = asyncio.get_running_loop()
        start = loop.time()
        item = await self._queue.get()
        self.get_wait_s += loop.time() - start
        return item

    def close(self) -> list[T]:
        """Refuse further puts and return what was still queued."""
        self._closed = True
        left = []
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        return left

    def __len__(self) -> int:
        return self._queue.qsize()
