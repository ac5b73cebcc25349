"""The scheduler's cost follows changes, not the queue's length: pure decisions on plain data."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.daemon import Seen, plan_due
from scheduler.policy import DEPENDENCY, DEPENDENCY_NEVER, DeviceView, JobView, plan
from scheduler.supervisor import took_effect


def devices(n: int = 4, busy: tuple[int, ...] = ()) -> list[DeviceView]:
    return [DeviceView(uuid=f"d{i}", index=i, free=i not in busy) for i in range(n)]


def test_a_dependency_on_a_job_left_out_of_the_plan_waits():
    """The daemon plans only schedulable jobs (held ones are left out); a job that waits on a held
    one is told it waits, not that its dependency can never be satisfied."""
    waiter = JobView(id=2, dependencies=(("afterok", 1),))
    assert plan([waiter], [], devices(), {}, 0.0).reasons == {2: DEPENDENCY_NEVER}
    assert plan([waiter], [], devices(), {}, 0.0, live_ids={1}).reasons == {2: DEPENDENCY}


def random_queue(rng: random.Random, n: int, unique: bool) -> list[JobView]:
    """Pending jobs of a few shapes; with `unique`, each gets a memory request no device checks
    (free memory unknown passes any), so no two share a shape but every decision is the same."""
    jobs = []
    for i in range(n):
        gpus = rng.choice([1, 1, 2, 3, 5])
        jobs.append(JobView(
            id=100 + i, priority=rng.choice([0, 0, 1]), submitted_at=float(i), gpus=gpus,
            gpu_ids=("d0",) if gpus == 1 and rng.random() < 0.2 else None,
            time_limit_s=rng.choice([None, 30.0, 600.0]), exclusive=rng.random() < 0.05,
            mem_per_gpu=(i + 1) if unique else None,
            dependencies=(("afterok", 1),) if rng.random() < 0.2 else ()))
    return jobs


def test_alike_jobs_sharing_a_fate_decide_as_each_one_alone_would():
    """The plan skips the device search for a job shaped like one that just failed to start; over
    random queues it decides exactly as when every job is searched for (no two alike)."""
    for seed in range(40):
        rng = random.Random(seed)
        running = [JobView(id=1, gpus=1, started_at=0.0, devices=("d0",), time_limit_s=rng.choice([None, 100.0])),
                   JobView(id=2, gpus=1, started_at=0.0, devices=("d1",), time_limit_s=50.0)]
        devs = devices(4, busy=(0, 1))
        shared = plan(random_queue(random.Random(seed), 150, False), running, devs, {}, 10.0)
        alone = plan(random_queue(random.Random(seed), 150, True), running, devs, {}, 10.0)
        assert shared.starts == alone.starts, seed
        assert shared.reasons == alone.reasons, seed
        assert (shared.reservation and shared.reservation.job_id) == (alone.reservation and alone.reservation.job_id)


def seen(**kw) -> Seen:
    base = dict(queue_version=7, reaped=False, devices=(("d0", True, False),), poked=False, now=100.0)
    return Seen(**{**base, **kw})


def test_a_pass_plans_only_when_something_changed():
    last = seen()
    assert plan_due(None, seen(), math.inf, 10.0)  # a new daemon plans once
    assert not plan_due(last, seen(now=105.0), math.inf, 10.0)  # idle: nothing read of the queue
    assert plan_due(last, seen(queue_version=8), math.inf, 10.0)  # a submit, end, hold, release...
    assert plan_due(last, seen(poked=True), math.inf, 10.0)
    assert plan_due(last, seen(reaped=True), math.inf, 10.0)
    assert plan_due(last, seen(devices=(("d0", False, False),)), math.inf, 10.0)
    assert plan_due(last, seen(now=104.0), 103.0, 10.0)  # a pending job's begin time came
    assert not plan_due(last, seen(now=102.0), 103.0, 10.0)
    assert plan_due(last, seen(now=110.0), math.inf, 10.0)  # the periodic full plan


def test_a_cancel_decides_only_when_it_reached_a_running_job():
    """SLURM: a job that had exited when the cancel came keeps its own outcome (exit 0 is
    COMPLETED); one the cancel's signal reached is CANCELLED whatever its exit code."""
    assert took_effect(True, ended_first=False)
    assert not took_effect(True, ended_first=True)
    assert not took_effect(False, ended_first=False)


def changes_follow_every_writer(engine) -> None:
    """A submit, a hold and an end each leave a change row; a reason written alone does not."""
    from sqlalchemy import text

    from scheduler.store import NewJob, changed_jobs, last_change, submit

    with engine.connect() as conn:
        before = last_change(conn)
    job_id = submit(engine, NewJob(name="x", kind="command", argv=["true"], gpus=1, workdir="/"))
    with engine.connect() as conn:
        seq, ids = changed_jobs(conn, before)
    assert ids == {job_id} and seq > before
    with engine.begin() as conn:  # a writer outside scheduler.store, in plain SQL
        conn.execute(text("UPDATE jobs SET reason = 'Priority' WHERE id = :i"), {"i": job_id})
    with engine.connect() as conn:
        assert changed_jobs(conn, seq) == (seq, set())
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET held = :h WHERE id = :i"), {"h": True, "i": job_id})
        conn.execute(text("UPDATE jobs SET state = 'CANCELLED' WHERE id = :i"), {"i": job_id})
    with engine.connect() as conn:
        later, ids = changed_jobs(conn, seq)
    assert ids == {job_id} and later >= seq + 2


def test_job_changes_follow_every_writer_on_sqlite(state_home):
    from sae_dist.db import get_engine

    changes_follow_every_writer(get_engine())


@pytest.mark.slow
def test_job_changes_follow_every_writer_on_postgres(postgres_url):
    from sae_dist.db import get_engine

    changes_follow_every_writer(get_engine(postgres_url))


def test_two_state_directories_hand_out_different_rendezvous_ports(state_home):
    """Two state directories on one machine (two users, two test workers) each searched from
    29600: both handed it out before either job listened on it, and one torchrun job failed."""
    from scheduler.store import PORT_RANGE, _free_port, port_search_start

    alice, bob = port_search_start("/srv/alice/.sae_dist"), port_search_start("/srv/bob/.sae_dist")
    assert alice != bob and {alice, bob} <= set(range(len(PORT_RANGE)))
    assert port_search_start("/srv/alice/.sae_dist") == alice  # stable: the same place every time
    first = _free_port(set())
    assert first in PORT_RANGE and _free_port({first}) != first  # a port a running job holds is skipped
