"""Broken connections: idempotent calls are retried, creates never make two
sandboxes, exec streams resume instead of re-running, and mutating calls are
resent with their trajectory step, so the server answers them from its log
instead of running them twice."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

import warren
from conftest import IMAGE, FlakyProxy

FAST = warren.RetryPolicy(attempts=4, base_delay=0.01, max_delay=0.05)

# Appends to a counter file (proof of how often it ran), then prints enough
# that a cut after a few hundred bytes of the answer lands mid-stream.
COUNTED = "echo run >> /tmp/runs; i=0; while [ $i -lt 300 ]; do echo line$i; i=$((i+1)); done"
EXPECTED_OUT = "".join(f"line{i}\n" for i in range(300))
# Headers plus the `started` frame and part of the first output frame.
CUT = "cut:400"

ProxyFactory = Callable[..., FlakyProxy]


@pytest.fixture
def sb(url: str) -> Iterator[warren.Sandbox]:
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        yield sb


def test_a_create_whose_answer_was_lost_is_retried_into_the_same_sandbox(
    url: str, flaky_proxy: ProxyFactory, label: dict[str, str]
) -> None:
    proxy = flaky_proxy("drop_answer")
    with warren.Client(proxy.url, retry=FAST) as client:
        with warren.Sandbox.create(IMAGE, client=client, memory_mib=64, labels=label) as sb:
            assert proxy.connections == 2 and proxy.cut_bytes == [0], "the first answer was dropped"
            made = warren.Sandbox.list(labels=label, url=url)
            assert [i.id for i in made] == [sb.id], "a retried create made a second sandbox"


async def test_async_create_retry_makes_one_sandbox(url: str, flaky_proxy: ProxyFactory, label: dict[str, str]) -> None:
    proxy = flaky_proxy("drop_answer", "reset")
    async with warren.AsyncClient(proxy.url, retry=FAST) as client:
        async with await warren.AsyncSandbox.create(IMAGE, client=client, memory_mib=64, labels=label) as sb:
            assert proxy.connections == 3
            made = await warren.AsyncSandbox.list(labels=label, url=url)
            assert [i.id for i in made] == [sb.id]


def test_the_same_idempotency_key_answers_with_the_same_sandbox(url: str, label: dict[str, str]) -> None:
    key = f"k-{uuid.uuid4()}"
    with warren.Sandbox.create(IMAGE, url=url, memory_mib=64, labels=label, idempotency_key=key) as first:
        second = warren.Sandbox.create(IMAGE, url=url, memory_mib=64, labels=label, idempotency_key=key)
        assert second.id == first.id and second.last_info.idempotency_key == key
        assert len(warren.Sandbox.list(labels=label, url=url)) == 1


def test_idempotent_calls_are_retried_after_a_reset(sb: warren.Sandbox, flaky_proxy: ProxyFactory) -> None:
    proxy = flaky_proxy("reset", "reset")
    with warren.Client(proxy.url, retry=FAST) as client:
        assert warren.Sandbox.connect(sb.id, client=client).id == sb.id
        assert proxy.connections == 3


def test_a_stepped_call_whose_answer_was_lost_is_resent_and_answered_from_the_log(
    sb: warren.Sandbox, flaky_proxy: ProxyFactory
) -> None:
    proxy = flaky_proxy("drop_answer")
    with warren.Client(proxy.url, retry=FAST) as client:
        session = warren.Sandbox(sb.last_info, client).sessions.create()
    assert proxy.connections == 2 and proxy.cut_bytes == [0], "the first answer was dropped"
    assert [s.id for s in sb.sessions.list()] == [session.id], "the resent step made a second session"


def test_retries_are_bounded(sb: warren.Sandbox, flaky_proxy: ProxyFactory) -> None:
    proxy = flaky_proxy(*["reset"] * 10)
    with warren.Client(proxy.url, retry=FAST) as client:
        with pytest.raises(warren.WarrenConnectionError):
            warren.Sandbox.connect(sb.id, client=client)
    assert proxy.connections == FAST.attempts


def test_a_cut_exec_stream_resumes_without_running_the_command_again(
    sb: warren.Sandbox, flaky_proxy: ProxyFactory
) -> None:
    proxy = flaky_proxy(CUT)
    with warren.Client(proxy.url, retry=FAST) as client:
        result = warren.Sandbox(sb.last_info, client).exec(COUNTED)
    assert proxy.cut_bytes == [400] and proxy.connections == 2, "the stream was cut once, then resumed"
    assert result.ok and result.stdout == EXPECTED_OUT
    assert sb.files.read_text("/tmp/runs") == "run\n", "the command ran more than once"


async def test_a_cut_async_exec_stream_resumes_without_running_the_command_again(
    url: str, flaky_proxy: ProxyFactory
) -> None:
    proxy = flaky_proxy(CUT, "reset")
    async with await warren.AsyncSandbox.create(IMAGE, url=url, memory_mib=64) as sb:
        async with warren.AsyncClient(proxy.url, retry=FAST) as client:
            frames = [f async for f in warren.AsyncSandbox(sb.last_info, client).exec_stream(COUNTED)]
        assert proxy.connections == 3
        out = b"".join(f.data for f in frames if isinstance(f, warren.Output))
        assert out.decode() == EXPECTED_OUT
        assert sum(isinstance(f, warren.Started) for f in frames) == 1
        assert isinstance(frames[-1], warren.End) and frames[-1].result.stdout == EXPECTED_OUT
        assert await sb.files.read_text("/tmp/runs") == "run\n"


def test_an_exec_whose_answer_was_lost_before_it_started_runs_once(
    sb: warren.Sandbox, flaky_proxy: ProxyFactory
) -> None:
    proxy = flaky_proxy("drop_answer")
    with warren.Client(proxy.url, retry=FAST) as client:
        result = warren.Sandbox(sb.last_info, client).exec(COUNTED)
    assert proxy.connections == 2, "resent with its step"
    assert result.ok and result.stdout == EXPECTED_OUT
    assert sb.files.read_text("/tmp/runs") == "run\n", "the resent step ran the command again"


def test_an_interrupted_download_starts_over(sb: warren.Sandbox, flaky_proxy: ProxyFactory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    payload = bytes(range(256)) * 4096
    sb.files.write("/tmp/blob", payload)
    proxy = flaky_proxy("cut:5000")
    with warren.Client(proxy.url, retry=FAST) as client:
        n = warren.Sandbox(sb.last_info, client).files.download("/tmp/blob", tmp_path / "blob")
    assert n == len(payload) and (tmp_path / "blob").read_bytes() == payload
    assert proxy.connections == 2 and not (tmp_path / "blob.warren-part").exists()


@pytest.mark.parametrize("fault", ["drop_answer", "cut:300"])
def test_a_broken_batch_is_resent_and_makes_no_extra_sandboxes(
    url: str, flaky_proxy: ProxyFactory, label: dict[str, str], fault: str
) -> None:
    proxy = flaky_proxy(fault)
    with warren.Client(proxy.url, retry=FAST) as client:
        made = warren.Sandbox.create_many(3, IMAGE, client=client, memory_mib=64, labels=label)
        try:
            assert proxy.connections == 2, "the broken batch was sent again"
            assert all(isinstance(s, warren.Sandbox) for s in made), made
            listed = warren.Sandbox.list(labels=label, url=url)
            assert sorted(i.id for i in listed) == sorted(s.id for s in made if isinstance(s, warren.Sandbox))
        finally:
            for s in made:
                if isinstance(s, warren.Sandbox):
                    s.delete()
