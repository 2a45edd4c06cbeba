"""The SDK examples run against the test server."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import IMAGE, REPO


def test_sdk_rollout_example_solves_every_rollout(url: str) -> None:
    done = subprocess.run(
        [sys.executable, REPO / "examples" / "sdk_rollout.py", "--n", "4", "--image", IMAGE],
        env={**os.environ, "WARREN_URL": url},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 rollouts, mean reward 1.00" in done.stdout
    assert done.stdout.count("after='PASS'") == 4


def test_async_many_example_runs_256_sandboxes_at_once(url: str) -> None:
    done = subprocess.run(
        [sys.executable, REPO / "examples" / "async_many.py", "--n", "256", "--image", IMAGE],
        env={**os.environ, "WARREN_URL": url},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "256 sandboxes made" in done.stdout and "256 commands right, 0 creates failed" in done.stdout, done.stdout


def test_preemption_demo_shows_zero_reexecutions(url: str) -> None:
    done = subprocess.run(
        [sys.executable, REPO / "examples" / "preemption_demo.py", "--image", IMAGE],
        env={**os.environ, "WARREN_URL": url},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "re-executions = 0" in done.stdout, done.stdout
    assert "killed the driver (SIGKILL)" in done.stdout
