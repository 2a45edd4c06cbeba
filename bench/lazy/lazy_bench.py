#!/usr/bin/env python3
"""Lazy-loading benchmark of layered images over a shaped link.

The blob store (s3s-fs) runs in a network namespace behind a veth pair
shaped with netem (rate and delay on both directions), so the node fetches
every chunk across a link like a cluster's, not at loopback speed. The
image is the three layers `build-image.sh` makes (>= 1 GB): a Debian base,
a Python toolkit from PyPI, a small workspace repository with tests.

Per workload it measures, each time as create + exec (the API's wall time
seen by the client):

- cold: a fresh node (new data dir, so an empty layer cache; same bucket)
  and the page cache dropped;
- warm-node: the same node again after dropping the page cache (layer
  files local, nothing in memory);
- hot: once more, nothing dropped;
- eager baseline: every chunk of the image downloaded over the same link
  (8 parallel GETs, as a puller that fetches everything first would), plus
  the warm-node start (the layers are then local files; EROFS needs no
  extraction); and the same with the extraction a tar-layer puller does
  after the download (the three layer trees unpacked from uncompressed
  tars, bottom first, and synced: the issue's "fetch and extract
  everything, then start");
- plain local directories: the same three trees merged into one directory
  image on the node's disk, page cache dropped (the warm-run comparison).

and the fraction of the image's bytes the node fetched (per-layer cache
counters, metadata prefill included) and the sandbox's own counters
(`GET /v1/sandboxes/{id}/image-stats`).

Usage (root): bench/lazy/run.sh [--rate 1gbit] [--delay 1ms] [--out FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
LAYERS = Path(os.environ.get("LAZY_BENCH_LAYERS", "/var/cache/warren/lazy-bench"))
S3_KEY, S3_SECRET, BUCKET = "lazybench", "lazybench-secret", "warren"
HOST_IP, NS_IP = "10.233.77.1", "10.233.77.2"
SANDBOX = {"memory_mib": 1024, "disk_mib": 1024, "cpus": 1}
WORKLOADS = [
    ("python3 -c pass", {"argv": ["python3", "-c", "pass"]}),
    ("import numpy, pandas", {"argv": ["python3", "-c", "import numpy, pandas"]}),
    ("pytest -q (workspace)", {"argv": ["python3", "-m", "pytest", "-q", "-p", "no:cacheprovider"], "cwd": "/work/repo"}),
]


def run(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(args, check=True, text=True, capture_output=True, **kw)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * factor)
    raise ValueError(f"rate {rate!r}: use e.g. 1gbit, 100mbit")


class Link:
    """A veth pair into namespace `ns`, shaped both ways: netem (rate and
    delay) where the kernel has it, else tbf (rate only)."""

    def __init__(self, rate: str, delay: str) -> None:
        tag = f"{os.getpid() % 100000}"
        self.ns, self.host_if, self.ns_if = f"wlb{tag}", f"wlbh{tag}", f"wlbn{tag}"
        self.shaping = ""
        run("ip", "netns", "add", self.ns)
        try:
            self._setup(rate, delay)
        except BaseException:
            self.close()
            raise

    def _setup(self, rate: str, delay: str) -> None:
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        run("ip", "link", "set", self.ns_if, "netns", self.ns)
        run("ip", "addr", "add", f"{HOST_IP}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        run("ip", "-n", self.ns, "addr", "add", f"{NS_IP}/30", "dev", self.ns_if)
        run("ip", "-n", self.ns, "link", "set", self.ns_if, "up")
        run("ip", "-n", self.ns, "link", "set", "lo", "up")
        # No delayed ACKs across the link (route metric `quickack`): s3s-fs
        # does not set TCP_NODELAY, so it writes a response's body only once
        # its headers are acknowledged, and a client's delayed ACK held the
        # body 40 ms (seen in a capture on 2026-12-04, on about half of the
        # GETs). A production S3 server sets TCP_NODELAY; this test server's
        # stall is not what a node would see.
        run("ip", "route", "add", f"{NS_IP}/32", "dev", self.host_if, "quickack", "1")
        run("ip", "-n", self.ns, "route", "add", f"{HOST_IP}/32", "dev", self.ns_if, "quickack", "1")
        # netem's own queue would drop at this rate; give it room for a window.
        netem = ["root", "netem", "delay", delay, "rate", rate, "limit", "100000"]
        if subprocess.run(["tc", "qdisc", "add", "dev", self.host_if, *netem], capture_output=True).returncode == 0:
            run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, *netem)
            self.shaping = f"netem rate {rate} delay {delay} each way"
            return
        # No sch_netem in this kernel: rate only, a bucket of 1 ms of traffic.
        burst = max(rate_bits(rate) // 8 // 1000, 64 * 1024)
        tbf = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]
        run("tc", "qdisc", "add", "dev", self.host_if, *tbf)
        run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.ns_if, *tbf)
        self.shaping = f"tbf rate {rate} (burst {burst} B) each way; no added delay (this kernel has no sch_netem)"

    def close(self) -> None:
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)


class S3Server:
    """s3s-fs serving `root` from inside the link's namespace."""

    def __init__(self, link: Link, root: Path) -> None:
        (root / BUCKET).mkdir(parents=True, exist_ok=True)
        binary = os.environ.get("WARREN_S3S_FS", str(ROOT / "target/tools/bin/s3s-fs"))
        cmd = ["ip", "netns", "exec", link.ns, binary, "--host", NS_IP, "--port", "9000",
               "--access-key", S3_KEY, "--secret-key", S3_SECRET, str(root)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.endpoint = f"http://{NS_IP}:9000"
        wait_for(lambda: port_open(NS_IP, 9000), "s3s-fs to listen")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait()


class Node:
    """One `warren serve` with its own data dir, on the shared bucket."""

    def __init__(self, work: Path, name: str, s3: S3Server, extra: tuple[str, ...] = ()) -> None:
        self.dir = work / name
        self.dir.mkdir()
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, WARREN_S3_ACCESS_KEY_ID=S3_KEY, WARREN_S3_SECRET_ACCESS_KEY=S3_SECRET)
        cmd = [str(warren_binary()), "serve", "--data-dir", str(self.dir / "data"), "--listen", f"127.0.0.1:{port}",
               "--instance", f"lazybench-{name}", "--destroy-on-exit", "--blob-store-s3", f"{s3.endpoint}/{BUCKET}", *extra]
        self.log = open(self.dir / "server.log", "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait_for(lambda: self.healthy(), f"warren serve ({self.dir / 'server.log'})")

    def healthy(self) -> bool:
        try:
            return self.call("GET", "/v1/health")["status"] == "ok"
        except (OSError, urllib.error.URLError, KeyError, ValueError):
            return False

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=1800) as resp:
                text = resp.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path}: {e.code} {e.read().decode(errors='replace')}") from None
        return json.loads(text) if text else {}

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)
        self.log.close()


def warren_binary() -> Path:
    return Path(os.environ.get("WARREN_BIN", ROOT / "target/debug/warren"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_for(ready, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_run(node: Node, image: str, workload: dict) -> dict:
    """Create + exec + delete; the seconds of create+exec and what it cost."""
    t0 = time.monotonic()
    sb = node.call("POST", "/v1/sandboxes", {"image": image, **SANDBOX})
    t1 = time.monotonic()
    result = node.call("POST", f"/v1/sandboxes/{sb['id']}/exec?wait=true", {**workload, "timeout_secs": 1200})
    t2 = time.monotonic()
    if result.get("exit_code") != 0:
        raise RuntimeError(f"workload failed: {json.dumps(result)[:2000]}")
    stats = node.call("GET", f"/v1/sandboxes/{sb['id']}/image-stats")
    node.call("DELETE", f"/v1/sandboxes/{sb['id']}")
    return {"secs": t2 - t0, "create_secs": t1 - t0, "exec_secs": t2 - t1, "sandbox": stats}


def layer_fetched(node: Node) -> tuple[int, dict]:
    """Bytes the node fetched, and what of them the metadata prefill took:
    metadata blob bytes, or whole chunks for layers stored without a blob.
    A background completion (the node's default) starts when the run's
    sandbox ends; its bytes are not the run's and are left out."""
    layers = node.call("GET", "/v1/images/stats")["layers"]
    prefill = {"blob_bytes": sum(l.get("metadata_bytes_fetched", 0) for l in layers),
               "chunks": sum(l["metadata_chunks_fetched"] for l in layers)}
    return sum(l["bytes_fetched"] - l.get("completion_bytes", 0) for l in layers), prefill


def wait_completions(node: Node, timeout: float = 300.0) -> tuple[float, int]:
    """Waits until no layer of the node is being completed in the
    background; returns the seconds waited and the bytes completions fetched."""
    start = time.monotonic()
    while True:
        layers = node.call("GET", "/v1/images/stats")["layers"]
        if sum(l.get("completion_running", 0) for l in layers) == 0:
            return time.monotonic() - start, sum(l.get("completion_bytes", 0) for l in layers)
        if time.monotonic() - start > timeout:
            raise RuntimeError("timed out waiting for the layers' background completion")
        time.sleep(0.1)


def wait_replays(node: Node, timeout: float = 120.0) -> tuple[int, int]:
    """Waits until the node's trace replays have ended (they run beside the
    workload and may outlast it): `trace_replays_running` where the node
    reports it, else until the replay counters stay put for a second.
    Returns the units replayed when called and at the end."""
    def replayed() -> tuple[int, int | None]:
        layers = node.call("GET", "/v1/images/stats")["layers"]
        done = sum(l.get("trace_units_replayed", 0) + l.get("failed_trace_units", 0) for l in layers)
        running = [l["trace_replays_running"] for l in layers if "trace_replays_running" in l]
        return done, (sum(running) if running else None)

    first, running = replayed()
    deadline = time.monotonic() + timeout
    last, since = first, time.monotonic()
    while time.monotonic() < deadline:
        done, running = replayed()
        if running == 0 or (running is None and done == last and time.monotonic() - since >= 1.0):
            return first, done
        if done != last:
            last, since = done, time.monotonic()
        time.sleep(0.1)
    raise RuntimeError("timed out waiting for the trace replays to end")


def layer_prefetch(node: Node) -> dict:
    """What the node fetched ahead of sequential readers, and how many of
    those pieces a read later asked for."""
    layers = node.call("GET", "/v1/images/stats")["layers"]
    return {key: sum(l.get(key, 0) for l in layers)
            for key in ("prefetched_bytes", "prefetched_units", "prefetched_units_used")}


def eager_fetch_secs(s3: S3Server) -> tuple[float, int]:
    """Every chunk object downloaded over the link, 8 at a time."""
    import boto3  # the host's; only the baseline needs it

    client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=S3_KEY,
                          aws_secret_access_key=S3_SECRET, region_name="us-east-1")
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="chunks/"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    local = threading.local()

    def get(key: str) -> int:
        if not hasattr(local, "c"):
            local.c = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=S3_KEY,
                                   aws_secret_access_key=S3_SECRET, region_name="us-east-1")
        return len(local.c.get_object(Bucket=BUCKET, Key=key)["Body"].read())

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        total = sum(pool.map(get, keys))
    return time.monotonic() - t0, total


def eager_extract_secs(work: Path) -> float:
    """Unpacking the image as a tar-layer puller does once the download is
    done: each layer's tree from an uncompressed tar (made beforehand,
    outside the timing; a real puller's are usually gzipped, which only
    adds time), bottom first into one directory, then synced."""
    tars = []
    for layer in ("base", "toolkit", "workspace"):
        tar = work / f"eager-{layer}.tar"
        run("tar", "-C", str((LAYERS / layer).resolve()), "-cf", str(tar), ".")
        tars.append(tar)
    dest = work / "eager-root"
    dest.mkdir()
    # The tars were just written, as a download would have: in the page
    # cache, but not still being written back.
    run("sync")
    t0 = time.monotonic()
    for tar in tars:
        run("tar", "-C", str(dest), "-xf", str(tar))
    run("sync")
    secs = time.monotonic() - t0
    shutil.rmtree(dest)
    for tar in tars:
        tar.unlink()
    return secs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--delay", default="1ms")
    ap.add_argument("--chunk-size-bytes", type=int, help="chunk size of the imported layers (server default 1 MiB)")
    ap.add_argument("--piece-size-bytes", type=int,
                    help="piece size of the imported layers (server default 16 KiB; 0 = whole chunks only)")
    ap.add_argument("--readahead-kb", type=int,
                    help="readahead of the nodes' layer mounts (server default 16; 0 = the kernel's 128)")
    ap.add_argument("--warm-readahead-kb", type=int,
                    help="readahead a layer mount gets once a sandbox that read from it ended on the node "
                         "(server default 128; 0 = keep the first window)")
    ap.add_argument("--no-complete-after-use", action="store_true",
                    help="nodes keep layers lazy for good (--layer-complete-after-use=false); by default they "
                         "complete a layer in the background once a sandbox that read from it ended, and the "
                         "warm runs start when that is done")
    ap.add_argument("--fetched-only", action="store_true",
                    help="only the cold runs and their fetched bytes (no warm/hot/plain/eager timings)")
    ap.add_argument("--no-plain", action="store_true",
                    help="skip the plain-directory comparison (it needs ~2.2 GB more disk)")
    ap.add_argument("--no-trace", action="store_true",
                    help="skip the cold run that replays the first cold run's access trace")
    ap.add_argument("--warm-pairs", type=int, default=0,
                    help="N more warm-node and hot runs per workload, each beside a plain-directory one (median, spread)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    for layer in ("base", "toolkit", "workspace"):
        if not (LAYERS / layer).exists():
            sys.exit(f"{LAYERS / layer} is missing: run bench/lazy/build-image.sh first")

    rows, notes = [], {}
    link = Link(args.rate, args.delay)
    notes["shaping"] = link.shaping
    work = Path(tempfile.mkdtemp(prefix="lazy-bench-", dir="/var/tmp"))
    os.chmod(work, 0o755)
    cleanup = [link.close]
    try:
        s3 = S3Server(link, work / "s3")
        cleanup.insert(0, s3.close)
        chunk_args = ("--chunk-size-bytes", str(args.chunk_size_bytes)) if args.chunk_size_bytes else ()
        if args.piece_size_bytes is not None:
            chunk_args += ("--piece-size-bytes", str(args.piece_size_bytes))
        node_args = ("--layer-readahead-kb", str(args.readahead_kb)) if args.readahead_kb is not None else ()
        if args.warm_readahead_kb is not None:
            node_args += ("--layer-warm-readahead-kb", str(args.warm_readahead_kb))
        if args.no_complete_after_use:
            node_args += ("--layer-complete-after-use=false",)
        notes["load_start"] = os.getloadavg()
        importer = Node(work, "import", s3, chunk_args)
        cleanup.insert(0, importer.close)
        t0 = time.monotonic()
        for layer, role in (("base", "base"), ("toolkit", "toolkit"), ("workspace", "workspace")):
            src = str((LAYERS / layer).resolve())
            importer.call("POST", "/v1/images", {"name": f"lb-{layer}", "dir": src, "format": "erofs", "role": role})
        notes["import_secs"] = time.monotonic() - t0
        importer.call("POST", "/v1/images/compose",
                      {"name": "lb", "layers": [{"image": "lb-base"}, {"image": "lb-toolkit"}, {"image": "lb-workspace"}]})
        detail = importer.call("GET", "/v1/images/lb")
        image_bytes = sum(layer["size_bytes"] for layer in detail["layers"])
        notes["layers"] = [(layer["id"], layer["size_bytes"]) for layer in detail["layers"]]
        notes["image_bytes"] = image_bytes
        # Every node reads the layer manifests once (piece digests make them
        # bigger); they are not in the per-layer fetched counters.
        notes["manifest_bytes"] = sum(f.stat().st_size for f in (work / "s3" / BUCKET / "layers").rglob("*.json"))

        # Plain local directories: the three trees merged into one directory image.
        if not (args.fetched_only or args.no_plain):
            merged = work / "merged"
            merged.mkdir()
            for layer in ("base", "toolkit", "workspace"):
                run("cp", "-a", "--reflink=auto", f"{(LAYERS / layer).resolve()}/.", str(merged) + "/")
            importer.call("POST", "/v1/images", {"name": "lb-dir", "dir": str(merged)})
            shutil.rmtree(merged)

        traces = work / "s3" / BUCKET / "traces"
        for label, workload in WORKLOADS:
            # Cold without a trace: no earlier workload's trace may help.
            shutil.rmtree(traces, ignore_errors=True)
            node = Node(work, f"cold-{len(rows)}", s3, node_args)
            try:
                drop_page_cache()
                cold = start_run(node, "lb", workload)
                fetched, prefill = layer_fetched(node)
                prefetch = layer_prefetch(node)
                store = node.call("GET", "/v1/images/stats").get("store", {})
                if args.fetched_only:
                    warm = hot = cold
                else:
                    completion = None if args.no_complete_after_use else wait_completions(node)
                    drop_page_cache()
                    warm = start_run(node, "lb", workload)
                    hot = start_run(node, "lb", workload)
                pairs = []
                if args.warm_pairs and not (args.fetched_only or args.no_plain):
                    # Lazy and plain in turns, so both see the same load.
                    for _ in range(args.warm_pairs):
                        drop_page_cache()
                        lw = start_run(node, "lb", workload)["secs"]
                        lh = start_run(node, "lb", workload)["secs"]
                        drop_page_cache()
                        pw = start_run(importer, "lb-dir", workload)["secs"]
                        ph = start_run(importer, "lb-dir", workload)["secs"]
                        pairs.append((lw, pw, lh, ph))
            finally:
                node.close()
            # Cold on another new node, with the trace the first one stored
            # when its sandbox's layers were released (see docs/images.md,
            # "Access traces").
            traced = traced_fetched = None
            if not args.no_trace and any(traces.rglob("*.json")):
                node = Node(work, f"traced-{len(rows)}", s3, node_args)
                try:
                    drop_page_cache()
                    traced = start_run(node, "lb", workload)
                    # The replay runs beside the workload: count all it fetched.
                    traced["replayed_at_end"], traced["replayed"] = wait_replays(node)
                    traced_fetched, _ = layer_fetched(node)
                finally:
                    node.close()
            if args.fetched_only or args.no_plain:
                plain_warm = plain_hot = None
            else:
                drop_page_cache()
                plain_warm = start_run(importer, "lb-dir", workload)
                plain_hot = start_run(importer, "lb-dir", workload)
            rows.append({"workload": label, "cold": cold, "warm": warm, "hot": hot, "fetched": fetched,
                         "prefill": prefill, "store": store, "prefetch": prefetch,
                         "completion": None if args.fetched_only else completion,
                         "traced": traced, "traced_fetched": traced_fetched, "pairs": pairs,
                         "plain_warm": plain_warm, "plain_hot": plain_hot})
            print(f"{label}: cold {cold['secs']:.2f}s warm {warm['secs']:.2f}s hot {hot['secs']:.2f}s "
                  f"fetched {fetched / image_bytes:.1%}"
                  + (f" traced cold {traced['secs']:.2f}s fetched {traced_fetched / image_bytes:.1%}" if traced else ""),
                  flush=True)
        if args.fetched_only:
            notes["eager_fetch_secs"], notes["eager_bytes"] = float("nan"), 0
            notes["eager_extract_secs"] = float("nan")
        else:
            drop_page_cache()
            notes["eager_fetch_secs"], notes["eager_bytes"] = eager_fetch_secs(s3)
            notes["eager_extract_secs"] = eager_extract_secs(work)
        notes["load_end"] = os.getloadavg()
    finally:
        for close in cleanup:
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep cleaning up
                print(f"cleanup: {e}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)

    report = render(args, rows, notes)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 0


def prefill_text(prefill: dict) -> str:
    parts = []
    if prefill["blob_bytes"]:
        parts.append(f"{prefill['blob_bytes'] / 1e6:.1f} MB blob")
    if prefill["chunks"]:
        parts.append(f"{prefill['chunks']} chunks")
    return " + ".join(parts) or "none"


def spread(values, unit: str) -> str:
    v = sorted(values)
    return f"{statistics.median(v):.2f}{unit} [{v[0]:.2f} - {v[-1]:.2f}]"


def fmt_load(load) -> str:
    return " ".join(f"{x:.1f}" for x in load)


def render(args, rows, notes) -> str:
    image_bytes = notes["image_bytes"]
    eager = notes["eager_fetch_secs"]
    extract = notes["eager_extract_secs"]
    version = subprocess.run([str(warren_binary()), "--version"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"# Lazy-loading benchmark, link {args.rate}",
        "",
        f"- link to the blob store (s3s-fs in a network namespace): {notes['shaping']}",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"- machine: {platform.node()}, {os.cpu_count()} CPUs, kernel {platform.release()}",
        f"- warren: {version} ({warren_binary()})",
        f"- command: `bench/lazy/run.sh{' --release' if 'release' in str(warren_binary()) else ''}"
        f" --rate {args.rate} --delay {args.delay}"
        + (f" --chunk-size-bytes {args.chunk_size_bytes}" if args.chunk_size_bytes else "")
        + (f" --piece-size-bytes {args.piece_size_bytes}" if args.piece_size_bytes is not None else "")
        + (f" --readahead-kb {args.readahead_kb}" if args.readahead_kb is not None else "")
        + (f" --warm-readahead-kb {args.warm_readahead_kb}" if args.warm_readahead_kb is not None else "")
        + (" --no-complete-after-use" if args.no_complete_after_use else "")
        + (" --fetched-only" if args.fetched_only else "")
        + (" --no-plain" if args.no_plain else "")
        + (" --no-trace" if args.no_trace else "")
        + (f" --warm-pairs {args.warm_pairs}" if args.warm_pairs else "") + "`",
        f"- chunk size: {args.chunk_size_bytes or 1 << 20} bytes; piece size: "
        + ("none (whole chunks)" if args.piece_size_bytes == 0 else f"{args.piece_size_bytes or 16 << 10} bytes")
        + "; layer mount readahead: "
        + ("kernel default (128 KiB)" if args.readahead_kb == 0 else f"{16 if args.readahead_kb is None else args.readahead_kb} KiB")
        + ", once a sandbox that read from the layer ended on the node: "
        + ("unchanged" if args.warm_readahead_kb == 0 else f"{128 if args.warm_readahead_kb is None else args.warm_readahead_kb} KiB"),
        f"- load average (1, 5, 15 min) at start {fmt_load(notes['load_start'])}, at end {fmt_load(notes['load_end'])}",
        f"- layer manifests (each node reads them once; not in the fetched column): {notes['manifest_bytes'] / 1e6:.2f} MB",
        f"- image: {image_bytes / 1e9:.2f} GB in EROFS layers: "
        + ", ".join(f"{name} {size / 1e6:.0f} MB" for name, size in notes["layers"]),
        f"- import (build EROFS + upload over the link): {notes['import_secs']:.1f} s",
        f"- eager fetch of every chunk ({notes['eager_bytes'] / 1e6:.0f} MB, 8 parallel GETs): {eager:.2f} s; "
        f"extracting the three layer trees from tars after it (a tar-layer puller's step): {extract:.2f} s",
        "",
        "Times are create + exec as the API client sees them, one run each.",
        "",
        "| workload | fetched (of image) | metadata prefill | sandbox fetched / accessed / hits | store GETs (chunks / ranged) | prefetched (pieces used / fetched ahead) | cold | warm-node | hot | eager (fetch + warm) | cold / eager | plain dirs warm | warm / plain | plain dirs hot |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eager_total = eager + r["warm"]["secs"]
        sb = r["cold"]["sandbox"]
        lines.append(
            f"| {r['workload']} | {r['fetched'] / 1e6:.0f} MB ({r['fetched'] / image_bytes:.1%}) "
            f"| {prefill_text(r['prefill'])} "
            f"| {sb['bytes_fetched'] / 1e6:.0f} MB / {sb['bytes_accessed'] / 1e6:.0f} MB / {sb['cache_hits']} "
            f"| {r['store'].get('chunks_fetched', '?')} / {r['store'].get('range_requests', '-')} "
            f"| {r['prefetch']['prefetched_bytes'] / 1e6:.1f} MB ({r['prefetch']['prefetched_units_used']}"
            f" / {r['prefetch']['prefetched_units']}) "
            f"| {r['cold']['secs']:.2f} s | {r['warm']['secs']:.2f} s | {r['hot']['secs']:.2f} s "
            f"| {eager_total:.2f} s | {r['cold']['secs'] / eager_total:.2f} "
            + (f"| {r['plain_warm']['secs']:.2f} s | {r['warm']['secs'] / r['plain_warm']['secs']:.2f} "
               f"| {r['plain_hot']['secs']:.2f} s |" if r["plain_warm"] else "| - | - | - |")
        )
    completed = [r for r in rows if r.get("completion")]
    if completed:
        lines += [
            "",
            "The node (by default) fetches the rest of each layer the cold run read once its "
            "sandbox ended; the warm runs start after that (the fetched columns leave those bytes out):",
            "",
        ]
        lines += [f"- {r['workload']}: {r['completion'][1] / 1e6:.0f} MB completed in the background, "
                  f"{r['completion'][0]:.1f} s waited after the cold run" for r in completed]
    traced_rows = [r for r in rows if r["traced"]]
    if traced_rows:
        lines += [
            "",
            "Cold with an access trace: a second new node (empty layer cache, page cache dropped) whose layers "
            "replay the trace the first cold node stored (see `docs/images.md`, \"Access traces\").",
            "",
            "| workload | fetched (of image), trace replay included | cold, no trace (create + exec) "
            "| cold, trace (create + exec; the replay runs beside them) | trace units replayed by the run's end / in all "
            "| eager (fetch + warm) "
            "| cold / eager, no trace | cold / eager, trace "
            "| eager with extraction (fetch + extract + warm) | cold / eager with extraction, no trace / trace "
            "| floor: (traced create + plain dirs warm) / eager with extraction |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in traced_rows:
            eager_total = eager + r["warm"]["secs"]
            lines.append(
                f"| {r['workload']} | {r['traced_fetched'] / 1e6:.0f} MB ({r['traced_fetched'] / image_bytes:.1%}) "
                f"| {r['cold']['secs']:.2f} s ({r['cold']['create_secs']:.2f} + {r['cold']['exec_secs']:.2f}) "
                f"| {r['traced']['secs']:.2f} s ({r['traced']['create_secs']:.2f} + {r['traced']['exec_secs']:.2f}) "
                f"| {r['traced']['replayed_at_end']} / {r['traced']['replayed']} "
                f"| {eager_total:.2f} s "
                f"| {r['cold']['secs'] / eager_total:.2f} | {r['traced']['secs'] / eager_total:.2f} "
                f"| {eager_total + extract:.2f} s "
                f"| {r['cold']['secs'] / (eager_total + extract):.2f} / {r['traced']['secs'] / (eager_total + extract):.2f} "
                + (f"| {(r['traced']['create_secs'] + r['plain_warm']['secs']) / (eager_total + extract):.2f} |"
                   if r["plain_warm"] else "| - |")
            )
        lines += [
            "",
            "The floor is the ratio a cold start would have if its exec cost no more than the workload's run on "
            "plain local directories with a cold page cache: what the workload itself takes bounds the cold start "
            "from below, however little is fetched.",
        ]
    paired = [r for r in rows if r.get("pairs")]
    if paired:
        lines += [
            "",
            f"Warm-node and hot against plain directories, {len(paired[0]['pairs'])} pairs per workload taken in turns "
            "(page cache dropped, lazy warm + hot, page cache dropped, plain warm + hot): median [min - max].",
            "",
            "| workload | lazy warm | plain warm | warm / plain, per pair | lazy hot | plain hot | hot / plain, per pair |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in paired:
            ps = r["pairs"]
            lines.append(
                f"| {r['workload']} | {spread([p[0] for p in ps], 's')} | {spread([p[1] for p in ps], 's')} "
                f"| {spread([p[0] / p[1] for p in ps], '')} | {spread([p[2] for p in ps], 's')} "
                f"| {spread([p[3] for p in ps], 's')} | {spread([p[2] / p[3] for p in ps], '')} |"
            )
    lines += [
        "",
        "Targets (issue 3): fetched <= 10% for pytest; cold <= 0.2x eager; warm <= 1.05x plain directories.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
