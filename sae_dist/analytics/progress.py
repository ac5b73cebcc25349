"""How far a job's training is and what it is doing before its first step: the Monitor's
progress line, ETA and start-up status, as pure functions of plain data.

The ETA comes from the recent step rate (the last minute of logged steps, or the last few
logged steps when the minute holds fewer), not from the run's average: start-up, a rebalance
or a slower phase would otherwise skew it. With no rate there is no ETA, and the page says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

RATE_WINDOW_S = 60.0
"""The rate is measured over the logged steps of the last minute before the newest one..."""
RATE_MIN_POINTS = 5
"""...or over the last this many logged steps when the minute holds fewer."""


@dataclass(frozen=True)
class Rate:
    steps_per_s: float
    steps: int  # the steps the rate was measured over
    seconds: float  # and the time they took


@dataclass(frozen=True)
class Startup:
    """What a job is doing before its first logged step: a title and what is known."""
    title: str
    detail: str


def recent_rate(points: list[tuple[int, datetime]]) -> Rate | None:
    """The step rate over the recent logged steps ((step, time), oldest first); None without
    two logged steps that differ in step and time."""
    if len(points) < 2:
        return None
    newest_step, newest_time = points[-1]
    recent = [p for p in points if (newest_time - p[1]).total_seconds() <= RATE_WINDOW_S]
    if len(recent) < RATE_MIN_POINTS:
        recent = points[-RATE_MIN_POINTS:]
    first_step, first_time = recent[0]
    steps, seconds = newest_step - first_step, (newest_time - first_time).total_seconds()
    if steps <= 0 or seconds <= 0:
        return None
    return Rate(steps / seconds, steps, seconds)


def eta_s(last_step: int, total_steps: int | None, rate: Rate | None) -> float | None:
    """Seconds left at the recent rate: remaining steps / rate; 0 when done; None when the total
    or the rate is unknown."""
    if not total_steps:
        return None
    remaining = max(0, total_steps - last_step)
    if remaining == 0:
        return 0.0
    return remaining / rate.steps_per_s if rate is not None else None


def startup_status(job: dict, run: dict | None, has_steps: bool, now: datetime) -> Startup | None:
    """What a running training job is doing before its first logged step, said from what exists:
    no run row yet (its ranks start, join and open the data source: a model loads then), or a
    run but no step (the SAEs are built, the first batch read, the first steps run). The job's
    log says each of these as it begins; the Monitor shows its last line beside this. None once
    a step is logged, or for a job that is not a running training."""
    if job["kind"] != "train" or job["state"] != "RUNNING" or has_steps:
        return None
    ranks = job["gpus"] or 1
    if run is None:
        since = _seconds(job["started_at"], now)
        return Startup(f"Starting {ranks} rank{'s' if ranks != 1 else ''}",
                       f"The job started {since} ago; the trainer records its run once its ranks "
                       "have joined and opened the data source.")
    since = _seconds(run["started_at"] or run["created_at"] or job["started_at"], now)
    return Startup("Building the SAEs / first steps",
                   f"Run {run['id']} was recorded {since} ago; its first metrics are logged after "
                   f"{_every(run)} steps.")


def _every(run: dict) -> str:
    every = (run.get("config") or {}).get("log_every")
    return f"the first {every:,}" if isinstance(every, int) else "the first few"


def _seconds(start: datetime | None, now: datetime) -> str:
    if start is None:
        return "an unknown time"
    return f"{max(0, round((now - start).total_seconds())):,} s"
