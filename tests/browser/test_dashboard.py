"""The dashboard at ``/ui``, end to end in headless Chromium: against a real
server with a few sandboxes, the list shows them and its filters select,
the detail view shows state, resources, exec history and security events,
the live charts move when sandboxes are created, and nothing is loaded from
anywhere but the server. Writes a screenshot
(``$WARREN_DASHBOARD_SCREENSHOT``, default a temp file; the one in
``docs/dashboard.png`` was taken this way).

Needs Debian's ``chromium`` and Python ``playwright`` (``scripts/test.sh``
installs both); Playwright drives the system browser, it downloads none.
"""

from __future__ import annotations

import json
import re
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import harness
from playwright.sync_api import Page, expect, sync_playwright

CHROMIUM = os.environ.get("WARREN_CHROMIUM", "/usr/bin/chromium")
#: Bound on anything the page does within a few polls (it polls every 1-3 s).
UI_WAIT_MS = 30_000
#: The shape every sandbox here is made with, and a warm pool of it: creates
#: are warm or cold depending on what the pool holds at the moment.
SHAPE = {"cpus": 0.5, "memory_mib": 64, "disk_mib": 64}
POOL = "image={},cpus=0.5,memory_mib=64,disk_mib=64,size=2"


def _create(url: str, **fields: object) -> dict:
    body = {"image": harness.IMAGE, **SHAPE, **fields}
    answer = httpx.post(f"{url}/v1/sandboxes", json=body, timeout=120)
    assert answer.status_code == 201, answer.text
    return answer.json()


def _sh(url: str, sandbox_id: str, command: str) -> dict:
    answer = httpx.post(
        f"{url}/v1/sandboxes/{sandbox_id}/exec?wait=true", json={"command": command}, timeout=120
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


@pytest.fixture(scope="module")
def server() -> Iterator[object]:
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"no Chromium at {CHROMIUM}: `apt-get install chromium` (scripts/setup-host.sh does)")
    with harness.running_server("dashboard", "--pool", POOL.format(harness.IMAGE)) as srv:
        yield srv


@pytest.fixture
def page(server: object) -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1440, "height": 1000})
            yield context.new_page()
        finally:
            browser.close()


def _rows(page: Page) -> list[str]:
    return page.eval_on_selector_all("#list tbody tr", "rows => rows.map(r => r.dataset.id)")


def _chart(page: Page, name: str) -> tuple[int, list]:
    canvas = page.locator(f"#chart-{name}")
    return int(canvas.get_attribute("data-points") or 0), json.loads(canvas.get_attribute("data-last") or "[]")


def test_dashboard_lists_filters_details_and_charts_live(server, page: Page) -> None:  # type: ignore[no-untyped-def]
    url = server.url
    suite = uuid.uuid4().hex[:8]
    agent = _create(url, labels={"suite": suite, "role": "agent"})
    grader = _create(url, labels={"suite": suite, "role": "grader"})
    gone = _create(url, labels={"suite": suite, "role": "gone"})
    assert _sh(url, agent["id"], "echo hello")["exit_code"] == 0
    assert _sh(url, agent["id"], "exit 3")["exit_code"] == 3
    # A refused system call: a seccomp event for the detail view.
    _sh(url, agent["id"], "chroot / true; true")
    assert httpx.delete(f"{url}/v1/sandboxes/{gone['id']}", timeout=60).status_code == 200

    foreign: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(url) else foreign.append(r.url))
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(f"{url}/ui")

    expect(page.locator("#status")).to_have_text("live", timeout=UI_WAIT_MS)
    expect(page.locator("#ov-running")).to_have_text("2", timeout=UI_WAIT_MS)
    expect(page.locator("#ov-pool")).to_have_attribute("title", re.compile(rf"^{harness.IMAGE}: \d+$"))
    page.wait_for_function(
        "ids => ids.every(id => document.querySelector(`#list tr[data-id='${id}']`))",
        arg=[agent["id"], grader["id"], gone["id"]],
        timeout=UI_WAIT_MS,
    )
    expect(page.locator(f"#list tr[data-id='{gone['id']}']")).to_contain_text("deleted")

    # Filters: by state (server side), by label (server side), by backend (in the page).
    page.select_option("#filter-state", "running")
    page.wait_for_function(f"!document.querySelector(\"#list tr[data-id='{gone['id']}']\")", timeout=UI_WAIT_MS)
    assert set(_rows(page)) == {agent["id"], grader["id"]}
    page.select_option("#filter-state", "")
    page.fill("#filter-label", f"suite={suite}")
    page.wait_for_function("n => document.querySelectorAll('#list tbody tr').length === n", arg=3, timeout=UI_WAIT_MS)
    page.fill("#filter-label", "role=grader")
    page.wait_for_function("n => document.querySelectorAll('#list tbody tr').length === n", arg=1, timeout=UI_WAIT_MS)
    assert _rows(page) == [grader["id"]]
    page.fill("#filter-label", "no-equals-sign")
    expect(page.locator("#list-error")).to_contain_text("key=value")
    page.fill("#filter-label", f"suite={suite}")
    page.select_option("#filter-backend", "vm")
    page.wait_for_function("document.querySelectorAll('#list tbody tr').length === 0", timeout=UI_WAIT_MS)
    page.select_option("#filter-backend", "container")
    page.wait_for_function("n => document.querySelectorAll('#list tbody tr').length === n", arg=3, timeout=UI_WAIT_MS)

    # The detail view of the sandbox that ran commands.
    page.click(f"#list tr[data-id='{agent['id']}']")
    expect(page.locator("#detail")).to_have_attribute("data-loaded", agent["id"], timeout=UI_WAIT_MS)
    expect(page.locator("#detail-id")).to_have_text(agent["id"])
    expect(page.locator("#detail-state")).to_contain_text("running")
    expect(page.locator("#detail-resources")).to_contain_text("64 MiB")
    history = page.locator("#detail-execs tbody tr")
    expect(history).to_have_count(3)
    expect(page.locator("#detail-execs tbody")).to_contain_text("exit 3")
    expect(page.locator("#detail-events tbody")).to_contain_text("seccomp")
    expect(page.locator("#detail-events tbody")).to_contain_text("chroot")

    # The charts: samples accumulate; creates show as a rate and a latency;
    # the running line follows the sandboxes.
    page.wait_for_function("document.querySelector('#chart-creations').dataset.points >= 2", timeout=UI_WAIT_MS)
    points_before, _ = _chart(page, "running")
    # A full pool first, so the burst has warm creates as well as cold ones.
    expect(page.locator("#ov-pool")).to_have_text("2", timeout=UI_WAIT_MS)
    made = [_create(url, labels={"suite": suite, "role": f"burst-{i}"}) for i in range(3)]
    # Each sample lasts one poll; watch every animation frame so none is missed.
    page.wait_for_function(
        "JSON.parse(document.querySelector('#chart-creations').dataset.last || '[0]')[0] > 0",
        timeout=UI_WAIT_MS,
        polling="raf",
    )
    # The pool's two members went to the burst: a warm create time was drawn.
    page.wait_for_function(
        "JSON.parse(document.querySelector('#chart-latency').dataset.last || '[]')[1] > 0",
        timeout=UI_WAIT_MS,
        polling="raf",
    )
    page.wait_for_function(
        "JSON.parse(document.querySelector('#chart-running').dataset.last || '[0]')[0] === 5", timeout=UI_WAIT_MS
    )
    points_after, _ = _chart(page, "running")
    assert points_after > points_before
    expect(page.locator("#ov-creations")).to_contain_text("6 (0)", timeout=UI_WAIT_MS)

    # Every chart has drawn something: not all pixels of its canvas are blank.
    for name in ("creations", "latency", "running"):
        inked = page.evaluate(
            """name => {
                const c = document.querySelector('#chart-' + name);
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0;
                for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
                return n;
            }""",
            name,
        )
        assert inked > 100, f"chart {name} is blank"

    shot = Path(os.environ.get("WARREN_DASHBOARD_SCREENSHOT") or Path(tempfile.gettempdir()) / "warren-dashboard.png")
    page.select_option("#filter-backend", "")
    page.fill("#filter-label", "")
    page.wait_for_timeout(2500)  # let the list and a few more chart samples land before the picture
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000, "the screenshot is empty"
    print(f"dashboard screenshot: {shot}")

    assert not foreign, f"the page loaded from elsewhere than the server: {foreign}"
    assert not errors, f"script errors on the page: {errors}"
    for sb in made:
        httpx.delete(f"{url}/v1/sandboxes/{sb['id']}", timeout=60)

