#!/usr/bin/env python3
"""A sample agent-style rollout against Warren's HTTP API (stdlib only).

Creates a sandbox, writes a buggy module and its test, runs the test (fails),
patches the module, runs the test again (passes), reads a result file back,
deletes the sandbox, and prints what happened.
"""
import base64
import json
import os
import sys
import time
import urllib.parse
import urllib.request

URL = os.environ.get("WARREN_URL", "http://127.0.0.1:7070").rstrip("/")


def call(method, path, body=None, raw=None, query=None):
    url = URL + path + ("?" + urllib.parse.urlencode(query) if query else "")
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            payload = resp.read()
            ctype = resp.headers.get("Content-Type", "")
            return json.loads(payload) if "json" in ctype and payload else payload
    except urllib.error.HTTPError as e:
        sys.exit(f"{method} {path} -> {e.code}: {e.read().decode()}")


def run(sb, command):
    """Streams an exec's NDJSON frames and returns (exit_code, stdout)."""
    req = urllib.request.Request(
        f"{URL}/v1/sandboxes/{sb}/exec",
        data=json.dumps({"command": command, "cwd": "/work", "timeout_secs": 120}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    out = b""
    with urllib.request.urlopen(req, timeout=600) as resp:
        for line in resp:
            frame = json.loads(line)
            if frame["type"] == "output":
                out += base64.b64decode(frame["data_b64"])
            elif frame["type"] == "end":
                return frame["result"], out.decode(errors="replace")
    raise RuntimeError("stream ended without an end frame")


def main():
    log = []
    t0 = time.monotonic()

    def step(what):
        log.append(f"{time.monotonic() - t0:7.3f}s  {what}")
        print(log[-1], flush=True)

    # Without bytecode caches: a patch of the same size within the same second
    # would otherwise be hidden by a stale .pyc (Python checks mtime in seconds and size).
    sb = call("POST", "/v1/sandboxes", {"image": "default", "memory_mib": 512, "labels": {"job": "demo"},
                                        "env": {"PYTHONDONTWRITEBYTECODE": "1"}})["id"]
    step(f"created sandbox {sb}")
    call("POST", f"/v1/sandboxes/{sb}/files/mkdir", {"path": "/work", "parents": True})
    call("PUT", f"/v1/sandboxes/{sb}/files", raw=b"def add(a, b):\n    return a - b\n", query={"path": "/work/calc.py"})
    call("PUT", f"/v1/sandboxes/{sb}/files",
         raw=b"from calc import add\n\ndef test_add():\n    assert add(2, 3) == 5\n",
         query={"path": "/work/test_calc.py"})
    step("wrote buggy calc.py and test_calc.py")
    result, out = run(sb, "python3 -m pytest -q -p no:cacheprovider test_calc.py")
    step(f"tests ran: exit {result['exit_code']} ({result['wall_time_secs']:.2f}s) - expected to fail")
    assert result["exit_code"] != 0, out
    call("PUT", f"/v1/sandboxes/{sb}/files", raw=b"def add(a, b):\n    return a + b\n", query={"path": "/work/calc.py"})
    step("patched calc.py")
    result, out = run(sb, "python3 -m pytest -q -p no:cacheprovider test_calc.py > /work/result.txt")
    step(f"tests ran: exit {result['exit_code']} ({result['wall_time_secs']:.2f}s)")
    assert result["exit_code"] == 0, out
    report = call("GET", f"/v1/sandboxes/{sb}/files", query={"path": "/work/result.txt"}).decode()
    step(f"read /work/result.txt: {report.strip().splitlines()[-1]}")
    assert "passed" in report and "failed" not in report, report
    info = call("DELETE", f"/v1/sandboxes/{sb}")
    step(f"deleted sandbox: state={info['state']} reason={info['end_reason']}")
    print("\nrollout OK: the failing test was fixed by the patch.")


if __name__ == "__main__":
    main()
