"""Files: a 1 GiB round trip in constant client memory, both APIs."""

from __future__ import annotations

import hashlib
import os
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

import warren
from conftest import IMAGE

GIB = 1 << 30
#: What a streaming transfer may hold at once: a few chunks, not the file.
MEMORY_BOUND = 32 << 20


def make_file(path: Path, size: int) -> str:
    """Random-looking content (so no layer can compress or dedupe it); its sha256."""
    digest = hashlib.sha256()
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for i in range(size // len(block)):
            chunk = hashlib.sha256(i.to_bytes(8, "little")).digest() + block[32:]
            f.write(chunk)
            digest.update(chunk)
    return digest.hexdigest()


@pytest.fixture
def big(tmp_path: Path) -> Iterator[tuple[Path, Path, str]]:
    """A 1 GiB source file, where to download it back, and its sha256;
    both removed afterwards (pytest keeps old tmp dirs around)."""
    src, back = tmp_path / "src.bin", tmp_path / "back.bin"
    want = make_file(src, GIB)
    yield src, back, want
    src.unlink(missing_ok=True)
    back.unlink(missing_ok=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def test_one_gib_round_trip_in_constant_memory(url: str, big: tuple[Path, Path, str]) -> None:
    src, back, want = big
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=128, disk_mib=GIB // (1 << 20) + 256) as sb:
        tracemalloc.start()
        try:
            stat = sb.files.upload(src, "/tmp/big.bin")
            got = sb.files.download("/tmp/big.bin", back)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert stat.size_bytes == GIB and got == GIB
        assert peak < MEMORY_BOUND, f"the client held {peak} bytes at once for a {GIB}-byte transfer"
        inside = sb.exec(["sha256sum", "/tmp/big.bin"], timeout=600)
        assert inside.stdout.split()[0] == want, "the sandbox holds other bytes than were sent"
    assert sha256_of(back) == want


async def test_one_gib_round_trip_async_in_constant_memory(url: str, big: tuple[Path, Path, str]) -> None:
    src, back, want = big
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=128, disk_mib=GIB // (1 << 20) + 256) as sb:
        tracemalloc.start()
        try:
            stat = await sb.files.upload(src, "/tmp/big.bin")
            got = await sb.files.download("/tmp/big.bin", back)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert stat.size_bytes == GIB and got == GIB
        assert peak < MEMORY_BOUND, f"the client held {peak} bytes at once for a {GIB}-byte transfer"
    assert sha256_of(back) == want


def test_uploads_and_writes_set_the_mode_of_the_new_file(url: str, tmp_path: Path) -> None:
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\necho from-script\n")
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        assert sb.files.upload(script, "/tmp/run.sh", mode=0o755).mode == 0o755
        assert sb.exec(["/tmp/run.sh"]).stdout == "from-script\n"
        # A write makes a new file: without `mode` it gets the default 0644.
        assert sb.files.write("/tmp/run.sh", "#!/bin/sh\necho v2\n").mode == 0o644
        assert sb.files.write("/tmp/run.sh", "#!/bin/sh\necho v2\n", mode=0o700).mode == 0o700
        assert sb.exec(["/tmp/run.sh"]).stdout == "v2\n"
        empty = tmp_path / "empty"
        empty.write_bytes(b"")
        assert sb.files.upload(empty, "/tmp/empty").size_bytes == 0
        assert sb.files.download("/tmp/empty", tmp_path / "empty.back") == 0
