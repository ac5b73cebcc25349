"""Jobs on a real SLURM cluster: `sbatch` submits them, `squeue --json` (and `sacct`) tell their
state, `scancel` cancels them. We run nothing ourselves: the `cluster_jobs` table only says which
SLURM jobs are ours and keeps the last state SLURM reported, for when SLURM has forgotten a job
(squeue keeps a finished job for MinJobAge, 300 s by default; sacct needs an accounting store).

The parsing is pure (plain text in, rows out); the commands run at the edges with time limits.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

from sqlalchemy import select, update
from sqlalchemy.engine import Engine
from sqlmodel import Session

from sae_dist.db.schema import ClusterJob
from sae_dist.errors import UserError

PREFIX = "slurm:"  # how our commands name a cluster job: slurm:1234
FINAL = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                   "BOOT_FAIL", "DEADLINE"})
COMMAND_TIMEOUT_S = 30


@dataclass(frozen=True)
class SlurmState:
    job_id: str
    state: str
    exit_code: int | None = None
    signal: int | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None


def _when(epoch) -> datetime | None:
    value = epoch.get("number") if isinstance(epoch, dict) else epoch  # newer SLURMs wrap numbers
    return datetime.fromtimestamp(int(value), timezone.utc) if value else None


def _wait_status(raw) -> tuple[int | None, int | None]:
    """(exit code, signal) from squeue's exit_code: a raw wait status in 22.05 (768 = exit 3), an
    object with return_code/signal in newer versions."""
    if isinstance(raw, dict):
        code = raw.get("return_code")
        sig = (raw.get("signal") or {}).get("id")
        return ((code.get("number") if isinstance(code, dict) else code),
                (sig.get("number") if isinstance(sig, dict) else sig))
    if raw is None:
        return None, None
    raw = int(raw)
    return (raw >> 8) & 0xFF, (raw & 0x7F) or None


def parse_squeue_json(text: str) -> dict[str, SlurmState]:
    """`squeue --json` -> {job id: state}."""
    out = {}
    for job in json.loads(text).get("jobs", []):
        state = job.get("job_state")
        if isinstance(state, list):  # newer versions: a list of flags, the first is the state
            state = state[0] if state else "UNKNOWN"
        code, sig = _wait_status(job.get("exit_code"))
        job_id = str(job.get("job_id"))
        out[job_id] = SlurmState(job_id, str(state), code, sig,
                                 _when(job.get("start_time")), _when(job.get("end_time")))
    return out


def parse_sacct(text: str) -> dict[str, SlurmState]:
    """`sacct --parsable2 --noheader -o JobID,State,ExitCode` -> {job id: state} (steps skipped)."""
    out = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 3 or "." in parts[0]:
            continue
        code, _, sig = parts[2].partition(":")
        out[parts[0]] = SlurmState(parts[0], parts[1].split()[0] if parts[1] else "UNKNOWN",
                                   int(code) if code.isdigit() else None,
                                   int(sig) if sig.isdigit() and int(sig) else None)
    return out


def parse_cluster_id(text: str) -> str | None:
    """'slurm:1234' -> '1234'; None for a local job id."""
    if not text.startswith(PREFIX):
        return None
    job_id = text[len(PREFIX):]
    if not job_id.isdigit():
        raise UserError(f"{text!r}: a cluster job is slurm:<SLURM job id>, e.g. slurm:1234")
    return job_id


# ---- the edges: commands and the table ----

OUR_SBATCH_MARK = b"scheduler.cli"
"""In our own `sbatch` console script (pyproject.toml: it queues on this machine), never SLURM's."""


def slurm_command(name: str, path: str | None = None) -> str | None:
    """SLURM's own command on `path` (default $PATH); None if it has none. Our `sbatch` console
    script, which an activated virtualenv puts first on PATH, is passed over: it would queue the
    job on this machine."""
    for folder in (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep):
        found = shutil.which(name, path=folder or ".")
        if found is None:
            continue
        try:
            with open(found, "rb") as f:
                head = f.read(4096)
        except OSError:
            head = b""
        if OUR_SBATCH_MARK not in head:
            return found
    return None


def _run(argv: list[str], cwd: str | None = None) -> subprocess.CompletedProcess:
    command = slurm_command(argv[0])
    if command is None:
        raise UserError(f"{argv[0]} is not installed here: --cluster slurm needs SLURM's commands "
                        f"(Debian: slurm-client) and a cluster they reach")
    try:
        return subprocess.run([command, *argv[1:]], cwd=cwd, capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"{argv[0]} did not answer in {COMMAND_TIMEOUT_S} s: is the SLURM controller up?") from None


def submit(engine: Engine, spec, script: str, script_dir: Path) -> str:
    """sbatch the script (written under script_dir) in the job's working directory; the SLURM id."""
    script_dir.mkdir(parents=True, exist_ok=True)
    path = script_dir / f"{spec.name}-{datetime.now():%Y%m%d-%H%M%S-%f}.sbatch"
    path.write_text(script)
    result = _run(["sbatch", "--parsable", str(path)], cwd=spec.workdir)
    if result.returncode != 0:
        raise UserError(f"sbatch refused the job: "
                        f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.returncode}")
    job_id = result.stdout.strip().split(";")[0]
    with Session(engine) as session:
        session.add(ClusterJob(cluster="slurm", cluster_job_id=job_id, name=spec.name, user=getpass.getuser(),
                               kind=spec.kind, workdir=spec.workdir, script_path=str(path),
                               train_config_json=json.dumps(spec.train_config) if spec.train_config else None))
        session.commit()
    return job_id


def script_job(spec) -> SimpleNamespace:
    """What sbatch_script reads of a job, from a validated JobSpec (no local job row)."""
    return SimpleNamespace(id=None, name=spec.name, kind=spec.kind, gpus=spec.gpus or 1, exclusive=spec.exclusive,
                           workdir=spec.workdir,
                           time_limit_s=spec.time_limit_s, env_json=json.dumps(spec.env or {}),
                           train_config_json=json.dumps(spec.train_config) if spec.train_config else None,
                           argv_json=json.dumps(spec.argv))


def refresh(engine: Engine) -> list[ClusterJob]:
    """Our cluster jobs with the state SLURM reports now (stored); those SLURM no longer knows keep
    their last state. Nothing is asked of SLURM when every job of ours has ended."""
    with Session(engine, expire_on_commit=False) as session:
        jobs = list(session.scalars(select(ClusterJob).order_by(ClusterJob.id)))
    live = [j for j in jobs if j.state not in FINAL]
    if live:
        states = _query([j.cluster_job_id for j in live])
        with engine.begin() as conn:
            for job in live:
                s = states.get(job.cluster_job_id)
                if s is None:
                    continue
                fields = {"state": s.state, "exit_code": s.exit_code, "signal": s.signal,
                          "started_at": s.started_at or job.started_at, "ended_at": s.ended_at or job.ended_at}
                conn.execute(update(ClusterJob).where(ClusterJob.id == job.id).values(**fields))
                for k, v in fields.items():
                    setattr(job, k, v)
    return jobs


def listed(engine: Engine) -> tuple[list[ClusterJob], str | None]:
    """refresh(), or, when SLURM cannot be asked, the last states stored and why (for the app)."""
    try:
        return refresh(engine), None
    except UserError as e:
        with Session(engine, expire_on_commit=False) as session:
            return list(session.scalars(select(ClusterJob).order_by(ClusterJob.id))), str(e)


def _query(ids: list[str]) -> dict[str, SlurmState]:
    states: dict[str, SlurmState] = {}
    result = _run(["squeue", "--json"])
    if result.returncode == 0:
        states.update({k: v for k, v in parse_squeue_json(result.stdout).items() if k in ids})
    missing = [i for i in ids if i not in states]
    if missing and shutil.which("sacct"):
        # With an accounting store, plain sacct; a cluster with only jobcomp/filetxt answers `sacct -c`.
        for extra in ([], ["-c"]):
            acct = _run(["sacct", *extra, "--parsable2", "--noheader", "-o", "JobID,State,ExitCode",
                         "-j", ",".join(missing)])
            if acct.returncode == 0 and acct.stdout.strip():
                states.update(parse_sacct(acct.stdout))
                break
    return states


def cancel(engine: Engine, job_id: str) -> str:
    with Session(engine) as session:
        known = session.scalars(select(ClusterJob).where(ClusterJob.cluster_job_id == job_id)).first()
    if known is None:
        raise UserError(f"{PREFIX}{job_id} was not submitted by sae-dist (see `queue --all`)")
    result = _run(["scancel", job_id])
    if result.returncode != 0:
        raise UserError(f"scancel {job_id}: {result.stderr.strip() or result.returncode}")
    return f"{PREFIX}{job_id}: cancel sent to SLURM"
