"""The state database on PostgreSQL (SAE_DIST_DB_URL=postgresql+psycopg://...), for real: a
throwaway server on loopback (tests/postgres_server.py), the same migrations, the trainer, the
scheduler and the app on it."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from sqlalchemy import inspect, select, text

from conftest import run_cli, start_daemon, stop_process, wait_for
from sae_dist.db import HEAD_REVISION, GpuSample, get_engine, immediate_transaction, metadata, utcnow
from sae_dist.db.engine import alembic_config

pytestmark = pytest.mark.slow  # a PostgreSQL server (started once per session) in every test


def test_the_migrations_make_the_models_on_postgres(postgres_url):
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    engine = get_engine(postgres_url)
    assert engine.dialect.name == "postgresql"
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar() == HEAD_REVISION
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, metadata) == []
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), "base")
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    with engine.begin() as conn:
        command.upgrade(alembic_config(conn), "head")
    # The per-minute totals are kept by PostgreSQL's own trigger.
    now = utcnow().replace(second=10)
    with engine.begin() as conn:
        conn.execute(GpuSample.__table__.insert(), [
            {"device_uuid": "virtual-0", "time": now, "utilization_pct": 40.0, "memory_used": 100},
            {"device_uuid": "virtual-0", "time": now + timedelta(seconds=1), "utilization_pct": None,
             "memory_used": 300}])
        row = conn.execute(text("SELECT samples, utilization_sum, utilization_n, memory_used_sum "
                                "FROM gpu_minutes")).one()
    assert tuple(row) == (2, 40.0, 1, 400)


def test_immediate_transactions_take_turns_on_postgres(postgres_url):
    engine = get_engine(postgres_url)
    order: list[str] = []
    first_holds = threading.Event()

    def first():
        with immediate_transaction(engine):
            first_holds.set()
            time.sleep(0.5)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    first_holds.wait(10)
    with immediate_transaction(engine):
        order.append("second in")
    thread.join()
    assert order == ["first done", "second in"]


def test_a_two_rank_training_records_into_postgres(postgres_url, tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--d-in", "32", "--d-sae", "128", "--k", "8", "--steps", "6", "--log-every", "2",
                     "--devices", "cpu:2", "--batch-size", "64", "--out-dir", str(run_dir), "--name", "on-pg")
    assert result.returncode == 0, result.stderr[-3000:]
    from sae_dist.db import rank_stats, step_metrics
    from sae_dist.db.runs import find_run_by_dir

    engine = get_engine(postgres_url)
    run = find_run_by_dir(engine, str(run_dir.resolve()))
    assert run is not None and run.status == "COMPLETED" and run.name == "on-pg" and run.world_size == 2
    assert [m.step for m in step_metrics(engine, run.id)] == [2, 4, 6]
    assert len(rank_stats(engine, run.id)) == 6
    assert (run_dir / "sae" / "cfg.json").is_file()


def test_the_scheduler_and_the_app_on_postgres(postgres_url, state_home, monkeypatch):
    monkeypatch.setenv("SAE_DIST_VIRTUAL_GPUS", "2")
    monkeypatch.setenv("SAE_DIST_AUTOSTART", "0")
    submitted = run_cli("submit", "-G", "2", "--json", "--", "python", "-c", "print('hello from pg')",
                        module="scheduler")
    assert submitted.returncode == 0, submitted.stderr
    job_id = json.loads(submitted.stdout)["job_id"]
    state_home.mkdir(parents=True, exist_ok=True)
    daemon = start_daemon(state_home / "daemon.log")
    try:
        from scheduler.store import get_job

        engine = get_engine(postgres_url)
        wait_for(lambda: get_job(engine, job_id).state == "COMPLETED", 90, "the job to complete")
        job = get_job(engine, job_id)
        assert json.loads(job.devices_json) == ["virtual-0", "virtual-1"] and job.exit_code == 0
        info = run_cli("info", "--json", module="scheduler")
        assert info.returncode == 0 and len(json.loads(info.stdout)) == 2, info.stderr
        acct = run_cli("acct", module="scheduler")
        assert acct.returncode == 0 and str(job_id) in acct.stdout
        def sampled():
            with engine.connect() as conn:
                return conn.execute(select(GpuSample.id).limit(1)).first()

        wait_for(sampled, 30, "device samples")
    finally:
        stop_process(daemon)

    from streamlit.testing.v1 import AppTest

    from conftest import REPO

    at = AppTest.from_file(str(REPO / "app.py"), default_timeout=60).run()
    assert not at.exception, at.exception
