#!/usr/bin/env python3
"""Writes the API reference of ``python/README.md`` from the docstrings.

Replaces what stands between ``<!-- api:begin -->`` and ``<!-- api:end -->``.
``--check`` exits 1 when the README is stale (the test suite runs it).

Usage: python3 python/tools/gen_api_doc.py [--check]
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import warren  # noqa: E402
from warren import errors  # noqa: E402

README = ROOT / "README.md"
BEGIN, END = "<!-- api:begin -->", "<!-- api:end -->"

# Each handle with the name its calls are shown on.
HANDLES = [
    (warren.Sandbox, "sb"),
    (warren.Files, "sb.files"),
    (warren.Sessions, "sb.sessions"),
    (warren.Session, "session"),
    (warren.Client, "client"),
]
RECORDS = [
    warren.ExecResult,
    warren.SandboxInfo,
    warren.FileStat,
    warren.SessionInfo,
    warren.SecurityEvents,
    warren.Started,
    warren.Output,
    warren.Gap,
    warren.End,
    warren.Trajectory,
    warren.TrajectoryStep,
    warren.StepResult,
    warren.ReplayReport,
    warren.ReplayStep,
    warren.FunctionResult,
    warren.FunctionTimings,
]
ENUMS = [warren.ExecStatus, warren.SandboxState, warren.EndReason, warren.Backend, warren.NetworkMode]


def doc(obj: object) -> str:
    text = inspect.getdoc(obj) or ""
    # Sphinx roles read as plain code in Markdown.
    return re.sub(r":(?:class|meth|func):`~?(?:warren\.)?([^`]+)`", r"`\1`", text)


def signature(name: str, fn: object) -> str:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    # Annotations are strings here (postponed evaluation): show them bare.
    params = [
        p.replace(annotation=inspect.Parameter.empty if p.annotation is p.empty else _Bare(p.annotation))
        for p in sig.parameters.values()
        if p.name not in ("self", "cls")
    ]
    ret = sig.return_annotation
    sig = sig.replace(parameters=params, return_annotation=_Bare(ret) if ret is not sig.empty else sig.empty)
    return f"{name}{sig}"


class _Bare:
    def __init__(self, text: object) -> None:
        self.text = str(text)

    def __repr__(self) -> str:
        return self.text


def handle(cls: type, var: str) -> list[str]:
    out = [f"### `{cls.__name__}`", "", doc(cls), ""]
    for name, member in cls.__dict__.items():
        if name.startswith("_") or name == "refresh":
            continue
        fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if isinstance(member, property):
            out += [f"- `{var}.{name}` (property): {doc(member) or ''}".rstrip(": "), ""]
            continue
        if not callable(fn):
            continue
        prefix = f"{cls.__name__}." if isinstance(member, classmethod) else f"{var}."
        out += [f"#### `{prefix}{signature(name, fn)}`", ""]
        if doc(fn):
            out += [doc(fn), ""]
    return out


def record(cls: type) -> list[str]:
    fields = ", ".join(f"`{f.name}`" for f in dataclasses.fields(cls) if f.name != "raw")
    props = [n for n, v in cls.__dict__.items() if isinstance(v, property)]
    extra = f"; properties {', '.join(f'`{p}`' for p in props)}" if props else ""
    first = doc(cls).split("\n\n")[0].replace("\n", " ")
    return [f"- **`{cls.__name__}`**: {first} Fields {fields}{extra}.".replace(":  Fields", ": Fields"), ""]


def error_tree() -> list[str]:
    out = []
    for cls in [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.WarrenError)]:
        bases = [b.__name__ for b in cls.__bases__ if b is not Exception]
        first = doc(cls).split("\n\n")[0].replace("\n", " ")
        out.append(f"- **`{cls.__name__}`** ({', '.join(bases) or 'Exception'}): {first}")
    return out + [""]


def render() -> str:
    lines = [
        BEGIN,
        "<!-- Generated from the docstrings by python/tools/gen_api_doc.py; edit those. -->",
        "",
        "The sync API is shown; `AsyncSandbox`, `AsyncFiles`, `AsyncSessions`, `AsyncSession` and",
        "`AsyncClient` have the same calls as coroutines (`exec_stream` and `run_stream` return",
        "async iterators; `AsyncClient.aclose()` replaces `Client.close()`).",
        "",
    ]
    for cls, var in HANDLES:
        lines += handle(cls, var)
    lines += ["### Records", ""]
    for cls in RECORDS:
        lines += record(cls)
    lines += ["### Enums", ""]
    for e in ENUMS:
        lines.append(f"- `{e.__name__}`: " + ", ".join(f"`{m.value}`" for m in e))
    lines += ["", "### Errors", ""] + error_tree() + [END]
    return "\n".join(lines)


def main() -> int:
    text = README.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    new = text[:start] + render() + text[end:]
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{README} is stale: run python3 python/tools/gen_api_doc.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
