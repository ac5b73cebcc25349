"""The command line's fast paths: `submit` through the standard library's sqlite3 stores exactly
the row the SQLAlchemy path stores, and only where that is safe (a SQLite file at the head
revision); anything else takes the migrating path."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta

import pytest

from conftest import add_virtual_devices, run_cli
from sae_dist.db import get_engine, utcnow
from sae_dist.errors import UserError
from sae_dist.paths import BUSY_TIMEOUT_ENV, HEAD_REVISION, busy_timeout_s
from scheduler import quick_submit
from scheduler.newjob import new_job
from scheduler.spec import JobSpec
from scheduler.store import get_job, submit

UUIDS = ["virtual-0", "virtual-1", "virtual-2", "virtual-3"]


@pytest.fixture
def migrated(state_home, monkeypatch):
    """A state database at the head revision whose daemon saw four devices; no daemon started."""
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    monkeypatch.delenv("SAE_DIST_VIRTUAL_GPUS", raising=False)
    engine = get_engine()
    with engine.begin() as conn:
        add_virtual_devices(conn, UUIDS, utcnow())
    return engine


def _columns(engine, job_id: int) -> dict:
    row = get_job(engine, job_id).model_dump()
    return {k: v for k, v in row.items() if k not in ("id", "submitted_at")}


def test_the_lean_path_checks_the_revision_alembic_calls_head():
    from alembic.script import ScriptDirectory

    from sae_dist.db.engine import alembic_config

    assert ScriptDirectory.from_config(alembic_config()).get_heads() == [HEAD_REVISION]
    assert quick_submit.HEAD_REVISION == HEAD_REVISION


def test_the_lean_submit_stores_the_row_the_regular_path_stores(migrated, tmp_path):
    first = submit(migrated, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), [(0, UUIDS[0])]))
    spec = dict(kind="command", argv=["python", "-c", "print(1)"], name="sweep é", gpu_ids=["2", "virtual-0"],
                mem_per_gpu=3 * 2**30, priority=-5, time_limit_s=90.0,
                begin_at=datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC) + timedelta(microseconds=7),
                dependencies=[("afterok", first)], held=True, requeue=True, workdir=str(tmp_path),
                env={"A": "b=c"}, stdout="%x-%j.out", stderr="err-%j")
    now = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)  # a whole second: SQLite text keeps .000000
    lean = quick_submit.submit_quick(JobSpec(**spec), now=now)
    regular = submit(migrated, new_job(JobSpec(**spec), [(i, u) for i, u in enumerate(UUIDS)]), now=now)
    assert lean == regular - 1
    assert _columns(migrated, lean) == _columns(migrated, regular)
    assert get_job(migrated, lean).submitted_at == get_job(migrated, regular).submitted_at == now
    assert get_job(migrated, lean).gpu_ids_json == '["virtual-2", "virtual-0"]'
    exclusive = quick_submit.submit_quick(JobSpec(argv=["true"], exclusive=True, workdir=str(tmp_path)))
    assert get_job(migrated, exclusive).gpus == len(UUIDS)  # every device the daemon saw


def test_the_lean_submit_resolves_devices_as_the_daemon_saw_them(migrated, tmp_path, monkeypatch):
    with pytest.raises(UserError, match="asked for 5 GPUs, this machine has 4"):
        quick_submit.submit_quick(JobSpec(argv=["true"], gpus=5, workdir=str(tmp_path)))
    with pytest.raises(UserError, match="unknown device id 4: this machine has devices 0-3"):
        quick_submit.submit_quick(JobSpec(argv=["true"], gpu_ids=["4"], workdir=str(tmp_path)))
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")  # the inventory obeys it first; so does submit
    with pytest.raises(UserError, match="this machine has devices 0-1"):
        quick_submit.submit_quick(JobSpec(argv=["true"], gpu_ids=["3"], workdir=str(tmp_path)))
    with sqlite3.connect(quick_submit.sqlite_file()) as con:
        assert con.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_an_unknown_dependency_stores_nothing(migrated, tmp_path):
    with pytest.raises(UserError, match="unknown dependency: job 7 does not exist"):
        quick_submit.submit_quick(JobSpec(argv=["true"], dependencies=[("afterok", 7)], workdir=str(tmp_path)))
    with sqlite3.connect(quick_submit.sqlite_file()) as con:
        assert con.execute("SELECT count(*) FROM jobs").fetchone() == (0,)


def test_a_database_not_at_the_head_revision_takes_the_migrating_path(state_home, tmp_path, monkeypatch):
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    spec = JobSpec(argv=["true"], workdir=str(tmp_path))
    assert quick_submit.submit_quick(spec) is None  # no file yet: nothing created here
    assert not (state_home / "state.db").exists()
    get_engine()
    with sqlite3.connect(state_home / "state.db") as con:
        con.execute("UPDATE alembic_version SET version_num = '0007'")
    assert quick_submit.submit_quick(spec) is None
    with sqlite3.connect(state_home / "state.db") as con:
        assert con.execute("SELECT count(*) FROM jobs").fetchone() == (0,)
    monkeypatch.setenv("SAE_DIST_DB_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert quick_submit.submit_quick(spec) is None


def test_the_busy_timeout_is_checked(monkeypatch):
    monkeypatch.setenv(BUSY_TIMEOUT_ENV, "2.5")
    assert busy_timeout_s() == 2.5
    for bad in ("soon", "-1", "nan", "1e9"):
        monkeypatch.setenv(BUSY_TIMEOUT_ENV, bad)
        with pytest.raises(UserError, match=f"{BUSY_TIMEOUT_ENV}='{bad}': give seconds from 0 to 3600"):
            busy_timeout_s()


def test_submit_from_the_command_line_on_a_migrated_database(migrated, tmp_path):
    result = run_cli("submit", "--gpu-ids", "3", "--", "true", module="scheduler",
                     env={"SAE_DIST_AUTOSTART": "0"})
    assert result.returncode == 0 and result.stdout == "Submitted batch job 1\n", result.stderr
    assert get_job(migrated, 1).gpu_ids_json == '["virtual-3"]'
    listed = run_cli("queue", module="scheduler")  # a pending job, and no daemon to start it: said
    assert listed.returncode == 0 and listed.stdout.splitlines()[1].split()[3] == "PD", listed.stdout
    assert "note: no scheduler daemon runs for " in listed.stderr and "pending jobs wait" in listed.stderr
    bad = run_cli("submit", "--", "true", module="scheduler", env={BUSY_TIMEOUT_ENV: "soon"})
    assert (bad.returncode, bad.stderr.count("\n")) == (2, 1), bad.stderr
    assert f"error: {BUSY_TIMEOUT_ENV}='soon'" in bad.stderr


# ---- the small defects: each is one line, never a traceback ----

def _main(capsys, *args: str) -> tuple[int, str, str]:
    from scheduler.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_a_job_id_beyond_the_largest_integer_is_one_line(migrated, capsys):
    huge = str(2**63)
    for command in ("cancel", "hold", "release", "requeue", "export-sbatch"):
        code, _, err = _main(capsys, command, huge)
        assert code == 2 and err.count("\n") == 1, err
        assert f"no job {huge}: job ids go up to {2**63 - 1}" in err
    result = run_cli("cancel", "99999999999999999999", module="scheduler")
    assert (result.returncode, result.stderr.count("\n")) == (2, 1), result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_flag_value_is_one_line_not_the_usage_block():
    result = run_cli("submit", "--gpus", "abc", "--", "true", module="scheduler")
    assert result.returncode == 2
    assert result.stderr == ("python -m scheduler submit: error: argument -G/--gpus: 'abc' is not a whole number "
                             "(see --help)\n")


def test_a_time_limit_beyond_a_year_is_refused():
    from scheduler.spec import MAX_TIME_LIMIT_S, parse_time_limit

    assert parse_time_limit("365-00:00:00") == MAX_TIME_LIMIT_S
    for text in ("99999999999999999999", "365-00:00:01", "525601"):
        with pytest.raises(UserError, match=f"--time: '{text}' is more than the longest limit, 365 days"):
            parse_time_limit(text)
    with pytest.raises(UserError, match="--time: 1e\\+20 is more than the longest limit"):
        JobSpec(argv=["true"], time_limit_s=1e20, workdir="/")


def test_acct_filters_in_the_database_and_refuses_an_empty_list(migrated, tmp_path, capsys):
    import json

    ids = [submit(migrated, new_job(JobSpec(argv=["true"], workdir=str(tmp_path)), [(0, UUIDS[0])]))
           for _ in range(3)]
    code, out, _ = _main(capsys, "acct", "--json", "-j", f"{ids[2]},{ids[0]},{ids[2] + 100}")
    assert code == 0 and [r["job_id"] for r in json.loads(out)] == [ids[0], ids[2]]  # no such job: no row
    code, out, err = _main(capsys, "acct", "-j", f"{ids[0]},{2**64}")  # no job can have it: as cancel says
    assert (code, out) == (2, "") and err == f"error: --jobs: no job {2**64}: job ids go up to {2**63 - 1}\n"
    code, out, err = _main(capsys, "acct", "-j", "")
    assert (code, out) == (2, "") and err == ("error: --jobs: '' is not a list of job ids; "
                                              "write e.g. 3,5 or 12_7 (task 7 of array 12)\n")


def test_queue_into_a_reader_that_went_away_exits_quietly(migrated):
    import os
    import subprocess
    import sys

    from conftest import REPO

    read_end, write_end = os.pipe()
    os.close(read_end)  # `queue | head -0`: the reader is gone before the first line
    try:
        result = subprocess.run([sys.executable, "-m", "scheduler", "queue", "--all"], cwd=REPO, stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert (result.returncode, result.stderr) == (141, "")  # as a coreutil killed by SIGPIPE


def test_info_reads_what_the_regular_path_reads(migrated, tmp_path):
    """`info` without SQLAlchemy (scheduler.device_view) sees the devices, their states, the
    allocations, a fault and the fresh samples exactly as scheduler.status does."""
    import subprocess
    import time

    from sqlalchemy import insert

    from sae_dist.db import GpuSample, record_fault
    from scheduler import device_view, procs, status
    from scheduler.store import record_process, start_jobs

    job_id = submit(migrated, new_job(JobSpec(argv=["sleep", "30"], workdir=str(tmp_path)), [(0, UUIDS[0])]))
    start_jobs(migrated, [(job_id, ("virtual-1",))], {})
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        record_process(migrated, job_id, pid=sleeper.pid, pgid=sleeper.pid,
                       proc_start_ticks=procs.start_ticks(sleeper.pid))
        record_fault(migrated, "virtual-0", "CUDA error: an illegal memory access", job_id=job_id, rank=0)
        now = time.time()
        with migrated.begin() as conn:
            conn.execute(insert(GpuSample.__table__), [
                {"device_uuid": u, "time": utcnow() - timedelta(seconds=age), "utilization_pct": pct}
                for u, age, pct in (("virtual-1", 3, 10.0), ("virtual-1", 1, 40.0), ("virtual-0", 60, 5.0))])
        plain, regular = device_view.devices_now(now), status.devices_now(migrated, now)
        assert plain[1] == regular[1] and plain[2] == regular[2] == {"virtual-1": job_id}
        assert [d.uuid for d in plain[0]] == [d.uuid for d in regular[0]]
        assert [d.fault for d in plain[0]] == [d.fault for d in regular[0]] and plain[0][0].fault is not None
        assert plain[1]["virtual-1"].state == "allocated" and plain[1]["virtual-0"].state == "unavailable"
        fresh = device_view.latest_samples(now)
        assert fresh.keys() == status.latest_samples(migrated, now).keys() == {"virtual-1"}
        assert fresh["virtual-1"]["utilization_pct"] == 40.0  # the newest
        assert fresh["virtual-1"]["time"] == status.latest_samples(migrated, now)["virtual-1"]["time"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_array_is_stored_alike_by_both_paths(migrated, tmp_path):
    from scheduler.arrays import parse_array
    from scheduler.submit import submit_spec

    spec = dict(kind="command", argv=["python", "run.py"], name="sweep", workdir=str(tmp_path), stdout="%A_%a.out")
    now = datetime(2026, 11, 24, 10, 0, tzinfo=UTC)
    lean = quick_submit.submit_quick(JobSpec(**spec), now=now, array=parse_array("0-8:4%2"))
    regular = submit_spec(migrated, JobSpec(**spec), array=parse_array("0-8:4%2"))
    assert regular == lean + 3
    for first in (lean, regular):
        tasks = [get_job(migrated, first + i) for i in range(3)]
        assert [(t.array_job_id, t.array_task_id, t.array_max_running) for t in tasks] == \
            [(first, 0, 2), (first, 4, 2), (first, 8, 2)]
    same = {"id", "submitted_at", "array_job_id"}
    assert [{k: v for k, v in get_job(migrated, lean + i).model_dump().items() if k not in same} for i in range(3)] == \
        [{k: v for k, v in get_job(migrated, regular + i).model_dump().items() if k not in same} for i in range(3)]
