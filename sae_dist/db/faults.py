"""Devices a training rank died on: the trainer's launcher records them, the scheduler keeps such
a device out of new jobs and clears the fault once a health check passes."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.schema import DeviceFault, utcnow


def record_fault(engine: Engine, device_uuid: str, reason: str, *, job_id: int | None = None,
                 run_id: int | None = None, rank: int | None = None) -> int:
    with Session(engine, expire_on_commit=False) as session:
        fault = DeviceFault(device_uuid=device_uuid, reason=reason, job_id=job_id, run_id=run_id, rank=rank)
        session.add(fault)
        session.commit()
        return fault.id


def active_faults(engine: Engine) -> list[DeviceFault]:
    """Uncleared faults, oldest first (a device may have several)."""
    query = select(DeviceFault).where(DeviceFault.cleared_at.is_(None)).order_by(DeviceFault.id)
    with Session(engine, expire_on_commit=False) as session:
        return list(session.scalars(query))


def clear_faults(engine: Engine, device_uuid: str, reason: str) -> int:
    """Mark every open fault of a device cleared; returns how many were open."""
    with engine.begin() as conn:
        result = conn.execute(update(DeviceFault)
                              .where(DeviceFault.device_uuid == device_uuid, DeviceFault.cleared_at.is_(None))
                              .values(cleared_at=utcnow(), cleared_reason=reason))
        return result.rowcount
