"""The wire formats under the SDK, spoken directly: E2B's control API error
bodies and status codes, and envd's Connect framing (5-byte envelopes, the
end-of-stream message, unary errors), its header routing and access token."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import pytest

from conftest import API_KEY, TEMPLATE


def envelope(message: dict, flags: int = 0) -> bytes:
    data = json.dumps(message).encode()
    return struct.pack(">BI", flags, len(data)) + data


def envelopes(body: bytes) -> list[tuple[int, dict]]:
    out = []
    while body:
        flags, size = struct.unpack(">BI", body[:5])
        out.append((flags, json.loads(body[5 : 5 + size])))
        body = body[5 + size :]
    return out


@pytest.fixture
def api(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers={"X-API-KEY": API_KEY}, timeout=60) as c:
        yield c


@pytest.fixture
def made(api: httpx.Client, label: dict[str, str]):
    r = api.post("/sandboxes", json={"templateID": TEMPLATE, "timeout": 120, "metadata": label, "someFutureField": [1]})
    assert r.status_code == 201, r.text
    body = r.json()
    yield body
    api.delete(f"/sandboxes/{body['sandboxID']}")


def envd_headers(sbx: dict) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx["sandboxID"], "X-Access-Token": sbx["envdAccessToken"]}


def test_control_errors_are_code_and_message(api: httpx.Client, server) -> None:
    r = httpx.post(f"{server.url}/sandboxes", json={"templateID": TEMPLATE}, headers={"X-API-KEY": "wrong"})
    assert r.status_code == 401
    assert set(r.json()) == {"code", "message"} and r.json()["code"] == 401
    r = api.get("/sandboxes/sb-does-not-exist")
    assert (r.status_code, r.json()["code"]) == (404, 404)
    r = api.post("/v2/sandboxes", content=b"{not json", headers={"Content-Type": "application/json"})
    assert (r.status_code, r.json()["code"]) == (400, 400)
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 0})
    assert r.status_code == 400 and "timeout" in r.json()["message"]
    r = api.get("/v2/sandboxes", params={"state": "exploded"})
    assert r.status_code == 400 and "state" in r.json()["message"]


def test_created_sandbox_has_the_sdks_required_fields(made: dict) -> None:
    for field in ("templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"):
        assert made[field], field
    assert made["templateID"] == TEMPLATE


def test_envd_needs_the_sandbox_header_and_its_token(server, made: dict) -> None:
    url = f"{server.url}/filesystem.Filesystem/Stat"
    body = {"path": "/"}
    r = httpx.post(url, json=body)
    assert r.status_code == 400
    r = httpx.post(url, json=body, headers={"E2b-Sandbox-Id": made["sandboxID"], "X-Access-Token": "forged"})
    assert r.status_code == 401
    r = httpx.post(url, json=body, headers=envd_headers(made))
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    assert httpx.get(f"{server.url}/health", headers=envd_headers(made)).status_code == 204


def test_unary_errors_use_connect_codes(server, made: dict) -> None:
    h = envd_headers(made)
    r = httpx.post(f"{server.url}/filesystem.Filesystem/Stat", json={"path": "/nope"}, headers=h)
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = httpx.post(f"{server.url}/filesystem.Filesystem/WatchDir", json={}, headers=h)
    assert r.status_code == 501 and r.json()["code"] == "unimplemented"
    proto = {**h, "Content-Type": "application/proto"}
    r = httpx.post(f"{server.url}/process.Process/List", content=b"\x00", headers=proto)
    assert r.status_code == 501


def test_start_streams_enveloped_events_and_ends_the_stream(server, made: dict) -> None:
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", "echo hi; echo oops >&2; exit 4"]}, "stdin": False}
    r = httpx.post(
        f"{server.url}/process.Process/Start",
        content=envelope(start),
        headers={**envd_headers(made), "Content-Type": "application/connect+json"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/connect+json"
    frames = envelopes(r.content)
    assert [f for f, _ in frames][-1] == 2 and frames[-1][1] == {}
    events = [m["event"] for f, m in frames if f == 0]
    assert "pid" in events[0]["start"]
    out = b"".join(base64.b64decode(e["data"].get("stdout", "")) for e in events if "data" in e)
    err = b"".join(base64.b64decode(e["data"].get("stderr", "")) for e in events if "data" in e)
    assert (out, err) == (b"hi\n", b"oops\n")
    assert events[-1]["end"] == {"exitCode": 4, "exited": True, "status": "exit status 4"}


def test_stream_errors_arrive_in_the_end_of_stream_message(server, made: dict) -> None:
    r = httpx.post(
        f"{server.url}/process.Process/Connect",
        content=envelope({"process": {"pid": 4242}}),
        headers={**envd_headers(made), "Content-Type": "application/connect+json"},
    )
    assert r.status_code == 200
    [(flags, end)] = envelopes(r.content)
    assert flags == 2 and end["error"]["code"] == "not_found"


def test_octet_stream_and_multipart_uploads(server, made: dict) -> None:
    h = envd_headers(made)
    r = httpx.post(
        f"{server.url}/files",
        params={"path": "/tmp/raw.bin"},
        content=b"\x00\x01raw",
        headers={**h, "Content-Type": "application/octet-stream"},
    )
    assert r.status_code == 200 and r.json() == [{"name": "raw.bin", "type": "file", "path": "/tmp/raw.bin"}]
    parts = [("file", ("/tmp/up/x.txt", b"X")), ("file", ("rel.txt", b"R"))]
    r = httpx.post(f"{server.url}/files", files=parts, headers=h)
    assert r.status_code == 200
    assert [e["path"] for e in r.json()] == ["/tmp/up/x.txt", "/home/user/rel.txt"]
    got = httpx.get(f"{server.url}/files", params={"path": "/tmp/raw.bin"}, headers=h)
    assert got.content == b"\x00\x01raw"
    missing = httpx.get(f"{server.url}/files", params={"path": "/tmp/none"}, headers=h)
    assert missing.status_code == 404 and missing.json()["code"] == 404


def test_envd_on_a_killed_sandbox_says_not_found(server, api: httpx.Client, label: dict[str, str]) -> None:
    sbx = api.post("/sandboxes", json={"templateID": TEMPLATE, "metadata": label}).json()
    assert api.delete(f"/sandboxes/{sbx['sandboxID']}").status_code == 204
    r = httpx.get(f"{server.url}/files", params={"path": "/etc/passwd"}, headers=envd_headers(sbx))
    assert r.status_code == 502 and "not found" in r.json()["message"]
    assert api.delete(f"/sandboxes/{sbx['sandboxID']}").status_code == 404


def test_quiet_processes_get_keepalives(server, made: dict) -> None:
    start = {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 2.5; echo woke"]}, "stdin": False}
    headers = {**envd_headers(made), "Content-Type": "application/connect+json", "Keepalive-Ping-Interval": "1"}
    r = httpx.post(f"{server.url}/process.Process/Start", content=envelope(start), headers=headers, timeout=60)
    events = [m["event"] for f, m in envelopes(r.content) if f == 0]
    assert sum("keepalive" in e for e in events) >= 1
    assert events[-1]["end"]["exitCode"] == 0


def test_process_list_forgets_ended_processes(server, made: dict) -> None:
    h = {**envd_headers(made), "Content-Type": "application/connect+json"}
    quick = {"process": {"cmd": "/bin/true"}, "stdin": False, "tag": "quick"}
    slow = {"process": {"cmd": "/bin/sleep", "args": ["600"]}, "stdin": False, "tag": "slow"}
    httpx.post(f"{server.url}/process.Process/Start", content=envelope(quick), headers=h, timeout=60)
    with httpx.stream("POST", f"{server.url}/process.Process/Start", content=envelope(slow), headers=h) as r:
        chunks = r.iter_bytes()
        first = next(chunks)
        pid = envelopes(first[: 5 + struct.unpack(">I", first[1:5])[0]])[0][1]["event"]["start"]["pid"]
        unary = envd_headers(made)
        listed = httpx.post(f"{server.url}/process.Process/List", json={}, headers=unary).json()["processes"]
        assert [(p["pid"], p["tag"], p["config"]["cmd"]) for p in listed] == [(pid, "slow", "/bin/sleep")]
        signal = {"process": {"tag": "slow"}, "signal": "SIGNAL_SIGKILL"}
        assert httpx.post(f"{server.url}/process.Process/SendSignal", json=signal, headers=unary).status_code == 200
        frames = envelopes(first + b"".join(chunks))
    assert frames[-1] == (2, {})
    assert frames[-2][1]["event"]["end"]["status"] == "signal: killed"
