"""Run a blocking generation (torch forwards, sync gRPC to the draft) in a worker thread and consume it from
asyncio. Cancellation (client gone, deadline) stops the worker after its current step and closes the generation,
which closes the draft stream and frees both sides' state."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


async def iterate_in_thread(source: Iterator[T], name: str = "generation") -> AsyncIterator[T]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancelled = threading.Event()

    def put(item) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, item)

    def worker() -> None:
        try:
            for item in source:
                put(item)
                if cancelled.is_set():
                    break
            put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put(exc)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=worker, name=name, daemon=True)
    thread.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()
