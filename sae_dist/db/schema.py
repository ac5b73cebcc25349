"""Every table of the state database, in one module: the schema is the product's shared contract.

The scheduler, the trainer and the app all read and write these tables; Alembic migrations in
`migrations/versions/` must create exactly what is declared here (a test compares them).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import BigInteger, DateTime, Index, MetaData, UniqueConstraint, text
from sqlalchemy import false as sa_false
from sqlalchemy import true as sa_true
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import registry
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

# Named constraints: SQLite batch migrations recreate tables and must find constraints by name.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}
metadata = MetaData(naming_convention=NAMING_CONVENTION)


def utcnow() -> datetime:
    """Now, timezone-aware UTC: the only kind of datetime the database accepts."""
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Aware datetimes only: refuses naive ones on write, returns aware UTC on read.

    Our own rather than sqlmodel's (0.0.50 has one) so the schema does not depend on the
    sqlmodel version; SQLite stores naive UTC text, so UTC is attached again on read.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.utcoffset() is None:
            raise ValueError(
                f"naive datetime {value!r} refused: the database stores timezone-aware UTC; "
                "use sae_dist.db.utcnow() or datetime.now(timezone.utc)"
            )
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.utcoffset() is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)


class Base(SQLModel, registry=registry(metadata=metadata)):
    """Base of our tables: our own MetaData (naming convention), not sqlmodel's global one."""


RUN_STATUSES = ("RUNNING", "COMPLETED", "FAILED", "STOPPED")


class TrainingRun(Base, table=True):
    """One SAE training (one torchrun launch, or several when resumed in the same run_dir)."""

    __tablename__ = "training_runs"

    id: int | None = Field(default=None, primary_key=True)
    name: str
    status: str = "RUNNING"  # one of RUN_STATUSES
    architecture: str
    config_json: str  # the full training config as JSON
    world_size: int
    backend: str  # "gloo" or "nccl"
    device_ids: str  # JSON list of device labels, one per rank
    host: str
    run_dir: str = Field(index=True)
    export_dir: str | None = None
    total_steps: int
    last_step: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    job_id: int | None = None  # the scheduler job that ran it (no FK: jobs may be pruned)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    error: str | None = None
    final_loss: float | None = None
    final_mse: float | None = None
    final_fvu: float | None = None
    final_l0: float | None = None
    final_dead_fraction: float | None = None
    final_samples_per_s: float | None = None
    recovery_mean_cos: float | None = None
    recovery_frac: float | None = None
    # An SAE of a sweep (one job training many SAEs from one stream): its sweep and its point's
    # name there ("k32-x16"); NULL for a run of its own.
    sweep_id: int | None = Field(default=None, index=True)
    sweep_point: str | None = None


SWEEP_STATUSES = RUN_STATUSES


class Sweep(Base, table=True):
    """One job's sweep: the SAEs it trains from one activation stream are training runs that
    name it (`TrainingRun.sweep_id`); this row holds what they share."""

    __tablename__ = "sweeps"

    id: int | None = Field(default=None, primary_key=True)
    name: str
    status: str = "RUNNING"  # one of SWEEP_STATUSES
    run_dir: str = Field(index=True)  # its SAEs train under run_dir/saes/<point>/
    job_id: int | None = None  # the scheduler job that ran it (no FK: jobs may be pruned)
    keys_json: str  # JSON list of the swept settings, in the order given
    config_json: str  # the base config (every setting the SAEs share) as JSON
    placement_json: str | None = None  # sae_dist.sweeps.placement.Placement.to_dict(), once planned
    world_size: int
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    error: str | None = None


class StepMetric(Base, table=True):
    """Aggregated (all-rank) metrics of one logged training step."""

    __tablename__ = "step_metrics"
    # Also the index for lookups by run_id (its leading column) and for the cascade.
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="training_runs.id", ondelete="CASCADE")
    step: int
    samples_seen: int = Field(sa_type=BigInteger)  # can pass 2**31 on long runs
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # Nullable: a diverged run logs NaN (stored as NULL by SQLite), and some metrics are
    # not computed every step (auxk only for TopK, throughput not on the first step).
    loss: float | None = None
    mse: float | None = None
    fvu: float | None = None
    explained_variance: float | None = None
    l0: float | None = None
    dead_fraction: float | None = None
    auxk_loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples_per_s: float | None = None
    straggler_rank: int | None = None
    recovery_mean_cos: float | None = None
    recovery_frac: float | None = None
    # Load balance of the window: slowest rank's compute time / fastest's (1.0 = even), and the
    # rank that stays slow even at its smallest allowed share (rebalancing cannot help it).
    imbalance: float | None = None
    balance_limited_rank: int | None = None


class RankStat(Base, table=True):
    """Per-rank timings and memory of one logged step: shows stragglers and imbalance."""

    __tablename__ = "rank_stats"
    __table_args__ = (UniqueConstraint("run_id", "step", "rank"),)

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="training_runs.id", ondelete="CASCADE")
    step: int
    rank: int
    device: str
    step_time_s: float
    compute_time_s: float
    peak_memory_bytes: int | None = Field(default=None, sa_type=BigInteger)
    is_straggler: bool = False
    batch_size: int | None = None  # this rank's samples per step in the window (its share)


class RunEvent(Base, table=True):
    """Something that changed how a run trains: shares rebalanced, a rank lost and the run
    continued on fewer devices. Shown beside the curves; `details_json` holds the figures."""

    __tablename__ = "run_events"

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="training_runs.id", ondelete="CASCADE", index=True)
    step: int
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    kind: str  # one of RUN_EVENT_KINDS
    message: str
    details_json: str = "{}"


RUN_EVENT_KINDS = ("rebalance", "balance_limited", "degraded")


EVALUATION_ORIGINS = ("heldout", "cli")


class SaeEvaluation(Base, table=True):
    """One evaluation of an SAE on rows of activations (sae_dist.evaluate): the trainer's at the
    end of a run on its held-out rows ("heldout"), or `python -m sae_dist evaluate` ("cli")."""

    __tablename__ = "evaluations"

    id: int | None = Field(default=None, primary_key=True)
    # The run whose export was evaluated; NULL for an SAE from elsewhere.
    run_id: int | None = Field(default=None, foreign_key="training_runs.id", ondelete="CASCADE", index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    sae_path: str
    data_path: str
    rows: int = Field(sa_type=BigInteger)
    # Nullable like step_metrics: NaN is stored as NULL, and FVU is undefined on rows that do not vary.
    fvu: float | None = None
    explained_variance: float | None = None
    mse: float | None = None
    cosine: float | None = None
    l0: float | None = None
    dead_fraction: float | None = None
    dense_fraction: float | None = None
    density_json: str  # {"edges": [...], "counts": [...], "never": n}
    recovery_json: str | None = None  # planted data only
    model_check_json: str | None = None
    core_json: str | None = None  # SAEBench's core metrics; NULL before they were measured
    origin: str  # one of EVALUATION_ORIGINS ("where" is an SQL keyword)


class DeviceFault(Base, table=True):
    """A device a training rank died on: unavailable to the scheduler until it reads healthy
    again (`cleared_at` set by a health check)."""

    __tablename__ = "device_faults"

    id: int | None = Field(default=None, primary_key=True)
    device_uuid: str = Field(index=True)  # NVML's "GPU-..." or "virtual-<i>"
    job_id: int | None = None  # no FK: faults outlive pruned jobs
    run_id: int | None = None
    rank: int | None = None
    reason: str
    detected_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    cleared_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    cleared_reason: str | None = None


# ---- the scheduler's tables (its behaviour lives in the scheduler package) ----

JOB_STATES = ("PENDING", "RUNNING", "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
FINAL_JOB_STATES = frozenset(JOB_STATES) - {"PENDING", "RUNNING"}

# A pending job's `reason`: SLURM's pending-reason codes, so `squeue` habits carry over. The
# scheduler's policy sets them; the CLI and the app show them (with REASON_WORDS).
HELD = "JobHeldUser"
BEGIN_TIME = "BeginTime"
DEPENDENCY = "Dependency"
DEPENDENCY_NEVER = "DependencyNeverSatisfied"
RESOURCES = "Resources"
PRIORITY = "Priority"
REQ_NODE_NOT_AVAIL = "ReqNodeNotAvail"  # given as "ReqNodeNotAvail, UnavailableNodes:<uuids>"
ARRAY_TASK_LIMIT = "JobArrayTaskLimit"  # its array already runs its %N tasks
PENDING_REASONS: frozenset[str] = frozenset({HELD, BEGIN_TIME, DEPENDENCY, DEPENDENCY_NEVER, RESOURCES, PRIORITY,
                                             REQ_NODE_NOT_AVAIL, ARRAY_TASK_LIMIT})
# Exclusive jobs: "Resources, ExclusiveJob:<id>" (the machine is held by that job) and
# "Resources, RunningJobs:<ids>" (an exclusive job waiting for those to end): the code stays
# SLURM's Resources, the detail says who is in the way.
EXCLUSIVE_JOB = "ExclusiveJob"
RUNNING_JOBS = "RunningJobs"
# A head making room by preemption: "Resources, Preempting:<ids>" (those jobs are being requeued).
PREEMPTING = "Preempting"
# A shared job short of GPU memory: "Resources, Memory:12.0GiB>8.0GiB" (needed > the most left).
MEMORY = "Memory"
# What a preempted job's run ends as (SLURM's); it is requeued at once, so the state is kept only in
# the job's earlier runs (`attempts_json`, `acct -D`), never as the job's own.
PREEMPTED = "PREEMPTED"

REASON_WORDS = {
    RESOURCES: "waiting for enough free devices",
    PRIORITY: "jobs of higher priority go first",
    DEPENDENCY: "waiting for the jobs it depends on",
    DEPENDENCY_NEVER: "a job it depends on ended in a way that never satisfies it",
    HELD: "held: release it to let it start",
    BEGIN_TIME: "its start time has not come yet",
    ARRAY_TASK_LIMIT: "its array already runs as many tasks at once as its %N allows",
}
"""The codes people read alone, in words (ReqNodeNotAvail always comes with the devices it names)."""
REASON_DETAIL_WORDS = {
    RUNNING_JOBS: "it runs alone (exclusive) and waits for job{s} {ids} to end",
    EXCLUSIVE_JOB: "exclusive job {ids} holds the whole machine",
    PREEMPTING: "job{s} {ids} of lower priority make room for it (preempted: requeued)",
    MEMORY: "a shared job: it needs more memory than any device has left (needed>left: {ids})",
}
"""The details after a code, in words ({s}: a plural's s, {ids}: the job ids)."""


class Job(Base, table=True):
    """A queued command or SAE training, with SLURM's states and reasons."""

    __tablename__ = "jobs"
    # Two running jobs never share a rendezvous port (torchrun's 29500 collision).
    __table_args__ = (
        Index("uq_jobs_running_port", "port", unique=True,
              sqlite_where=text("state = 'RUNNING'"), postgresql_where=text("state = 'RUNNING'")),
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str
    user: str
    kind: str  # "command" (an argv, never run through a shell), "train" (a TrainConfig) or "batch" (a script)
    argv_json: str  # JSON list: the command, or `python -m sae_dist train` flags for kind=train
    train_config_json: str | None = None  # the validated TrainConfig, for kind=train
    state: str = Field(default="PENDING", index=True)  # one of JOB_STATES
    reason: str | None = None  # SLURM's reason while PENDING; why it ended otherwise
    priority: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    gpus: int  # devices wanted
    gpu_ids_json: str | None = None  # JSON list of exact device uuids wanted
    mem_per_gpu: int | None = Field(default=None, sa_type=BigInteger)  # bytes
    time_limit_s: float | None = None
    begin_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    dependencies_json: str = Field(default="[]", sa_column_kwargs={"server_default": "[]"})  # [[kind, id]]
    held: bool = False
    # SLURM's --exclusive: the job holds every device of the machine while it runs (benchmarks);
    # on virtual devices (they share the CPU) it also waits until no other job runs.
    exclusive: bool = Field(default=False, sa_column_kwargs={"server_default": sa_false()})
    requeue_on_failure: bool = False
    requeue_count: int = Field(default=0, sa_column_kwargs={"server_default": "0"})
    workdir: str
    env_json: str = Field(default="{}", sa_column_kwargs={"server_default": "{}"})  # extra environment
    stdout_pattern: str | None = None  # with %j (job id) and %x (name)
    stderr_pattern: str | None = None
    stdout_path: str | None = None  # resolved at start
    stderr_path: str | None = None
    devices_json: str | None = None  # uuids it ran on (kept after release, for accounting)
    port: int | None = None  # reserved rendezvous port while RUNNING
    # Process identity: a pid plus its start time (clock ticks since boot) tells a reused pid apart.
    supervisor_pid: int | None = None
    supervisor_start_ticks: int | None = Field(default=None, sa_type=BigInteger)
    pid: int | None = None
    pgid: int | None = None
    proc_start_ticks: int | None = Field(default=None, sa_type=BigInteger)
    cancel_requested: bool = False
    exit_code: int | None = None
    signal: int | None = None
    submitted_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # A task of a job array (SLURM's 12_7): the array's id (its first task's job id), the task's
    # id, and the array's %N (at most N of its tasks run at once). None for a plain job.
    array_job_id: int | None = Field(default=None, index=True)
    array_task_id: int | None = None
    array_max_running: int | None = None
    # `submit --snapshot`: the commit it was queued at (<sha>, or <sha>+uncommitted) and the copy of
    # its working directory it runs in (scheduler.snapshot). None for other jobs.
    snapshot_commit: str | None = None
    snapshot_dir: str | None = None
    # Preemption (SLURM's PreemptMode=REQUEUE): a job of higher priority may take a preemptible job's
    # devices; it gets SIGTERM, `preempt_grace_s` (None: 60 s), SIGKILL, and is requeued.
    # submit --shared: runs beside other shared jobs on a GPU while their mem_per_gpu fits it.
    shared: bool = Field(default=False, sa_column_kwargs={"server_default": sa_false()})
    preemptible: bool = Field(default=False, sa_column_kwargs={"server_default": sa_false()})
    preempt_grace_s: float | None = None
    preempted_by: int | None = None  # while a preemption of it is under way: the job it makes room for
    # Its earlier runs (requeued after a preemption or a failure): JSON list of {state, reason,
    # started_at, ended_at, exit_code, signal, devices}, oldest first (`acct -D`, SLURM's duplicates).
    attempts_json: str | None = None
    # While it heads the queue and cannot start: when the scheduler expects it to (its reservation,
    # by the running jobs' time limits; `queue --start`). None for every other job.
    expected_start_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class ClusterJob(Base, table=True):
    """A job handed to a real SLURM cluster by `submit --cluster slurm`. SLURM owns its state; the
    row says it is ours and keeps the last state read (squeue/sacct) for when SLURM forgets it."""

    __tablename__ = "cluster_jobs"
    __table_args__ = (UniqueConstraint("cluster", "cluster_job_id"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster: str  # "slurm"
    cluster_job_id: str  # SLURM's job id
    name: str
    user: str
    kind: str  # "command" or "train"
    workdir: str
    script_path: str
    train_config_json: str | None = None
    state: str = "PENDING"  # the last state SLURM reported (its own names)
    exit_code: int | None = None
    signal: int | None = None
    submitted_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    ended_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class JobChange(Base, table=True):
    """A row per change that can let a pending job start: a job submitted or deleted, or its
    state, hold, priority, begin time, dependencies, request or cancel flag changed. Database
    triggers (migration 0009) write it for every writer, so the scheduler daemon reads what
    changed since its last pass instead of the whole queue; it deletes the rows it has read."""

    __tablename__ = "job_changes"
    __table_args__ = {"sqlite_autoincrement": True}  # a sequence never reused after a delete

    seq: int | None = Field(default=None, primary_key=True)
    job_id: int


class Allocation(Base, table=True):
    """A device held by a job. The partial unique index makes a second unshared allocation of a
    device impossible; shared allocations (`submit --shared`) are many, and `store.start_jobs`
    refuses, in the same transaction, a shared one beside an unshared one and the reverse."""

    __tablename__ = "allocations"
    __table_args__ = (
        Index("uq_allocations_active_device", "device_uuid", unique=True,
              sqlite_where=text("released_at IS NULL AND NOT shared"),
              postgresql_where=text("released_at IS NULL AND NOT shared")),
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="jobs.id", ondelete="CASCADE", index=True)
    device_uuid: str
    allocated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    released_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    shared: bool = Field(default=False, sa_column_kwargs={"server_default": sa_false()})


class Device(Base, table=True):
    """The latest inventory of a device (NVML or virtual), for listings and the app."""

    __tablename__ = "devices"

    uuid: str = Field(primary_key=True)
    index: int
    name: str
    virtual: bool
    available: bool = True
    error: str | None = None
    memory_total: int | None = Field(default=None, sa_type=BigInteger)
    pci_bus_id: str | None = None
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # Its shared jobs (submit --shared), as the daemon last saw them: JSON list of {job, declared,
    # used} (bytes; used measured per process, None when unknown). None when no shared job holds it.
    sharers_json: str | None = None


class GpuSample(Base, table=True):
    """One device reading, once a second; unknown values stay NULL (never invented)."""

    __tablename__ = "gpu_samples"
    __table_args__ = (Index("ix_gpu_samples_device_time", "device_uuid", "time"),)

    id: int | None = Field(default=None, primary_key=True)
    device_uuid: str
    time: datetime = Field(sa_type=UTCDateTime)
    utilization_pct: float | None = None
    memory_used: int | None = Field(default=None, sa_type=BigInteger)
    memory_total: int | None = Field(default=None, sa_type=BigInteger)
    # What NVML says is free (on a GPU, total less used less what the driver reserves); of a virtual
    # device, its share of the RAM less its jobs' resident memory. None where not read.
    memory_free: int | None = Field(default=None, sa_type=BigInteger)
    temperature_c: float | None = None
    power_w: float | None = None
    job_id: int | None = Field(default=None, index=True)  # no FK: samples outlive pruned jobs


class GpuMinute(Base, table=True):
    """One device's samples of one minute, as sums and counts: long windows read these.

    Kept by a database trigger on every insert into gpu_samples (migration 0003), so no writer
    has to know about it; a day is 1,440 rows a device here against 86,400 samples, which is
    what lets the app chart 24 h or a week as fast as an hour. Sums and counts (not means) so
    that minutes add up exactly into wider buckets. A figure nobody measured in a minute has a
    count of 0 and a NULL sum: unknown, never 0. Thinning old samples leaves these rows alone.
    A SQLite batch migration that recreates gpu_samples drops the trigger: recreate it there.
    """

    __tablename__ = "gpu_minutes"

    device_uuid: str = Field(primary_key=True)
    minute: int = Field(primary_key=True)  # Unix time (UTC) // 60 of the samples
    samples: int
    utilization_sum: float | None = None
    utilization_n: int = 0
    memory_used_sum: int | None = Field(default=None, sa_type=BigInteger)
    memory_used_n: int = 0
    memory_total_max: int | None = Field(default=None, sa_type=BigInteger)
    temperature_max: float | None = None
    power_sum: float | None = None
    power_n: int = 0


class BenchmarkRun(Base, table=True):
    """One scaling benchmark: a config measured on several device counts, and where it ran."""

    __tablename__ = "benchmark_runs"

    id: int | None = Field(default=None, primary_key=True)
    name: str
    status: str = "RUNNING"  # RUNNING, COMPLETED, FAILED
    mode: str  # "strong" (global batch fixed) or "weak" (per-device batch fixed)
    device_counts: str  # JSON list, e.g. [1, 2, 4]
    config_json: str  # the training config measured (its batch_size: see mode)
    steps: int  # timed steps per point (after warm-up)
    warmup_steps: int
    repeats: int
    queued: bool  # each point ran as a scheduler job (False: --no-queue)
    device_kind: str  # "cuda" or "cpu"
    device_names: str  # JSON list of the device names used
    virtual: bool  # CPU-backed (virtual) devices: the figures are the CPU's
    backend: str  # "nccl" or "gloo"
    torch_version: str
    link: str | None = None  # interconnect between the devices where NVML tells it
    host: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    error: str | None = None


class BenchmarkPoint(Base, table=True):
    """One measurement: N devices, one repeat, DDP or the no-communication ceiling."""

    __tablename__ = "benchmark_points"

    id: int | None = Field(default=None, primary_key=True)
    bench_id: int = Field(foreign_key="benchmark_runs.id", ondelete="CASCADE", index=True)
    devices: int
    repeat: int
    kind: str  # "ddp" (one job over N devices) or "ceiling" (N independent single-device processes)
    per_device_batch: int
    samples_per_s: float  # global throughput, from the median timed step
    step_s: float  # median step time (the slowest rank's, for DDP)
    step_no_comm_s: float | None = None  # median step time under no_sync (no gradient all-reduce)
    comm_share: float | None = None  # (step - step_no_comm) / step
    peak_memory: int | None = Field(default=None, sa_type=BigInteger)  # bytes, the largest rank
    grad_bytes: int | None = Field(default=None, sa_type=BigInteger)  # all-reduced per step
    allreduce_bytes_per_s: float | None = None  # measured ring all-reduce (bus) bandwidth, DDP N > 1
    mean_utilization_pct: float | None = None  # from the daemon's samples; NULL if none were taken
    job_id: int | None = None  # the scheduler job that ran it
    # The machine's other work while the point ran (JSON: CPU % of other processes before and
    # during it; on GPUs, NVML's other processes and their utilisation). NULL: not recorded.
    other_load_json: str | None = None
    # False when the point cannot be trusted (beats its ceiling, superlinear, noisy, other load);
    # `reason` says why. Unreliable points never enter a headline figure or the projection.
    reliable: bool = Field(default=True, sa_column_kwargs={"server_default": sa_true()})
    reason: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
