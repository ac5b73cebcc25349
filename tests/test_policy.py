"""The scheduling policy on plain data: order, device choice, eligibility, EASY backfill and
exclusive jobs."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from sae_dist.db.schema import (
    BEGIN_TIME,
    DEPENDENCY,
    DEPENDENCY_NEVER,
    HELD,
    PENDING_REASONS,
    PRIORITY,
    RESOURCES,
)
from scheduler.policy import (
    DeviceView,
    JobView,
    Plan,
    Reservation,
    blocking_reason,
    dependency_status,
    ends_before,
    exclusive_job_runs,
    exclusive_pick,
    exclusive_shadow_time,
    order_key,
    pick_devices,
    plan,
    req_node_not_avail,
    shadow_time,
    waits_for_jobs,
)

GiB = 1 << 30


def dev(i: int, free: bool = True, mem: int | None = None) -> DeviceView:
    return DeviceView(uuid=f"GPU-{i}", index=i, free=free, free_memory=mem)


def job(id: int, **kw) -> JobView:
    kw.setdefault("submitted_at", float(id))
    return JobView(id=id, **kw)


def running(id: int, devices: tuple[int, ...], started_at: float = 0.0, limit: float | None = None,
            **kw) -> JobView:
    kw.setdefault("gpus", len(devices))
    return JobView(id=id, devices=tuple(f"GPU-{i}" for i in devices), started_at=started_at,
                   time_limit_s=limit, **kw)


def uuids(*indices: int) -> tuple[str, ...]:
    return tuple(f"GPU-{i}" for i in indices)


def run(pending, devices, running_jobs=(), finished=None, now: float = 10.0) -> Plan:
    return plan(list(pending), list(running_jobs), list(devices), dict(finished or {}), now)


# --- order ---------------------------------------------------------------------------------

def test_priority_then_submission_then_id():
    pending = [job(1, priority=0), job(2, priority=5, submitted_at=3.0), job(3, priority=5, submitted_at=2.0),
               job(4, priority=0, submitted_at=1.0)]
    p = run(pending, [dev(0), dev(1), dev(2)])
    assert [j for j, _ in p.starts] == [3, 2, 1]  # job 4 ties job 1 on time, loses on id
    assert p.reasons == {4: RESOURCES}


def test_order_key_ties_broken_by_id():
    a, b = job(7, submitted_at=1.0), job(3, submitted_at=1.0)
    assert sorted([a, b], key=order_key) == [b, a]


def test_higher_priority_waits_and_lower_blocked_by_reservation_gets_priority():
    # Only one device free; the 2-GPU high-priority job is the head, the 1-GPU job behind it
    # would fit but has no time limit, so it must not take the head's devices.
    p = run([job(1, priority=9, gpus=2), job(2, gpus=1)], [dev(0), dev(1, free=False)],
            running_jobs=[running(50, (1,), limit=100)])
    assert p.starts == []
    assert p.reasons == {1: RESOURCES, 2: PRIORITY}


# --- device choice -------------------------------------------------------------------------

def test_exact_gpu_ids_wait_for_exactly_those():
    devices = [dev(0, free=False), dev(1), dev(2)]
    p = run([job(1, gpus=1, gpu_ids=uuids(0))], devices, running_jobs=[running(50, (0,), limit=100)])
    assert p.starts == [] and p.reasons == {1: RESOURCES}


def test_exact_gpu_ids_start_on_those_in_requested_order():
    p = run([job(1, gpus=2, gpu_ids=uuids(2, 1))], [dev(0), dev(1), dev(2)])
    assert p.starts == [(1, uuids(2, 1))]


def test_memory_filter():
    devices = [dev(0, mem=10 * GiB), dev(1, mem=30 * GiB)]
    assert pick_devices(job(1, mem_per_gpu=20 * GiB), devices) == uuids(1)
    assert pick_devices(job(1, gpus=2, mem_per_gpu=20 * GiB), devices) is None
    assert pick_devices(job(1, gpus=1, gpu_ids=uuids(0), mem_per_gpu=20 * GiB), devices) is None


def test_unknown_free_memory_passes():
    assert pick_devices(job(1, mem_per_gpu=80 * GiB), [dev(0, mem=None)]) == uuids(0)


def test_most_free_memory_first_ties_by_index_result_in_index_order():
    devices = [dev(0, mem=10 * GiB), dev(1, mem=40 * GiB), dev(2, mem=40 * GiB), dev(3, mem=20 * GiB)]
    assert pick_devices(job(1, gpus=1), devices) == uuids(1)
    assert pick_devices(job(1, gpus=3), devices) == uuids(1, 2, 3)


def test_pick_ignores_devices_not_free():
    assert pick_devices(job(1, gpus=1), [dev(0, free=False, mem=99 * GiB), dev(1, mem=GiB)]) == uuids(1)


def test_zero_gpu_job_starts_with_no_devices():
    assert run([job(1, gpus=0)], [dev(0, free=False)]).starts == [(1, ())]


def test_two_starts_in_one_plan_never_share_a_device():
    pending = [job(1, gpus=2), job(2, gpus=1), job(3, gpus=1, gpu_ids=uuids(0)), job(4, gpus=1)]
    p = run(pending, [dev(0), dev(1), dev(2), dev(3)])
    used = [u for _, us in p.starts for u in us]
    assert len(used) == len(set(used))
    assert [j for j, _ in p.starts] == [1, 2, 4]
    assert p.reasons == {3: RESOURCES}  # GPU-0 went to job 1


# --- eligibility ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,state,expected", [
    ("afterok", "COMPLETED", "ok"),
    ("afterok", "FAILED", "never"),
    ("afterok", "CANCELLED", "never"),
    ("afterany", "COMPLETED", "ok"),
    ("afterany", "TIMEOUT", "ok"),
    ("afternotok", "FAILED", "ok"),
    ("afternotok", "NODE_FAIL", "ok"),
    ("afternotok", "OUT_OF_MEMORY", "ok"),
    ("afternotok", "COMPLETED", "never"),
])
def test_dependency_on_finished_job(kind, state, expected):
    assert dependency_status(job(2, dependencies=((kind, 1),)), {1: state}, known_ids=[2]) == expected


@pytest.mark.parametrize("kind", ["afterok", "afterany", "afternotok"])
def test_dependency_on_live_job_waits_and_unknown_never(kind):
    j = job(2, dependencies=((kind, 1),))
    assert dependency_status(j, {}, known_ids=[1, 2]) == "wait"
    assert dependency_status(j, {}, known_ids=[2]) == "never"


def test_dependency_never_outranks_wait_and_all_must_hold():
    j = job(3, dependencies=(("afterany", 1), ("afterok", 2)))
    assert dependency_status(j, {2: "FAILED"}, known_ids=[1, 3]) == "never"
    assert dependency_status(j, {2: "COMPLETED"}, known_ids=[1, 3]) == "wait"
    assert dependency_status(j, {1: "FAILED", 2: "COMPLETED"}, known_ids=[3]) == "ok"


def test_dependency_on_itself_never_satisfied():
    assert dependency_status(job(1, dependencies=(("afterany", 1),)), {}, known_ids=[1]) == "never"


def test_dependency_reasons_in_plan():
    pending = [job(2, dependencies=(("afterok", 1),)),  # 1 still running
               job(3, dependencies=(("afterok", 9),)),  # 9 failed
               job(4, dependencies=(("afternotok", 9),)),
               job(5, dependencies=(("afterany", 404),))]  # no such job
    p = run(pending, [dev(0), dev(1)], running_jobs=[running(1, (), limit=None)], finished={9: "FAILED"})
    assert p.starts == [(4, uuids(0))]
    assert p.reasons == {2: DEPENDENCY, 3: DEPENDENCY_NEVER, 5: DEPENDENCY_NEVER}


def test_dependency_on_pending_job_waits():
    p = run([job(1, held=True), job(2, dependencies=(("afterany", 1),))], [dev(0)])
    assert p.reasons == {1: HELD, 2: DEPENDENCY}


def test_held_job_does_not_start_and_hold_outranks_other_reasons():
    assert run([job(1, held=True)], [dev(0)]).reasons == {1: HELD}
    j = job(1, held=True, begin_at=99.0, dependencies=(("afterok", 404),))
    assert blocking_reason(j, {}, [1], now=10.0) == HELD


def test_begin_time():
    assert run([job(1, begin_at=10.5)], [dev(0)], now=10.0).reasons == {1: BEGIN_TIME}
    assert run([job(1, begin_at=10.0)], [dev(0)], now=10.0).starts == [(1, uuids(0))]


def test_ineligible_jobs_do_not_become_the_head():
    # The held 2-GPU job would otherwise reserve both devices and block the no-limit job.
    p = run([job(1, priority=9, gpus=2, held=True), job(2, gpus=1)], [dev(0), dev(1, free=False)],
            running_jobs=[running(50, (1,), limit=100)])
    assert p.starts == [(2, uuids(0))] and p.reservation is None


# --- backfill ------------------------------------------------------------------------------

def _two_devices_one_busy_until_100():
    # GPU-1 busy until t=100; the 2-GPU head can start at 100 on both devices.
    return [dev(0), dev(1, free=False)], [running(50, (1,), started_at=0.0, limit=100.0)]


def test_backfill_starts_short_job_that_ends_before_shadow_time():
    devices, live = _two_devices_one_busy_until_100()
    p = run([job(1, gpus=2), job(2, time_limit_s=50.0)], devices, live, now=10.0)
    assert p.reservation == Reservation(1, 100.0, uuids(0, 1))
    assert p.starts == [(2, uuids(0))]
    assert p.reasons == {1: RESOURCES}


def test_backfill_boundary_ending_exactly_at_shadow_time_is_allowed():
    devices, live = _two_devices_one_busy_until_100()
    assert run([job(1, gpus=2), job(2, time_limit_s=90.0)], devices, live, now=10.0).starts == [(2, uuids(0))]


@pytest.mark.parametrize("limit", [90.5, None])
def test_backfill_refuses_job_that_would_delay_the_head(limit):
    devices, live = _two_devices_one_busy_until_100()
    p = run([job(1, gpus=2), job(2, time_limit_s=limit)], devices, live, now=10.0)
    assert p.starts == [] and p.reasons == {1: RESOURCES, 2: PRIORITY}


def test_job_behind_head_that_does_not_fit_at_all_gets_resources():
    devices, live = _two_devices_one_busy_until_100()
    p = run([job(1, gpus=2), job(2, gpus=2, time_limit_s=1.0)], devices, live, now=10.0)
    assert p.reasons == {1: RESOURCES, 2: RESOURCES}


def test_backfill_onto_unreserved_devices_even_without_time_limit():
    # GPU-0 and GPU-1 busy until 100; the 3-GPU head reserves 0, 1, 2; GPU-3 is left over.
    devices = [dev(0, free=False), dev(1, free=False), dev(2), dev(3)]
    live = [running(50, (0, 1), limit=100.0)]
    p = run([job(1, gpus=3), job(2, gpus=1), job(3, gpus=1)], devices, live, now=10.0)
    assert p.reservation == Reservation(1, 100.0, uuids(0, 1, 2))
    assert p.starts == [(2, uuids(3))]
    assert p.reasons == {1: RESOURCES, 3: PRIORITY}


def test_no_backfill_past_infinite_shadow_time_onto_reserved_devices():
    # The running job has no time limit: the head's shadow time is infinite.
    devices = [dev(0), dev(1, free=False)]
    p = run([job(1, gpus=2), job(2, gpus=1)], devices, [running(50, (1,), limit=None)])
    assert p.reservation == Reservation(1, math.inf, uuids(0, 1))
    assert p.starts == [] and p.reasons == {1: RESOURCES, 2: PRIORITY}


def test_time_limited_job_may_use_reserved_devices_when_shadow_time_is_infinite():
    devices = [dev(0), dev(1, free=False)]
    p = run([job(1, gpus=2), job(2, gpus=1, time_limit_s=60.0)], devices, [running(50, (1,), limit=None)])
    assert p.starts == [(2, uuids(0))]


def test_external_busy_device_comes_back_only_at_infinity():
    # GPU-1 is busy with someone else's process: no job of ours says when it frees up.
    r = shadow_time(job(1, gpus=2), [], [dev(0), dev(1, free=False)], now=10.0)
    assert r == Reservation(1, math.inf, uuids(0, 1))


def test_shadow_time_takes_earliest_release_that_suffices():
    devices = [dev(0), dev(1, free=False), dev(2, free=False), dev(3, free=False)]
    live = [running(50, (1,), limit=300.0), running(51, (2,), limit=100.0), running(52, (3,), limit=None)]
    assert shadow_time(job(1, gpus=2), live, devices, now=10.0) == Reservation(1, 100.0, uuids(0, 2))
    assert shadow_time(job(1, gpus=3), live, devices, now=10.0) == Reservation(1, 300.0, uuids(0, 1, 2))
    assert shadow_time(job(1, gpus=4), live, devices, now=10.0).start_at == math.inf
    assert shadow_time(job(1, gpus=1, gpu_ids=uuids(3)), live, devices, now=10.0).start_at == math.inf


def test_shadow_time_of_overdue_job_is_now():
    r = shadow_time(job(1, gpus=1), [running(50, (0,), started_at=0.0, limit=5.0)], [dev(0, free=False)], now=10.0)
    assert r == Reservation(1, 10.0, uuids(0))


def test_shadow_time_none_when_job_can_never_fit():
    assert shadow_time(job(1, gpus=3), [], [dev(0), dev(1)], now=0.0) is None
    assert shadow_time(job(1, gpus=1, gpu_ids=("GPU-nope",)), [], [dev(0)], now=0.0) is None
    assert shadow_time(job(1, mem_per_gpu=80 * GiB), [], [dev(0, mem=24 * GiB)], now=0.0) is None


def test_job_that_can_never_fit_does_not_block_others():
    p = run([job(1, gpus=5), job(2, gpus=1)], [dev(0), dev(1)])
    assert p.starts == [(2, uuids(0))] and p.reasons == {1: RESOURCES} and p.reservation is None


def test_jobs_started_earlier_in_the_plan_count_for_the_shadow_time():
    # Job 1 takes a device until t=30; head 2 needs all three, so its shadow time is 30.
    pending = [job(1, priority=9, gpus=1, time_limit_s=30.0), job(2, gpus=3),
               job(3, gpus=1, time_limit_s=20.0), job(4, gpus=1, time_limit_s=40.0)]
    p = run(pending, [dev(0), dev(1), dev(2)], now=0.0)
    assert p.reservation == Reservation(2, 30.0, uuids(0, 1, 2))
    assert [j for j, _ in p.starts] == [1, 3]
    assert p.reasons == {2: RESOURCES, 4: PRIORITY}


def test_only_one_reservation():
    # Head 1 reserves GPU-0 and GPU-1; job 2 also waits but reserves nothing, so job 3 may take
    # the devices job 2 would need.
    devices = [dev(0, free=False), dev(1, free=False), dev(2), dev(3)]
    pending = [job(1, gpus=2, gpu_ids=uuids(0, 1)), job(2, gpus=3), job(3, gpus=2)]
    p = run(pending, devices, [running(50, (0, 1), limit=100.0)])
    assert p.reservation.job_id == 1
    assert p.starts == [(3, uuids(2, 3))]
    assert p.reasons == {1: RESOURCES, 2: RESOURCES}


# --- exclusive jobs ------------------------------------------------------------------------

def test_exclusive_job_holds_every_device_and_uses_the_usual_choice():
    devices = [dev(0, mem=8 * GiB), dev(1, mem=40 * GiB), dev(2, mem=16 * GiB), dev(3, mem=40 * GiB)]
    p = run([job(1, gpus=2, exclusive=True)], devices)
    assert p.starts == [(1, uuids(1, 3))]  # the 2 it runs on: most free memory, as any job
    assert p.holds == {1: uuids(0, 1, 2, 3)}  # the whole machine
    assert p.reasons == {}


def test_exclusive_job_of_no_device_still_holds_the_machine():
    p = run([job(1, gpus=0, exclusive=True), job(2, gpus=1)], [dev(0), dev(1)])
    assert p.starts == [(1, ())] and p.holds == {1: uuids(0, 1)}
    assert p.reasons == {2: exclusive_job_runs(1)}


def test_exclusive_job_waits_for_running_jobs_even_with_enough_free_devices():
    # Three of four devices are free, enough for its 2, but job 50 runs: it waits for it to end.
    devices = [dev(0, free=False), dev(1), dev(2), dev(3)]
    p = run([job(1, gpus=2, exclusive=True)], devices, [running(50, (0,), limit=100.0)], now=10.0)
    assert p.starts == [] and p.holds == {}
    assert p.reasons == {1: "Resources, RunningJobs:50"} == {1: waits_for_jobs([50])}
    assert p.reservation == Reservation(1, 100.0, uuids(0, 1, 2, 3), exclusive=True)


def test_exclusive_job_waits_for_a_running_job_of_no_device():
    # Virtual devices share the CPU (and real GPUs the host): a CPU-only job in the way counts too.
    p = run([job(1, gpus=2, exclusive=True)], [dev(0), dev(1)], [running(50, (), limit=None)])
    assert p.starts == [] and p.reasons == {1: waits_for_jobs([50])}
    assert p.reservation == Reservation(1, math.inf, uuids(0, 1), exclusive=True)


def test_exclusive_job_waits_for_jobs_started_earlier_in_the_same_pass():
    p = run([job(1, gpus=1, time_limit_s=30.0), job(2, gpus=1, exclusive=True)], [dev(0), dev(1), dev(2)], now=0.0)
    assert p.starts == [(1, uuids(0))]
    assert p.reasons == {2: waits_for_jobs([1])}
    assert p.reservation == Reservation(2, 30.0, uuids(0, 1, 2), exclusive=True)


def test_running_exclusive_job_lets_nothing_start():
    # Job 50 holds all three devices (it runs on one of them); nothing starts beside it, not even
    # a job of no device, and the head's expected start is its end.
    devices = [dev(0, free=False), dev(1, free=False), dev(2, free=False)]
    live = [running(50, (0, 1, 2), limit=100.0, gpus=1, exclusive=True)]
    pending = [job(1, gpus=1), job(2, gpus=0), job(3, gpus=0, time_limit_s=1.0), job(4, gpus=2, exclusive=True)]
    p = run(pending, devices, live, now=10.0)
    assert p.starts == []
    assert p.reasons == {i: "Resources, ExclusiveJob:50" for i in (1, 2, 3, 4)}
    assert p.reservation == Reservation(1, 100.0, uuids(0))


def test_running_exclusive_job_blocks_even_devices_reported_free():
    # Whatever a device reading says, the machine is the exclusive job's until it ends.
    live = [running(50, (0,), limit=None, exclusive=True)]
    p = run([job(1, gpus=1, time_limit_s=5.0)], [dev(0, free=False), dev(1)], live)
    assert p.starts == [] and p.reasons == {1: exclusive_job_runs(50)}


def test_exclusive_first_in_order_starts_and_the_rest_wait_behind_it():
    p = run([job(1, gpus=1, exclusive=True), job(2, gpus=1), job(3, gpus=0)], [dev(0), dev(1)])
    assert p.starts == [(1, uuids(0))] and p.holds == {1: uuids(0, 1)}
    assert p.reasons == {2: exclusive_job_runs(1), 3: exclusive_job_runs(1)}


def test_backfill_respects_an_exclusive_reservation():
    # The exclusive head can start at 100, when job 50 ends. Behind it, only jobs whose time
    # limit ends them by then start, whether they need devices or not.
    devices = [dev(0, free=False), dev(1), dev(2)]
    live = [running(50, (0,), limit=100.0)]
    pending = [job(1, gpus=1, exclusive=True), job(2, gpus=1, time_limit_s=90.0), job(3, gpus=1),
               job(4, gpus=0), job(5, gpus=0, time_limit_s=50.0), job(6, gpus=1, time_limit_s=91.0),
               job(7, gpus=5, time_limit_s=1.0)]
    p = run(pending, devices, live, now=10.0)
    assert p.reservation == Reservation(1, 100.0, uuids(0, 1, 2), exclusive=True)
    assert p.starts == [(2, uuids(1)), (5, ())]
    assert p.reasons == {1: waits_for_jobs([50]), 3: PRIORITY, 4: PRIORITY, 6: PRIORITY, 7: RESOURCES}


def test_exclusive_job_behind_a_head_waits():
    # Head 1 (2 devices) waits for the externally busy GPU-1; the exclusive job behind it cannot
    # start either (GPU-1 is not free), and, not being the head, reserves nothing.
    devices = [dev(0), dev(1, free=False)]
    p = run([job(1, gpus=2), job(2, gpus=1, exclusive=True, time_limit_s=5.0)], devices)
    assert p.starts == [] and p.reasons == {1: RESOURCES, 2: RESOURCES}
    assert p.reservation == Reservation(1, math.inf, uuids(0, 1))


def test_exclusive_job_waits_for_externally_busy_devices():
    devices = [dev(0), dev(1, free=False)]  # GPU-1: someone else's process, not one of our jobs
    p = run([job(1, gpus=1, exclusive=True), job(2, gpus=1, time_limit_s=60.0), job(3, gpus=0)], devices)
    assert p.reservation == Reservation(1, math.inf, uuids(0, 1), exclusive=True)
    assert p.starts == [(2, uuids(0))]  # borrows: the head's estimate is "never"
    assert p.reasons == {1: RESOURCES, 3: PRIORITY}  # no time limit: it would never give it back


def test_exclusive_job_waits_for_unavailable_devices_and_holds_nobody_up():
    devices = [dev(0), replace(dev(1, free=False), unavailable=True), dev(2)]
    p = run([job(1, gpus=1, exclusive=True), job(2, gpus=1)], devices)
    assert p.reasons == {1: req_node_not_avail(["GPU-1"])}
    assert p.reservation is None and p.starts == [(2, uuids(0))]


def test_exclusive_job_that_can_never_fit_holds_nobody_up():
    p = run([job(1, gpus=1, exclusive=True, mem_per_gpu=80 * GiB), job(2, gpus=1)],
            [dev(0, mem=24 * GiB), dev(1, mem=24 * GiB)])
    assert p.reasons == {1: RESOURCES} and p.reservation is None
    assert p.starts == [(2, uuids(0))]


def test_exclusive_shadow_time_is_the_last_end_of_every_job():
    devices = [dev(0, free=False), dev(1, free=False), dev(2)]
    live = [running(50, (0,), limit=300.0), running(51, (1,), limit=100.0), running(52, (), limit=400.0)]
    r = exclusive_shadow_time(job(1, gpus=1, exclusive=True), live, devices, now=10.0)
    assert r == Reservation(1, 400.0, uuids(0, 1, 2), exclusive=True)
    assert exclusive_shadow_time(job(1, exclusive=True), [], [dev(0)], now=10.0).start_at == 10.0


# --- validation and determinism ------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    {"gpus": 2, "gpu_ids": ("GPU-0",)},
    {"gpus": 2, "gpu_ids": ("GPU-0", "GPU-0")},
    {"gpus": -1},
    {"time_limit_s": 0.0},
    {"dependencies": (("after", 1),)},
])
def test_bad_job_views_are_refused(kw):
    with pytest.raises(ValueError):
        job(1, **kw)


def test_plan_does_not_depend_on_input_order():
    devices, live = _two_devices_one_busy_until_100()
    pending = [job(i, gpus=1 + i % 2, priority=i % 3, time_limit_s=None if i % 4 else 30.0) for i in range(1, 9)]
    expected = run(pending, devices, live)
    rng = random.Random(0)
    for _ in range(5):
        rng.shuffle(pending)
        assert run(pending, list(reversed(devices)), live) == expected


# --- property-style: random queues ---------------------------------------------------------

def _random_case(rng: random.Random):
    n_dev = rng.randint(1, 6)
    devices, live, next_id = [], [], 1000
    for i in range(n_dev):
        devices.append(dev(i, free=rng.random() < 0.6, mem=rng.choice([None, 8 * GiB, 16 * GiB, 40 * GiB])))
    busy = [d.index for d in devices if not d.free]
    rng.shuffle(busy)
    while busy and rng.random() < 0.8:  # some busy devices are ours, the rest external
        take = tuple(busy[: rng.randint(1, len(busy))])
        busy = busy[len(take):]
        live.append(running(next_id, take, started_at=rng.uniform(0, 50),
                            limit=rng.choice([None, 10.0, 60.0, 200.0])))
        next_id += 1
    finished = {2000 + k: rng.choice(["COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"]) for k in range(3)}
    dep_pool = [j.id for j in live] + list(finished) + [1, 2, 3, 4, 9999]
    pending = []
    for jid in range(1, rng.randint(1, 12)):
        gpus = rng.randint(0, 4)
        gpu_ids = None
        if rng.random() < 0.2 and gpus <= n_dev:
            gpu_ids = tuple(f"GPU-{i}" for i in rng.sample(range(n_dev), gpus))
        deps = tuple((rng.choice(["afterok", "afterany", "afternotok"]), rng.choice(dep_pool))
                     for _ in range(rng.choice([0, 0, 0, 1, 2])))
        pending.append(job(jid, priority=rng.randint(0, 2), submitted_at=rng.uniform(0, 50), gpus=gpus,
                           gpu_ids=gpu_ids, mem_per_gpu=rng.choice([None, None, 10 * GiB, 30 * GiB]),
                           time_limit_s=rng.choice([None, 5.0, 30.0, 120.0]),
                           begin_at=rng.choice([None, None, 40.0, 80.0]), held=rng.random() < 0.1,
                           dependencies=deps))
    return pending, live, devices, finished


def test_random_queues_keep_the_invariants():
    rng = random.Random(12345)
    now = 60.0
    for _ in range(400):
        pending, live, devices, finished = _random_case(rng)
        _check_invariants(plan(pending, live, devices, finished, now), pending, live, devices, finished, now)


def _with_exclusive_jobs(rng: random.Random, pending, live, devices):
    """_random_case with some pending jobs exclusive, and sometimes an exclusive job running
    (it holds every device, so none is free) or a running job of no device."""
    pending = [replace(j, exclusive=True, gpu_ids=None) if rng.random() < 0.3 else j for j in pending]
    if rng.random() < 0.2:
        devices = [replace(d, free=False) for d in devices]
        live = [running(999, tuple(d.index for d in devices), started_at=rng.uniform(0, 50),
                        limit=rng.choice([None, 30.0, 200.0]), gpus=rng.randint(0, len(devices)), exclusive=True)]
    elif rng.random() < 0.2:
        live = [*live, running(998, (), started_at=rng.uniform(0, 50), limit=rng.choice([None, 100.0]))]
    return pending, live, devices


def test_random_queues_with_exclusive_jobs_keep_the_invariants():
    rng = random.Random(4242)
    now = 60.0
    for _ in range(400):
        pending, live, devices, finished = _random_case(rng)
        pending, live, devices = _with_exclusive_jobs(rng, pending, live, devices)
        p = plan(pending, live, devices, finished, now)
        _check_invariants(p, pending, live, devices, finished, now)
        by_id = {j.id: j for j in pending}
        every = {d.uuid for d in devices}
        exclusive_starts = [jid for jid, _ in p.starts if by_id[jid].exclusive]
        assert set(p.holds) == set(exclusive_starts)
        for jid in exclusive_starts:  # alone: nothing of ours runs, nothing else starts
            assert set(p.holds[jid]) == every and set(dict(p.starts)[jid]) <= every
            assert not live and len(p.starts) == 1
            assert all(d.free and not d.unavailable for d in devices)
        if any(j.exclusive for j in live):
            assert p.starts == []
        # An exclusive head needs every job gone: whatever starts behind it ends by the shadow time.
        if p.reservation is not None and p.reservation.exclusive:
            head = by_id[p.reservation.job_id]
            assert head.exclusive and set(p.reservation.devices) == every
            for jid, _ in p.starts:
                if order_key(by_id[jid]) > order_key(head):
                    assert ends_before(by_id[jid], now, p.reservation.start_at)


def _check_invariants(p: Plan, pending, live, devices, finished, now) -> None:
    by_id = {j.id: j for j in pending}
    free = {d.uuid: d for d in devices if d.free}
    started = dict(p.starts)
    known = set(by_id) | {j.id for j in live}

    assert set(started) | set(p.reasons) == set(by_id) and not set(started) & set(p.reasons)
    assert {r.split(",")[0] for r in p.reasons.values()} <= PENDING_REASONS
    held = [u for jid, us in started.items() for u in p.holds.get(jid, us)]
    assert len(held) == len(set(held)), "a device allocated twice"
    assert set(held) <= set(free) and len(held) <= len(free), "started on a device that was not free"
    for jid, us in started.items():
        j = by_id[jid]
        assert set(us) <= set(p.holds.get(jid, us))
        assert dependency_status(j, finished, known) == "ok"
        assert not j.held and (j.begin_at is None or j.begin_at <= now)
        assert len(us) == j.gpus and (j.gpu_ids is None or us == j.gpu_ids)
        assert all(free[u].free_memory is None or j.mem_per_gpu is None
                   or free[u].free_memory >= j.mem_per_gpu for u in us)

    # Backfill never delays the head: a later job on a reserved device ends by the shadow time.
    if p.reservation is not None:
        head = by_id[p.reservation.job_id]
        assert p.reasons[head.id].startswith(RESOURCES)
        for jid, us in started.items():
            if order_key(by_id[jid]) > order_key(head) and set(p.holds.get(jid, us)) & set(p.reservation.devices):
                assert ends_before(by_id[jid], now, p.reservation.start_at)

    # Free devices only shrink during a pass, so "Resources" still means "does not fit".
    left = [d for d in devices if d.free and d.uuid not in set(held)]
    taken = [replace(d, free=False) if d.uuid in set(held) else d for d in devices]
    active = [*live, *[by_id[jid] for jid in started]]
    for jid, reason in p.reasons.items():
        if reason == RESOURCES:
            if by_id[jid].exclusive:
                assert exclusive_pick(by_id[jid], taken, active) is None
            else:
                assert pick_devices(by_id[jid], left) is None


# ---- job arrays: %N ---------------------------------------------------------------------------

def test_an_array_runs_at_most_its_limit_and_holds_nobody_up():
    from sae_dist.db.schema import ARRAY_TASK_LIMIT

    devices = [DeviceView(f"d{i}", i, free=True) for i in range(4)]
    running = [JobView(1, array_id=1, array_limit=2, started_at=0.0, devices=("d0",))]
    tasks = [JobView(i, submitted_at=float(i), array_id=1, array_limit=2) for i in range(2, 6)]
    later = JobView(9, submitted_at=9.0, gpus=2)  # behind the tasks, and bigger than what is left
    p = plan(tasks + [later], running, [replace(devices[0], free=False)] + devices[1:], {}, now=10.0)
    assert p.starts == [(2, ("d1",)), (9, ("d2", "d3"))]  # one more task (2 of 2), then the other job
    assert {i: p.reasons[i] for i in (3, 4, 5)} == dict.fromkeys((3, 4, 5), ARRAY_TASK_LIMIT)
    assert p.reservation is None  # a throttled task is never the head: it reserves nothing


def test_an_array_without_a_limit_fills_every_free_device():
    devices = [DeviceView(f"d{i}", i, free=True) for i in range(3)]
    tasks = [JobView(i, submitted_at=float(i), array_id=1) for i in range(1, 6)]
    p = plan(tasks, [], devices, {}, now=0.0)
    assert [job for job, _ in p.starts] == [1, 2, 3]


# --- preemption ----------------------------------------------------------------------------

def test_a_higher_priority_head_preempts_the_fewest_lowest_priority_jobs():
    from scheduler.policy import preempting

    jobs = [running(1, (0,), started_at=1.0, preemptible=True, priority=-5),
            running(2, (1,), started_at=2.0, preemptible=True, priority=-5),  # newer: less work redone
            running(3, (2,), started_at=0.0, preemptible=True, priority=-9),  # lowest priority first
            running(4, (3,), started_at=0.0)]  # not preemptible
    p = run([job(10, gpus=2, priority=1)], [dev(i, free=False) for i in range(4)], jobs)
    assert p.preempt == {3: 10, 2: 10} and p.starts == []
    assert p.reasons[10] == preempting([2, 3]) == "Resources, Preempting:2,3"
    assert p.reservation == Reservation(10, 10.0 + 60.0, uuids(1, 2))


def test_no_preemption_of_equal_priority_unpreemptible_or_when_it_would_not_help():
    devices = [dev(0, free=False), dev(1, free=False)]
    equal = [running(1, (0,), preemptible=True), running(2, (1,), preemptible=True)]
    assert run([job(10)], devices, equal).preempt == {}  # same priority: it waits its turn
    plain = [running(1, (0,), priority=-1), running(2, (1,), priority=-1)]
    assert run([job(10)], devices, plain).preempt == {}
    one = [running(1, (0,), preemptible=True, priority=-1), running(2, (1,))]
    assert run([job(10, gpus=2)], devices, one).preempt == {}  # job 2 keeps device 1: no use taking 0
    p = run([job(10, gpus=2)], devices, one)
    assert p.reasons[10] == RESOURCES


def test_jobs_already_leaving_are_not_asked_again_and_hold_the_head_reservation():
    devices = [dev(0, free=False), dev(1, free=False)]
    jobs = [running(1, (0,), preemptible=True, priority=-1, leaving=True, grace_s=5.0),
            running(2, (1,), preemptible=True, priority=-1)]
    p = run([job(10), job(11, time_limit_s=1000.0)], devices, jobs)
    assert p.preempt == {} and p.reasons[10] == "Resources, Preempting:1"
    assert p.reservation == Reservation(10, 15.0, uuids(0))
    assert p.reasons[11] == RESOURCES  # device 0 is promised to job 10, device 1 busy


def test_an_exclusive_head_preempts_every_job_or_none():
    devices = [dev(0, free=False), dev(1, free=False), dev(2)]
    all_preemptible = [running(1, (0,), preemptible=True, priority=-1), running(2, (1,), preemptible=True, priority=-1)]
    p = run([job(10, exclusive=True, gpus=1)], devices, all_preemptible)
    assert p.preempt == {1: 10, 2: 10} and p.reservation.exclusive
    mixed = [all_preemptible[0], running(2, (1,))]
    assert run([job(10, exclusive=True, gpus=1)], devices, mixed).preempt == {}


def test_a_preemptible_exclusive_job_is_preempted_by_a_higher_priority_one():
    devices = [dev(0, free=False), dev(1, free=False)]
    holder = [running(1, (0, 1), preemptible=True, priority=-1, exclusive=True, gpus=1)]
    p = run([job(10)], devices, holder)
    assert p.preempt == {1: 10}


# --- shared devices ------------------------------------------------------------------------

def shared_job(id: int, mem_gib: int, **kw) -> JobView:
    return job(id, shared=True, mem_per_gpu=mem_gib * GiB, **kw)


def test_shared_jobs_pack_one_device_while_their_declared_memory_fits_it():
    from scheduler.policy import memory_wait

    devices = [DeviceView("GPU-0", 0, free=True, free_memory=79 * GiB, memory_total=80 * GiB),
               DeviceView("GPU-1", 1, free=True, free_memory=79 * GiB, memory_total=80 * GiB)]
    p = run([shared_job(i, 12) for i in range(1, 6)], devices[:1])
    assert [j for j, _ in p.starts] == [1, 2, 3, 4, 5] and {d for _, d in p.starts} == {uuids(0)}
    p = run([shared_job(i, 20) for i in range(1, 6)], devices[:1])
    assert [j for j, _ in p.starts] == [1, 2, 3]  # 3 x 20 GiB of the 79 free; a 4th would pass it
    assert p.reasons == {4: "Resources, Memory:20.0GiB>19.0GiB", 5: "Resources, Memory:20.0GiB>19.0GiB"}
    # Two devices: the second shared job goes beside the first, the idle device stays whole.
    p = run([shared_job(1, 12), shared_job(2, 12), job(3)], devices)
    assert p.starts == [(1, uuids(0)), (2, uuids(0)), (3, uuids(1))]
    assert memory_wait(job(9), devices) is None  # not a shared job: memory is never its reason


def test_a_device_with_sharers_takes_no_unshared_job_and_a_held_device_no_sharer():
    shared_dev = DeviceView("GPU-0", 0, free=False, free_memory=60 * GiB, memory_total=80 * GiB,
                            shared_used=48 * GiB)
    sharers = [running(1, (0,), shared=True, mem_per_gpu=48 * GiB)]
    p = run([shared_job(11, 30), shared_job(12, 4), job(13)], [shared_dev], sharers)
    assert p.starts == [(11, uuids(0))]  # 48 + 30 of 80 declared; then 2 GiB left by declarations
    assert p.reasons[12] == "Resources, Memory:4.0GiB>2.0GiB" and p.reasons[13] == RESOURCES
    # An unshared head waiting for the device to empty: sharers behind it may not join (they would
    # delay it), as any backfilled job may not take its reserved devices.
    p = run([job(10), shared_job(11, 4)], [shared_dev], sharers)
    assert p.starts == [] and p.reasons == {10: RESOURCES, 11: PRIORITY}
    whole = DeviceView("GPU-0", 0, free=False, free_memory=70 * GiB, memory_total=80 * GiB)
    p = run([shared_job(11, 4)], [whole], [running(1, (0,))])
    assert p.starts == [] and p.reasons[11] == RESOURCES


def test_what_sharers_declared_and_use_per_device():
    from scheduler.sharing import MIB, shared_use, sharers

    jobs = [running(1, (0,), shared=True, mem_per_gpu=12 * GiB), running(2, (0, 1), shared=True, mem_per_gpu=12 * GiB),
            running(3, (2,))]
    assert shared_use(jobs) == {"GPU-0": 24 * GiB, "GPU-1": 12 * GiB}
    assert shared_use([*jobs, running(4, (1,))])["GPU-1"] is None  # held whole as well: none may join
    listed = sharers("GPU-0", [(100, 13 * GiB + 5), (200, 2 * GiB), (300, None)], jobs, {1: [100], 2: [200]})
    assert listed == [{"job": 1, "declared": 12 * GiB, "used": 13 * GiB, "over": True},
                      {"job": 2, "declared": 12 * GiB, "used": 2 * GiB, "over": False}]
    assert sharers("GPU-0", [(100, None)], jobs, {1: [100]})[0]["used"] is None  # unknown, never 0
    assert MIB == 2**20


def test_a_shared_job_naming_its_gpu_waits_for_that_gpus_memory():
    full = DeviceView("GPU-0", 0, free=False, free_memory=80 * GiB, memory_total=80 * GiB, shared_used=48 * GiB)
    idle = DeviceView("GPU-1", 1, free=True, free_memory=80 * GiB, memory_total=80 * GiB)
    p = run([shared_job(5, 40, gpu_ids=uuids(0), gpus=1)], [full, idle],
            [running(1, (0,), shared=True, mem_per_gpu=48 * GiB)])
    assert p.reasons == {5: "Resources, Memory:40.0GiB>32.0GiB"}

