"""One real ``warren serve`` for the whole session, and a flaky TCP proxy.

The server is the binary cargo built (``$WARREN_BIN``, default
``target/debug/warren`` with ``warren-init`` beside it), on its own data dir
and cgroup instance, serving a busybox image made by
``scripts/make-test-image.sh``. At the end every sandbox is deleted, the
server is stopped, and the fixture fails if it left a mount, a cgroup, a
process or a run directory behind. Runs as root (the sandboxes are real).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = "busybox"
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Bound on anything a healthy server does quickly (start, stop).
SERVER_WAIT = 60.0
#: Ports tried: a fixed range derived from this process's pid (never an
#: OS-chosen port handed over after closing it, which another process could take).
PORT_BASE, PORT_SPAN, PORT_TRIES = 17000, 1000, 25


@dataclass
class Server:
    url: str
    instance: str
    dir: Path
    proc: subprocess.Popen[bytes]

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def log(self) -> Path:
        return self.dir / "server.log"

    @property
    def headers(self) -> dict[str, str]:
        """The admin key of a ``--auth on`` server (its ``admin.key``) as a header."""
        try:
            key = (self.data_dir / "admin.key").read_text().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {key}"}

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _warren_bin() -> Path:
    path = Path(os.environ.get("WARREN_BIN") or REPO / "target" / "debug" / "warren")
    if not path.is_file() or not (path.parent / "warren-init").is_file():
        pytest.exit(f"no warren binary with warren-init beside it at {path}: run `cargo build --workspace` first")
    return path


def _start(binary: Path, tmp: Path, instance: str, extra_args: list[str]) -> Server:
    # No SDK test needs Landlock events, and the server's default makes it the
    # host's audit daemon (host-wide; the Rust suite covers it on its own).
    if not any(a == "--landlock-audit" or a.startswith("--landlock-audit=") for a in extra_args):
        extra_args = [*extra_args, "--landlock-audit", "off"]
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    url_file = data / "server.url"
    for i in range(PORT_TRIES):
        port = PORT_BASE + (os.getpid() + i * 37) % PORT_SPAN
        url_file.unlink(missing_ok=True)
        log = open(tmp / "server.log", "ab")
        proc = subprocess.Popen(
            [binary, "serve", "--data-dir", data, "--listen", f"127.0.0.1:{port}", "--instance", instance, *extra_args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "WARREN_LOG": os.environ.get("WARREN_LOG", "info"), "NO_COLOR": "1"},
        )
        log.close()
        server = Server(f"http://127.0.0.1:{port}", instance, tmp, proc)
        deadline = time.monotonic() + SERVER_WAIT
        while time.monotonic() < deadline:
            if url_file.exists() and url_file.read_text().endswith("\n"):
                return server
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        else:
            proc.kill()
            proc.wait()
            pytest.exit(f"warren serve wrote no server.url in {SERVER_WAIT}s:\n{server.log_tail()}")
        if "in use" not in server.log_tail(5).lower():
            pytest.exit(f"warren serve exited with {proc.returncode}:\n{server.log_tail()}")
    pytest.exit(f"no free port in {PORT_TRIES} tries from {PORT_BASE}")


# ---- the leak check (mirrors tests/src/leaks.rs) ----------------------------


def _mounts_under(d: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split(" ")[4]
        point = point.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")
        if point == str(d) or point.startswith(str(d) + "/"):
            out.append(point)
    return sorted(out, key=lambda p: -p.count("/"))


def _instance_cgroup_dirs(instance: str) -> list[Path]:
    # The microVM driver's QEMU processes live in `<instance>-vm`, the full-VM
    # driver's in `<instance>-fullvm`; the server makes (and caps) all three.
    names = (instance, f"{instance}-vm", f"{instance}-fullvm")
    return [h / n for h in CGROUP_ROOT.iterdir() for n in names if (h / n).is_dir()]


def _sandbox_cgroup_dirs(instance: str) -> list[Path]:
    return [d for top in _instance_cgroup_dirs(instance) for d in top.iterdir() if d.is_dir()]


def _instance_processes(instance: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cgroups = (entry / "cgroup").read_text()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state = stat[stat.rfind(")") + 1 :].split()[0]
        paths = [line.split(":", 2)[2] for line in cgroups.splitlines() if line.count(":") >= 2]
        if state not in ("Z", "X") and any({instance, f"{instance}-vm", f"{instance}-fullvm"} & set(p.split("/")) for p in paths):
            pids.append(int(entry.name))
    return pids


def _leaks(server: Server) -> dict[str, list[object]]:
    run = server.data_dir / "run"
    found: dict[str, list[object]] = {
        "mounts": list(_mounts_under(server.data_dir)),
        "cgroups": list(_sandbox_cgroup_dirs(server.instance)),
        "processes": list(_instance_processes(server.instance)),
        "run entries": sorted(run.iterdir()) if run.is_dir() else [],
    }
    return {k: v for k, v in found.items() if v}


def _force_cleanup(server: Server) -> None:
    for pid in _instance_processes(server.instance):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in _mounts_under(server.data_dir):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    for d in _sandbox_cgroup_dirs(server.instance) + _instance_cgroup_dirs(server.instance):
        try:
            d.rmdir()
        except OSError:
            pass


@contextlib.contextmanager
def running_server(name: str, *extra_args: str) -> Iterator[Server]:
    """A server with the busybox image imported; stopped and leak-checked on exit."""
    if os.geteuid() != 0:
        pytest.exit("the SDK tests run real sandboxes: run them as root")
    binary = _warren_bin()
    tmp = Path(tempfile.mkdtemp(prefix=f"warren-pytest-{name}-"))
    # Like /var/lib: the sandbox's ids must be able to traverse to its root.
    tmp.chmod(0o755)
    subprocess.run(["sh", REPO / "scripts" / "make-test-image.sh", tmp / "rootfs"], check=True)
    instance = f"wpy-{os.getpid()}-{name}"
    srv = _start(binary, tmp, instance, list(extra_args))
    try:
        answer = httpx.post(
            f"{srv.url}/v1/images", json={"name": IMAGE, "dir": str(tmp / "rootfs")}, headers=srv.headers, timeout=120
        )
        assert answer.status_code == 201, f"importing the busybox image: {answer.text}"
        yield srv
        _finish(srv)
        leaks = _leaks(srv)
        assert not leaks, f"the server left behind: {leaks}\n{srv.log_tail()}"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait()
        _force_cleanup(srv)
        if not _mounts_under(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    with running_server("main") as srv:
        yield srv


def _finish(srv: Server) -> None:
    """Deletes what the tests left running, then stops the server (SIGTERM)."""
    listing = httpx.get(f"{srv.url}/v1/sandboxes", headers=srv.headers, timeout=60).json()["sandboxes"]
    for sb in listing:
        if sb["state"] != "ended":
            answer = httpx.delete(f"{srv.url}/v1/sandboxes/{sb['id']}", headers=srv.headers, timeout=60)
            assert answer.status_code == 200, f"deleting {sb['id']} at the end: {answer.text}"
    srv.proc.send_signal(signal.SIGTERM)
    try:
        srv.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        srv.proc.kill()
        srv.proc.wait()
        pytest.fail(f"the server ignored SIGTERM for 30 s:\n{srv.log_tail()}")


@pytest.fixture
def url(server: Server) -> str:
    return server.url


@pytest.fixture
def label() -> dict[str, str]:
    """A label unique to the test, to find exactly its sandboxes."""
    return {"test": uuid.uuid4().hex[:12]}


# ---- a TCP proxy that breaks connections on purpose ------------------------


@dataclass
class FlakyProxy:
    """Forwards 127.0.0.1:<port> to the server. The n-th connection behaves
    as ``plan[n]`` (then ``pass``):

    - ``reset``: closed as soon as it is accepted (the request never arrives);
    - ``drop_answer``: the request reaches the server, its answer is dropped
      and the connection closed (the server did the work; the client cannot know);
    - ``cut:N``: the first N bytes of the answer pass, then the connection closes.
    """

    upstream: tuple[str, int]
    plan: list[str]
    connections: int = 0
    cut_bytes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Bound and listening before the port is known: no window for anyone else.
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._open: list[socket.socket] = []
        self._closed = False
        self._start(self._accept)

    def _start(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            mode = self.plan[self.connections] if self.connections < len(self.plan) else "pass"
            self.connections += 1
            if mode == "reset":
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                client.close()
                continue
            upstream = socket.create_connection(self.upstream)
            self._open += [client, upstream]
            self._start(self._pump, client, upstream, None)
            limit = 0 if mode == "drop_answer" else int(mode.split(":")[1]) if mode.startswith("cut:") else None
            self._start(self._pump, upstream, client, limit)

    def _pump(self, src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if limit is not None and sent + len(data) >= limit:
                    dst.sendall(data[: limit - sent])
                    self.cut_bytes.append(limit)
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        # shutdown, not just close: it wakes the threads blocked in accept and recv.
        for s in [self._sock, *self._open]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for t in self._threads:
            t.join(timeout=10)


@pytest.fixture
def flaky_proxy(server: Server):  # type: ignore[no-untyped-def]
    made: list[FlakyProxy] = []

    def make(*plan: str) -> FlakyProxy:
        host, port = server.url.removeprefix("http://").split(":")
        proxy = FlakyProxy((host, int(port)), list(plan))
        made.append(proxy)
        return proxy

    yield make
    for p in made:
        p.close()
