"""The machine's other work while a benchmark point runs: a figure is only as good as the quiet
around it.

CPU: the machine's busy time from /proc/stat (user, nice, system, irq, softirq over every core)
minus the CPU time of the point's own process tree (the process started for it and everything
below it, whatever session torchrun's ranks moved to) and of this benchmarking process, sampled
before the point starts and every second while it runs. The remainder is "other", in percent of
one core (100 = one core kept busy); processes outside the tree are also listed by their own
CPU time, the busiest first (short-lived ones only count in the total).

GPU (kind cuda only, through NVML; anything NVML cannot tell stays unknown): the compute
processes on every GPU of the machine that are not the point's, with their memory and, where
the driver reports it, their SM utilisation.

Linux /proc only (the scheduler's platform). Everything here tolerates a missing /proc entry, a
process that ends mid-read, and a machine without NVML.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

from sae_dist.contract import BENCH_WAIT_SCALE_ENV
from sae_dist.errors import UserError

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
SAMPLE_EVERY_S = 1.0  # while a point runs
BASELINE_S = 1.0  # quiet window measured just before a point starts
TOP_PROCESSES = 5


def wait_scale() -> float:
    """The test knob BENCH_WAIT_SCALE_ENV: 1 unless set; anything but a positive number is one
    clear error (`bench` checks it before any point starts)."""
    raw = os.environ.get(BENCH_WAIT_SCALE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        scale = float(raw)
    except ValueError:
        scale = math.nan
    if not scale > 0 or math.isinf(scale):
        raise UserError(f"{BENCH_WAIT_SCALE_ENV}={raw!r}: give a positive number such as 0.2 "
                        "(the benchmark's fixed waits times this)")
    return scale


def _busy_ticks() -> tuple[int, int] | None:
    """(busy ticks over all cores, number of cores) from /proc/stat; None where unreadable."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    total, ncores = None, 0
    for line in lines:
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            # user nice system idle iowait irq softirq steal ...: guest time is inside user already
            total = v[0] + v[1] + v[2] + (v[5] if len(v) > 5 else 0) + (v[6] if len(v) > 6 else 0)
        elif line.startswith("cpu"):
            ncores += 1
    cores = ncores or os.cpu_count() or 1
    return (total, cores) if total is not None else None


def _processes() -> dict[int, tuple[int, int, int, int, str]]:
    """pid -> (parent pid, start ticks, own CPU ticks (utime + stime), with its reaped children's
    (+ cutime + cstime), name) of every process."""
    out = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # ended meanwhile
        try:
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()
            own = int(fields[11]) + int(fields[12])
            out[int(name)] = (int(fields[1]), int(fields[19]), own, own + int(fields[13]) + int(fields[14]), comm)
        except (ValueError, IndexError):
            continue
    return out


def _tree(procs: dict[int, tuple], roots: set[int]) -> set[int]:
    """The roots and every process below them."""
    kids: dict[int, list[int]] = {}
    for pid, info in procs.items():
        kids.setdefault(info[0], []).append(pid)
    found, todo = set(), [r for r in roots if r in procs]
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(kids.get(pid, []))
    return found


def mine_ticks(procs0: dict, tree0: set[int], procs1: dict, tree1: set[int]) -> int | None:
    """CPU ticks the tree used between two readings, its members' ended children included: the
    sum of (own + reaped children's) time over the tree then and now, so a member that ended in
    between counts through its parent's children's time. None when a member ended and its parent
    is not in the tree (its last moments cannot be told apart): the interval is left out."""
    def same(pid: int) -> bool:
        return pid in procs0 and pid in procs1 and procs0[pid][1] == procs1[pid][1]

    now = sum(procs1[p][3] for p in tree1)
    then = sum(procs0[p][3] for p in tree0 | {p for p in tree1 if same(p)} if p in procs0)
    for p in tree0:
        if not same(p) and procs0[p][0] not in tree1:
            return None
    return max(0, now - then)


@dataclass
class _Window:
    """CPU seconds accumulated over one stretch of time (before, or during the point)."""

    wall_s: float = 0.0
    other_s: float = 0.0
    samples: int = 0
    peak_pct: float = 0.0
    by_process: dict[tuple[int, int], list] = field(default_factory=dict)  # (pid, start) -> [name, cpu s]

    def add(self, wall_s: float, other_s: float, per_process: dict[tuple[int, int], tuple[str, float]]) -> None:
        self.wall_s += wall_s
        self.other_s += other_s
        self.samples += 1
        if wall_s > 0:
            self.peak_pct = max(self.peak_pct, 100 * other_s / wall_s)
        for key, (name, cpu_s) in per_process.items():
            entry = self.by_process.setdefault(key, [name, 0.0])
            entry[1] += cpu_s

    def summary(self) -> dict | None:
        if self.samples == 0 or self.wall_s <= 0:
            return None
        top = sorted(((name, pid, cpu_s) for (pid, _), (name, cpu_s) in self.by_process.items() if cpu_s > 0),
                     key=lambda t: -t[2])[:TOP_PROCESSES]
        return {"window_s": round(self.wall_s, 2), "samples": self.samples,
                "other_cpu_pct": round(100 * self.other_s / self.wall_s, 1),
                "peak_cpu_pct": round(self.peak_pct, 1),
                "top": [{"pid": pid, "name": name, "cpu_pct": round(100 * cpu_s / self.wall_s, 1)}
                        for name, pid, cpu_s in top]}


class LoadMonitor:
    """Samples the machine's other load around one benchmark point.

    `tick(roots)` at any pace (it measures at most every SAMPLE_EVERY_S): roots are the pids of
    the point's processes known so far (none before it starts). `start_point()` switches from
    "before" to "during"; `result()` is the JSON-ready record for other_load_json.
    """

    def __init__(self, kind: str):
        self.kind = kind
        self.cores = os.cpu_count() or 1
        self.before, self.during = _Window(), _Window()
        self.window = self.before
        self.jobs: dict[int, dict] = {}
        self.gpu = _GpuWatch() if kind == "cuda" else None
        self.error: str | None = None
        self._last = self._read(set())
        self._last_t = time.monotonic()

    def _read(self, roots: set[int]):
        busy = _busy_ticks()
        procs = _processes()
        mine = _tree(procs, roots | {os.getpid()})
        if busy is not None:
            self.cores = busy[1]
        return busy, procs, mine

    def baseline(self, seconds: float = BASELINE_S) -> None:
        """Measure the quiet before the point for `seconds` (sleeps)."""
        time.sleep(seconds * wait_scale())
        self.tick(set(), force=True)

    def start_point(self) -> None:
        self.window = self.during

    def note_jobs(self, jobs: list[dict]) -> None:
        """Other scheduler jobs seen running meanwhile (id, name, user)."""
        if self.window is self.during:
            for j in jobs:
                self.jobs.setdefault(j["id"], j)

    def tick(self, roots: set[int], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_t < SAMPLE_EVERY_S:
            return
        try:
            current = self._read(set(roots))
            self._account(self._last, current, now - self._last_t)
            if self.gpu is not None:
                self.gpu.sample(current[2], during=self.window is self.during)
        except Exception as e:  # never let the watching break the measurement
            self.error = f"{type(e).__name__}: {e}"[:300]
            return
        self._last, self._last_t = current, now

    def _account(self, last, current, wall_s: float) -> None:
        (busy0, procs0, mine0), (busy1, procs1, mine1) = last, current
        if busy0 is None or busy1 is None or wall_s <= 0:
            return
        ours = mine_ticks(procs0, mine0, procs1, mine1)
        if ours is None:
            return
        per_process = {}
        for pid, (_, start, ticks, _all, name) in procs1.items():
            if pid in mine1:
                continue
            prev = procs0.get(pid)
            delta = ticks - prev[2] if prev is not None and prev[1] == start else ticks  # new: from 0
            if delta > 0:
                per_process[(pid, start)] = (name, delta / CLOCK_TICKS)
        other_s = max(0.0, (busy1[0] - busy0[0] - ours) / CLOCK_TICKS)
        self.window.add(wall_s, other_s, per_process)

    def result(self) -> dict:
        out = {"cores": self.cores, "sample_every_s": SAMPLE_EVERY_S,
               "cpu": {"before": self.before.summary(), "during": self.during.summary()},
               "jobs": sorted(self.jobs.values(), key=lambda j: j["id"])}
        if self.gpu is not None:
            out["gpu"] = self.gpu.result()
        if self.error:
            out["error"] = self.error
        return out

    def finish(self) -> str:
        """The record as JSON; NVML is let go."""
        out = json.dumps(self.result())
        if self.gpu is not None:
            self.gpu.close()
        return out


class _GpuWatch:
    """Other compute processes on the machine's GPUs (NVML), with their SM utilisation where the
    driver reports it. A pid that is not in this machine's /proc (another container) is listed
    as not attributable; it is not counted as the point's nor as other load."""

    def __init__(self):
        self.error: str | None = None
        self.handles = []
        self.seen: dict[tuple[int, int], dict] = {}  # (gpu, pid) -> record
        self.device_util: list[float] = []
        self._stamp = 0
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:  # no NVML, no driver
            self.nvml = None
            self.error = f"NVML unavailable: {type(e).__name__}: {e}"[:300]

    def sample(self, mine: set[int], during: bool) -> None:
        if self.nvml is None or not during:
            return
        nv = self.nvml
        for index, handle in enumerate(self.handles):
            try:
                procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)
            except Exception as e:
                self.error = f"NVML processes: {type(e).__name__}: {e}"[:300]
                continue
            try:
                self.device_util.append(float(nv.nvmlDeviceGetUtilizationRates(handle).gpu))
            except Exception:
                pass
            util = {}
            try:
                for u in nv.nvmlDeviceGetProcessUtilization(handle, self._stamp):
                    util[u.pid] = float(u.smUtil)
            except Exception:
                util = None  # not supported, or no sample since the last one
            for p in procs:
                if p.pid in mine:
                    continue
                visible = os.path.exists(f"/proc/{p.pid}")
                rec = self.seen.setdefault((index, p.pid), {
                    "gpu": index, "pid": p.pid, "name": _name(p.pid) if visible else None,
                    "attributable": visible, "used_memory": None, "sm_samples": []})
                rec["used_memory"] = max(rec["used_memory"] or 0, p.usedGpuMemory or 0)
                if util is not None and p.pid in util:
                    rec["sm_samples"].append(util[p.pid])
        self._stamp = int(time.time() * 1e6) - 1_000_000

    def result(self) -> dict:
        procs = []
        for rec in self.seen.values():
            samples = rec["sm_samples"]
            procs.append({**{k: v for k, v in rec.items() if k != "sm_samples"},
                          "sm_pct": round(sum(samples) / len(samples), 1) if samples else None})
        out = {"gpus": len(self.handles), "other_processes": procs,
               "mean_utilization_pct": (round(sum(self.device_util) / len(self.device_util), 1)
                                        if self.device_util else None)}
        if self.error:
            out["error"] = self.error
        return out

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None


def _name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None
