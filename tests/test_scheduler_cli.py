"""`python -m scheduler ...` for real: bad input, hostile names, output patterns, the job's
environment, every listing in text and JSON, and a daemon started by `submit` itself.

Each CLI call is a fresh Python (~0.6 s), so independent calls run a few at a time; where a test
is about what a command answers rather than about its process, it calls the CLI's main in-process
(every path keeps at least one real process: exit code 2 and one line on stderr).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, cli_in_process, kill_running_jobs, run_cli, start_daemon, stop_process, wait_for
from sae_dist.db import get_engine
from scheduler import procs
from scheduler.store import count_jobs, get_job

DEVICES = 4

pytestmark = pytest.mark.slow  # a real daemon or CLI processes in every test


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_cli(*args, env=env, module="scheduler", timeout=60)


def cli_many(calls: list[tuple[str, ...]], workers: int = 3) -> list[subprocess.CompletedProcess]:
    """Independent CLI calls, a few at a time (results in the order given)."""
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda args: cli(*args), calls))


def submitted_id(result: subprocess.CompletedProcess) -> int:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["job_id"]


def processes_of(home: Path) -> list[int]:
    """Every process (but this one) whose environment names this test's state home: the daemon,
    supervisors and jobs all inherit it."""
    needle = f"SAE_DIST_HOME={home}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ and state != "Z":
            found.append(int(entry))
    return found


def stop_and_reap(home: Path, daemons: list[subprocess.Popen]) -> list[int]:
    """Stop daemons, end any job or supervisor of this test; returns what had to be killed."""
    for proc in daemons:
        stop_process(proc)
    pid_file = home / "daemon.pid"
    if pid_file.exists():  # a daemon started by `submit` itself
        try:
            pid, ticks = (int(x) for x in pid_file.read_text().split())
        except ValueError:
            pid = ticks = None
        if pid and procs.is_alive(pid, ticks):
            os.kill(pid, signal.SIGTERM)
            procs.wait_gone([pid], 10)
    if (home / "state.db").exists():
        kill_running_jobs()
    # Supervisors record the end and exit within moments; anything still there is a leak.
    try:
        wait_for(lambda: not processes_of(home), 10, "the test's processes to end")
        return []
    except AssertionError:
        left = processes_of(home)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return left


@pytest.fixture
def sched(state_home, monkeypatch, tmp_path):
    """4 virtual devices, no automatic daemon; start_daemon() runs one for the test."""
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", str(DEVICES))
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.setenv("SAE_DIST_KILL_GRACE_S", "3")
    started: list[subprocess.Popen] = []

    class Sched:
        home = state_home

        def start_daemon(self) -> subprocess.Popen:
            state_home.mkdir(parents=True, exist_ok=True)
            proc = start_daemon(tmp_path / "daemon-test.log")  # outside the home: see the file checks
            started.append(proc)
            return proc

        def stop_daemons(self) -> None:
            assert stop_and_reap(state_home, started) == [], "processes outlived their jobs"

    yield Sched()
    left = stop_and_reap(state_home, started)
    assert left == [], f"processes of the test were still running: {left}"


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------

def test_bad_input_is_one_error_line_and_stores_nothing(sched, tmp_path, capsys):
    done = submitted_id(cli("submit", "--json", "-J", "done", "--", "true"))
    assert cli("cancel", str(done)).returncode == 0  # PENDING -> CANCELLED: a finished job
    (tmp_path / "unknown.toml").write_text("d_in = 32\nd_sae = 128\nk = 8\nbogus_field = 3\n")
    (tmp_path / "wrongtype.toml").write_text('d_in = 32\nd_sae = 128\nk = "eight"\n')
    before = count_jobs(get_engine())

    ours = [  # (args, what the one error line must mention)
        (("submit", "--gpus", "5", "--", "true"), "5 GPUs"),
        (("submit", "--gpu-ids", "0,7", "--", "true"), "unknown device id 7"),
        (("submit", "-d", "afterok:999", "--", "true"), "job 999 does not exist"),
        (("submit", "-d", "afterok:99999999999999999999999", "--", "true"), "does not exist"),
        (("submit", "-t", "5:xx", "--", "true"), "--time"),
        (("submit", "--mem", "lots", "--", "true"), "--mem"),
        (("submit", "--mem", "99999999999999999999T", "--", "true"), "--mem"),
        (("submit",), "empty command"),
        (("submit", "--"), "empty command"),
        (("submit", "--begin", "tomorrowish", "--", "true"), "--begin"),
        (("submit", "--begin", "now+99999999999999999weeks", "--", "true"), "--begin"),
        (("submit", "--env", "SLURM_JOB_ID=1", "--", "true"), "SLURM_JOB_ID"),
        (("submit", "--train", str(tmp_path / "unknown.toml")), "bogus_field"),
        (("submit", "--train", str(tmp_path / "wrongtype.toml")), "k: "),
        (("cancel", "999"), "no job 999"),
        (("hold", str(done)), "CANCELLED"),
        (("acct", "-j", "abc"), "--jobs"),
        # issue 32: each refused, naming what was wrong (the sign kept, the flag the one typed)
        (("submit", "--priority", "99999999999999999999", "--", "true"), "--priority: 99999999999999999999 is out"),
        (("submit", "--priority", "3000000000", "--", "true"), "--priority: 3000000000 is out of range"),
        (("submit", "--nice", "-3000000000", "--", "true"), "--nice: -3000000000 is out of range"),
        (("submit", "--array", "０-３", "--", "true"), "'０' is not a task id"),
        (("submit", "--array", "0-1%99999999999999999999", "--", "true"), "more than the 100,000 tasks"),
        (("submit", "-d", "", "--", "true"), "--dependency: empty"),
        (("submit", "-t", "", "--", "true"), "--time: '' is not a time limit"),
        (("submit", "--gpu-ids", "", "--", "true"), "--gpu-ids: '' names no device"),
        (("submit", "--mem", "", "--", "true"), "--mem"),
        (("submit", "--begin", "", "--", "true"), "--begin"),
        (("submit", "-J", "bad\udcff", "--", "true"), "is not valid UTF-8"),
        (("acct", "-j", "9223372036854775808"), "no job 9223372036854775808"),
    ]
    from_argparse = [
        (("cancel", "abc"), "job id must be a positive number"),
        (("submit", "--gpus", "two", "--", "true"), "--gpus"),
        (("submit", "--gpus", "٣", "--", "true"), "'٣' is not a whole number"),
        (("hold",), "job_ids"),
        (("queue", "--bogus"), "--bogus"),
        (("export-sbatch", "0"), "job id"),
    ]
    # One of ours and one of argparse's as real processes, every one in-process.
    results = cli_many([ours[0][0], from_argparse[0][0]]) + [cli_in_process(capsys, *args)
                                                             for args, _ in ours + from_argparse]
    for (args, needle), r in zip([ours[0], from_argparse[0]] + ours + from_argparse, results):
        what = f"{args}: rc={r.returncode} stdout={r.stdout!r} stderr={r.stderr!r}"
        assert r.returncode == 2 and r.stdout == "", what
        assert "Traceback" not in r.stderr, what
        lines = r.stderr.strip().splitlines()
        assert len([line for line in lines if "error:" in line]) == 1, what
        assert needle in lines[-1] and "error:" in lines[-1], what
        if (args, needle) in ours:
            assert lines == [lines[0]] and lines[0].startswith("error: "), what
    assert count_jobs(get_engine()) == before  # nothing stored
    assert get_job(get_engine(), done).state == "CANCELLED"
    assert not get_job(get_engine(), done).held


@pytest.mark.parametrize("env, needle", [
    ({"SAE_DIST_HOME": "/proc/nonexistent"}, "SAE_DIST_HOME='/proc/nonexistent' cannot hold the state"),
    ({"SAE_DIST_HOME": "/etc/passwd"}, "SAE_DIST_HOME='/etc/passwd' is a file, not a directory"),
    ({"SAE_DIST_DB_URL": "garbage://"}, "SAE_DIST_DB_URL='garbage://' is not a database sae-dist can use"),
])
def test_a_state_home_or_database_that_cannot_be_used_is_one_line(env, needle):
    """A bad SAE_DIST_HOME or SAE_DIST_DB_URL: one line naming it, exit 2, for listing and submitting
    alike (each was a traceback)."""
    for args in (("queue",), ("submit", "--", "true")):
        done = run_cli(*args, module="scheduler", env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (args, done.stderr)
        assert done.stderr.strip().splitlines() == [f"error: {done.stderr.strip().removeprefix('error: ')}"]
        assert needle in done.stderr, (args, done.stderr)


# ---------------------------------------------------------------------------------------------
# A daemon running real jobs: hostile names, patterns, environment; then every listing.
# ---------------------------------------------------------------------------------------------

def _env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_names_patterns_environment_and_listings(sched, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SLURM_JOB_ID", "77")  # in the submitters' and the daemon's environment
    monkeypatch.setenv("SLURM_NODELIST", "node1")
    hostile_dir = tmp_path / "a" / "b"  # "../../x" from here (or from logs/) is still in tmp_path
    hostile_dir.mkdir(parents=True)
    work = tmp_path / "work"
    (work / "barrier").mkdir(parents=True)
    sched.start_daemon()
    before = {p for p in tmp_path.rglob("*") if p.is_file()}

    echo_name = ("sh", "-c", "echo $SAE_DIST_JOB_NAME")
    # Two jobs that overlap for sure: each waits (at most 10 s) until both have started.
    env_job = ("sh", "-c", "env; touch barrier/$SAE_DIST_JOB_ID; i=0; "
               "while [ $(ls barrier | wc -l) -lt 2 ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; sleep 2")
    results = cli_many([
        ("submit", "--json", "-J", "../../x", "-D", str(hostile_dir), "--", *echo_name),
        ("submit", "--json", "-J", "$(touch PWNED)", "-D", str(hostile_dir), "--", *echo_name),
        ("submit", "--json", "-J", "pat", "-D", str(work), "-o", "out/%x-%j.log", "--",
         "sh", "-c", "echo job $SAE_DIST_JOB_ID here"),
        ("submit", "--json", "-J", "envA", "-D", str(work), "-o", "%x.out", "--env", "GREETING=a=b c", "--", *env_job),
        ("submit", "--json", "-J", "envB", "-D", str(work), "-o", "%x.out", "--", *env_job),
        ("submit", "--json", "-J", "waits", "--hold", "-t", "10", "--gpus", "2", "--", "true"),
    ])
    dotted, pwned, pat, env_a, env_b, held = (submitted_id(r) for r in results)
    engine = get_engine()
    wait_for(lambda: all(get_job(engine, j).state not in ("PENDING", "RUNNING")
                         for j in (dotted, pwned, pat, env_a, env_b)), 60, "the jobs to end")
    jobs = {j: get_job(engine, j) for j in (dotted, pwned, pat, env_a, env_b)}
    assert {j.state for j in jobs.values()} == {"COMPLETED"}, {j.id: (j.state, j.reason) for j in jobs.values()}

    # Hostile names: stored literally, written only inside the log directory, never evaluated.
    logs = (sched.home / "logs").resolve()
    for job_id, name in ((dotted, "../../x"), (pwned, "$(touch PWNED)")):
        job = jobs[job_id]
        assert job.name == name
        out = Path(job.stdout_path).resolve()
        assert out.parent == logs, out
        assert out.read_text() == name + "\n"  # the job saw the literal name
    assert list(hostile_dir.iterdir()) == []
    for place in (tmp_path, REPO, sched.home, Path.home(), Path("/tmp")):
        assert not (place / "PWNED").exists(), place
    assert not list(tmp_path.rglob("PWNED"))
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()

    # %x/%j relative to --chdir.
    pattern_file = work / "out" / f"pat-{pat}.log"
    assert pattern_file.read_text() == f"job {pat} here\n"

    # Every new file: in the log directory, the database and locks, or what the pattern and
    # environment jobs were told to write in their working directory.
    infra = {"state.db", "state.db-wal", "state.db-shm", "scheduler.lock", "daemon.lock", "daemon.pid"}
    expected_work = {pattern_file, work / "envA.out", work / "envB.out",
                     work / "barrier" / str(env_a), work / "barrier" / str(env_b)}
    for path in {p for p in tmp_path.rglob("*") if p.is_file()} - before:
        ok = (path.resolve().is_relative_to(logs)
              or (path.parent == sched.home and (path.name in infra or path.suffix == ".lock"))
              or path in expected_work or path == tmp_path / "daemon-test.log")
        assert ok, f"unexpected file {path}"

    # The environment: --env reaches the job, SLURM_* does not, each job its own port.
    env = {j: _env_of((work / f"{n}.out").read_text()) for j, n in ((env_a, "envA"), (env_b, "envB"))}
    assert env[env_a]["GREETING"] == "a=b c" and "GREETING" not in env[env_b]
    ports = set()
    for job_id, e in env.items():
        assert not [k for k in e if k.startswith("SLURM_")], sorted(e)
        assert e["SAE_DIST_JOB_ID"] == str(job_id)
        assert e["SAE_DIST_NUM_GPUS"] == "1"
        assert e["CUDA_VISIBLE_DEVICES"] == ""  # virtual devices: no CUDA device at all
        assert e["SAE_DIST_MASTER_PORT"] != "29500"
        ports.add(e["SAE_DIST_MASTER_PORT"])
    assert len(ports) == 2
    a, b = jobs[env_a], jobs[env_b]
    assert a.started_at < b.ended_at and b.started_at < a.ended_at  # they did run at the same time

    sched.stop_daemons()  # flushes the samples; listings need no daemon
    listings = [("queue",), ("queue", "--json"), ("queue", "--all"), ("queue", "--all", "--json"),
                ("info",), ("info", "--json"), ("acct",), ("acct", "--json"),
                ("recommend", "--mem", "1GiB", "--count", "2"),
                ("recommend", "--mem", "1GiB", "--count", "2", "--json"),
                ("recommend", "--count", "5"), ("recommend", "--count", "5", "--json")]
    # In-process (the answers are the subject); `queue --all --json` and a refused `recommend`
    # also as real processes, which must answer the same.
    runs = [cli_in_process(capsys, *args) for args in listings]
    queue_all_process, too_many_process = cli_many([listings[3], listings[10]])
    assert queue_all_process.returncode == 0 and queue_all_process.stdout == runs[3].stdout
    assert too_many_process.returncode == 2 and too_many_process.stdout == ""
    assert too_many_process.stderr.strip().splitlines() == runs[10].stderr.strip().splitlines()
    for args, r in zip(listings, runs[:-2]):  # `queue` notes that no daemon starts its pending jobs
        note = "note: no scheduler daemon runs for " if args[0] == "queue" and "--json" not in args else None
        assert r.returncode == 0 and (r.stderr == "" or note and r.stderr.startswith(note)), (args, r.stderr)
    (queue, queue_json, queue_all, queue_all_json, info, info_json, acct, acct_json,
     rec, rec_json, too_many, too_many_json) = runs

    queue_keys = {"job_id", "name", "state", "reason", "gpus", "elapsed_s", "time_limit_s"}
    rows = json.loads(queue_json.stdout)
    assert [r["job_id"] for r in rows] == [held]
    assert queue_keys <= rows[0].keys()
    assert rows[0]["state"] == "PENDING" and rows[0]["reason"] == "JobHeldUser" and rows[0]["held"] is True
    assert rows[0]["gpus"] == 2 and rows[0]["time_limit_s"] == 600 and rows[0]["elapsed_s"] is None
    header, *lines = queue.stdout.splitlines()
    assert header.split()[:4] == ["JOBID", "NAME", "USER", "ST"] and len(lines) == 1
    assert "JobHeldUser" in lines[0] and "00:10:00" in lines[0]

    rows = {r["job_id"]: r for r in json.loads(queue_all_json.stdout)}
    assert set(rows) == {dotted, pwned, pat, env_a, env_b, held}
    assert rows[dotted]["name"] == "../../x" and rows[pwned]["name"] == "$(touch PWNED)"
    for job_id in (dotted, pwned, pat, env_a, env_b):
        assert queue_keys <= rows[job_id].keys()
        assert rows[job_id]["state"] == "COMPLETED" and rows[job_id]["elapsed_s"] >= 0
    assert "$(touch PWNED)" in queue_all.stdout and "../../x" in queue_all.stdout
    assert len(queue_all.stdout.splitlines()) == 7

    devices = json.loads(info_json.stdout)
    assert [d["index"] for d in devices] == list(range(DEVICES))
    for d in devices:
        assert {"index", "uuid", "name", "virtual", "state", "memory_total", "memory_used", "utilization_pct",
                "temperature_c", "power_w"} <= d.keys()
        assert d["virtual"] is True and d["state"] == "idle"
        assert d["temperature_c"] is None and d["power_w"] is None  # unknown, never invented
        assert d["memory_total"] > 0
    header, *lines = info.stdout.splitlines()
    assert len(lines) == DEVICES and all("virtual" in line and "idle" in line for line in lines)

    usage_keys = {"exit_code", "start", "end", "elapsed_s", "mean_util_pct", "peak_util_pct",
                  "peak_memory_bytes", "energy_wh"}
    rows = {r["job_id"]: r for r in json.loads(acct_json.stdout)}
    assert set(rows) == {dotted, pwned, pat, env_a, env_b, held}
    for row in rows.values():
        assert usage_keys <= row.keys(), sorted(row)
        assert row["energy_wh"] is None  # virtual devices have no power reading: unknown, not 0
    for job_id in (env_a, env_b):  # ran for seconds: the daemon sampled their devices
        row = rows[job_id]
        assert row["exit_code"] == 0 and row["start"] and row["end"] and row["elapsed_s"] > 1
        assert row["samples"] > 0 and row["mean_util_pct"] is not None
        assert row["peak_util_pct"] >= row["mean_util_pct"] and row["peak_memory_bytes"] > 0
    assert rows[held]["start"] is None and rows[held]["mean_util_pct"] is None
    header, *lines = acct.stdout.splitlines()
    assert "EXITCODE" in header and "ENERGY Wh" in header and len(lines) == 6
    assert any(line.split()[:4] == [str(env_a), "envA", "COMPLETED", "0:0"] for line in lines)

    choice = json.loads(rec_json.stdout)
    assert len(choice["chosen"]) == 2 and choice["error"] is None
    assert len(choice["passed_over"]) == 2 and all(choice["passed_over"].values())
    assert [line.split()[0] for line in rec.stdout.splitlines()] == ["use", "use", "skip", "skip"]
    assert too_many.returncode == 2 and too_many.stdout == ""
    assert too_many.stderr.startswith("error: ") and "5 devices" in too_many.stderr and "has 4" in too_many.stderr
    assert too_many_json.returncode == 2
    explained = json.loads(too_many_json.stdout)
    assert explained["chosen"] == [] and "has 4" in explained["error"]


# ---------------------------------------------------------------------------------------------
# submit starts the daemon when none runs, and only one.
# ---------------------------------------------------------------------------------------------

def test_submit_starts_one_daemon(sched, tmp_path, monkeypatch):
    from scheduler.control import daemon_running, pid_file

    monkeypatch.delenv("SAE_DIST_AUTOSTART")
    assert not daemon_running()
    first = submitted_id(cli("submit", "--json", "-D", str(tmp_path), "--", "true"))
    # The daemon takes its lock, then records its pid: wait for both.
    wait_for(lambda: daemon_running() and pid_file().exists(), 15, "submit's daemon")
    pid, ticks = (int(x) for x in (sched.home / "daemon.pid").read_text().split())
    second = submitted_id(cli("submit", "--json", "-D", str(tmp_path), "--", "true"))
    engine = get_engine()
    wait_for(lambda: all(get_job(engine, j).state == "COMPLETED" for j in (first, second)), 30, "both jobs")

    def daemons() -> list[int]:  # forked supervisors share the daemon's command line, but end with their job
        found = []
        for p in processes_of(sched.home):
            try:
                if Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[1:4] == [b"-m", b"scheduler", b"daemon"]:
                    found.append(p)
            except OSError:
                pass
        return found

    wait_for(lambda: daemons() == [pid], 10, f"{pid} to be the one daemon (have {daemons()})")
    assert procs.is_alive(pid, ticks)
    assert (sched.home / "daemon.pid").read_text().split() == [str(pid), str(ticks)]
    log = (sched.home / "daemon.log").read_text()
    assert log.count(" started for ") == 1 and "already runs" not in log, log
    os.kill(pid, signal.SIGTERM)
    assert procs.wait_gone([pid], 10)
    assert not daemon_running()

