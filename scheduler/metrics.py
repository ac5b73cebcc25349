"""`python -m scheduler metrics`: the devices and the queue as Prometheus / OpenMetrics gauges.

Every scrape reads the state database (what the daemon last listed of each device in `devices`,
its newest sample of each in `gpu_samples`, the open device faults, the jobs) through the plain
SQL readers `info` uses (`scheduler.device_view`, `sae_dist.job_listing`); NVML is never called
here, and nothing is kept between scrapes. A device's readings carry NVIDIA dcgm-exporter's names,
units and labels (gpu, UUID, pci_bus_id, modelName, Hostname), so its dashboards and alerts read
them; everything else is `sae_dist_*`. Every device series also says whether the device is a
virtual (CPU-backed) one: virtual="true" is never a GPU. A value nobody measured (a virtual
device's temperature, a sensor a card lacks, a sample older than SAMPLE_FRESH_S) is absent from
the output, never 0.

The text is prometheus_client's: OpenMetrics when the scraper's Accept asks for it (Prometheus
does), the classic text format otherwise. It listens on loopback unless --listen names another
address (`listen_address`), and runs in the foreground until SIGINT or SIGTERM.
"""

from __future__ import annotations

import errno
import ipaddress
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from socketserver import TCPServer, ThreadingMixIn
from typing import Any, Callable, Iterable, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from sae_dist.errors import UserError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 9400  # dcgm-exporter's too: on a machine running it, give --listen another port
MIB = 2**20  # dcgm-exporter's memory unit

DEVICE_LABELS = ("gpu", "UUID", "pci_bus_id", "modelName", "Hostname", "virtual")
"""dcgm-exporter's labels of a device (its `device`, nvidiaN, is not known here), then ours."""


# ---- where to listen ----

@dataclass(frozen=True)
class Listen:
    """An address to listen on: an IP address (never a name to look up) and a port."""

    host: str
    port: int

    @property
    def ip(self) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        return ipaddress.ip_address(self.host)

    @property
    def loopback(self) -> bool:
        """Only this machine can connect (127.0.0.0/8, ::1)."""
        return self.ip.is_loopback

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if self.ip.version == 6 else self.host
        return f"http://{host}:{self.port}/metrics"

    def startup_line(self) -> str:
        """What the command says once it listens: where, and who can reach it."""
        if self.loopback:
            return f"serving metrics on {self.url}: loopback only, other machines cannot reach it"
        where = "every interface" if self.ip.is_unspecified else self.host
        return f"serving metrics on {self.url}: {where}, as --listen asked: other machines can reach it"


def listen_address(text: str | None) -> Listen:
    """Where to listen, from --listen's HOST:PORT (None: 127.0.0.1:9400, loopback).

    Another address only when named: the host is never implied (":9400" is refused, not every
    interface), "localhost" is 127.0.0.1, an IPv6 address goes in brackets ([::1]:9400), and a
    host name is refused: no name lookup decides what is exposed. Raises UserError, saying why."""
    if text is None:
        return Listen(DEFAULT_HOST, DEFAULT_PORT)
    shape = f"--listen: {text!r} is not HOST:PORT (127.0.0.1:{DEFAULT_PORT}, 0.0.0.0:{DEFAULT_PORT} or " \
            f"[::1]:{DEFAULT_PORT})"
    if text.startswith("["):
        host, bracket, port = text[1:].partition("]:")
        if not bracket:
            raise UserError(shape)
    else:
        host, colon, port = text.rpartition(":")
        if not colon:
            raise UserError(shape)
        if ":" in host:
            raise UserError(f"--listen: {text!r}: write an IPv6 address in brackets, [{host}]:{port}")
    if not host:
        raise UserError(f"--listen: {text!r} names no host; give 127.0.0.1:{port or DEFAULT_PORT} (this machine "
                        f"only) or 0.0.0.0:{port or DEFAULT_PORT} (every interface)")
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise UserError(f"--listen: {text!r}: the port must be a number from 1 to 65535, got {port!r}")
    if host.lower() == "localhost":
        host = DEFAULT_HOST
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise UserError(f"--listen: {text!r}: the host must be an IP address (127.0.0.1, 0.0.0.0, [::1]) "
                        "or localhost, not a name to look up") from None
    return Listen(str(ip), int(port))


# ---- what a scrape reads ----

class State(NamedTuple):
    """The database at one scrape."""

    devices: list  # device_view.DeviceRow, by index
    samples: dict[str, dict[str, Any]]  # uuid -> the device's newest sample, however old
    faults: dict[str, Any]  # uuid -> its open fault
    counts: dict[tuple[str, str | None], int]  # (state, a pending job's reason code) -> jobs
    running: list  # job_listing.JobRow of every RUNNING job
    now: float


def read_state(now: float | None = None) -> State:
    """One read of everything a scrape shows, with the readers `info` and `queue` use."""
    from sae_dist.job_listing import job_counts, read_jobs
    from scheduler.device_view import device_table, latest_samples, open_faults

    return State(devices=device_table(), samples=latest_samples(now, max_age_s=float("inf")),
                 faults=open_faults(), counts=job_counts(), running=read_jobs(states=("RUNNING",)),
                 now=time.time() if now is None else now)


# ---- the metric families ----

def families(state: State, hostname: str) -> list[Metric]:
    """The metric families of one scrape, from `state` alone."""
    devices, labels = device_families(state, hostname)
    return devices + queue_families(state) + running_job_families(state, labels, hostname)


def _gauge(name: str, doc: str, labels: Iterable[str] = DEVICE_LABELS) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def device_families(state: State, hostname: str) -> tuple[list[Metric], dict[str, list[str]]]:
    """Each device's readings from its newest sample, if fresh (a reading it lacks: absent),
    and its state; with the label values of each device, by uuid."""
    from scheduler.device_view import SAMPLE_FRESH_S

    util = _gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %); of a virtual device, the CPU share of its "
                                          "job's processes.")
    fb_used = _gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB); of a virtual device, the "
                                            "resident memory of its job's processes.")
    fb_total = _gauge("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).")
    fb_free = _gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB), as NVML reads it; of a virtual "
                                            "device, its share of the RAM less its job's resident memory.")
    temp = _gauge("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).")
    power = _gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).")
    sampled = _gauge("sae_dist_device_sample_timestamp_seconds",
                     f"When the daemon last sampled the device (Unix time); readings older than "
                     f"{SAMPLE_FRESH_S:g} s are left out.")
    available = _gauge("sae_dist_device_available", "1 if the daemon could read the device at its last inventory.")
    failed = _gauge("sae_dist_device_failed", "1 while the device is failed (a training rank died on it), until "
                                              "a health check passes.")
    by_uuid = {}
    for d in state.devices:
        labels = [str(d.index), d.uuid, d.pci_bus_id or "", d.name, hostname, "true" if d.virtual else "false"]
        by_uuid[d.uuid] = labels
        available.add_metric(labels, 1.0 if d.available else 0.0)
        failed.add_metric(labels, 1.0 if d.uuid in state.faults else 0.0)
        if d.memory_total is not None:
            fb_total.add_metric(labels, d.memory_total / MIB)
        sample = state.samples.get(d.uuid)
        if sample is None:
            continue
        sampled.add_metric(labels, sample["time"].timestamp())
        if sample["time"].timestamp() <= state.now - SAMPLE_FRESH_S:
            continue  # the daemon stopped sampling it: what it read then is not now
        for family, key, scale in ((util, "utilization_pct", 1), (fb_used, "memory_used", MIB),
                                   (fb_free, "memory_free", MIB),
                                   (temp, "temperature_c", 1), (power, "power_w", 1)):
            if sample.get(key) is not None:
                family.add_metric(labels, sample[key] / scale)
    return [util, fb_used, fb_free, fb_total, temp, power, sampled, available, failed], by_uuid


def queue_families(state: State) -> list[Metric]:
    """The jobs of each state (every state, 0 included), and the pending ones by reason."""
    from sae_dist.db.schema import JOB_STATES, PENDING_REASONS

    jobs = _gauge("sae_dist_jobs", "Jobs in each state (SLURM's names).", ["state"])
    for name in JOB_STATES:
        jobs.add_metric([name], float(sum(n for (s, _), n in state.counts.items() if s == name)))
    pending = _gauge("sae_dist_jobs_pending", "Pending jobs by the code of their reason (SLURM's; None: not "
                                              "planned yet).", ["reason"])
    waiting = {why or "None": n for (s, why), n in state.counts.items() if s == "PENDING"}
    for reason in sorted(set(PENDING_REASONS) | set(waiting)):
        pending.add_metric([reason], float(waiting.get(reason, 0)))
    return [jobs, pending]


def running_job_families(state: State, device_labels: dict[str, list[str]], hostname: str) -> list[Metric]:
    """Each running job: who and what, since when, its time limit, and the devices it runs on
    (with the gpu, UUID, Hostname and virtual labels of the device series, to join them)."""
    job_labels = ["job_id"]
    info = InfoMetricFamily("sae_dist_job", "A running job.", labels=job_labels)
    started = _gauge("sae_dist_job_start_time_seconds", "When the running job started (Unix time).", job_labels)
    limit = _gauge("sae_dist_job_time_limit_seconds", "The running job's time limit, where it has one.", job_labels)
    count = _gauge("sae_dist_job_devices", "How many devices the running job runs on.", job_labels)
    on = _gauge("sae_dist_job_device", "1 for each device the running job runs on (an exclusive job holds "
                                       "every device besides).", ["job_id", "gpu", "UUID", "Hostname", "virtual"])
    for j in state.running:
        job_id = [str(j.id)]
        info.add_metric(job_id, {"name": j.name, "user": j.user, "kind": j.kind,
                                 "exclusive": "true" if j.exclusive else "false"})
        if j.started_at is not None:
            started.add_metric(job_id, j.started_at.timestamp())
        if j.time_limit_s is not None:
            limit.add_metric(job_id, float(j.time_limit_s))
        count.add_metric(job_id, float(len(j.devices)))
        for uuid in j.devices:
            gpu, _, _, _, _, virtual = device_labels.get(uuid, ["", uuid, "", "", hostname, ""])
            on.add_metric([str(j.id), gpu, uuid, hostname, virtual], 1.0)
    return [info, started, limit, count, on]


class StateCollector(Collector):
    """The collector: the database as it is at each scrape."""

    def __init__(self, hostname: str, read: Callable[[], State] = read_state):
        self.hostname, self.read = hostname, read

    def collect(self) -> list[Metric]:
        return families(self.read(), self.hostname)


# ---- serving ----

class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # a line per scrape is noise
        pass


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold up the exit

    def server_bind(self):
        # HTTPServer's looks its own address up (socket.getfqdn): a query to a name server for
        # any address /etc/hosts lacks. Nothing here needs the name.
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]
        self.setup_environ()


class _Server6(_Server):
    address_family = socket.AF_INET6


def scrape_error_line(error: Exception) -> str:
    """One line for a failed scrape: the storage fault in words (scheduler.storage_errors), or
    the error's first line."""
    from scheduler.storage_errors import storage_line

    line = storage_line(error)
    return line if line is not None else f"error: a scrape failed: {type(error).__name__}: {error}".splitlines()[0]


def wsgi_app(collector) -> Callable:
    """prometheus_client's app (its content negotiation: OpenMetrics when asked, gzip when
    accepted) over `collector` alone (not the library's process metrics); a scrape the database
    cannot answer is a 500 with one line, the same line on stderr, not a traceback."""
    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)  # nothing read until a scrape
    registry.register(collector)
    inner = make_wsgi_app(registry)

    def app(environ, start_response):
        try:
            return inner(environ, start_response)
        except Exception as e:  # the response is not started before the registry is read
            line = scrape_error_line(e)
            print(line, file=sys.stderr, flush=True)
            start_response("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")])
            return [(line + "\n").encode()]

    return app


def bind(listen: Listen, app: Callable) -> _Server:
    """A server listening at `listen` (not serving yet); UserError if it cannot."""
    server_class = _Server6 if listen.ip.version == 6 else _Server
    try:
        server = server_class((listen.host, listen.port), _QuietHandler)
    except OSError as e:
        taken = e.errno == errno.EADDRINUSE and listen.port == DEFAULT_PORT
        hint = " (dcgm-exporter's default port too: give --listen another)" if taken else ""
        raise UserError(f"--listen {listen.host}:{listen.port}: cannot listen there: "
                        f"{e.strerror or e}{hint}") from None
    server.set_app(app)
    return server


def serve(listen: Listen) -> int:
    """Serve until SIGINT or SIGTERM, then stop cleanly: 0."""
    server = bind(listen, wsgi_app(StateCollector(socket.gethostname())))
    stop = {signal.SIGINT, signal.SIGTERM}
    # Blocked before any thread starts (each inherits the mask), and for good: only sigwait
    # takes them, so a second one during the shutdown changes nothing.
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    try:
        thread.start()
        print(listen.startup_line(), flush=True)
        signal.sigwait(stop)
        server.shutdown()
        thread.join()
    finally:
        server.server_close()
    return 0
