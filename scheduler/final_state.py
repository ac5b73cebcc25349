"""A job's real end, kept durably until the database has it.

The supervisor learns how a job ended (state, exit code, signal, when) at a moment the state
database may not take a write: read-only, a full disk, a lock held past the busy timeout. Lost,
that end would become NODE_FAIL once the supervisor is gone. So the supervisor first writes it
to `final.json` in the job's state directory (`$SAE_DIST_HOME/jobs/<id>/`: written to a
temporary file, fsynced, renamed over, the directory fsynced), then records it, retrying with
backoff while the storage refuses. Whoever can write next records it: the supervisor itself,
or, when the supervisor is gone, the daemon's reaper through `replay_final_state` (instead of
NODE_FAIL). The file is removed once the database has the end.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

from sae_dist.paths import state_home
from scheduler import store
from scheduler.storage_errors import storage_problem

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.25
MAX_RETRY_S = 30.0


@dataclass(frozen=True)
class FinalState:
    """How a job ended, as the supervisor saw it."""

    state: str  # SLURM's name: COMPLETED, FAILED, CANCELLED, TIMEOUT, OUT_OF_MEMORY
    exit_code: int | None
    signal: int | None
    reason: str | None
    ended_at: str  # ISO 8601, UTC: when it ended, not when the database took it
    cancelled: bool = False  # a cancel ended it (a requeue asked for meanwhile is honoured)
    started_at: str | None = None  # ISO: the run it ended, so a requeued job's next run never takes it

    def ended(self) -> datetime:
        return datetime.fromisoformat(self.ended_at)


def record_path(job_id: int) -> Path:
    return state_home() / "jobs" / str(job_id) / "final.json"


def keep(job_id: int, final: FinalState) -> bool:
    """Write the end durably (atomic: a reader sees the whole record or none). False when the
    disk refuses it too: the database may still take it."""
    path = record_path(job_id)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w") as f:
            f.write(json.dumps(asdict(final)))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # the rename itself survives a crash
        finally:
            os.close(directory)
        return True
    except OSError as e:
        log.warning("job %d ended %s; could not keep it in %s either: %s", job_id, final.state, path, e)
        tmp.unlink(missing_ok=True)
        return False


def kept(job_id: int) -> FinalState | None:
    """The end kept for a job, or None (none, or unreadable: then the job's end is unknown)."""
    try:
        return FinalState(**json.loads(record_path(job_id).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def record(engine, job_id: int, final: FinalState) -> str:
    """Store the end (and a requeue asked for while it was being cancelled), then drop the
    kept file. Returns the state the job was left in. An end kept for an earlier run of the job
    (it was requeued and started again since) is dropped, not recorded."""
    job = store.get_job(engine, job_id)
    run = datetime.fromisoformat(final.started_at) if final.started_at is not None else None
    if run is not None and job.started_at != run:
        _forget(job_id)
        return job.state
    requeue_asked = final.cancelled and job.reason == "Requeue requested"
    state = store.finish_job(engine, job_id, final.state, exit_code=final.exit_code, signal=final.signal,
                             reason=final.reason, now=final.ended())
    if requeue_asked:
        store.requeue(engine, job_id)
        state = "PENDING"
    _forget(job_id)
    return state


def _forget(job_id: int) -> None:
    """Drop the kept end and its directory (no empty directory per job is left behind)."""
    path = record_path(job_id)
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:  # gone already, or holds something else
        pass


def record_until_stored(engine, job_id: int, final: FinalState, wait: Callable[[float], None] = time.sleep,
                        lost: Callable[[], bool] = lambda: False) -> str | None:
    """The supervisor's way: keep the end on disk, then record it, retrying with backoff (up to
    MAX_RETRY_S apart) for as long as the storage refuses. Another error is a bug: it raises.
    Returns None, recording nothing, once `lost()` says the database itself was removed or
    replaced: no queue is left to take the end (nor a home to keep it in)."""
    stored_on_disk = False
    delay = FIRST_RETRY_S
    while True:
        if lost():
            log.error("job %d ended %s (exit %s); not recorded: its state database was removed or replaced "
                      "while it ran", job_id, final.state, final.exit_code)
            return None
        if not stored_on_disk:
            stored_on_disk = keep(job_id, final)
        try:
            return record(engine, job_id, final)
        except Exception as e:
            problem = storage_problem(e)
            if problem is None:
                raise
            log.warning("job %d ended %s; the database cannot take it yet (%s); again in %.2g s",
                        job_id, final.state, problem, delay)
        engine.dispose()  # the next try on a fresh connection
        wait(delay)
        delay = min(MAX_RETRY_S, delay * 2)


def replay_final_state(engine, job_id: int) -> str | None:
    """For the daemon's reaper, before it ends a job whose supervisor vanished as NODE_FAIL:
    the end that supervisor kept, recorded now. Returns the state recorded, None when nothing
    was kept (then NODE_FAIL is the truth). Storage errors raise (the reaper tries again on a
    later pass)."""
    final = kept(job_id)
    if final is None:
        return None
    state = record(engine, job_id, final)
    log.info("job %d: recorded the end its supervisor kept (%s, exit %s)", job_id, final.state, final.exit_code)
    return state
