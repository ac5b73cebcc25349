"""`python -m scheduler metrics`: the OpenMetrics endpoint, for real.

The command runs as a process on a free loopback port against a state directory a real daemon
filled (virtual devices, and the emulated NVML driver's eight A100s), with a job running and
others pending; it is scraped over HTTP (127.0.0.1 only, no proxy) in both formats, parsed with
prometheus_client's parsers, and every value is checked against the database. Each process runs
under an audit hook that records every socket it binds or connects and every name it looks up:
it binds the one loopback address it was given and asks nothing of any other host. Where to
listen is a pure decision, tested alone; so are the families of one scrape.
"""

from __future__ import annotations

import ipaddress
import json
import os
import select
import signal
import socket
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from pathlib import Path
from wsgiref.util import setup_testing_defaults

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

import fake_nvml
from conftest import REPO, kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from sae_dist.errors import UserError
from scheduler.metrics import Listen, State, families, listen_address, wsgi_app

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
HOST = socket.gethostname()
MIB = 2**20

# Run as `python -c AUDITED metrics ...`: `python -m scheduler` under an audit hook that writes
# every bind, connect, send to an address and name lookup of the process to $METRICS_AUDIT_LOG.
AUDITED = """
import os, runpy, sys
log = open(os.environ["METRICS_AUDIT_LOG"], "a", buffering=1)
ADDRESSED = ("socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg")
LOOKUPS = ("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex", "socket.gethostbyaddr",
           "socket.getnameinfo")
def hook(event, args):
    if event in ADDRESSED:
        log.write(repr((event, args[1])) + "\\n")
    elif event in LOOKUPS:
        log.write(repr((event, args[0])) + "\\n")
sys.addaudithook(hook)
sys.argv = ["scheduler", *sys.argv[1:]]
runpy.run_module("scheduler", run_name="__main__", alter_sys=True)
"""


# ---- where to listen: a pure decision ----

def test_it_listens_on_loopback_unless_another_address_is_named():
    default = listen_address(None)
    assert default == Listen("127.0.0.1", 9400) and default.loopback
    assert default.startup_line() == ("serving metrics on http://127.0.0.1:9400/metrics: loopback only, "
                                      "other machines cannot reach it")
    for text, host, port, loopback in (("127.0.0.1:9500", "127.0.0.1", 9500, True),
                                       ("localhost:9400", "127.0.0.1", 9400, True),  # no name lookup
                                       ("127.8.0.1:1", "127.8.0.1", 1, True), ("[::1]:65535", "::1", 65535, True),
                                       ("0.0.0.0:9400", "0.0.0.0", 9400, False), ("[::]:9400", "::", 9400, False),
                                       ("192.168.1.5:9400", "192.168.1.5", 9400, False)):
        listen = listen_address(text)
        assert (listen.host, listen.port, listen.loopback) == (host, port, loopback), text
    assert listen_address("[::1]:9400").url == "http://[::1]:9400/metrics"
    assert listen_address("0.0.0.0:9400").startup_line() == (
        "serving metrics on http://0.0.0.0:9400/metrics: every interface, as --listen asked: "
        "other machines can reach it")
    assert "192.168.1.5, as --listen asked: other machines can reach it" in \
        listen_address("192.168.1.5:9400").startup_line()


@pytest.mark.parametrize("text, says", [
    ("9400", "is not HOST:PORT"), ("127.0.0.1", "is not HOST:PORT"), ("[::1]", "is not HOST:PORT"),
    ("[::1]9400", "is not HOST:PORT"), (":9400", "names no host; give 127.0.0.1:9400"),
    ("127.0.0.1:", "the port must be a number from 1 to 65535, got ''"), ("127.0.0.1:0", "got '0'"),
    ("127.0.0.1:65536", "got '65536'"), ("127.0.0.1:http", "got 'http'"), ("127.0.0.1:-1", "got '-1'"),
    ("127.0.0.1:٩٤٠٠", "got '٩٤٠٠'"), ("::1:9400", "write an IPv6 address in brackets, [::1]:9400"),
    ("example.com:9400", "the host must be an IP address"), ("127.0.0.256:9400", "the host must be an IP address"),
])
def test_a_listen_address_that_is_not_host_port_is_refused_saying_why(text, says):
    with pytest.raises(UserError, match="^--listen: ") as raised:
        listen_address(text)
    assert says in str(raised.value) and "\n" not in str(raised.value)


# ---- one scrape's families: a pure function of the database's rows ----

def test_a_reading_nobody_measured_is_absent_never_0():
    from sae_dist.job_listing import JobRow
    from scheduler.device_view import DeviceRow

    now = datetime(2026, 11, 27, 12, 0, tzinfo=timezone.utc)
    gpu = DeviceRow("GPU-a", 0, "NVIDIA H100", False, True, None, 80 * 2**30, "00000000:07:00.0")
    lacking = DeviceRow("GPU-b", 1, "NVIDIA H100", False, True, None, 80 * 2**30, "00000000:0F:00.0")
    stale = DeviceRow("GPU-c", 2, "NVIDIA H100", False, True, None, 80 * 2**30, "00000000:47:00.0")
    never = DeviceRow("virtual-0", 3, "Virtual GPU 0 (CPU-backed)", True, False, "gone", None, None)
    reading = {"utilization_pct": 55.0, "memory_used": 10 * 2**30, "memory_total": 80 * 2**30,
               "memory_free": 69 * 2**30, "temperature_c": 64.0, "power_w": 250.5}
    samples = {"GPU-a": {"time": now - timedelta(seconds=1), **reading},
               "GPU-b": {"time": now, **reading, "temperature_c": None, "power_w": None, "utilization_pct": 0.0},
               "GPU-c": {"time": now - timedelta(seconds=11), **reading}}
    job = JobRow(*[None] * len(JobRow._fields))._replace(
        id=7, name="sweep", user="ann", kind="train", state="RUNNING", exclusive=False, devices=["GPU-b"],
        started_at=now - timedelta(minutes=5), time_limit_s=None)
    counts = {("PENDING", "Resources"): 2, ("PENDING", None): 1, ("RUNNING", None): 1, ("COMPLETED", None): 4}
    state = State([gpu, lacking, stale, never], samples, {"GPU-c": object()}, counts, [job], now.timestamp())
    got = {(m.name, tuple(s.labels.get(k) for k in ("UUID", "state", "reason", "job_id"))): s.value
           for m in families(state, "node1") for s in m.samples}

    def value(name, uuid=None, state=None, reason=None, job_id=None):
        return got.get((name, (uuid, state, reason, job_id)))

    assert value("DCGM_FI_DEV_GPU_UTIL", "GPU-a") == 55.0 and value("DCGM_FI_DEV_FB_USED", "GPU-a") == 10240.0
    assert (value("DCGM_FI_DEV_GPU_TEMP", "GPU-a"), value("DCGM_FI_DEV_POWER_USAGE", "GPU-a")) == (64.0, 250.5)
    assert value("DCGM_FI_DEV_FB_TOTAL", "GPU-a") == 81920.0
    assert value("DCGM_FI_DEV_FB_FREE", "GPU-a") == 69 * 1024.0  # NVML's own: the driver's reserve is not free
    # A sensor the card lacks: absent. A measured 0 stays 0.
    assert value("DCGM_FI_DEV_GPU_TEMP", "GPU-b") is None and value("DCGM_FI_DEV_POWER_USAGE", "GPU-b") is None
    assert value("DCGM_FI_DEV_GPU_UTIL", "GPU-b") == 0.0
    # A sample older than 10 s is not now: no reading, only when it was taken; and the fault shows.
    assert [k for k in got if k[1][0] == "GPU-c" and k[0].startswith("DCGM_FI_DEV_")] == \
        [("DCGM_FI_DEV_FB_TOTAL", ("GPU-c", None, None, None))]
    assert value("sae_dist_device_sample_timestamp_seconds", "GPU-c") == now.timestamp() - 11
    assert value("sae_dist_device_failed", "GPU-c") == 1.0 and value("sae_dist_device_failed", "GPU-a") == 0.0
    # A device never sampled, whose total is unknown: only whether it is available and failed.
    assert sorted(k[0] for k in got if k[1][0] == "virtual-0") == ["sae_dist_device_available",
                                                                   "sae_dist_device_failed"]
    assert value("sae_dist_device_available", "virtual-0") == 0.0
    assert value("sae_dist_jobs", state="PENDING") == 3.0 and value("sae_dist_jobs", state="TIMEOUT") == 0.0
    assert value("sae_dist_jobs_pending", reason="Resources") == 2.0 and value("sae_dist_jobs_pending",
                                                                               reason="None") == 1.0
    assert value("sae_dist_jobs_pending", reason="JobHeldUser") == 0.0
    assert value("sae_dist_job_devices", job_id="7") == 1.0 and value("sae_dist_job_time_limit_seconds",
                                                                      job_id="7") is None
    device = [s.labels for m in families(state, "node1") for s in m.samples if m.name == "sae_dist_job_device"]
    assert device == [{"job_id": "7", "gpu": "1", "UUID": "GPU-b", "Hostname": "node1", "virtual": "false"}]
    labels = [s.labels for m in families(state, "node1") for s in m.samples if m.name == "DCGM_FI_DEV_GPU_UTIL"]
    assert labels[0] == {"gpu": "0", "UUID": "GPU-a", "pci_bus_id": "00000000:07:00.0", "modelName": "NVIDIA H100",
                         "Hostname": "node1", "virtual": "false"}


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_scrape_reads_sqlite_and_postgresql_alike(database, request, state_home, tmp_path):
    """The rows a scrape reads, from a SQLite file (the standard library's sqlite3, as `info`) or
    PostgreSQL (through the engine): devices, newest samples, jobs by state and reason code."""
    from sqlalchemy import insert

    from conftest import add_virtual_devices
    from sae_dist.db import GpuSample, get_engine, record_fault, utcnow
    from scheduler.metrics import read_state
    from scheduler.newjob import new_job
    from scheduler.spec import JobSpec
    from scheduler.store import start_jobs, submit

    if database == "postgresql":
        request.getfixturevalue("postgres_url")
    engine, uuids, now = get_engine(), ["virtual-0", "virtual-1"], utcnow()
    with engine.begin() as conn:
        add_virtual_devices(conn, uuids, now)
        conn.execute(insert(GpuSample.__table__), [
            {"device_uuid": "virtual-0", "time": now - timedelta(seconds=age), "utilization_pct": pct,
             "memory_used": used, "memory_total": 16 * 2**30}
            for age, pct, used in ((2, 10.0, None), (1, 40.0, 3 * MIB))])
    ids = [submit(engine, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), list(enumerate(uuids))))
           for _ in range(4)]
    start_jobs(engine, [(ids[0], ("virtual-1",))], {ids[1]: "Resources, ExclusiveJob:9", ids[2]: "JobHeldUser"})
    record_fault(engine, "virtual-0", "CUDA error: an illegal memory access", job_id=ids[0], rank=0)
    state = read_state(now.timestamp())
    assert [(d.uuid, d.index, d.virtual, d.memory_total) for d in state.devices] == \
        [("virtual-0", 0, True, 16 * 2**30), ("virtual-1", 1, True, 16 * 2**30)]
    assert set(state.samples) == {"virtual-0"} and state.samples["virtual-0"]["utilization_pct"] == 40.0
    assert state.samples["virtual-0"]["memory_used"] == 3 * MIB and state.samples["virtual-0"]["power_w"] is None
    assert state.counts == {("RUNNING", None): 1, ("PENDING", "Resources"): 1, ("PENDING", "JobHeldUser"): 1,
                            ("PENDING", None): 1}
    assert [(j.id, j.devices) for j in state.running] == [(ids[0], ["virtual-1"])] and set(state.faults) == {
        "virtual-0"}


def test_a_scrape_the_database_cannot_answer_is_a_500_with_one_line(state_home, capsys):
    state_home.mkdir(parents=True)
    (state_home / "state.db").write_bytes(b"this is not a database" * 100)
    from scheduler.metrics import StateCollector

    environ, status = {}, []
    setup_testing_defaults(environ)
    body = b"".join(wsgi_app(StateCollector("node1"))(environ, lambda s, headers: status.append(s)))
    err = capsys.readouterr().err
    assert status == ["500 Internal Server Error"]
    assert body.decode().count("\n") == 1 and err == body.decode() and str(state_home) in err, err


# ---- the command, for real ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    """`python -m scheduler metrics ARGS` started under the audit hook; `line` is what it said."""

    def __init__(self, tmp_path: Path, *args: str):
        self.audit = tmp_path / f"audit-{len(list(tmp_path.glob('audit-*')))}.log"
        self.proc = subprocess.Popen([sys.executable, "-c", AUDITED, "metrics", *args], cwd=REPO,
                                     env={**os.environ, "METRICS_AUDIT_LOG": str(self.audit)},
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        self.line = self.proc.stdout.readline().rstrip("\n") if ready else ""

    def stop(self, sig=signal.SIGTERM) -> tuple[int, str, str]:
        """Signal it; (exit code, the rest of stdout, stderr)."""
        self.proc.send_signal(sig)
        out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, out, err

    def events(self) -> list[tuple[str, object]]:
        return [eval(line) for line in self.audit.read_text().splitlines()] if self.audit.exists() else []


def assert_offline(exporter: Exporter, bound: tuple[str, int]) -> None:
    """It bound `bound` alone, connected to or sent to nothing but loopback, and looked no name up."""
    events = exporter.events()
    assert [a for e, a in events if e == "socket.bind"] == [bound], events
    assert not [(e, a) for e, a in events if e.startswith("socket.get")], events  # no lookup at all
    for event, address in events:
        if event != "socket.bind" and isinstance(address, tuple):
            assert ipaddress.ip_address(address[0]).is_loopback, (event, address)


def listening(pid: int) -> set[tuple[str, int]]:
    """The TCP addresses the process listens on, from /proc (its sockets' inodes in net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for row in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = row.split()
            if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # each 32-bit word in the host's (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


def scrape(port: int, accept: str | None = None) -> tuple[str, str]:
    """(Content-Type, body) of GET /metrics on 127.0.0.1:port, with no proxy in the way."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept} if accept else {})
    with opener.open(request, timeout=60) as response:
        return response.headers["Content-Type"], response.read().decode()


def parsed(port: int) -> dict[str, list[tuple[dict, float]]]:
    """Both formats scraped and parsed, checked to say the same; sample name -> [(labels, value)]."""
    kind, text = scrape(port)
    om_kind, om_text = scrape(port, OPENMETRICS)
    assert kind.startswith("text/plain; version=0.0.4"), kind
    assert om_kind.startswith("application/openmetrics-text; version=1.0.0"), om_kind
    assert om_text.endswith("# EOF\n")
    both = []
    for families_ in (parse_text(text), parse_openmetrics(om_text)):
        found: dict[str, list] = {}
        for family in families_:
            for s in family.samples:
                found.setdefault(s.name, []).append((s.labels, s.value))
        both.append({k: sorted(v, key=lambda p: sorted(p[0].items())) for k, v in found.items()})
    assert both[0] == both[1]
    return both[0]


def series(found: dict, name: str, **labels: str) -> dict[str, float]:
    """UUID (or job_id, or state...) -> value of the samples of `name` whose labels include `labels`."""
    key = {"sae_dist_jobs": "state", "sae_dist_jobs_pending": "reason"}.get(name, "UUID")
    return {s[key]: v for s, v in found.get(name, []) if labels.items() <= s.items()}


def cli(*args: str) -> subprocess.CompletedProcess:
    out = run_cli(*args, module="scheduler", timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def submit(*args: str) -> int:
    return json.loads(cli("submit", "--json", *args).stdout)["job_id"]


def the_database() -> dict:
    """What the state database holds, read here with SQLAlchemy: devices, newest samples, jobs."""
    from sqlalchemy import func, select

    from sae_dist.db import Device, GpuSample, Job, get_engine

    engine = get_engine()
    with engine.connect() as conn:
        devices = conn.execute(select(Device.__table__).order_by(Device.index)).mappings().all()
        newest = select(func.max(GpuSample.id)).group_by(GpuSample.device_uuid)
        samples = {r["device_uuid"]: r for r in conn.execute(
            select(GpuSample.__table__).where(GpuSample.id.in_(newest))).mappings().all()}
        jobs = conn.execute(select(Job.__table__)).mappings().all()
    return {"devices": devices, "samples": samples, "jobs": jobs}


def assert_as_the_database_says(found: dict, db: dict, virtual: bool) -> None:
    """Every device's series and labels, its readings (MiB for memory; absent where the sample
    has none), the jobs by state and pending reason, and the running jobs' devices."""
    flag = "true" if virtual else "false"
    for d in db["devices"]:
        labels = {"gpu": str(d["index"]), "UUID": d["uuid"], "pci_bus_id": d["pci_bus_id"] or "",
                  "modelName": d["name"], "Hostname": HOST, "virtual": flag}
        sample = db["samples"][d["uuid"]]
        assert datetime.now(timezone.utc) - sample["time"].replace(tzinfo=timezone.utc) < timedelta(seconds=10)
        for name, value in (("DCGM_FI_DEV_GPU_UTIL", sample["utilization_pct"]),
                            ("DCGM_FI_DEV_FB_USED", None if sample["memory_used"] is None
                             else sample["memory_used"] / MIB),
                            ("DCGM_FI_DEV_FB_FREE", None if sample["memory_free"] is None
                             else sample["memory_free"] / MIB),
                            ("DCGM_FI_DEV_FB_TOTAL", d["memory_total"] / MIB),
                            ("DCGM_FI_DEV_GPU_TEMP", sample["temperature_c"]),
                            ("DCGM_FI_DEV_POWER_USAGE", sample["power_w"]),
                            ("sae_dist_device_available", 1.0), ("sae_dist_device_failed", 0.0)):
            got = [v for s, v in found.get(name, []) if s["UUID"] == d["uuid"]]
            assert got == ([] if value is None else [value]), (name, d["uuid"], got, value)
            assert all(s == labels for s, _ in found.get(name, []) if s["UUID"] == d["uuid"]), name
    for name in ("DCGM_FI_DEV_GPU_UTIL", "sae_dist_device_available"):
        assert set(series(found, name)) == {d["uuid"] for d in db["devices"]}
    states = {}
    for j in db["jobs"]:
        states[j["state"]] = states.get(j["state"], 0) + 1
    assert {k: v for k, v in series(found, "sae_dist_jobs").items() if v} == states
    waiting = {}
    for j in db["jobs"]:
        if j["state"] == "PENDING":
            waiting[j["reason"].split(",")[0]] = waiting.get(j["reason"].split(",")[0], 0) + 1
    assert {k: v for k, v in series(found, "sae_dist_jobs_pending").items() if v} == waiting
    running = [j for j in db["jobs"] if j["state"] == "RUNNING"]
    index = {d["uuid"]: str(d["index"]) for d in db["devices"]}
    assert sorted((s["job_id"], s["UUID"], s["gpu"], s["virtual"]) for s, _ in found["sae_dist_job_device"]) == \
        sorted((str(j["id"]), u, index[u], flag) for j in running for u in json.loads(j["devices_json"]))
    assert sorted((s["job_id"], s["name"], s["user"], s["kind"]) for s, _ in found["sae_dist_job_info"]) == \
        sorted((str(j["id"]), j["name"], j["user"], j["kind"]) for j in running)
    assert {s["job_id"]: v for s, v in found["sae_dist_job_start_time_seconds"]} == \
        {str(j["id"]): j["started_at"].replace(tzinfo=timezone.utc).timestamp() for j in running}


def a_queue(daemon_log: Path, gpus_busy: int) -> tuple[int, int, int]:
    """A real daemon with a job running on one device, one pending for want of devices and one
    held; waits until each device was sampled after the job started, then stops the daemon (the
    jobs run on, and the database holds still while it is compared)."""
    from sae_dist.db import get_engine
    from scheduler.store import get_job

    daemon = start_daemon(daemon_log)
    try:
        running = submit("-J", "holder", "-t", "30:00", "--", "sleep", "300")
        pending = submit("-G", str(gpus_busy), "--", "true")
        held = submit("-H", "--", "true")
        wait_for(lambda: get_job(get_engine(), running).state == "RUNNING", 60, "the job to run")
        wait_for(lambda: (get_job(get_engine(), pending).reason or "").startswith("Resources"), 60,
                 "the job too big for what is free to wait for resources")
        started = get_job(get_engine(), running).started_at.replace(tzinfo=timezone.utc)

        def sampled_since_start():
            db = the_database()
            return db["devices"] and all(db["samples"].get(d["uuid"]) is not None and db["samples"][d["uuid"]][
                "time"].replace(tzinfo=timezone.utc) > started for d in db["devices"])
        wait_for(sampled_since_start, 60, "a sample of every device since the job started")
    finally:
        stop_process(daemon)
    return running, pending, held


@pytest.mark.slow
def test_virtual_devices_and_the_queue_as_the_database_has_them(tmp_path, monkeypatch, state_home):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    state_home.mkdir(parents=True)
    try:
        running, pending, held = a_queue(state_home / "daemon-test.log", 2)
        port = free_port()
        exporter = Exporter(tmp_path, "--listen", f"127.0.0.1:{port}")
        try:
            assert exporter.line == f"serving metrics on http://127.0.0.1:{port}/metrics: loopback only, " \
                                    "other machines cannot reach it"
            assert listening(exporter.proc.pid) == {("127.0.0.1", port)}
            found = parsed(port)
        finally:
            code, out, err = exporter.stop(signal.SIGTERM)
        assert (code, out, err) == (0, "", "")
        db = the_database()
        assert_as_the_database_says(found, db, virtual=True)
        assert [d["uuid"] for d in db["devices"]] == ["virtual-0", "virtual-1"]
        # A virtual device is never passed off as a GPU, and what it cannot measure is absent.
        assert all(s["virtual"] == "true" and "CPU-backed" in s["modelName"] for s, _ in found["DCGM_FI_DEV_GPU_UTIL"])
        assert "DCGM_FI_DEV_GPU_TEMP" not in found and "DCGM_FI_DEV_POWER_USAGE" not in found
        assert series(found, "sae_dist_jobs") == {"PENDING": 2, "RUNNING": 1, "COMPLETED": 0, "FAILED": 0,
                                                  "CANCELLED": 0, "TIMEOUT": 0, "NODE_FAIL": 0, "OUT_OF_MEMORY": 0}
        assert series(found, "sae_dist_jobs_pending")["Resources"] == 1
        assert series(found, "sae_dist_jobs_pending")["JobHeldUser"] == 1
        assert [s["job_id"] for s, _ in found["sae_dist_job_info"]] == [str(running)]
        assert found["sae_dist_job_time_limit_seconds"] == [({"job_id": str(running)}, 1800.0)]
        assert_offline(exporter, ("127.0.0.1", port))
    finally:
        kill_running_jobs()


@pytest.fixture
def eight_a100s(fake_nvml_lib, tmp_path, monkeypatch):
    """This test's processes see the emulated driver's eight A100s (tests/fake_nvml), GPU 0
    partly used by something else and GPU 5 without temperature or power sensors."""
    scenario = fake_nvml.eight_a100s()
    by_bus = fake_nvml.in_bus_order(scenario)
    by_bus[0].update(memory_used=10 * 2**30, utilization=55, temperature=64, power_w=250.5)
    by_bus[5]["errors"] = {"temperature": "NOT_SUPPORTED", "power": "NOT_SUPPORTED"}
    path = fake_nvml.write(tmp_path / "scenario.json", scenario)
    for key, value in fake_nvml.environment(fake_nvml_lib, path, base={}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SAE_DIST_VIRTUAL_GPUS", raising=False)
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    return by_bus


@pytest.mark.slow
def test_gpus_carry_dcgm_exporters_names_units_and_labels(eight_a100s, tmp_path, state_home):
    state_home.mkdir(parents=True)
    try:
        running, _, _ = a_queue(state_home / "daemon-test.log", 8)
        port = free_port()
        exporter = Exporter(tmp_path, "--listen", f"localhost:{port}")
        try:
            assert listening(exporter.proc.pid) == {("127.0.0.1", port)}
            found = parsed(port)
        finally:
            code, out, err = exporter.stop(signal.SIGINT)
        assert (code, out, err) == (0, "", "")
        assert_as_the_database_says(found, the_database(), virtual=False)
        first, lacking = eight_a100s[0], eight_a100s[5]
        util = {s["UUID"]: s for s, _ in found["DCGM_FI_DEV_GPU_UTIL"]}
        assert [util[d["uuid"]]["gpu"] for d in eight_a100s] == [str(i) for i in range(8)]  # PCI bus order
        assert util[first["uuid"]] == {"gpu": "0", "UUID": first["uuid"], "pci_bus_id": first["pci_bus_id"],
                                       "modelName": fake_nvml.A100, "Hostname": HOST, "virtual": "false"}
        assert series(found, "DCGM_FI_DEV_GPU_UTIL")[first["uuid"]] == 55.0
        assert series(found, "DCGM_FI_DEV_FB_USED")[first["uuid"]] == 10240.0  # MiB, as dcgm-exporter's
        assert series(found, "DCGM_FI_DEV_FB_TOTAL")[first["uuid"]] == 81920.0
        assert series(found, "DCGM_FI_DEV_FB_FREE")[first["uuid"]] == 81920.0 - 10240.0  # NVML's free
        assert series(found, "DCGM_FI_DEV_GPU_TEMP")[first["uuid"]] == 64.0
        assert series(found, "DCGM_FI_DEV_POWER_USAGE")[first["uuid"]] == 250.5  # W (NVML's mW / 1000)
        # A sensor the card lacks: absent, never 0; the other seven have theirs.
        assert set(series(found, "DCGM_FI_DEV_GPU_TEMP")) == {d["uuid"] for d in eight_a100s} - {lacking["uuid"]}
        assert set(series(found, "DCGM_FI_DEV_POWER_USAGE")) == {d["uuid"] for d in eight_a100s} - {lacking["uuid"]}
        job_devices = [s for s, _ in found["sae_dist_job_device"]]
        assert len(job_devices) == 1 and job_devices[0]["job_id"] == str(running)
        assert job_devices[0]["UUID"] != first["uuid"]  # GPU 0 is busy with something else
        assert_offline(exporter, ("127.0.0.1", port))
    finally:
        kill_running_jobs()


@pytest.mark.slow
def test_by_default_it_listens_on_loopback_only_and_stops_cleanly(tmp_path, state_home):
    exporter = Exporter(tmp_path)
    try:
        if exporter.proc.poll() is not None:
            _, err = exporter.proc.communicate()
            if "Address already in use" in err:  # something else holds 9400 here (dcgm-exporter?)
                pytest.skip(f"port 9400 is in use on this machine: {err.strip()}")
        assert exporter.line == "serving metrics on http://127.0.0.1:9400/metrics: loopback only, " \
                                "other machines cannot reach it"
        assert listening(exporter.proc.pid) == {("127.0.0.1", 9400)}
        found = parsed(9400)  # no database yet: the first scrape creates it; no device, no job
        assert not [k for k in found if k.startswith("DCGM_")] and set(series(found, "sae_dist_jobs").values()) == {0}
    finally:
        code, out, err = exporter.stop(signal.SIGINT)
    assert (code, out, err) == (0, "", "")
    assert_offline(exporter, ("127.0.0.1", 9400))


@pytest.mark.slow
def test_a_bad_listen_address_is_one_line_and_exit_2(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        calls = [["--listen", "9400"], ["--listen", ":9400"], ["--listen", "127.0.0.1:65536"],
                 ["--listen", "example.com:9400"], ["--listen", f"127.0.0.1:{port}"],
                 ["--listen", "192.0.2.1:9400"],  # TEST-NET-1: no address of this machine
                 ["--port", "9400"]]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda args: run_cli("metrics", *args, module="scheduler", timeout=60), calls))
    for args, result in zip(calls, results):
        assert result.returncode == 2, (args, result.stderr)
        assert result.stdout == "" and result.stderr.count("\n") == 1, (args, result.stderr)
    said = [r.stderr for r in results]
    assert said[0] == "error: --listen: '9400' is not HOST:PORT (127.0.0.1:9400, 0.0.0.0:9400 or [::1]:9400)\n"
    assert said[4] == f"error: --listen 127.0.0.1:{port}: cannot listen there: Address already in use\n"
    assert said[5].startswith("error: --listen 192.0.2.1:9400: cannot listen there: Cannot assign requested address")
    assert "unrecognized arguments: --port" in said[6]
