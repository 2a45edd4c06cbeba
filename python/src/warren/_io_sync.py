"""The sync counterparts of ``_io_async``, with the same names."""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from ._core import CHUNK_BYTES
from .errors import WarrenError

sleep = time.sleep


def invoke(callback: Callable[[str], Any] | None, text: str) -> None:
    """Calls an output callback."""
    if callback is None or not text:
        return
    out = callback(text)
    if inspect.isawaitable(out):
        close = getattr(out, "close", None)
        if close is not None:
            close()
        raise TypeError("a coroutine function was given as a callback to the sync API; use AsyncSandbox")


def file_chunks(path: str | os.PathLike[str]) -> Iterator[bytes]:
    """The file's bytes, one chunk in memory at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def write(f: IO[bytes], data: bytes) -> None:
    f.write(data)


def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def loop_key() -> Any:
    """One shared client per URL for the whole process (httpx.Client is thread-safe)."""
    return None


def forget_closed_loops(shared: dict[Any, Any]) -> None:
    pass


def map_limited(fn: Callable[[Any], Any], items: Iterable[Any], limit: int) -> list[Any]:
    """``fn`` over ``items`` on at most ``limit`` threads, in order; a
    WarrenError an item raises becomes its result."""

    def one(item: Any) -> Any:
        try:
            return fn(item)
        except WarrenError as e:
            return e

    with ThreadPoolExecutor(max_workers=limit) as pool:
        return list(pool.map(one, items))


def notify(callback: Callable[[Any], Any], value: Any) -> None:
    """Calls a progress callback with ``value``."""
    out = callback(value)
    if inspect.isawaitable(out):
        close = getattr(out, "close", None)
        if close is not None:
            close()
        raise TypeError("a coroutine function was given as a callback to the sync API; use AsyncSandbox")
