"""The few I/O steps that differ between the async and the sync API.

``_io_sync`` has the same names; the generated ``_sync.py`` imports it
instead of this module (see ``python/tools/gen_sync.py``).
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterator, Callable, Iterable
from typing import IO, Any

from ._core import CHUNK_BYTES
from .errors import WarrenError

sleep = asyncio.sleep


async def invoke(callback: Callable[[str], Any] | None, text: str) -> None:
    """Calls an output callback; a coroutine function is awaited."""
    if callback is None or not text:
        return
    out = callback(text)
    if inspect.isawaitable(out):
        await out


async def file_chunks(path: str | os.PathLike[str]) -> AsyncIterator[bytes]:
    """The file's bytes, one chunk in memory at a time (read off the event loop)."""
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK_BYTES):
            yield chunk


async def write(f: IO[bytes], data: bytes) -> None:
    await asyncio.to_thread(f.write, data)


async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    return await asyncio.to_thread(fn, *args)


def loop_key() -> Any:
    """Shared clients are per event loop: an httpx.AsyncClient is bound to one."""
    return asyncio.get_running_loop()


def forget_closed_loops(shared: dict[Any, Any]) -> None:
    for key in [k for k in shared if k[1].is_closed()]:
        del shared[key]


async def map_limited(fn: Callable[[Any], Any], items: Iterable[Any], limit: int) -> list[Any]:
    """``fn`` over ``items``, at most ``limit`` at once, in order; a
    WarrenError an item raises becomes its result."""
    gate = asyncio.Semaphore(limit)

    async def one(item: Any) -> Any:
        async with gate:
            try:
                return await fn(item)
            except WarrenError as e:
                return e

    return list(await asyncio.gather(*(one(item) for item in items)))


async def notify(callback: Callable[[Any], Any], value: Any) -> None:
    """Calls a progress callback with ``value``; a coroutine function is awaited."""
    out = callback(value)
    if inspect.isawaitable(out):
        await out
