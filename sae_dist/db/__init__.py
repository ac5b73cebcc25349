"""The state database: schema, engine (migrated on first use), run helpers, metrics writer.

Importing this package does not import Alembic; it is loaded only when a database needs
upgrading, so the scheduler CLI starts fast.
"""

from sae_dist.db.engine import HEAD_REVISION, filesystem_type, get_engine, immediate_transaction, write_session
from sae_dist.db.faults import active_faults, clear_faults, record_fault
from sae_dist.db.runs import (
    add_run_event,
    create_run,
    delete_metrics_after,
    find_run_by_dir,
    get_run,
    rank_stats,
    run_events,
    step_metrics,
    update_run,
)
from sae_dist.db.schema import (
    FINAL_JOB_STATES,
    JOB_STATES,
    RUN_EVENT_KINDS,
    RUN_STATUSES,
    Allocation,
    BenchmarkPoint,
    BenchmarkRun,
    ClusterJob,
    Device,
    DeviceFault,
    GpuSample,
    Job,
    RankStat,
    RunEvent,
    StepMetric,
    TrainingRun,
    UTCDateTime,
    metadata,
    utcnow,
)
from sae_dist.db.writer import DatabaseMetricsLogger

__all__ = [
    "FINAL_JOB_STATES",
    "JOB_STATES",
    "Allocation",
    "ClusterJob",
    "Device",
    "DeviceFault",
    "RunEvent",
    "RUN_EVENT_KINDS",
    "active_faults",
    "add_run_event",
    "clear_faults",
    "record_fault",
    "run_events",
    "GpuSample",
    "Job",
    "HEAD_REVISION",
    "RUN_STATUSES",
    "DatabaseMetricsLogger",
    "RankStat",
    "StepMetric",
    "TrainingRun",
    "BenchmarkRun",
    "BenchmarkPoint",
    "UTCDateTime",
    "create_run",
    "delete_metrics_after",
    "filesystem_type",
    "find_run_by_dir",
    "get_engine",
    "get_run",
    "immediate_transaction",
    "write_session",
    "metadata",
    "rank_stats",
    "step_metrics",
    "update_run",
    "utcnow",
]
