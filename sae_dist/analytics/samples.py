"""Series for the Monitor, downsampled by the database: device readings by time, training
metrics by step, at most about `MAX_POINTS_PER_SERIES` points a series whatever the window.

Device readings. Buckets are whole seconds of Unix time, `epoch // width * width` on
integers (SQLAlchemy's `/` is true division, even on integer columns), aligned to multiples of the
width so a bucket's edges do not move as the window slides. Widths come from a short list
of round values (1 s, 2 s, 5 s, ..., 1 min, 2 min, ...), the smallest that keeps a window
within the budget. Where to read them from is the speed decision:

- short windows read `gpu_samples` through its (device_uuid, time) index; SQLite keeps
  times as text, so the epoch is `strftime('%s', time)` there (`extract(epoch ...)` on
  PostgreSQL): per-row work, fine for the few tens of thousands of rows of an hour;
- windows that would read more than `RAW_ROW_BUDGET` samples (a day of 8 devices is
  700,000) read `gpu_minutes` instead, the per-minute sums a trigger keeps as samples
  arrive (migration 0003), in buckets of whole minutes: 1,440 rows a device a day. Reading
  and sorting the raw rows took SQLite 0.5-1 s for a day of 8 devices however indexed;
  the minute rows take milliseconds.

In a bucket a device's utilisation, memory used and power are means of its readings and
its temperature the highest one. Over several devices: memory used and power add up, the
utilisation is the mean of the devices', the temperature the hottest device's. A reading
that is NULL (a virtual device has no temperature or power) is left out of every mean,
sum and maximum, and a bucket without any such reading is None, never 0; sums over
devices come with how many devices were measured, so a total is never passed off as
covering devices it does not.

Training metrics: steps are bucketed the same way (`step // width`), giving each bucket's
mean, min and max and its last step: the chart draws the mean as a line and min-max as a
band, so a spike inside a bucket stays visible.

Nothing here imports Streamlit or the scheduler; functions take an engine and return
plain data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import BigInteger, Integer, case, cast, extract, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.sql import ColumnElement

from sae_dist.analytics.downsample import MAX_POINTS_PER_SERIES, points_per_series
from sae_dist.db.schema import GpuMinute, GpuSample, RankStat, StepMetric

SAMPLES = GpuSample.__table__
MINUTES = GpuMinute.__table__

DEVICE_FIELDS = ("utilization_pct", "memory_used", "memory_total", "temperature_c", "power_w")
"""The per-device series, named as gpu_samples' columns."""

TOTAL_FIELDS = ("utilization_pct", "memory_used", "memory_total", "temperature_c", "power_w",
                "power_devices", "memory_devices", "devices")
"""The series over several devices: mean utilisation, memory used and total of the devices
whose memory was read, hottest temperature, total power, and how many devices were measured
(power_devices, memory_devices) or reported at all (devices)."""

BUCKET_WIDTHS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800,
                   21600, 43200, 86400)
RAW_ROW_BUDGET = 100_000
"""Most samples a query reads from gpu_samples (at 1 Hz) before it uses minute rows."""
SAMPLE_RATE_HZ = 1.0


@dataclass
class Series:
    """Column-wise series: `columns["time"]` (aware UTC datetimes, the start of each bucket)
    and one list per field; `width_s` is what one point summarises, `source` where it was
    read ("samples" or "minutes")."""

    width_s: int
    source: str
    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns.get("time", ()))


# ---- buckets --------------------------------------------------------------------------------

def bucket_width(span_s: float, n_devices: int = 1, max_points: int = MAX_POINTS_PER_SERIES,
                 raw_row_budget: int = RAW_ROW_BUDGET) -> int:
    """Seconds a bucket covers for a window of `span_s` seconds over `n_devices` devices.

    The smallest round width with at most `max_points` buckets in the window (one more may
    be cut by the aligned edges, hence `max_points - 1`); at least a minute, so that the
    minute rows are read, when the raw samples would be more than `raw_row_budget`.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2, got {max_points}")
    span_s = max(float(span_s), 1.0)
    need = span_s / (max_points - 1)
    if span_s * SAMPLE_RATE_HZ * max(n_devices, 1) > raw_row_budget:
        need = max(need, 60.0)
    for width in BUCKET_WIDTHS_S:
        if width >= need:
            return width
    return math.ceil(need / 86400) * 86400


def _epoch(dt: datetime) -> float:
    if dt.utcoffset() is None:
        raise ValueError(f"naive datetime {dt!r}: pass timezone-aware UTC times")
    return dt.timestamp()


def _when(epoch_s: int | float) -> datetime:
    return datetime.fromtimestamp(epoch_s, timezone.utc)


def _sample_epoch(engine: Engine) -> ColumnElement:
    """gpu_samples.time as whole Unix seconds, in SQL (floor: a reading at 12.9 s is in 12)."""
    if engine.dialect.name == "sqlite":  # stored as "YYYY-MM-DD HH:MM:SS.ffffff" UTC text
        return cast(func.strftime("%s", SAMPLES.c.time), Integer)
    return cast(func.floor(extract("epoch", SAMPLES.c.time)), BigInteger)


def _per_device_query(engine: Engine, devices: Sequence[str], start_s: int, end: datetime,
                      width: int, source: str):
    """One row per (device, bucket): the device's figures in that bucket (see the module
    docstring), with `bucket` its start in Unix seconds."""
    if source == "minutes" or (source == "auto" and width % 60 == 0):
        m = MINUTES.c
        per = width // 60
        bucket = (m.minute // per * width).label("bucket")
        end_minute = math.ceil(_epoch(end) / 60)
        return (
            select(m.device_uuid, bucket,
                   (func.sum(m.utilization_sum) / func.nullif(func.sum(m.utilization_n), 0)
                    ).label("utilization_pct"),
                   (func.sum(m.memory_used_sum) / func.nullif(func.sum(m.memory_used_n), 0)
                    ).label("memory_used"),
                   func.max(m.memory_total_max).label("memory_total"),
                   func.max(m.temperature_max).label("temperature_c"),
                   (func.sum(m.power_sum) / func.nullif(func.sum(m.power_n), 0)).label("power_w"))
            .where(m.device_uuid.in_(list(devices)), m.minute >= start_s // 60,
                   m.minute < end_minute)
            .group_by(m.device_uuid, bucket)
        ), "minutes"
    s = SAMPLES.c
    bucket = (_sample_epoch(engine) // width * width).label("bucket")
    return (
        select(s.device_uuid, bucket,
               func.avg(s.utilization_pct).label("utilization_pct"),
               func.avg(s.memory_used).label("memory_used"),
               func.max(s.memory_total).label("memory_total"),
               func.max(s.temperature_c).label("temperature_c"),
               func.avg(s.power_w).label("power_w"))
        .where(s.device_uuid.in_(list(devices)), s.time >= _when(start_s), s.time <= end)
        .group_by(s.device_uuid, bucket)
    ), "samples"


SOURCES = ("auto", "samples", "minutes")


def _window(devices: Sequence[str], start: datetime, end: datetime, max_points: int,
            raw_row_budget: int, source: str) -> tuple[int, int]:
    if end < start:
        raise ValueError(f"the window ends ({end}) before it starts ({start})")
    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    width = bucket_width(_epoch(end) - _epoch(start), len(devices), max_points, raw_row_budget)
    if source == "minutes":
        width = math.ceil(width / 60) * 60
    return width, int(_epoch(start)) // width * width


def device_series(engine: Engine, devices: Sequence[str], start: datetime, end: datetime,
                  max_points: int = MAX_POINTS_PER_SERIES,
                  raw_row_budget: int = RAW_ROW_BUDGET, source: str = "auto"
                  ) -> dict[str, Series]:
    """Each device's series (DEVICE_FIELDS) between `start` and `end` (aware datetimes),
    keyed by device uuid; a device without readings in the window has an empty Series.

    `source` "auto" reads whole-minute buckets from gpu_minutes and shorter ones from
    gpu_samples; "samples" or "minutes" forces one (the minutes round the width up to a
    whole minute)."""
    devices = list(dict.fromkeys(devices))
    if not devices:
        return {}
    width, start_s = _window(devices, start, end, max_points, raw_row_budget, source)
    query, source = _per_device_query(engine, devices, start_s, end, width, source)
    query = query.order_by("device_uuid", "bucket")
    out = {d: Series(width, source, {"time": [], **{f: [] for f in DEVICE_FIELDS}})
           for d in devices}
    with engine.connect() as conn:
        for row in conn.execute(query).mappings():
            columns = out[row["device_uuid"]].columns
            columns["time"].append(_when(row["bucket"]))
            for name in DEVICE_FIELDS:
                columns[name].append(_number(row[name]))
    return out


def total_series(engine: Engine, devices: Sequence[str], start: datetime, end: datetime,
                 max_points: int = MAX_POINTS_PER_SERIES,
                 raw_row_budget: int = RAW_ROW_BUDGET, source: str = "auto") -> Series:
    """The series over `devices` together (TOTAL_FIELDS), one point per bucket where at
    least one of them reported; `source` as for `device_series`."""
    devices = list(dict.fromkeys(devices))
    columns: dict[str, list] = {"time": [], **{f: [] for f in TOTAL_FIELDS}}
    if not devices:
        return Series(bucket_width(_epoch(end) - _epoch(start)), "samples", columns)
    width, start_s = _window(devices, start, end, max_points, raw_row_budget, source)
    query, source = _per_device_query(engine, devices, start_s, end, width, source)
    per = query.subquery()
    read_memory = per.c.memory_used.is_not(None)
    totals = (
        select(per.c.bucket,
               func.avg(per.c.utilization_pct).label("utilization_pct"),
               func.sum(per.c.memory_used).label("memory_used"),
               func.sum(case((read_memory, per.c.memory_total))).label("memory_total"),
               func.max(per.c.temperature_c).label("temperature_c"),
               func.sum(per.c.power_w).label("power_w"),
               func.count(per.c.power_w).label("power_devices"),
               func.count(per.c.memory_used).label("memory_devices"),
               func.count().label("devices"))
        .group_by(per.c.bucket).order_by(per.c.bucket)
    )
    with engine.connect() as conn:
        for row in conn.execute(totals).mappings():
            columns["time"].append(_when(row["bucket"]))
            for name in TOTAL_FIELDS:
                columns[name].append(_number(row[name]))
    return Series(width, source, columns)


def _number(value: Any) -> float | int | None:
    if value is None:
        return None
    if isinstance(value, float):
        return None if math.isnan(value) else value
    return value if isinstance(value, int) else float(value)  # Decimal from PostgreSQL


# ---- the latest readings --------------------------------------------------------------------

def latest_samples(engine: Engine, devices: Sequence[str], at: datetime | None = None,
                   since: datetime | None = None) -> dict[str, dict[str, Any] | None]:
    """Each device's newest reading at or before `at` (default: the newest of all), and not
    before `since` when given: {uuid: {"time", DEVICE_FIELDS..., "job_id"} or None}. One index
    seek a device on (device_uuid, time)."""
    s = SAMPLES.c
    out: dict[str, dict[str, Any] | None] = {}
    with engine.connect() as conn:
        for device in dict.fromkeys(devices):
            query = select(s.time, *[getattr(s, f) for f in DEVICE_FIELDS], s.job_id).where(
                s.device_uuid == device)
            if at is not None:
                query = query.where(s.time <= at)
            if since is not None:
                query = query.where(s.time >= since)
            row = conn.execute(query.order_by(s.time.desc()).limit(1)).mappings().first()
            out[device] = dict(row) if row is not None else None
    return out


def first_sample_time(engine: Engine, devices: Sequence[str]) -> datetime | None:
    """When the oldest reading of any of `devices` was taken (index seeks), None without any."""
    s = SAMPLES.c
    firsts = []
    with engine.connect() as conn:
        for device in dict.fromkeys(devices):
            first = conn.execute(select(func.min(s.time)).where(s.device_uuid == device)).scalar()
            if first is not None:
                firsts.append(first if first.tzinfo else first.replace(tzinfo=timezone.utc))
    return min(firsts) if firsts else None


def current_totals(latest: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """The figures over several devices from their latest readings (`latest_samples`), with
    the same rules as `total_series`; "devices" counts those with a reading."""
    readings = [r for r in latest.values() if r is not None]
    utils = [r["utilization_pct"] for r in readings if r["utilization_pct"] is not None]
    memory = [r for r in readings if r["memory_used"] is not None]
    temps = [r["temperature_c"] for r in readings if r["temperature_c"] is not None]
    powers = [r["power_w"] for r in readings if r["power_w"] is not None]
    totals = [r["memory_total"] for r in memory if r["memory_total"] is not None]
    return {
        "utilization_pct": sum(utils) / len(utils) if utils else None,
        "memory_used": sum(r["memory_used"] for r in memory) if memory else None,
        "memory_total": sum(totals) if totals and len(totals) == len(memory) else None,
        "temperature_c": max(temps) if temps else None,
        "power_w": sum(powers) if powers else None,
        "power_devices": len(powers),
        "memory_devices": len(memory),
        "devices": len(readings),
    }


# ---- training metrics, bucketed by step -----------------------------------------------------

def step_width(first_step: int, last_step: int, max_points: int = MAX_POINTS_PER_SERIES) -> int:
    """Steps a bucket covers so that the steps from first to last make at most `max_points`."""
    span = max(last_step - first_step + 1, 1)
    return max(1, math.ceil(span / (max_points - 1)))


def run_curves(engine: Engine, run_id: int, metrics: Sequence[str],
               max_points: int = MAX_POINTS_PER_SERIES) -> dict[str, Any]:
    """One run's metrics by step bucket: {"width": steps a bucket, "step": the last logged
    step of each bucket, metric: means, f"{metric}_min", f"{metric}_max"}. A bucket where a
    metric was never measured is None for it (and drawn as a gap)."""
    unknown = [m for m in metrics if m not in StepMetric.__table__.columns]
    if unknown:
        raise ValueError(f"not step metrics: {', '.join(unknown)}")
    t = StepMetric.__table__.c
    with engine.connect() as conn:
        first, last = conn.execute(select(func.min(t.step), func.max(t.step))
                                   .where(t.run_id == run_id)).one()
        out: dict[str, Any] = {"width": 1, "step": []}
        for m in metrics:
            out[m], out[f"{m}_min"], out[f"{m}_max"] = [], [], []
        if first is None:
            return out
        width = out["width"] = step_width(first, last, max_points)
        bucket = (t.step // width).label("bucket")
        columns = [func.max(t.step).label("step")]
        for m in metrics:
            column = getattr(t, m)
            columns += [func.avg(column).label(m), func.min(column).label(f"{m}_min"),
                        func.max(column).label(f"{m}_max")]
        query = (select(bucket, *columns).where(t.run_id == run_id)
                 .group_by(bucket).order_by(bucket))
        for row in conn.execute(query).mappings():
            out["step"].append(row["step"])
            for m in metrics:
                for key in (m, f"{m}_min", f"{m}_max"):
                    out[key].append(_number(row[key]))
    return out


def rank_times(engine: Engine, run_id: int, field: str = "step_time_s",
               max_rows: int = 4_000) -> dict[str, Any]:
    """Per-rank `field` ("step_time_s" or "compute_time_s") by step bucket, column-wise:
    {"width", "step" (last step of the bucket), "rank", "device", "mean_s", "max_s",
    "stragglers" (steps flagged in the bucket)}; at most about `max_rows` rows in all."""
    if field not in ("step_time_s", "compute_time_s"):
        raise ValueError(f"field must be step_time_s or compute_time_s, got {field!r}")
    t = RankStat.__table__.c
    out: dict[str, Any] = {"width": 1, "step": [], "rank": [], "device": [], "mean_s": [],
                           "max_s": [], "stragglers": []}
    with engine.connect() as conn:
        first, last = conn.execute(select(func.min(t.step), func.max(t.step))
                                   .where(t.run_id == run_id)).one()
        if first is None:
            return out
        ranks = conn.execute(select(t.rank, t.device).where(t.run_id == run_id, t.step == last)
                             .order_by(t.rank)).all()
        devices = dict(ranks)
        per_rank = points_per_series(max(len(ranks), 1), max_rows)
        width = out["width"] = step_width(first, last, per_rank)
        bucket = (t.step // width).label("bucket")
        value = getattr(t, field)
        query = (select(t.rank, bucket, func.max(t.step).label("step"),
                        func.avg(value).label("mean_s"), func.max(value).label("max_s"),
                        func.sum(case((t.is_straggler, 1), else_=0)).label("stragglers"))
                 .where(t.run_id == run_id).group_by(t.rank, bucket).order_by(t.rank, bucket))
        for row in conn.execute(query).mappings():
            out["step"].append(row["step"])
            out["rank"].append(row["rank"])
            out["device"].append(devices.get(row["rank"]))
            out["mean_s"].append(_number(row["mean_s"]))
            out["max_s"].append(_number(row["max_s"]))
            out["stragglers"].append(int(row["stragglers"] or 0))
    return out
