"""The scheduler's tables: the database itself refuses a double allocation or a shared port."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, func, select

from sae_dist.db import Allocation, Job, get_engine, utcnow


def _job(session: Session, **fields) -> Job:
    job = Job(name="j", user="me", kind="command", argv_json='["true"]', gpus=1, workdir="/tmp", **fields)
    session.add(job)
    session.commit()
    session.refresh(job)
    return job


def test_two_active_allocations_cannot_hold_one_device():
    engine = get_engine()
    with Session(engine) as s:
        a, b = _job(s), _job(s)
        s.add(Allocation(job_id=a.id, device_uuid="virtual-0"))
        s.commit()
        s.add(Allocation(job_id=b.id, device_uuid="virtual-0"))
        with pytest.raises(IntegrityError):
            s.commit()
        s.rollback()
        first = s.exec(select(Allocation)).one()
        first.released_at = utcnow()
        s.commit()
        s.add(Allocation(job_id=b.id, device_uuid="virtual-0"))  # free again: allowed
        s.commit()
        assert s.exec(select(func.count()).select_from(Allocation)).one() == 2


def test_running_jobs_never_share_a_port():
    engine = get_engine()
    with Session(engine) as s:
        _job(s, state="RUNNING", port=29600)
        _job(s, state="COMPLETED", port=29600)  # history may repeat a port
        with pytest.raises(IntegrityError):
            _job(s, state="RUNNING", port=29600)
