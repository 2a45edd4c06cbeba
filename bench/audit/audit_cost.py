#!/usr/bin/env python3
"""What an audit context costs each system call, on this host.

Runs syscall_loop.c (CPU ns per getppid()) in processes created under four
audit states, in alternating rounds:

  disabled          audit as the host has it (disabled)
  disabled+never    disabled, with a `never,task` rule while the process is made
  enabled           enabled, this script the audit daemon, no rules
  enabled+never     enabled, daemon, `never,task` (what `warren serve` does)

Needs root (CAP_AUDIT_CONTROL in the initial namespaces), gcc, and no audit
daemon running. Puts back `enabled` and removes the rule it added after each
state. Note: once audit has been enabled, the kernel gives every new process
an audit context until reboot (unless a `never,task` rule says otherwise), so
"disabled" on a host where audit was never enabled equals "disabled+never".

Usage: python3 bench/audit/audit_cost.py [rounds]
"""
import os
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

AUDIT_GET, AUDIT_SET, ADD_RULE, DEL_RULE = 1000, 1001, 1011, 1012
NETLINK_AUDIT, NLMSG_ERROR = 9, 2
MASK_ENABLED, MASK_PID = 0x1, 0x4
# struct audit_rule_data: flags=AUDIT_FILTER_TASK, action=AUDIT_NEVER, no fields.
NEVER_TASK = struct.pack("=3I", 1, 0, 0) + b"\0" * (64 * 4 * 4) + struct.pack("=I", 0)


class Audit:
    def __init__(self):
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_AUDIT)
        self.sock.bind((0, 0))
        self.seq = 0

    def request(self, kind, body=b""):
        self.seq += 1
        self.sock.send(struct.pack("=IHHII", 16 + len(body), kind, 5, self.seq, 0) + body)
        reply = None
        while True:
            data = self.sock.recv(65536)
            _, k, _, seq, _ = struct.unpack("=IHHII", data[:16])
            if seq != self.seq:
                continue  # an audit record
            if k == NLMSG_ERROR:
                err = struct.unpack("=i", data[16:20])[0]
                if err:
                    raise OSError(-err, f"audit request {kind}")
                if kind != AUDIT_GET or reply is not None:
                    return reply
            elif k == AUDIT_GET:
                reply = struct.unpack("=11I", data[16:60])
                return reply

    def set(self, mask, enabled=0, pid=0):
        self.request(AUDIT_SET, struct.pack("=11I", mask, enabled, 0, pid, *([0] * 7)))


def run_in_state(loop, state):
    if state == "disabled":
        return subprocess.run([loop], capture_output=True, text=True, check=True).stdout.strip()
    audit = Audit()
    enabled_before, daemon = audit.request(AUDIT_GET)[1], audit.request(AUDIT_GET)[3]
    if daemon and Path(f"/proc/{daemon}").exists():
        sys.exit(f"an audit daemon (pid {daemon}) runs: stop it first")
    audit.set(MASK_PID, pid=os.getpid())
    try:
        if state.endswith("+never"):
            audit.request(ADD_RULE, NEVER_TASK)
        if state.startswith("enabled"):
            audit.set(MASK_ENABLED, enabled=1)
        # Records (configuration changes) arrive on this socket; the loop
        # makes none, so reading them after it is enough.
        out = subprocess.run([loop], capture_output=True, text=True, check=True).stdout.strip()
    finally:
        if state.endswith("+never"):
            audit.request(DEL_RULE, NEVER_TASK)
        if state.startswith("enabled"):
            audit.set(MASK_ENABLED, enabled=enabled_before)
        audit.sock.settimeout(0.3)
        try:
            while True:
                audit.sock.recv(65536)
        except socket.timeout:
            pass
        audit.sock.settimeout(None)
        audit.set(MASK_PID, pid=0)
    return out


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    src = Path(__file__).with_name("syscall_loop.c")
    with tempfile.TemporaryDirectory() as tmp:
        loop = str(Path(tmp) / "syscall_loop")
        subprocess.run(["gcc", "-O2", "-o", loop, str(src)], check=True)
        states = ["disabled", "disabled+never", "enabled", "enabled+never"]
        results = {s: [] for s in states}
        for _ in range(rounds):
            for s in states:
                results[s].append(float(run_in_state(loop, s)))
        print(f"{os.uname().release}, {os.cpu_count()} CPUs: CPU ns per getppid(), best of 30 x 10^6, {rounds} rounds")
        for s in states:
            print(f"  {s:16} {min(results[s]):6.1f} - {max(results[s]):6.1f}")


if __name__ == "__main__":
    main()
