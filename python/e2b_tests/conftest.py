"""The official ``e2b`` SDK against a real ``warren serve``.

The server comes from the SDK tests' harness (``python/tests/conftest.py``:
its own data dir and cgroup instance, leak check at the end), with an API
key and an ``e2b`` image as the default template: the busybox test image
plus what E2B templates have and the SDK relies on - ``/bin/bash`` (a shim
to busybox ``sh``: the SDK runs every command as ``/bin/bash -l -c``) and
``/home/user``. The SDK is pointed at it by the environment, as a user
would: ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``.

Run by ``run.sh``, once per SDK version, each in its own virtualenv.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
API_KEY = "e2b_warren_test_key"
TEMPLATE = "e2b"

_spec = importlib.util.spec_from_file_location("warren_harness", REPO / "python" / "tests" / "conftest.py")
assert _spec and _spec.loader
harness = importlib.util.module_from_spec(_spec)
# Dataclasses look their module up in sys.modules while being made.
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)


def _make_template(server_dir: Path) -> Path:
    root = server_dir / "e2b-rootfs"
    subprocess.run(["sh", REPO / "scripts" / "make-test-image.sh", root], check=True)
    bash = root / "bin" / "bash"
    bash.unlink(missing_ok=True)
    bash.write_text('#!/bin/sh\nexec /bin/sh "$@"\n')
    bash.chmod(0o755)
    (root / "home" / "user").mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="session")
def server() -> Iterator[harness.Server]:
    with harness.running_server("e2b", "--e2b-api-key", API_KEY, "--e2b-default-template", TEMPLATE) as srv:
        root = _make_template(srv.dir)
        answer = httpx.post(f"{srv.url}/v1/images", json={"name": TEMPLATE, "dir": str(root)}, timeout=120)
        assert answer.status_code == 201, f"importing the e2b template: {answer.text}"
        yield srv


@pytest.fixture(autouse=True)
def e2b_env(server: harness.Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    for var in ("E2B_DEBUG", "E2B_DOMAIN", "E2B_ACCESS_TOKEN"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def label() -> dict[str, str]:
    """Metadata unique to the test, to find exactly its sandboxes."""
    return {"test": uuid.uuid4().hex[:12]}


def sdk_version() -> tuple[int, ...]:
    from importlib.metadata import version

    return tuple(int(p) for p in version("e2b").split(".")[:3])


@pytest.fixture
def sandbox(label: dict[str, str]) -> Iterator[object]:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300, metadata=label)
    try:
        yield sbx
    finally:
        try:
            sbx.kill()
        except Exception:  # noqa: BLE001 - already gone is fine at teardown
            pass


os.environ.setdefault("E2B_CONNECTION_RETRIES", "1")
