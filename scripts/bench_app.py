"""How fast the app's pages draw on a full database: in Chromium, and through AppTest.

Fills a fresh state database with 8 devices x 24 h of 1 Hz samples (about 700,000 rows), a
queue (pending, running and finished jobs), a 200,000-step training run of the running
job (step metrics and per-rank stats every `--log-every` steps, the trainer's default 10) and a
finished sweep of 50 SAEs.
Then, in the browser: serves the app (`streamlit run`, loopback only) and measures in
Debian's headless Chromium, for each page, the time from navigation to its main content (its
title drawn, the page's script run finished and every chart drawn): a
click on its sidebar link from the Overview (as a person navigates), and a fresh load of its
URL (Training runs' Compare tab, comparing the long run, by its URL only). Aim: at most 1.5 s a
page. Then each page's script through `streamlit.testing.v1.AppTest`
(no browser): the first run (nothing cached) and the median of the next ones, the Monitor
also in each of its views and windows. Aim: under 0.5 s a page.

    .venv/bin/python scripts/bench_app.py                 # fills a temporary home
    .venv/bin/python scripts/bench_app.py --home /tmp/b   # an empty directory, kept after
    .venv/bin/python scripts/bench_app.py --no-apptest    # the browser's timings only

The samples end at the moment of filling and the pages' windows end now, so a database is
filled afresh each time (about 15 s): an aged one would leave the short windows empty.

Figures are wall-clock on a shared machine: compare them with each other, within one run; the
load average is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from webui.browser import ALL_DRAWN, CHROMIUM, CHROMIUM_ARGS  # noqa: E402 (after the path)

GIB = 2**30
PAGES = ("app.py", "pages/1_Train.py", "pages/2_Monitor.py", "pages/3_Queue.py",
         "pages/4_Training_runs.py")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--home", help="an empty state directory to fill (default: a temporary one)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--hours", type=float, default=24.0)
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--log-every", type=int, default=10, help="steps between logged metrics")
    p.add_argument("--repeat", type=int, default=5, help="timed runs of each page after the first")
    p.add_argument("--browser-repeat", type=int, default=5, help="timed navigations to each page in Chromium")
    p.add_argument("--no-browser", action="store_true", help="skip the Chromium timings")
    p.add_argument("--no-apptest", action="store_true", help="skip the AppTest timings")
    return p.parse_args()


T_FMT = "%Y-%m-%d %H:%M:%S.%f"  # the text SQLAlchemy writes for a UTC datetime (microseconds)
SAMPLE_INSERT = ("INSERT INTO gpu_samples (device_uuid, time, utilization_pct, memory_used, memory_total, "
                 "temperature_c, power_w, job_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?)")


def fill(engine, args) -> dict:
    """Write the benchmark's data; returns what was written (counts, ids)."""
    rng = random.Random(0)
    now = datetime.now(timezone.utc).replace(microsecond=0)
    start = now - timedelta(hours=args.hours)
    uuids = [f"GPU-{i:08x}-bench-0000-0000-{i:012x}" for i in range(args.devices)]
    job_start = start + timedelta(hours=args.hours / 6)
    n_jobs, running_id = write_devices_and_jobs(engine, uuids, start, job_start, now)
    # Samples and metrics through the raw DB-API connection: SQLAlchemy's per-row processing
    # would make filling take minutes.
    raw = engine.raw_connection()
    try:
        cur = raw.cursor()
        n_samples = write_samples(cur, rng, uuids, start, job_start, int(args.hours * 3600), running_id)
        # The sweep's 50 runs first: Training runs opens the newest run with steps, which must be
        # the 200,000-step run it is timed on, not the sweep's last SAE.
        sweep_id = write_sweep(engine, cur, job_start, now)
        run_id = create_bench_run(engine, args, uuids, running_id, job_start)
        logged = write_training(cur, rng, args, uuids, run_id, job_start, now)
        cur.execute("ANALYZE")
    finally:
        raw.close()
    return {"samples": n_samples, "step_metrics": len(logged), "rank_stats": len(logged) * args.devices,
            "jobs": n_jobs, "run_id": run_id, "job_id": running_id, "sweep_id": sweep_id}


def write_devices_and_jobs(engine, uuids: list[str], start: datetime, job_start: datetime,
                           now: datetime) -> tuple[int, int]:
    """The devices and a day's queue: 200 finished jobs, one running on every device, 30
    pending. Returns (jobs written, the running job's id)."""
    from sqlalchemy import insert

    from sae_dist.db import Device, Job

    with engine.begin() as conn:
        conn.execute(insert(Device.__table__), [
            {"uuid": u, "index": i, "name": "NVIDIA H100 80GB HBM3", "virtual": False,
             "available": True, "memory_total": 80 * GIB, "pci_bus_id": f"00000000:{i:02X}:00.0",
             "updated_at": now} for i, u in enumerate(uuids)])
        rows = [{**JOB_DEFAULTS, **j} for j in queue_jobs(uuids, start, job_start, now)]
        conn.execute(insert(Job.__table__), rows)
        running_id = conn.exec_driver_sql("SELECT id FROM jobs WHERE state = 'RUNNING'").scalar()
    return len(rows), running_id


JOB_DEFAULTS = {"user": "bench", "kind": "train", "argv_json": "[]", "workdir": "/tmp",
                "held": False, "requeue_on_failure": False, "cancel_requested": False,
                "dependencies_json": "[]", "env_json": "{}", "priority": 0, "reason": None,
                "devices_json": None, "started_at": None, "ended_at": None, "exit_code": None,
                "port": None}


def queue_jobs(uuids: list[str], start: datetime, job_start: datetime, now: datetime) -> list[dict]:
    jobs = []
    for i in range(200):  # finished, over the day
        t0 = start + timedelta(minutes=5 * i)
        jobs.append(dict(name=f"sweep-{i}", state=("COMPLETED", "FAILED", "CANCELLED")[i % 3],
                         gpus=1, devices_json=json.dumps([uuids[i % len(uuids)]]),
                         submitted_at=t0, started_at=t0, ended_at=t0 + timedelta(minutes=4),
                         exit_code=0 if i % 3 == 0 else 1))
    jobs.append(dict(name="big-sae", state="RUNNING", gpus=len(uuids),
                     devices_json=json.dumps(uuids), submitted_at=job_start,
                     started_at=job_start, port=29600))
    for i in range(30):
        jobs.append(dict(name=f"queued-{i}", state="PENDING", gpus=2, submitted_at=now,
                         reason="Resources" if i else "Priority", priority=i % 3))
    return jobs


def write_samples(cur, rng: random.Random, uuids: list[str], start: datetime, job_start: datetime,
                  seconds: int, running_id: int) -> int:
    """1 Hz readings of every device: idle before the running job started, busy after.
    Returns the rows written."""
    cur.execute("BEGIN")
    batch = []
    for s in range(seconds):
        t = start + timedelta(seconds=s, microseconds=rng.randrange(1000, 900_000))
        busy = t >= job_start
        text = t.strftime(T_FMT)
        for d, uuid in enumerate(uuids):
            util = min(100.0, max(0.0, rng.gauss(92 if busy else 3, 4)))
            mem = int((61 + d + rng.random()) * GIB) if busy else int(0.5 * GIB)
            temp = 35 + 0.4 * util + rng.random() * 3
            power = 70 + 6 * util + rng.random() * 20
            batch.append((uuid, text, util, mem, 80 * GIB, temp, power, running_id if busy else None))
        if len(batch) >= 50_000:
            cur.executemany(SAMPLE_INSERT, batch)
            batch = []
    if batch:
        cur.executemany(SAMPLE_INSERT, batch)
    cur.execute("COMMIT")
    return seconds * len(uuids)


def create_bench_run(engine, args, uuids: list[str], running_id: int, job_start: datetime) -> int:
    from sae_dist.db import create_run

    return create_run(engine, name="big-sae", status="RUNNING", architecture="topk",
                      config_json=json.dumps({"architecture": "topk", "source": "synthetic",
                                              "steps": args.steps}),
                      world_size=args.devices, backend="nccl", device_ids=json.dumps(uuids),
                      host="bench", run_dir="/tmp/bench-run", total_steps=args.steps,
                      last_step=args.steps, job_id=running_id, started_at=job_start,
                      created_at=job_start)


def write_training(cur, rng: random.Random, args, uuids: list[str], run_id: int, job_start: datetime,
                   now: datetime) -> list[int]:
    """The run's step metrics and per-rank stats every `--log-every` steps, rank 3 a straggler
    every 500 steps; returns the logged steps."""
    logged = list(range(args.log_every, args.steps + 1, args.log_every))
    span = (now - job_start).total_seconds()
    cur.execute("BEGIN")
    metrics, ranks = [], []
    for step in logged:
        t = (job_start + timedelta(seconds=span * step / args.steps)).strftime(T_FMT)
        loss = 0.05 + 2.0 / math.sqrt(step) + rng.random() * 0.01
        recovery = min(1.0, step / (0.6 * args.steps)) if step % 1000 == 0 else None
        metrics.append((run_id, step, step * 4096, t, loss, loss * 0.8, loss * 0.5, 32.0,
                        max(0.0, 0.2 - step / args.steps), 4096 * 8 / 0.05,
                        recovery, None if recovery is None else 0.5 + recovery / 2))
        for r in range(args.devices):
            slow = r == 3 and step % 500 == 0
            step_s = 0.05 + rng.random() * 0.005 + (0.05 if slow else 0)
            ranks.append((run_id, step, r, uuids[r], step_s, step_s * 0.8, 40 * GIB, slow))
    cur.executemany("INSERT INTO step_metrics (run_id, step, samples_seen, time, loss, mse, "
                    "fvu, l0, dead_fraction, samples_per_s, recovery_frac, "
                    "recovery_mean_cos) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", metrics)
    cur.executemany("INSERT INTO rank_stats (run_id, step, rank, device, step_time_s, "
                    "compute_time_s, peak_memory_bytes, is_straggler) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)", ranks)
    cur.execute("COMMIT")
    return logged


SWEEP_KS, SWEEP_LRS, SWEEP_STEPS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256), (1e-4, 2e-4, 5e-4, 1e-3, 2e-3), 2000


def write_sweep(engine, cur, start: datetime, end: datetime) -> int:
    """A finished overnight sweep of 50 SAEs (10 k x 5 lr), each logged every 10 of 2,000 steps:
    what the Sweeps page draws. Returns the sweep's id."""
    from sae_dist.db import create_run
    from sae_dist.db.sweeps import create_sweep

    sweep_id = create_sweep(engine, name="overnight", run_dir="/tmp/bench-sweep", job_id=None,
                            keys_json=json.dumps(["k", "lr"]), config_json="{}", world_size=8,
                            placement_json=json.dumps({"mode": "shared", "reason": "bench", "saes": [],
                                                       "devices": []}),
                            status="COMPLETED", error=None, created_at=start, finished_at=end)
    rows = []  # the runs first (their own connection), then every metric in one transaction
    span = (end - start).total_seconds()
    for i, (k, lr) in enumerate((k, lr) for k in SWEEP_KS for lr in SWEEP_LRS):
        point = f"k{k}-lr{lr:g}"
        fvu = 0.3 / math.sqrt(k) + abs(math.log10(lr / 5e-4)) * 0.02
        run_id = create_run(engine, name=f"overnight/{point}", status="COMPLETED", architecture="topk",
                            config_json=json.dumps({"k": k, "lr": lr}), world_size=8, backend="nccl",
                            device_ids="[]", host="bench", run_dir=f"/tmp/bench-sweep/saes/{point}",
                            total_steps=SWEEP_STEPS, last_step=SWEEP_STEPS, started_at=start, created_at=start,
                            finished_at=end, sweep_id=sweep_id, sweep_point=point, final_fvu=fvu,
                            final_l0=float(k), final_loss=fvu, final_dead_fraction=0.01 * (i % 7))
        rows += [(run_id, s, s * 4096, (start + timedelta(seconds=span * s / SWEEP_STEPS)).strftime(T_FMT),
                  fvu * (1 + 20 / math.sqrt(s)), fvu, fvu * (1 + 20 / math.sqrt(s)), float(k), 0.01, 4096 / 0.05)
                 for s in range(10, SWEEP_STEPS + 1, 10)]
    cur.execute("BEGIN")
    cur.executemany("INSERT INTO step_metrics (run_id, step, samples_seen, time, loss, mse, fvu, l0, "
                    "dead_fraction, samples_per_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    cur.execute("COMMIT")
    return sweep_id


def counts(engine) -> dict:
    with engine.connect() as conn:
        return {t: conn.exec_driver_sql(f"SELECT count(*) FROM {t}").scalar()
                for t in ("gpu_samples", "gpu_minutes", "step_metrics", "rank_stats", "jobs")}


def timed(at, action=None) -> float:
    t0 = time.perf_counter()
    (action(at) if action else at).run()
    elapsed = time.perf_counter() - t0
    if at.exception:
        raise SystemExit(f"the page raised: {at.exception[0].value}")
    return elapsed


def time_page(page: str, repeat: int, action=None) -> tuple[float, float]:
    """(first run, median of `repeat` more) in seconds for `page` after the overview ran once;
    `action(at)` sets a widget on an already drawn page (its run is what is timed)."""
    from streamlit.testing.v1 import AppTest

    runs = []
    for _ in range(repeat + 1):
        at = AppTest.from_file(str(REPO / "app.py"), default_timeout=120)
        if page == "app.py" and action is None:
            runs.append(timed(at))
            continue
        at.run()
        if page != "app.py":
            at.switch_page(page)
            if action is None:
                runs.append(timed(at))
                continue
            at.run()
        runs.append(timed(at, action))
    return runs[0], statistics.median(runs[1:]) if len(runs) > 1 else runs[0]


def main() -> int:
    args = parse_args()
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="sae-bench-app-"))
    os.environ["SAE_DIST_HOME"] = str(home)
    os.environ.pop("SAE_DIST_DB_URL", None)
    os.environ.setdefault("SAE_DIST_AUTOSTART", "0")
    os.environ.setdefault("SAE_DIST_VIRTUAL_GPUS", str(args.devices))
    from sae_dist.db import get_engine

    if (home / "state.db").exists():
        raise SystemExit(f"error: {home} already holds a state database; give an empty --home")
    engine = get_engine()
    t0 = time.perf_counter()
    written = fill(engine, args)
    print(f"filled {home} in {time.perf_counter() - t0:.1f} s: {written}")
    size = (home / "state.db").stat().st_size / 2**20
    print(f"database: {counts(engine)}, {size:.0f} MiB")
    time_queries(engine)
    if not args.no_browser:
        time_in_browser(home, args.browser_repeat)
    if not args.no_apptest:
        worst = time_pages(args.repeat)
        print(f"\nslowest page through AppTest (median): {worst:.3f} s (aim: under 0.5 s)")
    print(f"state directory: {home}")
    return 0


def time_queries(engine) -> None:
    """The queries behind the Monitor, alone (no Streamlit), for each window."""
    from sae_dist.analytics import jobs, samples

    now = datetime.now(timezone.utc)
    uuids = [d["uuid"] for d in jobs.devices(engine)]
    print("\nqueries (s)             per device   all devices")
    for name, seconds in (("5 min", 300), ("1 h", 3600), ("24 h", 86400)):
        start = now - timedelta(seconds=seconds)
        t0 = time.perf_counter()
        series = samples.device_series(engine, uuids, start, now)
        t1 = time.perf_counter()
        total = samples.total_series(engine, uuids, start, now)
        t2 = time.perf_counter()
        points = max(len(s) for s in series.values())
        print(f"  {name:<6} {series[uuids[0]].source:>8} {t1 - t0:8.3f} {t2 - t1:12.3f}"
              f"   ({points} points a device, {len(total)} in all, {total.width_s} s each)")


def time_pages(repeat: int) -> float:
    """Each page, then the Monitor in each view and window; returns the slowest page's median."""
    # Warm up what is not the pages' own work: AppTest's first run in a process scans the
    # installed packages for components (~0.5 s), and pandas/Altair import once.
    import altair  # noqa: F401
    from streamlit.testing.v1 import AppTest

    AppTest.from_string("import streamlit as st\nst.write('warm-up')").run()

    print(f"\npage timings through AppTest (s): first run (nothing cached), then median of {repeat}")
    worst = 0.0
    for page in PAGES:
        first, warm = time_page(page, repeat)
        worst = max(worst, warm)
        print(f"  {page:<40} {first:6.3f} {warm:8.3f}")
    for view in ("Aggregated", "Per-GPU"):
        for window in ("5 min", "1 h", "24 h", "All"):
            def action(at, view=view, window=window):
                at.segmented_control(key="monitor_view").set_value(view)
                return at.segmented_control(key="monitor_window").set_value(window)
            first, warm = time_page("pages/2_Monitor.py", repeat, action)
            print(f"  {'Monitor ' + view + ', ' + window:<40} {first:6.3f} {warm:8.3f}")
    return worst


# ---- in the browser ----------------------------------------------------------------------------

# (URL path, title, sidebar label) of each page; Streamlit names a page's URL after its file.
BROWSER_PAGES = (("", "Overview", "Overview"), ("Train", "Train", "Train"),
                 ("Monitor", "Monitor", "Monitor"), ("Queue", "Queue", "Queue"),
                 ("Training_runs", "Training runs", "Training runs"),
                 ("Benchmarks", "Benchmarks", "Benchmarks"), ("Sweeps", "Sweeps", "Sweeps"))
# The Sweeps page opens the bench's one sweep (the latest) by itself.
# Views only a URL opens (a sidebar link opens the page's first tab): (URL path, title, name).
URL_ONLY_PAGES = (("Training_runs?view=Compare+runs", "Training runs", "  Compare tab"),)
BROWSER_AIM_S = 1.5


def serve(home: Path):
    """`streamlit run app.py` on a free loopback port over `home`: (process, url)."""
    import socket
    import subprocess
    import urllib.request

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "SAE_DIST_HOME": str(home), "SAE_DIST_AUTOSTART": "0"}
    log = open(home / "bench-app-streamlit.log", "wb")
    app = subprocess.Popen([sys.executable, "-m", "streamlit", "run", "app.py", "--server.port", str(port),
                            "--server.address", "127.0.0.1", "--server.headless", "true"],
                           cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2):
                return app, url
        except OSError:
            time.sleep(0.25)
    app.terminate()
    raise SystemExit(f"the app did not answer on {url} within 60 s (log: {log.name})")


def wait_main(page, title: str) -> None:
    """Until the page's title is drawn, its script run has finished (every element sent) and
    every chart has drawn (`ALL_DRAWN`)."""
    page.locator('[data-testid="stMain"] h1', has_text=title).first.wait_for(state="visible")
    page.locator('[data-testid="stApp"][data-test-script-state="notRunning"]').wait_for(state="attached")
    page.wait_for_function(ALL_DRAWN, polling=10)
    if page.locator('[data-testid="stException"]').count():
        raise SystemExit(f"{title} raised: {page.locator('[data-testid=stException]').first.inner_text()}")


def navigate(page, url: str, path: str, title: str, label: str | None) -> float:
    """Seconds from navigation to the page's main content: a click on its sidebar link from the
    Overview (`label`), or a fresh load of its URL (`label` None)."""
    if label is None:
        t0 = time.perf_counter()
        page.goto(f"{url}/{path}")
    else:
        page.goto(url)
        wait_main(page, "Overview")
        link = page.locator('[data-testid="stSidebar"] a', has_text=label).first
        t0 = time.perf_counter()
        link.click()
    wait_main(page, title)
    return time.perf_counter() - t0


def spread(seconds: list[float]) -> str:
    """"1.02 (0.95-1.31)": the median of timed runs and their range, which says how far one
    median of a loaded machine can be trusted."""
    return f"{statistics.median(seconds):.2f} ({min(seconds):.2f}-{max(seconds):.2f})"


def time_in_browser(home: Path, repeat: int) -> None:
    """Each page's navigation-to-main-content time in headless Chromium: median of `repeat`."""
    from playwright.sync_api import sync_playwright

    app, url = serve(home)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.set_default_timeout(120_000)
            navigate(page, url, "", "Overview", None)  # the server's first run imports pandas, Altair
            load = os.getloadavg()
            print(f"\nin Chromium (s), navigation to main content, median (min-max) of {repeat}; load "
                  f"average {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} ({os.cpu_count()} cores)")
            print(f"  {'page':<16} {'sidebar click':>18} {'URL load':>18}")
            worst = 0.0
            for path, title, label in BROWSER_PAGES:
                clicks = [navigate(page, url, path, title, label) for _ in range(repeat)]
                loads = [navigate(page, url, path, title, None) for _ in range(repeat)]
                worst = max(worst, statistics.median(clicks), statistics.median(loads))
                print(f"  {title:<16} {spread(clicks):>18} {spread(loads):>18}")
            for path, title, name in URL_ONLY_PAGES:  # opens the run with steps, as the Run tab does
                loads = [navigate(page, url, path, title, None) for _ in range(repeat)]
                worst = max(worst, statistics.median(loads))
                print(f"  {name:<16} {'-':>18} {spread(loads):>18}")
            load = os.getloadavg()
            print(f"  slowest: {worst:.2f} s (aim: at most {BROWSER_AIM_S} s); load average after: "
                  f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}")
            browser.close()
    finally:
        app.terminate()
        app.wait(30)


if __name__ == "__main__":
    raise SystemExit(main())
