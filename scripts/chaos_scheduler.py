"""Chaos run of the local scheduler: prints what was lost, duplicated, double-booked or killed.

    .venv/bin/python scripts/chaos_scheduler.py [--jobs 400] [--submitters 4] [--seed 1]

N short jobs come from concurrent submitters (Python API processes, and every --cli-every'th job
through a `python -m scheduler submit` process), with job arrays beside them (one `submit
--array 0-4%2` per 50 jobs), while a chaos thread SIGKILLs and restarts the daemon, SIGKILLs
supervisors and jobs, cancels jobs (CLI and API) and array tasks (`cancel A_[x-y]`) and gives
some jobs a time limit shorter than their work, on 4 virtual devices in a throwaway
SAE_DIST_HOME. Each job appends its id to a file when it starts, so a job that ran twice shows,
and leaves a `sleep 600` behind in a session of its own (setsid), its pid recorded.

At the end it prints, and exits 1 if any is not 0:
- jobs lost: submitted but missing from the database, or never final (PENDING/RUNNING at the end);
- jobs duplicated: more rows than submits, or a job that started more than once;
- devices double-booked: two allocations of one device overlapping in time (allocations table);
- healthy jobs killed: a job no chaos action targeted that did not end COMPLETED;
- tracebacks: "Traceback" in any output or log (daemon, supervisors, submitters, jobs);
- array limits broken: an array with more tasks holding devices at one moment than its %N;
- processes outlived their job: a detached `sleep 600` still alive once every job has ended.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
KINDS = ["daemon", "supervisor", "job", "cancel", "cancel-cli", "cancel-array"]
ARRAY_TASKS, ARRAY_LIMIT, JOBS_PER_ARRAY = 5, 2, 50  # an array of 5 tasks, 2 at once, per 50 jobs
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}

# Every job: `sh job.sh STARTS PIDS SECONDS`. It records its start, leaves a `sleep 600` behind in
# a session of its own (its "pid start-ticks" in PIDS), then works SECONDS.
JOB_SCRIPT = """echo "$SAE_DIST_JOB_ID" >> "$1"
setsid sh -c 'echo "$$ $(cut -d" " -f22 /proc/$$/stat)" >> "$1"; exec sleep 600' detached "$2" \\
    </dev/null >/dev/null 2>&1 &
sleep "$3"
"""

# A submitter: one job spec a line on stdin (JSON), one `id` a line on stdout.
API_SUBMITTER = textwrap.dedent("""
    import json, sys
    from sae_dist.db import get_engine
    from scheduler.control import wake_daemon
    from scheduler.store import NewJob, submit
    engine = get_engine()
    for line in sys.stdin:
        s = json.loads(line)
        job_id = submit(engine, NewJob(name="chaos", kind="command", argv=s["argv"], gpus=s["gpus"],
                                       workdir=s["workdir"], time_limit_s=s["time_limit_s"]))
        wake_daemon()
        print(json.dumps([s["key"], job_id]), flush=True)
""")


class Chaos:
    def __init__(self, home: Path, jobs: int, submitters: int, cli_every: int, seed: int):
        self.home, self.jobs, self.submitters, self.cli_every = home, jobs, submitters, cli_every
        self.rng = random.Random(seed)
        self.targeted: set[int] = set()  # jobs a chaos action aimed at (their end is not judged)
        self.ids: dict[int, int] = {}  # spec key -> job id, as the submitters reported
        self.timed: set[int] = set()  # spec keys given a time limit shorter than their work
        self.outputs: list[Path] = []  # every file that may hold a traceback
        self.daemon: subprocess.Popen | None = None
        self.engine = None
        self.daemons = 0
        self.counts: Counter = Counter()
        self.arrays: dict[int, list[int]] = {}  # array id -> its tasks' job ids
        self.expected = jobs + ARRAY_TASKS * max(1, jobs // JOBS_PER_ARRAY)  # jobs and array tasks
        self.done = threading.Event()
        self.lock = threading.Lock()

    # ---- processes ----
    def start_daemon(self) -> None:
        self.daemons += 1
        log = self.home / f"daemon-{self.daemons}.log"
        self.outputs.append(log)
        with open(log, "ab") as out:
            self.daemon = subprocess.Popen([PY, "-m", "scheduler", "daemon"], cwd=REPO, stdout=out, stderr=out,
                                           start_new_session=True)

    def spec(self, key: int) -> dict:
        work = round(self.rng.uniform(0.05, 0.6), 2)
        limit = None
        if self.rng.random() < 0.08:  # meant to time out
            work, limit = 30.0, 1.0
            self.timed.add(key)
        elif self.rng.random() < 0.3:
            limit = 120.0  # a time limit it never reaches
        return {"key": key, "gpus": self.rng.choice([1, 1, 1, 2]), "workdir": str(self.home), "time_limit_s": limit,
                "argv": self.job_argv(work)}

    def job_argv(self, work: float) -> list[str]:
        return ["sh", str(self.home / "job.sh"), str(self.home / "starts"), str(self.home / "detached"), str(work)]

    def submit_all(self) -> None:
        specs = [self.spec(k) for k in range(self.jobs)]
        cli = [s for s in specs if s["key"] % self.cli_every == self.cli_every - 1]
        api = [s for s in specs if s not in cli]
        threads = [threading.Thread(target=self.api_submitter, args=(api[i::self.submitters], i))
                   for i in range(self.submitters)]
        threads += [threading.Thread(target=self.cli_submitter, args=(cli[i::2], i)) for i in range(2)]
        threads.append(threading.Thread(target=self.array_submitter, args=(max(1, self.jobs // JOBS_PER_ARRAY),)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def api_submitter(self, specs: list[dict], n: int) -> None:
        err = self.home / f"submitter-{n}.err"
        self.outputs.append(err)
        with open(err, "wb") as e:
            proc = subprocess.Popen([PY, "-c", API_SUBMITTER], cwd=REPO, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=e, text=True)
            for s in specs:  # one at a time, with pauses: submits overlap the chaos
                proc.stdin.write(json.dumps(s) + "\n")
                proc.stdin.flush()
                self.record(*json.loads(proc.stdout.readline() or "[null, null]"))
                time.sleep(self.rng.uniform(0, 0.05))
            proc.stdin.close()
            proc.wait()

    def cli_submitter(self, specs: list[dict], n: int) -> None:
        for s in specs:
            args = ["submit", "--gpus", str(s["gpus"]), "-J", "chaos", "-D", s["workdir"]]
            if s["time_limit_s"]:
                args += ["-t", f"{int(s['time_limit_s']) // 60}:{int(s['time_limit_s']) % 60:02d}"]
            out = self.cli(*args, "--", *s["argv"], name=f"cli-submit-{n}")
            found = re.search(r"(\d+)", out)
            self.record(s["key"], int(found.group(1)) if found else None)

    def array_submitter(self, arrays: int) -> None:
        """`submit --array` through the command line, its tasks' ids read back from the database."""
        for n in range(arrays):
            out = self.cli("submit", "--array", f"0-{ARRAY_TASKS - 1}%{ARRAY_LIMIT}", "-J", "chaos", "-D",
                           str(self.home), "--", *self.job_argv(0.3), name="cli-submit-array")
            found = re.search(r"(\d+)", out)
            if not found:
                continue
            array_id = int(found.group(1))
            tasks = [j.id for j in self.array_tasks(array_id)]
            with self.lock:
                self.arrays[array_id] = tasks
            for i, job_id in enumerate(tasks):
                self.record(self.jobs + n * ARRAY_TASKS + i, job_id)
            time.sleep(self.rng.uniform(0, 0.3))

    def array_tasks(self, array_id: int) -> list:
        from scheduler.store import list_jobs

        return sorted((j for j in list_jobs(self.engine) if j.array_job_id == array_id), key=lambda j: j.array_task_id)

    def cli(self, *args: str, name: str) -> str:
        done = subprocess.run([PY, "-m", "scheduler", *args], cwd=REPO, capture_output=True, text=True)
        log = self.home / f"{name}.log"
        with open(log, "a") as f:
            f.write(done.stdout + done.stderr)
        if log not in self.outputs:
            self.outputs.append(log)
        return done.stdout

    def record(self, key, job_id) -> None:
        if key is None or job_id is None:
            return
        with self.lock:
            self.ids[key] = job_id
            if key in self.timed:
                self.targeted.add(job_id)

    # ---- chaos ----
    def running(self) -> list:
        from scheduler.store import list_jobs

        return [j for j in list_jobs(self.engine, ("RUNNING",)) if j.id in self.ids.values()]

    def act(self) -> None:
        """One random chaos action."""
        from scheduler import procs

        # Every kind once first (retried until it finds a target), then at random.
        kind = next((k for k in KINDS if not self.counts[k]), None) or self.rng.choices(KINDS, [3, 2, 2, 3, 1, 1])[0]
        if kind == "daemon":
            self.daemon.send_signal(signal.SIGKILL)
            self.daemon.wait()
            time.sleep(self.rng.uniform(0, 0.3))
            self.start_daemon()
        elif kind in ("supervisor", "job"):
            running = self.running()
            if not running:
                return
            job = self.rng.choice(running)
            pid, ticks = (job.supervisor_pid, job.supervisor_start_ticks) if kind == "supervisor" \
                else (job.pid, job.proc_start_ticks)
            if not procs.is_alive(pid, ticks):
                return
            self.targeted.add(job.id)  # before the kill: its end is ours to cause
            os.kill(pid, signal.SIGKILL)
        elif kind == "cancel-array":  # two tasks of an array, by their names (A_[x-y])
            with self.lock:
                arrays = dict(self.arrays)
            if not arrays:
                return
            array_id = self.rng.choice(sorted(arrays))
            first = self.rng.randrange(ARRAY_TASKS - 1)
            self.targeted.update(arrays[array_id][first:first + 2])  # before the cancel, as below
            self.cli("cancel", f"{array_id}_[{first}-{first + 1}]", name="cli-cancel-array")
        else:
            with self.lock:
                known = list(self.ids.values())
            if not known:
                return
            job_id = self.rng.choice(known)
            self.targeted.add(job_id)
            if kind == "cancel":
                from scheduler.actions import perform

                perform(self.engine, "cancel", job_id)
            else:
                self.cli("cancel", str(job_id), name="cli-cancel")
        self.counts[kind] += 1

    def every_kind_happened(self) -> bool:
        return all(self.counts[k] for k in KINDS)

    def chaos_loop(self) -> None:
        while not self.done.wait(self.rng.uniform(0.1, 0.5)):
            # Most jobs stay healthy, to be judged; but every kind of chaos happens at least once.
            if len(self.targeted) < self.jobs // 4 or not self.every_kind_happened():
                self.act()

    def drain(self, timeout_s: float) -> list:
        """Wait until every submitted job is final (or the timeout); their rows."""
        from scheduler.store import list_jobs

        deadline = time.monotonic() + timeout_s
        while True:
            jobs = [j for j in list_jobs(self.engine) if j.name == "chaos"]
            if all(j.state in FINAL for j in jobs) or time.monotonic() > deadline:
                return jobs
            time.sleep(0.5)

    def run(self, timeout_s: float) -> dict[str, int]:
        from sae_dist.db import get_engine

        self.engine = get_engine()
        (self.home / "job.sh").write_text(JOB_SCRIPT)
        self.start_daemon()
        chaos = threading.Thread(target=self.chaos_loop)
        chaos.start()
        self.submit_all()
        time.sleep(1.0)  # the last jobs meet some chaos too
        # On a loaded machine the submissions can end before every kind of chaos had its turn:
        # wait for them (a count, not a time, decides when chaos ends).
        deadline = time.monotonic() + timeout_s
        while not self.every_kind_happened() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.done.set()
        chaos.join()
        if self.daemon.poll() is not None:
            self.start_daemon()
        jobs = self.drain(timeout_s)
        self.daemon.send_signal(signal.SIGTERM)
        self.daemon.wait(30)
        return self.judge(jobs)

    # ---- the verdict ----
    def judge(self, jobs: list) -> dict[str, int]:
        by_id = {j.id: j for j in jobs}
        submitted = set(self.ids.values())
        lost = (self.expected - len(self.ids)) + sum(1 for i in submitted
                                                     if i not in by_id or by_id[i].state not in FINAL)
        starts = Counter(int(x) for x in (self.home / "starts").read_text().split()) \
            if (self.home / "starts").exists() else Counter()
        duplicated = max(0, len(jobs) - len(submitted)) + sum(1 for n in starts.values() if n > 1)
        healthy_killed = sum(1 for i in submitted - self.targeted if i in by_id and by_id[i].state in FINAL
                             and by_id[i].state != "COMPLETED")
        tracebacks = sum(p.read_text(errors="replace").count("Traceback") for p in self.all_outputs())
        return {"jobs lost": lost, "jobs duplicated": duplicated, "devices double-booked": double_booked(self.engine),
                "healthy jobs killed": healthy_killed, "tracebacks": tracebacks,
                "array limits broken": limits_broken(self.engine, self.arrays, ARRAY_LIMIT),
                "processes outlived their job": outlived(self.home / "detached")}

    def all_outputs(self) -> list[Path]:
        logs = self.home / "logs"
        return [p for p in self.outputs if p.exists()] + (sorted(logs.iterdir()) if logs.exists() else [])


def outlived(record: Path) -> int:
    """The detached processes still alive (every job has ended): "pid start-ticks" a line."""
    from scheduler import procs

    lines = record.read_text().splitlines() if record.exists() else []
    alive = [int(pid) for pid, ticks in (line.split() for line in lines if line.strip())
             if procs.is_alive(int(pid), int(ticks))]
    for pid in alive:  # reported, and not left running
        os.kill(pid, signal.SIGKILL)
    return len(alive)


def double_booked(engine) -> int:
    """Pairs of allocations of one device whose times overlap (an open one lasts until now)."""
    from sqlalchemy import select

    from sae_dist.db import utcnow
    from scheduler.store import ALLOCATIONS

    with engine.connect() as conn:
        rows = conn.execute(select(ALLOCATIONS.c.device_uuid, ALLOCATIONS.c.allocated_at,
                                   ALLOCATIONS.c.released_at)).all()
    spans = defaultdict(list)
    for r in rows:
        spans[r.device_uuid].append((r.allocated_at, r.released_at or utcnow()))
    overlaps = 0
    for device in spans.values():
        device.sort()
        overlaps += sum(1 for a, b in zip(device, device[1:]) if b[0] < a[1])
    return overlaps


def limits_broken(engine, arrays: dict[int, list[int]], limit: int) -> int:
    """Arrays that ever had more than `limit` tasks holding devices at once (from every allocation
    made, released or not: a task run twice counts each time)."""
    from sqlalchemy import select

    from sae_dist.db import utcnow
    from scheduler.store import ALLOCATIONS

    with engine.connect() as conn:
        rows = conn.execute(select(ALLOCATIONS.c.job_id, ALLOCATIONS.c.allocated_at, ALLOCATIONS.c.released_at)).all()
    array_of = {task: array_id for array_id, tasks in arrays.items() for task in tasks}
    edges = defaultdict(list)
    for r in rows:
        if r.job_id in array_of:
            edges[array_of[r.job_id]] += [(r.allocated_at, 1), (r.released_at or utcnow(), -1)]
    broken = 0
    for points in edges.values():
        held = most = 0
        for _, step in sorted(points, key=lambda e: (e[0], e[1])):  # a release before a start at one instant
            held += step
            most = max(most, held)
        broken += most > limit
    return broken


def bad_arguments(args) -> str | None:
    for name in ("jobs", "submitters", "cli_every"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.home is not None and args.home.exists() and (not args.home.is_dir() or any(args.home.iterdir())):
        return f"--home {args.home} is not an empty directory: the chaos run needs a state directory of its own"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--submitters", type=int, default=4, help="Python API submitter processes")
    ap.add_argument("--cli-every", type=int, default=10, help="every Nth job goes through a `submit` command")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the jobs to end")
    ap.add_argument("--home", type=Path, help="an empty state directory to use (default: a new temporary one)")
    args = ap.parse_args(argv)
    wrong = bad_arguments(args)
    if wrong:
        print(f"error: {wrong}", file=sys.stderr)
        return 2
    home = args.home or Path(tempfile.mkdtemp(prefix="sae-dist-chaos-"))
    home.mkdir(parents=True, exist_ok=True)
    os.environ.update(SAE_DIST_HOME=str(home), SAE_DIST_VIRTUAL_GPUS="4", SAE_DIST_AUTOSTART="0",
                      SAE_DIST_KILL_GRACE_S="2")
    os.environ.pop("SAE_DIST_DB_URL", None)
    start = time.perf_counter()
    chaos = Chaos(home, args.jobs, args.submitters, args.cli_every, args.seed)
    figures = chaos.run(args.timeout)
    from scheduler.cgroups import remove_home

    remove_home(home)  # the state directory's parent cgroup (where jobs ran in cgroups), empty by now
    print(f"{args.jobs} jobs and {len(chaos.arrays)} arrays of {ARRAY_TASKS} tasks (%{ARRAY_LIMIT}), "
          f"{args.submitters} API submitters + 2 CLI submitters + 1 array submitter, state home {home}")
    print("chaos: " + ", ".join(f"{n} {k}" for k, n in sorted(chaos.counts.items())) +
          f"; {len(chaos.targeted)} jobs targeted; {time.perf_counter() - start:.0f} s")
    for name, value in figures.items():
        print(f"{name}: {value}")
    return 1 if any(figures.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
