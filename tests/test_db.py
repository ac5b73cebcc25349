"""The state database on real SQLite files: connection setup, migrations, runs, metrics writer."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy import delete, event, func, insert, inspect, select
from sqlalchemy.exc import OperationalError, StatementError

from sae_dist.db import (
    HEAD_REVISION,
    DatabaseMetricsLogger,
    StepMetric,
    TrainingRun,
    create_run,
    delete_metrics_after,
    filesystem_type,
    find_run_by_dir,
    get_engine,
    get_run,
    immediate_transaction,
    metadata,
    rank_stats,
    step_metrics,
    update_run,
    utcnow,
    write_session,
)
from sae_dist.db.engine import alembic_config

RUN = dict(
    name="topk-test",
    architecture="topk",
    config_json="{}",
    world_size=2,
    backend="gloo",
    device_ids='["virtual:0", "virtual:1"]',
    host="testhost",
    run_dir="/runs/a",
    total_steps=100,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SAE_DIST_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SAE_DIST_DB_URL", raising=False)
    return tmp_path / "home"


@pytest.fixture
def engine(home: Path):
    engine = get_engine()
    yield engine
    engine.dispose()


@pytest.fixture
def run_id(engine) -> int:
    return create_run(engine, **RUN)


def count(engine, model) -> int:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).select_from(model))


def rank_rows(step: int, world_size: int = 2) -> list[dict]:
    return [
        {"rank": r, "device": f"virtual:{r}", "step_time_s": 0.1, "compute_time_s": 0.08}
        for r in range(world_size)
    ]


# --- connections -----------------------------------------------------------------------------


def test_every_connection_has_the_pragmas(engine, home: Path):
    assert engine.url.database == str(home / "state.db")
    assert get_engine() is engine
    engine.dispose()  # the connections below are new ones
    with engine.connect() as first, engine.connect() as second:
        for conn in (first, second):
            pragma = lambda name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()  # noqa: E731
            assert pragma("journal_mode") == "wal"
            assert pragma("busy_timeout") == 30000
            assert pragma("synchronous") == 1  # NORMAL
            assert pragma("foreign_keys") == 1


def test_immediate_transaction_takes_the_write_lock_at_once(engine, home: Path):
    other = sqlite3.connect(home / "state.db", timeout=0.1, isolation_level=None)
    with immediate_transaction(engine) as conn:
        conn.exec_driver_sql("SELECT 1")  # no write yet: BEGIN IMMEDIATE alone holds the lock
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("BEGIN IMMEDIATE")
    other.execute("BEGIN IMMEDIATE")
    other.execute("ROLLBACK")
    other.close()


def test_a_read_then_write_session_is_not_undone_by_a_write_between(engine, home: Path, run_id: int):
    """Another process commits between a session's read and its write: a plain session's write
    then fails at once (SQLite cannot move a WAL snapshot forward; the busy timeout does not
    apply), which is what failed a benchmark beside a busy app. write_session holds the lock from
    its start, so the other writer waits for it instead, and both writes land."""
    from sqlmodel import Session

    other = sqlite3.connect(home / "state.db", timeout=0.1, isolation_level=None)
    rename = lambda name: other.execute("UPDATE training_runs SET name = ? WHERE id = ?", (name, run_id))  # noqa: E731
    with Session(engine) as s:
        run = s.get(TrainingRun, run_id)
        rename("from-another-process")
        run.status = "COMPLETED"
        with pytest.raises(OperationalError, match="database is locked"):
            s.commit()
    with write_session(engine) as s:
        run = s.get(TrainingRun, run_id)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            rename("too-early")  # waits its 0.1 s for our lock, then gives up
        run.status = "COMPLETED"
        s.commit()
    rename("after")
    other.close()
    stored = get_run(engine, run_id)
    assert (stored.status, stored.name) == ("COMPLETED", "after")


@pytest.mark.slow
def test_importing_the_package_does_not_import_alembic():
    code = "import sys, sae_dist.db; assert not {'alembic', 'torch'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nfs_detection_on_proc_mounts_text():
    mounts = "\n".join(
        [
            "sysfs /sys sysfs rw,nosuid 0 0",
            "/dev/sda1 / ext4 rw,relatime 0 0",
            "server:/export/home /home nfs4 rw,vers=4.2,addr=10.0.0.2 0 0",
            "/dev/sdb1 /home/local ext4 rw 0 0",
            r"server:/x /mnt/with\040space nfs rw 0 0",
        ]
    )
    assert filesystem_type("/home/alice/.sae_dist", mounts) == "nfs4"
    assert filesystem_type("/home", mounts) == "nfs4"
    assert filesystem_type("/home/local/state", mounts) == "ext4"
    assert filesystem_type("/homework/x", mounts) == "ext4"  # a name prefix is not a mount
    assert filesystem_type("/mnt/with space/db", mounts) == "nfs"
    assert filesystem_type("/tmp", mounts) == "ext4"
    assert filesystem_type("/tmp", "") is None


# --- migrations ------------------------------------------------------------------------------


def test_first_use_migrates_and_models_match_migrations(engine):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    tables = set(inspect(engine).get_table_names())
    assert {"alembic_version", "training_runs", "step_metrics", "rank_stats"} <= tables
    with engine.connect() as conn:
        version = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
        assert version == HEAD_REVISION
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, metadata) == []


def test_head_revision_constant_is_alembic_head():
    from alembic.script import ScriptDirectory

    assert ScriptDirectory.from_config(alembic_config()).get_heads() == [HEAD_REVISION]


def test_downgrade_and_upgrade_again(engine):
    from alembic import command

    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "base")
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "head")
    assert "step_metrics" in inspect(engine).get_table_names()


@pytest.mark.slow
def test_two_processes_migrate_a_new_database_at_once(home: Path):
    code = (
        "from sae_dist.db import get_engine, create_run, get_run\n"
        "e = get_engine()\n"
        f"assert get_run(e, create_run(e, **{RUN!r})) is not None\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
    assert count(get_engine(), TrainingRun) == 2


# --- runs ------------------------------------------------------------------------------------


def test_naive_datetime_refused_aware_returned(engine):
    naive = datetime(2024, 1, 1, 12)
    with pytest.raises(ValueError, match="naive"):
        create_run(engine, **RUN, started_at=naive)
    # The column type itself refuses too, for writes that bypass the helpers.
    with pytest.raises(StatementError, match="naive"), engine.begin() as conn:
        conn.execute(insert(TrainingRun).values(**RUN, created_at=naive, started_at=naive))

    plus_two = timezone(timedelta(hours=2))
    run_id = create_run(engine, **RUN, started_at=datetime(2024, 1, 1, 12, tzinfo=plus_two))
    run = get_run(engine, run_id)
    assert run.started_at == datetime(2024, 1, 1, 10, tzinfo=timezone.utc)
    assert run.started_at.utcoffset() == timedelta(0)
    assert run.created_at.tzinfo is not None
    assert run.status == "RUNNING" and run.last_step == 0 and run.finished_at is None


def test_run_helpers(engine, run_id: int):
    later = create_run(engine, **RUN)
    assert find_run_by_dir(engine, "/runs/a").id == later
    assert find_run_by_dir(engine, "/runs/none") is None
    update_run(engine, run_id, status="COMPLETED", finished_at=utcnow(), final_fvu=0.1)
    run = get_run(engine, run_id)
    assert (run.status, run.final_fvu) == ("COMPLETED", 0.1) and run.finished_at.tzinfo
    assert get_run(engine, 999) is None
    with pytest.raises(ValueError, match="no_such_column"):
        update_run(engine, run_id, no_such_column=1)
    with pytest.raises(LookupError):
        update_run(engine, 999, status="FAILED")


def test_deleting_a_run_cascades_to_its_metrics(engine, run_id: int):
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as logger:
        for step in range(3):
            logger.log({"loss": 1.0, "samples_seen": step}, step)
            logger.log_rank_stats(step, rank_rows(step))
    assert (count(engine, StepMetric), len(rank_stats(engine, run_id))) == (3, 6)
    with engine.begin() as conn:
        conn.execute(delete(TrainingRun).where(TrainingRun.id == run_id))
    assert count(engine, StepMetric) == 0
    assert rank_stats(engine, run_id) == []


def test_delete_metrics_after_a_step(engine, run_id: int):
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as logger:
        for step in range(10):
            logger.log({"loss": 1.0, "samples_seen": step * 8}, step)
            logger.log_rank_stats(step, rank_rows(step))
    delete_metrics_after(engine, run_id, 4)
    assert [m.step for m in step_metrics(engine, run_id)] == [0, 1, 2, 3, 4]
    assert sorted({r.step for r in rank_stats(engine, run_id)}) == [0, 1, 2, 3, 4]


# --- metrics writer --------------------------------------------------------------------------


def test_writer_writes_in_batches_and_everything_by_close(engine, run_id: int):
    commits = []
    on_commit = commits.append  # one bound method, so that event.remove finds it
    event.listen(engine, "commit", on_commit)
    logger = DatabaseMetricsLogger(engine, run_id, flush_interval=0.05, max_batch=16)
    for step in range(100):
        logger.log({"loss": 1 / (step + 1), "samples_seen": step * 64, "l0": 32}, step)
    logger.log_rank_stats(99, rank_rows(99))
    logger.update_run(last_step=99, status="COMPLETED", finished_at=utcnow())
    logger.close()
    logger.close()  # idempotent
    event.remove(engine, "commit", on_commit)

    assert 7 <= len(commits) < 50  # 103 rows, at most 16 a transaction, not one each
    metrics = step_metrics(engine, run_id)
    assert [m.step for m in metrics] == list(range(100))
    assert metrics[3].loss == 0.25 and metrics[3].samples_seen == 192 and metrics[3].l0 == 32
    assert metrics[0].time.tzinfo is not None and metrics[0].grad_norm is None
    assert [(r.step, r.rank) for r in rank_stats(engine, run_id)] == [(99, 0), (99, 1)]
    run = get_run(engine, run_id)
    assert (run.last_step, run.status) == (99, "COMPLETED")
    with pytest.raises(RuntimeError, match="closed"):
        logger.log({"loss": 1.0, "samples_seen": 0}, 100)


def test_writer_refuses_bad_rows_at_once(engine, run_id: int):
    with DatabaseMetricsLogger(engine, run_id) as logger:
        with pytest.raises(ValueError, match="lossy"):
            logger.log({"lossy": 1.0, "samples_seen": 0}, 0)
        with pytest.raises(ValueError, match="samples_seen"):
            logger.log({"loss": 1.0}, 0)
        with pytest.raises(ValueError, match="naive"):
            logger.log({"samples_seen": 0, "time": datetime(2024, 1, 1)}, 0)
        with pytest.raises(ValueError, match="gpu"):
            logger.log_rank_stats(0, [{**rank_rows(0)[0], "gpu": 0}])
        with pytest.raises(ValueError, match="bogus"):
            logger.update_run(bogus=1)


def test_writer_logs_again_a_step_replaces_it(engine, run_id: int):
    with DatabaseMetricsLogger(engine, run_id, flush_interval=0.01) as logger:
        logger.log({"loss": float("nan"), "samples_seen": 8}, 1)  # a diverged step: NULL
        logger.log({"loss": 2.0, "samples_seen": 8}, 1)
    assert [(m.step, m.loss) for m in step_metrics(engine, run_id)] == [(1, 2.0)]


@pytest.mark.slow
def test_log_does_not_block_while_the_database_is_locked(engine, run_id: int):
    logger = DatabaseMetricsLogger(engine, run_id, flush_interval=0.05)
    with immediate_transaction(engine):  # another writer holds the lock for 2 s
        start = time.monotonic()
        for step in range(50):
            logger.log({"loss": 1.0, "samples_seen": step}, step)
        elapsed = time.monotonic() - start
        time.sleep(0.5)
        assert count(engine, StepMetric) == 0  # the writer waits on the lock, not log()
        time.sleep(1.5)
    assert elapsed < 0.5
    deadline = time.monotonic() + 10
    while count(engine, StepMetric) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count(engine, StepMetric) == 50  # landed after the release, before close()
    logger.close()


def test_writer_drops_the_oldest_rows_beyond_its_bound(engine, run_id: int, caplog):
    logger = DatabaseMetricsLogger(engine, run_id, flush_interval=0.02, max_pending=10)
    with caplog.at_level(logging.WARNING, logger="sae_dist.db.writer"):
        with immediate_transaction(engine):
            logger.log({"samples_seen": 0}, 0)
            time.sleep(0.2)  # the writer takes step 0 and waits on the lock
            for step in range(1, 31):
                logger.log({"samples_seen": step}, step)
        logger.close()
    steps = {m.step for m in step_metrics(engine, run_id)}
    assert set(range(21, 31)) <= steps and len(steps) <= 11  # the newest 10 kept
    assert "dropped" in caplog.text
