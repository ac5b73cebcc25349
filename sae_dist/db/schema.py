"""Every table of the state database, in one module: the schema is the product's shared contract.

The scheduler, the trainer and the app all read and write these tables; Alembic migrations in
`migrations/versions/` must create exactly what is declared here (a test compares them).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import BigInteger, DateTime, MetaData, UniqueConstraint
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


RUN_STATUSES = ("RUNNING", "COMPLETED", "FAILED")


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
