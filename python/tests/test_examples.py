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
