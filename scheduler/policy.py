"""Which pending job starts now, and on which GPUs: the scheduler's decisions, with no I/O.

The daemon reads the queue and the devices, turns them into `JobView`/`DeviceView` values,
calls `plan(...)` and applies the result in one transaction. Keeping the decision pure (no
database, no clock: `now` is an argument) lets it be tested on plain data and replayed.

Order: highest priority first, then submission time, then id. Each pending job is first checked
for eligibility (hold, dependencies, begin time); eligible jobs are then walked in order.

Backfill (EASY, as in SLURM's sched/backfill with one reservation): every job that fits on the
free devices starts. The first eligible job that does not fit is the *head*; from the running
jobs' expected ends (start + time limit) we find its *shadow time*, the earliest moment enough
devices will be free for it, and the devices it would take then (the *reserved* devices). After
that, a later job starts now only if it fits on the free devices and either ends (by its time
limit) no later than the shadow time, or uses no reserved device. A job without a time limit
never ends for this purpose, so it can only use unreserved devices; a running job without a
time limit makes the shadow time infinite, and then a job with a time limit may still borrow
reserved devices (the head's estimate is "never", so nothing it was promised is delayed).

Unavailable devices (unreadable, or failed until a health check passes) come back at no known
time: a job that needs one (it names it, or asks for more devices than the others) waits with
SLURM's ReqNodeNotAvail naming them, and takes no reservation, so it holds nobody up.

Tasks of a job array throttled by `%N` wait with SLURM's JobArrayTaskLimit while N of them run;
they are passed over, never the head, so they hold no device back from other jobs.

Exclusive jobs (SLURM's --exclusive: the whole node, here the whole machine) hold every device
while they run and use `gpus` of them (the usual choice); they start only when every device is
free and available and no other job of ours runs, 0-device jobs included (virtual devices share
the CPU; real GPUs share the host's CPUs and PCIe). While one runs nothing else starts. An
exclusive head reserves every device and needs every job gone, so a job behind it starts now
only if its time limit ends it by the shadow time, whatever devices it asks for.

Preemption (SLURM's PreemptMode=REQUEUE by priority): a head that does not fit now takes the
devices of running preemptible jobs of lower priority when that makes it fit: the fewest of them,
lowest priority first, the most recently started first among equals (the least work is redone).
They are asked to leave (SIGTERM, their grace time, SIGKILL; then requeued); until they have, the
head keeps its reason and reserves their devices from now plus the longest grace, so nothing
else takes them. Jobs already leaving count as gone: a pass never asks more of them.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Iterable, Literal

from sae_dist.db.schema import (
    ARRAY_TASK_LIMIT,
    BEGIN_TIME,
    DEPENDENCY,
    DEPENDENCY_NEVER,
    EXCLUSIVE_JOB,
    HELD,
    MEMORY,
    PRIORITY,
    REQ_NODE_NOT_AVAIL,
    RESOURCES,
    RUNNING_JOBS,
)

DependencyKind = Literal["afterok", "afterany", "afternotok"]
DEPENDENCY_KINDS: frozenset[str] = frozenset({"afterok", "afterany", "afternotok"})

DependencyStatus = Literal["ok", "wait", "never"]


@dataclass(frozen=True)
class JobView:
    """What the policy needs to know about one job (pending or running)."""

    id: int
    priority: int = 0  # higher runs first; the caller maps SLURM's nice to -nice
    submitted_at: float = 0.0  # epoch seconds; breaks priority ties (FIFO)
    gpus: int = 1  # device count wanted
    gpu_ids: tuple[str, ...] | None = None  # exact device uuids wanted; then gpus == len(gpu_ids)
    mem_per_gpu: int | None = None  # bytes of free memory needed on each device
    time_limit_s: float | None = None  # None: unlimited
    begin_at: float | None = None  # epoch seconds; not eligible before
    held: bool = False
    dependencies: tuple[tuple[DependencyKind, int], ...] = ()
    started_at: float | None = None  # running jobs only
    devices: tuple[str, ...] = ()  # running jobs only: uuids they hold (an exclusive job: every device)
    exclusive: bool = False  # holds the whole machine while it runs; uses `gpus` of its devices
    array_id: int | None = None  # a task of this job array
    array_limit: int | None = None  # its array's %N: at most this many of its tasks run at once
    shared: bool = False  # runs beside other shared jobs on a device while their mem_per_gpu fits it
    preemptible: bool = False  # a job of higher priority may take its devices (it is requeued)
    grace_s: float = 60.0  # a preemption's SIGTERM-to-SIGKILL time (SLURM's GraceTime)
    leaving: bool = False  # running jobs only: a preemption of it is under way

    def __post_init__(self) -> None:
        # Checked here so every helper can trust the shape (e.g. no duplicate uuids to double-book).
        if self.gpus < 0:
            raise ValueError(f"job {self.id}: gpus must be >= 0, got {self.gpus}")
        if self.gpu_ids is not None:
            if len(self.gpu_ids) != self.gpus:
                raise ValueError(f"job {self.id}: gpus={self.gpus} but {len(self.gpu_ids)} gpu_ids")
            if len(set(self.gpu_ids)) != len(self.gpu_ids):
                raise ValueError(f"job {self.id}: duplicate gpu_ids {self.gpu_ids}")
        if self.time_limit_s is not None and self.time_limit_s <= 0:
            raise ValueError(f"job {self.id}: time_limit_s must be > 0, got {self.time_limit_s}")
        for kind, _ in self.dependencies:
            if kind not in DEPENDENCY_KINDS:
                raise ValueError(f"job {self.id}: unknown dependency kind {kind!r}")


@dataclass(frozen=True)
class DeviceView:
    """One GPU (or virtual device) as the policy sees it."""

    uuid: str
    index: int  # for people and for tie-breaking; uuids identify devices
    free: bool  # idle and usable by us now (not allocated, not busy-external, readable)
    free_memory: int | None = None  # bytes; None = unknown, passes any memory request
    unavailable: bool = False  # unreadable or failed: nobody knows when it comes back
    memory_total: int | None = None  # bytes; None = unknown (then shared jobs are bounded by free_memory)
    # Declared memory (mem_per_gpu) of the shared jobs on it, when only shared jobs hold it; None
    # when it is idle (`free`) or held whole.
    shared_used: int | None = None


@dataclass(frozen=True)
class Reservation:
    """Where and when the head job is expected to start."""

    job_id: int
    start_at: float  # shadow time; math.inf when it depends on a job that never ends
    devices: tuple[str, ...]  # the reserved devices
    exclusive: bool = False  # the head is exclusive: it also needs every other job gone


@dataclass(frozen=True)
class Plan:
    starts: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)  # in start order
    reasons: dict[int, str] = field(default_factory=dict)  # every pending job that does not start
    reservation: Reservation | None = None  # the head's, for `queue` to show an expected start
    # Exclusive jobs started: every device each holds (a superset of its devices in `starts`).
    holds: dict[int, tuple[str, ...]] = field(default_factory=dict)
    # Running preemptible jobs to requeue now, each with the job it makes room for (the head).
    preempt: dict[int, int] = field(default_factory=dict)


def order_key(job: JobView) -> tuple[int, float, int]:
    return (-job.priority, job.submitted_at, job.id)


def dependency_status(job: JobView, finished_states: dict[int, str], known_ids: Iterable[int]) -> DependencyStatus:
    """"ok" when all dependencies are satisfied, "never" when one cannot be, else "wait".

    `known_ids` are the ids of jobs still pending or running; an id in neither those nor
    `finished_states` does not exist, so waiting on it would be forever.
    """
    # Callers walking a long queue pass a set: copying it per job made a pass quadratic.
    known = known_ids if isinstance(known_ids, (set, frozenset)) else set(known_ids)
    waiting = False
    for kind, dep_id in job.dependencies:
        if dep_id in finished_states:
            completed = finished_states[dep_id] == "COMPLETED"
            if (kind == "afterok" and not completed) or (kind == "afternotok" and completed):
                return "never"
        elif dep_id in known and dep_id != job.id:  # a job waiting on itself waits forever
            waiting = True
        else:
            return "never"
    return "wait" if waiting else "ok"


def blocking_reason(job: JobView, finished_states: dict[int, str], known_ids: Iterable[int], now: float) -> str | None:
    """Why `job` may not be considered at all now (hold, dependencies, begin time), or None."""
    if job.held:
        return HELD  # a user hold outranks everything, as in SLURM
    status = dependency_status(job, finished_states, known_ids)
    if status == "never":
        return DEPENDENCY_NEVER
    if status == "wait":
        return DEPENDENCY
    if job.begin_at is not None and job.begin_at > now:
        return BEGIN_TIME
    return None


def _memory_ok(job: JobView, device: DeviceView) -> bool:
    return job.mem_per_gpu is None or device.free_memory is None or device.free_memory >= job.mem_per_gpu


def room_left(device: DeviceView) -> int | None:
    """Bytes a shared job may still declare on `device`: its total less what its sharers declared
    (None when its total is unknown)."""
    if device.memory_total is None:
        return None
    return device.memory_total - (device.shared_used or 0)


def shares(job: JobView, device: DeviceView) -> bool:
    """Whether shared `job` may run on `device` now: idle, or held by shared jobs only, with room
    for its declared memory by the sharers' declarations and by the memory actually free."""
    if not job.shared or job.mem_per_gpu is None or device.unavailable:
        return False
    if not device.free and device.shared_used is None:
        return False
    left = room_left(device)
    return (left is None or left >= job.mem_per_gpu) and _memory_ok(job, device)


def _preference(device: DeviceView) -> tuple[bool, int, int]:
    # Most free memory first; unknown memory after known; then by index for stable choices.
    return (device.free_memory is None, -(device.free_memory or 0), device.index)


def _packing(device: DeviceView) -> tuple:
    left = room_left(device)
    return (device.shared_used is None, left is None, left or 0, device.index)


def memory_wait(job: JobView, devices: list[DeviceView]) -> str | None:
    """Why a shared job waits when memory is what it lacks: "Resources, Memory:<needed>><the most
    any open device has left>"; None when memory is not why (or is unknown)."""
    if not job.shared or job.mem_per_gpu is None:
        return None
    rooms = []
    for d in devices if job.gpu_ids is None else [d for d in devices if d.uuid in job.gpu_ids]:
        if d.unavailable or not (d.free or d.shared_used is not None):
            continue
        known = [r for r in (room_left(d), d.free_memory) if r is not None]
        if not known:
            return None  # a device of unknown memory: memory cannot be the reason
        rooms.append(min(known))
    most = max(rooms, default=None)
    if most is None or most >= job.mem_per_gpu:
        return None
    return f"{RESOURCES}, {MEMORY}:{_gib(job.mem_per_gpu)}>{_gib(max(most, 0))}"


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}GiB"


def pick_devices(job: JobView, free_devices: Iterable[DeviceView]) -> tuple[str, ...] | None:
    """The devices `job` would get from `free_devices` (entries with free=False are ignored), or None.

    Exact `gpu_ids` are returned in the order asked; a count is chosen by most free memory and
    returned in index order, the order CUDA_VISIBLE_DEVICES will list them.
    """
    if job.shared:
        usable = [d for d in free_devices if shares(job, d)]
    else:
        usable = [d for d in free_devices if d.free and _memory_ok(job, d)]
    if job.gpu_ids is not None:
        by_uuid = {d.uuid for d in usable}
        return job.gpu_ids if all(u in by_uuid for u in job.gpu_ids) else None
    if len(usable) < job.gpus:
        return None
    # A shared job fills devices already shared first, the fullest that fits first: idle devices
    # stay whole for the jobs that need them whole.
    key = _packing if job.shared else _preference
    chosen = sorted(usable, key=key)[: job.gpus]
    return tuple(d.uuid for d in sorted(chosen, key=lambda d: d.index))


def unavailable_needed(job: JobView, devices: list[DeviceView]) -> list[str]:
    """The unavailable devices `job` cannot start without: those it names, or, for a count larger
    than the available devices, every unavailable one; an exclusive job needs every device.
    [] when the available ones could do."""
    unavailable = [d.uuid for d in sorted(devices, key=lambda d: d.index) if d.unavailable]
    if job.exclusive:
        return unavailable
    if job.gpu_ids is not None:
        return [u for u in job.gpu_ids if u in unavailable]
    return unavailable if job.gpus > len(devices) - len(unavailable) else []


def req_node_not_avail(uuids: list[str]) -> str:
    """SLURM's reason for a job waiting on devices that are down: it names them."""
    return f"{REQ_NODE_NOT_AVAIL}, UnavailableNodes:{','.join(uuids)}"


def exclusive_job_runs(job_id: int) -> str:
    """Why a job waits while an exclusive job holds the machine."""
    return f"{RESOURCES}, {EXCLUSIVE_JOB}:{job_id}"


def waits_for_jobs(job_ids: Iterable[int]) -> str:
    """Why an exclusive job waits while other jobs of ours run (they all must end first)."""
    return f"{RESOURCES}, {RUNNING_JOBS}:{','.join(str(i) for i in sorted(job_ids))}"


def exclusive_pick(job: JobView, devices: list[DeviceView], active: list[JobView]) -> tuple[str, ...] | None:
    """The devices an exclusive job would use now, or None: it needs every device free and no
    other job running. It holds all of `devices`; it uses `gpus` of them, chosen as usual."""
    if active or not all(d.free for d in devices):
        return None
    return pick_devices(job, devices)


def exclusive_shadow_time(head: JobView, running: list[JobView], devices: list[DeviceView],
                          now: float) -> Reservation | None:
    """When an exclusive `head` can start: once every running job has ended (by its time limit)
    and every device is back; a device busy with something not ours comes back only at infinity.
    Reserves every device. None when it would not fit even then (e.g. not enough memory)."""
    when = max((expected_end(job, now) for job in running), default=now)
    ours = {u for job in running for u in job.devices}
    if any(not d.free and d.uuid not in ours for d in devices):
        when = math.inf
    back = [d if d.free else replace(d, free=True, free_memory=None, shared_used=None) for d in devices]
    if pick_devices(head, back) is None:
        return None
    every = tuple(d.uuid for d in sorted(devices, key=lambda d: d.index))
    return Reservation(head.id, when, every, exclusive=True)


def expected_end(job: JobView, now: float) -> float:
    """When a running job will have released its devices at the latest; inf without a time limit."""
    if job.time_limit_s is None:
        return math.inf
    started = job.started_at if job.started_at is not None else now
    # An overdue job is being killed right now; it cannot end in the past.
    return max(now, started + job.time_limit_s)


def shadow_time(head: JobView, running: list[JobView], devices: list[DeviceView], now: float) -> Reservation | None:
    """The earliest time and devices on which `head` can start, or None if it never fits here.

    Devices come back as running jobs reach their expected end (their free memory is then unknown).
    Devices not free and held by none of our jobs (external use) come back only at infinity, as do
    those of jobs without a time limit: nothing says when they will be free. Unavailable devices
    never come back here (see `unavailable_needed`).
    """
    by_uuid = {d.uuid: d for d in devices if not d.unavailable}
    pool = {d.uuid: d for d in devices if d.free}
    releases: dict[float, list[str]] = {}
    for job in running:
        for uuid in job.devices:
            if uuid in by_uuid and uuid not in pool:
                releases.setdefault(expected_end(job, now), []).append(uuid)

    def released(uuid: str) -> DeviceView:
        return replace(by_uuid[uuid], free=True, free_memory=None, shared_used=None)

    picked = pick_devices(head, pool.values())
    if picked is not None:
        return Reservation(head.id, now, picked)
    for t in sorted(t for t in releases if t != math.inf):
        pool.update((u, released(u)) for u in releases[t])
        picked = pick_devices(head, pool.values())
        if picked is not None:
            return Reservation(head.id, t, picked)
    # At infinity everything we know of is back; free devices keep their memory figure.
    pool.update((u, released(u)) for u in by_uuid if u not in pool)
    picked = pick_devices(head, pool.values())
    return Reservation(head.id, math.inf, picked) if picked is not None else None


def ends_before(job: JobView, now: float, deadline: float) -> bool:
    """Whether `job`, started now, is sure to be done by `deadline` (it needs a time limit)."""
    return job.time_limit_s is not None and now + job.time_limit_s <= deadline


def backfill_pick(job: JobView, free: list[DeviceView], reservation: Reservation, now: float) -> tuple[str, ...] | None:
    """Devices for a job behind the head that cannot delay the head's reservation, or None."""
    if ends_before(job, now, reservation.start_at):
        return pick_devices(job, free)  # gone before the head needs anything
    if reservation.exclusive:
        return None  # the head needs every job gone, even one without devices
    reserved = set(reservation.devices)
    return pick_devices(job, [d for d in free if d.uuid not in reserved])


def preemption_victims(head: JobView, active: list[JobView], devices: list[DeviceView]) -> tuple[int, ...] | None:
    """The running jobs `head` must preempt to start (none new: () when those already leaving
    make room), or None when preempting every job it may would still not let it start."""
    leaving = [j for j in active if j.leaving]
    candidates = sorted((j for j in active if j.preemptible and not j.leaving and j.priority < head.priority),
                        key=lambda j: (j.priority, -(j.started_at or 0.0), -j.id))
    if head.exclusive:  # it needs every job gone: all must be preemptible, or on their way out
        others = [j for j in active if not j.leaving]
        return tuple(j.id for j in others) if len(others) == len(candidates) and \
            _fits_without(head, leaving + others, devices) else None
    chosen: list[JobView] = []
    for job in [None, *candidates]:  # first with only the leaving jobs gone, then one more at a time
        if job is not None:
            chosen.append(job)
        if _fits_without(head, leaving + chosen, devices):
            break
    else:
        return None
    for job in list(reversed(chosen)):  # keep none that is not needed
        rest = [j for j in chosen if j is not job]
        if _fits_without(head, leaving + rest, devices):
            chosen = rest
    return tuple(j.id for j in chosen)


def _fits_without(head: JobView, gone: list[JobView], devices: list[DeviceView]) -> bool:
    return pick_devices(head, _freed(devices, gone)) is not None


def _freed(devices: list[DeviceView], gone: list[JobView]) -> list[DeviceView]:
    """The devices as they will be once `gone` have left (their memory then unknown)."""
    released = {u for j in gone for u in j.devices}
    return [replace(d, free=True, free_memory=None, shared_used=None) if d.uuid in released and not d.unavailable
            else d for d in devices]


def preemption_reservation(head: JobView, active: list[JobView], victims: tuple[int, ...],
                           devices: list[DeviceView], now: float) -> Reservation:
    """Where the head starts once its victims (and the jobs already leaving) are gone: their
    devices, from now plus the longest grace among them."""
    gone = [j for j in active if j.leaving or j.id in victims]
    when = now + max((j.grace_s for j in gone), default=0.0)
    if head.exclusive:
        return Reservation(head.id, when, tuple(d.uuid for d in sorted(devices, key=lambda d: d.index)), True)
    return Reservation(head.id, when, pick_devices(head, _freed(devices, gone)) or ())


def preempting(job_ids: Iterable[int]) -> str:
    """Why a head waits while jobs it preempts leave."""
    return f"{RESOURCES}, Preempting:{','.join(str(i) for i in sorted(job_ids))}"


def shape(job: JobView) -> tuple:
    """What a pending job's start decision depends on, past its eligibility and the head's id."""
    return (job.gpus, job.gpu_ids, job.mem_per_gpu, job.time_limit_s, job.exclusive, job.shared)


def plan(pending: list[JobView], running: list[JobView], devices: list[DeviceView],
         finished_states: dict[int, str], now: float, live_ids: Iterable[int] = ()) -> Plan:
    """Decide which pending jobs start now and on which devices; give a reason for every other.

    `live_ids`: other jobs that exist and have not ended (e.g. held ones the caller left out),
    so a dependency on one of them waits rather than never being satisfied.
    """
    known_ids = {j.id for j in pending} | {j.id for j in running} | set(live_ids)
    reasons: dict[int, str] = {}
    eligible: list[JobView] = []
    for job in sorted(pending, key=order_key):
        reason = blocking_reason(job, finished_states, known_ids, now)
        if reason is None:
            eligible.append(job)
        else:
            reasons[job.id] = reason

    walk = _Walk(running, devices, now, reasons)
    # Tasks of each array running (or started by this plan), for its %N.
    array_active = Counter(j.array_id for j in running if j.array_id is not None)
    # Until a job starts or the reservation changes, jobs of one shape meet the same fate: a long
    # queue of alike jobs costs a dictionary lookup each, not a device search each.
    fates: dict[tuple, str] = {}
    for job in eligible:
        if job.array_limit is not None and array_active[job.array_id] >= job.array_limit:
            reasons[job.id] = ARRAY_TASK_LIMIT  # waits for its own array, holds nobody else up
            continue
        fate = fates.get(shape(job))
        if fate is not None:
            reasons[job.id] = fate
            continue
        before = (len(walk.starts), walk.reservation)
        walk.decide(job)
        if len(walk.starts) == before[0] and walk.reservation is before[1]:
            fates[shape(job)] = reasons[job.id]
        else:
            fates.clear()
            if len(walk.starts) > before[0] and job.array_id is not None:
                array_active[job.array_id] += 1
    return Plan(starts=walk.starts, reasons=reasons, reservation=walk.reservation, holds=walk.holds,
                preempt=walk.preempt)


class _Walk:
    """The state of one walk over the eligible jobs, in order: what started, the head's reservation."""

    def __init__(self, running: list[JobView], devices: list[DeviceView], now: float, reasons: dict[int, str]):
        self.devices, self.now, self.reasons = devices, now, reasons
        self.starts: list[tuple[int, tuple[str, ...]]] = []
        self.holds: dict[int, tuple[str, ...]] = {}
        self.taken: set[str] = set()
        self.shared_add: dict[str, int] = {}  # declared memory of the shared jobs this plan starts, by device
        self.active = list(running)  # running jobs plus those this plan starts, for the shadow time
        self.reservation: Reservation | None = None
        self.preempt: dict[int, int] = {}

    def current_devices(self) -> list[DeviceView]:
        return [self._now(d) for d in self.devices]

    def _now(self, d: DeviceView) -> DeviceView:
        if d.uuid in self.taken:
            return replace(d, free=False, shared_used=None)
        added = self.shared_add.get(d.uuid)
        if added is None:
            return d
        return replace(d, free=False, shared_used=(d.shared_used or 0) + added,
                       free_memory=None if d.free_memory is None else d.free_memory - added)

    def reserve(self, head: JobView, now_devices: list[DeviceView]) -> Reservation | None:
        # A job that can never fit on this machine gets no reservation: it must not block others.
        if head.exclusive:
            return exclusive_shadow_time(head, self.active, now_devices, self.now)
        return shadow_time(head, self.active, now_devices, self.now)

    def waiting(self, job: JobView, now_devices: list[DeviceView]) -> str:
        # An exclusive job that would fit once our jobs end names them; a shared one short of memory
        # says how much; else SLURM's plain Resources.
        if job.exclusive and self.active and \
                exclusive_shadow_time(job, self.active, now_devices, self.now) is not None:
            return waits_for_jobs(j.id for j in self.active)
        return memory_wait(job, now_devices) or RESOURCES

    def preempt_for(self, head: JobView, now_devices: list[DeviceView]) -> bool:
        """Make room for the head by preemption when it can (and take its reservation)."""
        victims = preemption_victims(head, self.active, now_devices)
        gone = [j.id for j in self.active if j.leaving] + list(victims or ())
        if victims is None or not gone:
            return False
        self.preempt.update((v, head.id) for v in victims)
        self.reasons[head.id] = preempting(gone)
        self.reservation = preemption_reservation(head, self.active, victims, now_devices, self.now)
        return True

    def decide(self, job: JobView) -> None:
        """Start `job` now, or give its reason (and take the reservation if it is the head)."""
        now, reasons, reservation = self.now, self.reasons, self.reservation
        now_devices = self.current_devices()
        down = unavailable_needed(job, now_devices)
        if down:
            reasons[job.id] = req_node_not_avail(down)
            return
        holder = next((j for j in self.active if j.exclusive), None)
        if holder is not None:  # the machine is someone's alone: nothing starts beside it
            if reservation is None and self.preempt_for(job, now_devices):
                return
            reasons[job.id] = exclusive_job_runs(holder.id)
            if reservation is None:
                self.reservation = self.reserve(job, now_devices)
            return
        if job.exclusive:
            fits = exclusive_pick(job, now_devices, self.active)
            # It holds every device, so behind a head it may only borrow time it gives back:
            # every reservation has devices, or is exclusive itself.
            picked = fits if reservation is None or ends_before(job, now, reservation.start_at) else None
        elif reservation is None:
            fits = picked = pick_devices(job, now_devices)
        else:
            fits = pick_devices(job, now_devices)
            picked = backfill_pick(job, now_devices, reservation, now)
        if picked is not None:
            held = tuple(d.uuid for d in sorted(now_devices, key=lambda d: d.index)) if job.exclusive else picked
            self.starts.append((job.id, picked))
            if job.exclusive:
                self.holds[job.id] = held
            if job.shared:
                for u in picked:
                    self.shared_add[u] = self.shared_add.get(u, 0) + job.mem_per_gpu
            else:
                self.taken.update(held)
            self.active.append(replace(job, started_at=now, devices=held))
        elif reservation is None:
            if not self.preempt_for(job, now_devices):
                reasons[job.id] = self.waiting(job, now_devices)
                self.reservation = self.reserve(job, now_devices)
        elif fits is not None:
            reasons[job.id] = PRIORITY  # would fit, but would delay the head
        else:
            reasons[job.id] = self.waiting(job, now_devices)
