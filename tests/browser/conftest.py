"""The browser suite reuses the SDK suite's server harness: a real
``warren serve`` with the busybox image, stopped and leak-checked at the end
(``python/tests/conftest.py``), loaded under its own module name so the two
``conftest`` modules never shadow each other."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_SDK_CONFTEST = Path(__file__).resolve().parents[2] / "python" / "tests" / "conftest.py"
_spec = importlib.util.spec_from_file_location("warren_sdk_conftest", _SDK_CONFTEST)
assert _spec is not None and _spec.loader is not None
harness = importlib.util.module_from_spec(_spec)
# dataclasses look their module up in sys.modules while the module runs.
sys.modules[_spec.name] = harness
_spec.loader.exec_module(harness)
