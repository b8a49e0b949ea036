"""A bounded channel inside the controller's event loop.

Items are small (metadata plus Ray object references); the tensors themselves stay in Ray's
object store and move directly from the producing executor to the consuming one. ``put`` waits
while the channel is full, which is the back-pressure that stops a fast producer.
"""

from __future__ import annotations

import asyncio
import time
from typing import Generic, TypeVar

from relayrl.observability.tracing import Tracer

T = TypeVar("T")


class ChannelClosed(Exception):
    """Raised by ``get`` on a closed, empty channel and by ``put`` on a closed one."""


class Channel(Generic[T]):
    """Bounded FIFO with back-pressure and close.

    A put that waits (channel full) is recorded as a wait of ``producer``; a get that waits
    (channel empty) as a wait of ``consumer``: the trace then shows why an executor sat idle.
    """

    def __init__(
        self,
        capacity: int,
        name: str = "channel",
        producer: Tracer | None = None,
        consumer: Tracer | None = None,
    ):
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        self.name = name
        self._queue: asyncio.Queue[T] = asyncio.Queue(maxsize=capacity)
        self._closed = False
        self._producer = producer
        self._consumer = consumer

    async def put(self, item: T, producer: Tracer | None = None) -> None:
        """Append ``item``, waiting while the channel is full; a wait is recorded on
        ``producer`` (default: the channel's)."""
        if self._closed:
            raise ChannelClosed(self.name)
        start = time.time()
        await self._queue.put(item)
        producer = producer or self._producer
        if producer is not None:
            producer.wait(f"{self.name} full", start, time.time())

    async def get(self, consumer: Tracer | None = None) -> T:
        """Remove and return the oldest item, waiting while the channel is empty; a wait is
        recorded on ``consumer`` (default: the channel's)."""
        if self._closed and self._queue.empty():
            raise ChannelClosed(self.name)
        start = time.time()
        item = await self._queue.get()
        consumer = consumer or self._consumer
        if consumer is not None:
            consumer.wait(f"{self.name} empty", start, time.time())
        return item

    def close(self) -> list[T]:
        """Refuse further puts and return what was still queued."""
        self._closed = True
        left = []
        while not self._queue.empty():
            left.append(self._queue.get_nowait())
        return left

    def peek(self) -> list[T]:
        """What is queued now, oldest first, without taking it."""
        return list(self._queue._queue)  # asyncio.Queue keeps its items in a deque

    def __len__(self) -> int:
        return self._queue.qsize()
