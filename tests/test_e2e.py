"""End to end, for real: the scheduler daemon (2 virtual devices) and the app served on a free
loopback port, driven by Playwright in Debian's headless Chromium (scripts/setup.sh --test
installs the `chromium` package; never `playwright install`).

A person's path through the app: the Overview, a training job submitted from the Train page,
its Monitor charts growing on their own (the fragment refreshes without a page load), the job
cancelled from the Queue page. A screenshot of each page is kept under test-artifacts/e2e/ (or
$SAE_DIST_E2E_ARTIFACTS) to be looked at.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, stop_process
from sae_dist.db import get_engine
from scheduler import procs
from scheduler.store import get_job, list_jobs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("SAE_DIST_E2E_ARTIFACTS", REPO / "test-artifacts" / "e2e"))
# The flags this machine's closed network needs (no background fetches, no sandbox as root).
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
UI_TIMEOUT_MS = 60_000  # a loaded 2-core machine trains, serves and renders at once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"{url} did not answer within {timeout} s")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The daemon and `streamlit run app.py` on 127.0.0.1:<free port>, in a state home of the
    module's own (the steps of the path below share them): (url, engine of that home)."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium package "
                    "(scripts/setup.sh --test does, as root)")
    tmp = tmp_path_factory.mktemp("e2e")
    home = tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "SAE_DIST_DB_URL"}
    env.update({"SAE_DIST_HOME": str(home), "SAE_DIST_VIRTUAL_GPUS": "2",
                "SAE_DIST_AUTOSTART": "0",  # this module starts its daemon itself
                "SAE_DIST_KILL_GRACE_S": "5"})
    engine = get_engine(f"sqlite:///{home / 'state.db'}")  # migrate once, before the daemon and the app race to
    logs = {name: open(tmp / f"{name}.log", "wb") for name in ("app", "daemon")}
    port = free_port()
    daemon = subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], cwd=REPO, env=env,
                              stdout=logs["daemon"], stderr=subprocess.STDOUT, start_new_session=True)
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                            "--server.address", "127.0.0.1", "--server.headless", "true"],
                           cwd=REPO, env=env, stdout=logs["app"], stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", 60)
        yield f"http://127.0.0.1:{port}", engine
    finally:
        stop_process(app, 15)
        stop_process(daemon, 15)
        for job in list_jobs(engine, ("RUNNING",)):  # no job outlives the module
            for pid, ticks in ((job.supervisor_pid, job.supervisor_start_ticks), (job.pid, job.proc_start_ticks)):
                if procs.is_alive(pid, ticks):
                    procs.terminate_tree(pid, None, 5)
        for log in logs.values():
            log.close()
        print("app log tail:\n", (tmp / "app.log").read_text(errors="replace")[-3000:])
        print("daemon log tail:\n", (tmp / "daemon.log").read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def browser_page():
    """One headless Chromium page for the whole path, and the JavaScript errors it saw."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 2000})
        context.set_default_timeout(UI_TIMEOUT_MS)
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        yield page, errors
        browser.close()


@pytest.fixture
def page(browser_page):
    """The shared page; no JavaScript error may happen during a step."""
    page, errors = browser_page
    yield page
    assert not errors, f"JavaScript errors in the page: {errors}"


def shoot(page, name: str) -> None:
    page.wait_for_timeout(500)  # let the last redraw settle
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def no_exception(page) -> None:
    """Streamlit shows a script's exception as an element of its own: none may be on the page."""
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


def set_number(page, label: str, value: int) -> None:
    field = page.get_by_label(label, exact=True)
    field.fill(str(value))
    field.press("Enter")  # commits the value: the page reruns with it


def step_shown(page) -> int:
    """The step in the Monitor's training caption, "Run 1 · name · step 1,230 / 5,000 · ..."."""
    text = page.get_by_text(re.compile(r"Run \d+ · .* · step ")).first.inner_text()
    match = re.search(r"step ([\d,]+) / ", text)
    return int(match.group(1).replace(",", "")) if match else -1


# A person's path, one step per test, in this order, on the module's server and page: each step
# starts from where the one before left the job (a step alone fails at its first check).

def test_1_overview_shows_the_virtual_devices(served, page):
    """Overview: both virtual devices, idle, labelled as virtual."""
    from playwright.sync_api import expect

    url, _ = served
    page.goto(url)
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    expect(page.get_by_text("virtual", exact=False).first).to_be_visible()
    expect(page.get_by_text("Start a demo training")).to_be_visible()  # an empty database
    no_exception(page)
    shoot(page, "1-overview")


def test_2_train_submits_on_both_devices(served, page):
    """Train: a small TopK SAE on both devices (recommended, hence preselected)."""
    from playwright.sync_api import expect

    url, engine = served
    page.goto(f"{url}/Train")
    expect(page.get_by_role("heading", name="Train")).to_be_visible()
    set_number(page, "Batch size per device", 512)
    set_number(page, "Steps", 20_000)
    page.get_by_label("Name", exact=True).fill("e2e-topk")
    page.get_by_label("Name", exact=True).press("Enter")
    expect(page.get_by_text("Selected: 2 GPUs | Effective batch size: 1024")).to_be_visible()
    submit = page.get_by_role("button", name="Submit training job")
    expect(submit).to_be_enabled()
    no_exception(page)
    submit.click()
    expect(page.get_by_text("Job 1 (e2e-topk) is queued on 2 devices.")).to_be_visible()
    job = get_job(engine, 1)
    assert job.kind == "train" and job.gpus == 2 and job.name == "e2e-topk"
    shoot(page, "2-train-submitted")


def test_3_monitor_charts_fill_without_a_page_load(served, page):
    """Monitor: the job's charts fill on their own, with no page load."""
    from playwright.sync_api import expect

    page.get_by_role("link", name="Monitor job 1").click()
    expect(page.get_by_role("heading", name="Job 1 · e2e-topk")).to_be_visible()
    expect(page.get_by_text(re.compile(r"Run \d+ · e2e-topk · step "))).to_be_visible(timeout=120_000)
    page.evaluate("window.__e2e_same_page = true")  # gone if the page were loaded again
    first = step_shown(page)
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    expect(charts.first).to_be_visible()
    before = charts.first.screenshot()
    deadline = time.monotonic() + 90
    while step_shown(page) <= first and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    later = step_shown(page)
    assert later > first, f"the step stayed at {first}: the Monitor did not refresh itself"
    assert page.evaluate("window.__e2e_same_page === true"), "the page was reloaded, not refreshed"
    # A later refresh draws the new points (on a loaded machine it can take a few refreshes).
    deadline = time.monotonic() + 30
    while charts.first.screenshot() == before and time.monotonic() < deadline:
        page.wait_for_timeout(1000)
    assert charts.first.screenshot() != before, "the loss chart did not change as steps came in"
    assert charts.count() >= 5  # loss, FVU, L0, dead latents, samples/s (+ per-rank time)
    no_exception(page)
    shoot(page, "3-monitor-aggregated")
    page.get_by_text("Per-GPU", exact=True).click()
    expect(page.get_by_text("GPU 0", exact=False).first).to_be_visible()
    expect(page.get_by_text("GPU 1", exact=False).first).to_be_visible()
    no_exception(page)
    shoot(page, "4-monitor-per-gpu")


def test_4_queue_cancels_the_running_job(served, page):
    """Queue: cancel the running job, after a confirmation; it ends CANCELLED."""
    from playwright.sync_api import expect

    url, engine = served
    assert get_job(engine, 1).state == "RUNNING"
    page.goto(f"{url}/Queue?job=1")
    expect(page.get_by_role("heading", name="Queue")).to_be_visible()
    page.get_by_role("button", name="Cancel").click()
    dialog = page.get_by_role("dialog")
    expect(dialog.get_by_text("(e2e-topk, RUNNING)")).to_be_visible()
    dialog.get_by_role("button", name="Cancel job 1").click()
    expect(dialog).to_be_hidden()
    # The job's badge (the tables' grids also hold the word, in hidden accessibility cells).
    expect(page.get_by_text("CANCELLED", exact=True).filter(visible=True).first).to_be_visible(timeout=60_000)
    cancelled = get_job(engine, 1)
    assert cancelled.state == "CANCELLED", cancelled.state
    no_exception(page)
    shoot(page, "5-queue-cancelled")
