"""End to end, for real: the scheduler daemon (2 virtual devices) and the app served on a free
loopback port, driven by Playwright in Debian's headless Chromium (scripts/setup.sh --test
installs the `chromium` package; never `playwright install`).

A person's path through the app: the Overview, a training job submitted from the Train page,
its Monitor charts growing on their own (the fragment refreshes without a page load), the job
cancelled from the Queue page, the run's page, a small benchmark on the Benchmarks page, a sweep on the
Sweeps page, two runs compared (a click on the L0-FVU chart opens one), and a job queued from the
Train page while every device is busy, PENDING until they free, then RUNNING. A screenshot of each
page is kept under test-artifacts/e2e/ (or $SAE_DIST_E2E_ARTIFACTS) to be looked at.

Every request the browser makes on the way is recorded, and a step fails naming any to a host
other than the app's own (the app must work on a machine with no network: icons, fonts and
favicons are served by the app, `webui/icons/`), or any request the app answers with an error,
but one: opening a page's URL directly (/Train), Streamlit's browser side first tries that path
as the app's base path (/Train/_stcore/health and /_stcore/host-config answer 404, by design:
streamlit/streamlit#7074), then the root. Moving between pages by the sidebar's links loads
nothing and probes nothing. The browser runs in New York time: the app writes UTC whatever the
browser's zone.
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
from urllib.parse import urlsplit

import pytest

from conftest import REPO, run_cli, stop_process
from sae_dist.analytics.queries import list_runs
from sae_dist.db import get_engine
from scheduler import procs
from scheduler.store import get_job, list_jobs
from webui.browser import ALL_DRAWN, CHROMIUM, CHROMIUM_ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARTIFACTS = Path(os.environ.get("SAE_DIST_E2E_ARTIFACTS", REPO / "test-artifacts" / "e2e"))
UI_TIMEOUT_MS = 60_000  # a loaded 2-core machine trains, serves and renders at once
HANG_GUARD_S = 300  # how long a wait for the live page to move on may last before it counts as a hang
LOCAL_SCHEMES = ("data", "blob", "about")  # nothing leaves the browser for these
# Streamlit's base-path discovery on a direct load of a page URL (the module's docstring).
BASE_PATH_PROBE = re.compile(r"^/[^/]+/_stcore/(health|host-config)$")


def foreign_requests(requests: list[tuple[str, str]], origin: str) -> list[str]:
    """The requests ((page URL, request URL) pairs) to anywhere but `origin`
    ("http://127.0.0.1:8501"), as "page -> URL" lines."""
    own = urlsplit(origin).netloc
    return [f"{page} -> {url}" for page, url in requests
            if urlsplit(url).scheme not in LOCAL_SCHEMES and urlsplit(url).netloc != own]


def failed_requests(responses: list[tuple[str, str, int]]) -> list[str]:
    """The responses ((page URL, request URL, status)) that are errors, but for Streamlit's
    base-path probe."""
    return [f"{page} -> {url} ({status})" for page, url, status in responses
            if status >= 400 and not (status == 404 and BASE_PATH_PROBE.match(urlsplit(url).path))]


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
    """One headless Chromium page for the whole path (in New York time), the JavaScript errors
    it saw, every request it made ((page URL, URL)) and every answer ((page URL, URL, status))."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=UI_TIMEOUT_MS)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1400, "height": 2000}, timezone_id="America/New_York")
        context.set_default_timeout(UI_TIMEOUT_MS)
        page = context.new_page()
        seen = {"errors": [], "requests": [], "responses": [], "vega": []}
        page.on("pageerror", lambda e: seen["errors"].append(str(e)))
        # Vega's own warnings ("WARN Infinite extent ..."): a chart drawn from a layer with no rows,
        # a setting it dropped; each is a chart that does not draw what its builder meant.
        page.on("console", lambda m: m.text.startswith(("WARN ", "ERROR ")) and seen["vega"].append(m.text))
        # On the context: requests of workers and other frames count too.
        context.on("request", lambda r: seen["requests"].append((page.url, r.url)))
        context.on("response", lambda r: seen["responses"].append((page.url, r.url, r.status)))
        page.on("websocket", lambda ws: seen["requests"].append((page.url, ws.url)))
        yield page, seen
        browser.close()


@pytest.fixture
def page(served, browser_page):
    """The shared page; no JavaScript error may happen during a step, nor a request to another
    host, nor an error answer (but Streamlit's base-path probe: the module's docstring)."""
    page, seen = browser_page
    for found in seen.values():
        found.clear()
    yield page
    assert not seen["errors"], f"JavaScript errors in the page: {seen['errors']}"
    assert not seen["vega"], f"Vega warned while drawing a chart: {seen['vega']}"
    elsewhere = foreign_requests(seen["requests"], served[0])
    assert not elsewhere, "requests to another host than the app's:\n" + "\n".join(elsewhere)
    failed = failed_requests(seen["responses"])
    assert not failed, "requests the app answered with an error:\n" + "\n".join(failed)


def drawn_text(page, charts, wanted: tuple[str, ...], timeout_s: float = HANG_GUARD_S) -> str:
    """The text the chart elements drew, once every one has drawn (`ALL_DRAWN`) and all of
    `wanted` is in it, or as it is after `timeout_s` (a live view can be mid-redraw)."""
    deadline = time.monotonic() + timeout_s
    while True:
        page.wait_for_function(ALL_DRAWN)
        text = " ".join(charts.locator("svg text").all_text_contents())
        if all(w in text for w in wanted) or time.monotonic() > deadline:
            return text
        page.wait_for_timeout(250)


# Each table's grid: its scrolled width against its box's (a wider grid cuts columns off).
GRID_WIDTHS = """() => [...document.querySelectorAll('[data-testid="stDataFrame"] .dvn-scroller')]
    .map(grid => [grid.scrollWidth, grid.clientWidth])"""


def tables_fit(page) -> None:
    """Every table on the page shows all its columns at the browser's width (1,400 px): the
    Queue's and the Benchmarks' tables were cut off there."""
    page.wait_for_function(ALL_DRAWN)
    widths = page.evaluate(GRID_WIDTHS)
    assert widths and all(scroll <= box + 1 for scroll, box in widths), f"(scrolled, shown) px: {widths}"


def shoot(page, name: str) -> None:
    page.wait_for_timeout(500)  # let the last redraw settle
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def no_exception(page) -> None:
    """Streamlit shows a script's exception as an element of its own: none may be on the page."""
    assert page.locator('[data-testid="stException"]').count() == 0, page.locator(
        '[data-testid="stException"]').first.inner_text()


def settled(page, text) -> None:
    """Wait until `text` (what the last input's rerun draws) is on the page and no script run is
    in progress or asked for: the page is then in its final state for every input so far, and a
    widget seen enabled stays so (an earlier run's button may be enabled for a moment)."""
    from playwright.sync_api import expect

    expect(page.get_by_text(text).first).to_be_visible()
    expect(page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]')).to_be_attached()


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
    with page.expect_request(f"{url}/") as loaded:  # the recording sees what the page loads
        page.goto(url)
    assert loaded.value.url == f"{url}/"
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
    page.get_by_label("Name", exact=True).fill("e2e-topk")
    page.get_by_label("Name", exact=True).press("Enter")
    set_number(page, "Batch size per device", 512)
    set_number(page, "Steps", 20_000)
    settled(page, re.compile(r"^20,000 steps on "))  # the last input's rerun, with the others' values
    expect(page.get_by_text("Selected: 2 GPUs | Effective batch size: 1024")).to_be_visible()
    submit = page.get_by_role("button", name="Submit training job")
    expect(submit).to_be_enabled()
    no_exception(page)
    submit.click()
    # Where it stands when the page redraws: PENDING until the daemon's pass, or RUNNING already.
    expect(page.get_by_text(re.compile(r"Job 1 \(e2e-topk, 2 devices\) is in the queue: (PENDING|RUNNING)"))
           ).to_be_visible()
    job = get_job(engine, 1)
    assert job.kind == "train" and job.gpus == 2 and job.name == "e2e-topk"
    shoot(page, "2-train-submitted")


@pytest.mark.timeout(3 * HANG_GUARD_S)  # its waits, each bounded by the guard, add up
def test_3_monitor_charts_fill_without_a_page_load(served, page):
    """Monitor: the job's charts fill on their own, with no page load."""
    from playwright.sync_api import expect

    page.get_by_role("link", name="Monitor job 1").click()
    expect(page.get_by_role("heading", name="Job 1 · e2e-topk")).to_be_visible()
    expect(page.get_by_text(re.compile(r"Run \d+ · e2e-topk · step "))).to_be_visible(timeout=120_000)
    page.evaluate("window.__e2e_same_page = true")  # gone if the page were loaded again
    first = step_shown(page)
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    # The loss chart by its drawn title: the first chart on the page is the devices' (its time axis
    # moves with the daemon's samples, not with the trainer's steps).
    loss = charts.filter(has=page.locator("svg text", has_text=re.compile(r"^Loss$"))).first
    expect(loss).to_be_visible()
    before = loss.screenshot()
    deadline = time.monotonic() + HANG_GUARD_S
    while step_shown(page) <= first and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    later = step_shown(page)
    assert later > first, f"the step stayed at {first}: the Monitor did not refresh itself"
    assert page.evaluate("window.__e2e_same_page === true"), "the page was reloaded, not refreshed"
    # A later refresh draws the new points (on a loaded machine it can take many refreshes: the
    # wait ends when it does, and the guard only bounds a hang).
    deadline = time.monotonic() + HANG_GUARD_S
    while loss.screenshot() == before and time.monotonic() < deadline:
        page.wait_for_timeout(1000)
    assert loss.screenshot() != before, "the loss chart did not change as steps came in"
    # Loss, FVU, L0, dead latents, samples/s (+ per-rank time), stacked a column to a view:
    # each chart's title is drawn (Vega draws these small charts as SVG). A live run's views are
    # redrawn as its steps come in, so the titles are read until a redraw has not just begun.
    titles = ("Loss", "FVU", "L0", "Dead latents", "Throughput")
    assert all(title in drawn_text(page, charts, titles) for title in titles), drawn_text(page, charts, titles)
    no_exception(page)
    shoot(page, "3-monitor-aggregated")
    page.get_by_text("Per-GPU", exact=True).click()
    expect(page.get_by_text("GPU 0", exact=False).first).to_be_visible()
    expect(page.get_by_text("GPU 1", exact=False).first).to_be_visible()
    # Each device's sparklines are charts with a time axis (memory and utilisation: a virtual
    # device measures no temperature nor power).
    sparklines = page.locator('[class*="st-key-gpu_panel_"] [data-testid="stVegaLiteChart"]')
    expect(sparklines.nth(3)).to_be_visible()
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
    expect(page.get_by_text("Cancelled by user").filter(visible=True).first).to_be_visible()  # the job's reason
    tables_fit(page)
    no_exception(page)
    shoot(page, "5-queue-cancelled")


def test_5_runs_and_benchmarks_pages_load_nothing_from_elsewhere(served, page):
    """The Training runs page (the cancelled job's run), then a small benchmark measured for real
    on the Benchmarks page: its charts' keys name every series drawn, its tables show every
    column at 1,400 px, and no request goes to another host (checked by the `page` fixture)."""
    from playwright.sync_api import expect

    from sae_dist.analytics.bench_charts import TARGET
    from test_bench import QUICK_WAITS, SMALL

    url, engine = served
    page.goto(f"{url}/Training_runs?run=1")
    expect(page.get_by_role("heading", name="Training runs")).to_be_visible()
    expect(page.get_by_text("e2e-topk").first).to_be_visible()
    no_exception(page)
    shoot(page, "6-training-run")
    home = Path(engine.url.database).parent
    bench = run_cli("bench", "--devices", "1,2", "--no-queue", "--repeats", "1", *SMALL, timeout=400,
                    env={"SAE_DIST_HOME": str(home), "SAE_DIST_DB_URL": "", "SAE_DIST_VIRTUAL_GPUS": "2",
                         **QUICK_WAITS})
    assert bench.returncode == 0, bench.stderr
    page.goto(f"{url}/Benchmarks")
    expect(page.get_by_role("heading", name="Benchmarks")).to_be_visible()
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    expect(charts.first).to_be_visible()
    keys = ("measured (DDP)", "ideal (N x)", TARGET)  # whether measured is keyed by colour or as unreliable
    text = drawn_text(page, charts, keys)
    assert all(k in text for k in keys), text
    tables_fit(page)
    no_exception(page)
    shoot(page, "7-benchmarks")


def test_6_sweeps_page_draws_a_sweep_with_nothing_from_elsewhere(served, page):
    """The Sweeps page on a sweep written as the sweep trainer writes one (its grid, its Pareto
    plot and curves drawn), opened by its URL: no request to another host."""
    from playwright.sync_api import expect

    from test_app_sweeps import add_sweep

    url, engine = served
    sweep_id, _ = add_sweep(engine, "e2e-sweep")
    page.goto(f"{url}/Sweeps?sweep={sweep_id}")
    expect(page.get_by_role("heading", name=f"Sweep {sweep_id} · e2e-sweep")).to_be_visible()
    expect(page.get_by_role("link", name="k4-x4")).to_be_visible()  # its run's link
    expect(page.locator('[data-testid="stVegaLiteChart"]').first).to_be_visible()
    no_exception(page)
    shoot(page, "8-sweeps")


def test_7_two_runs_compared_and_a_pareto_click_opens_one(served, page):
    """Training runs' Compare tab: the cancelled training and one of the sweep's SAEs overlaid
    (both in the colour key, every chart drawn), their configuration differences listed, and a
    click on a point of the L0-FVU chart opens that point's run in the Run tab."""
    from playwright.sync_api import expect

    url, engine = served
    other = next(r["id"] for r in list_runs(engine) if r["name"] == "e2e-sweep-k4-x4")
    label = f"{other} · e2e-sweep-k4-x4"
    page.goto(f"{url}/Training_runs?run=1")
    expect(page.get_by_role("heading", name="Training runs")).to_be_visible()
    page.get_by_role("tab", name="Compare runs").click()
    picker = page.get_by_label("Runs to compare")
    expect(page.get_by_text("1 · e2e-topk").first).to_be_visible()  # the open run, picked first
    picker.click()
    picker.fill("k4-x4")
    page.get_by_role("option", name=re.compile(f"^{label}")).click()
    page.keyboard.press("Escape")
    key = page.get_by_text(re.compile(f"1 · e2e-topk .* {label}"))
    expect(key).to_be_visible()  # one colour key for every overlaid chart, both runs in it
    expect(page.get_by_text("Pick two or more runs")).to_have_count(0)
    expect(page.get_by_role("heading", name="Configuration differences")).to_be_visible()
    expect(page.get_by_text("The runs compared have the same configuration.")).to_have_count(0)
    charts = page.locator('[data-testid="stVegaLiteChart"]')
    expect(charts).to_have_count(3)  # two stacked columns of overlays, the L0-FVU chart
    titles = ("Loss", "FVU", "L0", "Dead latents", "Throughput")
    assert all(title in drawn_text(page, charts, titles) for title in titles), drawn_text(page, charts, titles)
    # Its plot is 320 px tall, with its title, axis and key around it (Streamlit's default fit
    # took the key and title out of those 320 px: the plot drew about 100 px tall).
    assert charts.nth(2).bounding_box()["height"] > 400, charts.nth(2).bounding_box()
    no_exception(page)
    shoot(page, "9-compare-runs")
    # The L0-FVU chart's points are its last layer's symbols; the evaluated SAE's point is
    # the one at L0 4.0, FVU 0.19 (its tooltip names the run).
    points = charts.nth(2).locator("g.mark-symbol path")
    expect(points.first).to_be_visible()
    for i in range(points.count()):
        points.nth(i).hover()
        if page.locator("#vg-tooltip-element").filter(has_text=label).count():
            points.nth(i).click()
            break
    else:
        raise AssertionError("no point of the L0-FVU chart names the evaluated SAE's run")
    expect(page.get_by_role("tab", name="Run", exact=True)).to_have_attribute("aria-selected", "true")
    expect(page.get_by_role("heading", name="e2e-sweep-k4-x4", exact=True)).to_be_visible()
    assert f"run={other}" in page.url, page.url
    no_exception(page)


def test_8_with_every_device_busy_the_train_page_queues_a_job_that_starts_when_they_free(served, page):
    """Train, with both devices held by another job: the page still submits (any 2 devices), the
    job waits PENDING with the scheduler's reason, and runs once the devices are free."""
    from playwright.sync_api import expect

    url, engine = served
    env = {**os.environ, "SAE_DIST_HOME": str(Path(engine.url.database).parent), "SAE_DIST_VIRTUAL_GPUS": "2",
           "SAE_DIST_AUTOSTART": "0"}
    env.pop("SAE_DIST_DB_URL", None)

    def scheduler(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "scheduler", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    blocker = int(scheduler("submit", "--json", "--gpus", "2", "-J", "blocker", "--", "sleep", "600")
                  .split('"job_id": ')[1].split(",")[0])
    deadline = time.monotonic() + HANG_GUARD_S
    while get_job(engine, blocker).state != "RUNNING":
        assert time.monotonic() < deadline, "the blocking job never started"
        time.sleep(0.2)
    page.goto(f"{url}/Train")
    expect(page.get_by_text("Every device is taken: the job will wait")).to_be_visible()
    page.get_by_label("Name", exact=True).fill("e2e-queued")
    page.get_by_label("Name", exact=True).press("Enter")
    set_number(page, "GPUs wanted", 2)
    settled(page, "any 2 devices, queued until they are free (0 free now)")
    page.get_by_role("button", name="Submit training job").click()
    status = page.get_by_text(re.compile(r"\(e2e-queued, 2 devices\) is in the queue: "))
    expect(status).to_be_visible()
    queued = next(j for j in list_jobs(engine) if j.name == "e2e-queued")
    refresh = page.get_by_role("button", name="Refresh")
    for wanted in ("PENDING, Resources: waiting for enough free devices", "RUNNING on virtual-0, virtual-1"):
        if wanted.startswith("RUNNING"):
            scheduler("cancel", str(blocker))
        deadline = time.monotonic() + HANG_GUARD_S
        while wanted not in status.inner_text():
            assert time.monotonic() < deadline, f"never {wanted!r}: {status.inner_text()}"
            time.sleep(0.5)
            refresh.click()
        no_exception(page)
    shoot(page, "10-train-queued-while-busy")
    scheduler("cancel", str(queued.id))


def test_9_a_fields_error_stays_in_view_as_tab_moves_on(served, page):
    """A bad learning rate, then Tab: the focus lands on the next field's help, whose tooltip
    opens upwards. It covered the error drawn under the field; the error sits above it now."""
    from playwright.sync_api import expect

    url, _ = served
    page.goto(f"{url}/Train")
    field = page.get_by_label("Learning rate", exact=True)
    field.fill("abc")
    field.press("Tab")
    error = page.locator('[data-testid="stAlert"]', has_text="'abc' is not a number")
    tooltip = page.locator('[data-testid="stTooltipContent"]')
    expect(error).to_be_visible()
    expect(tooltip).to_be_visible()
    assert page.evaluate("() => document.activeElement.getAttribute('aria-label')") == "Help for Steps"
    a, b = error.bounding_box(), tooltip.bounding_box()
    apart = (a["x"] + a["width"] <= b["x"] or b["x"] + b["width"] <= a["x"]
             or a["y"] + a["height"] <= b["y"] or b["y"] + b["height"] <= a["y"])
    assert apart, f"the tooltip {b} covers the error {a}"
    no_exception(page)
    shoot(page, "11-train-error-in-view")


def test_request_checks_on_plain_data():
    """The two checks the steps make, on hand-made requests."""
    origin = "http://127.0.0.1:8501"
    requests = [("p", f"{origin}/"), ("p", "ws://127.0.0.1:8501/_stcore/stream"), ("p", "data:image/svg+xml;base64,AA"),
                ("p", "https://fonts.gstatic.com/s/i/x.svg"), ("p", "http://127.0.0.1:9999/other"),
                ("p", "http://localhost:8501/")]
    assert foreign_requests(requests, origin) == [
        "p -> https://fonts.gstatic.com/s/i/x.svg", "p -> http://127.0.0.1:9999/other", "p -> http://localhost:8501/"]
    responses = [("p", f"{origin}/Train/_stcore/health", 404), ("p", f"{origin}/Train/_stcore/host-config", 404),
                 ("p", f"{origin}/_stcore/health", 404), ("p", f"{origin}/Train/_stcore/stream", 404),
                 ("p", f"{origin}/media/x.png", 500), ("p", f"{origin}/", 200)]
    assert failed_requests(responses) == [f"p -> {origin}/_stcore/health (404)",
                                          f"p -> {origin}/Train/_stcore/stream (404)",
                                          f"p -> {origin}/media/x.png (500)"]
