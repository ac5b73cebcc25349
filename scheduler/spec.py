"""What a user asks the scheduler for (`JobSpec`), checked in one place, and the parsers behind `submit`.

Every mistake a user can make on `submit` — a bad time string, an unknown dependency kind, an
environment variable we refuse, a working directory that is not there — is found here, before
anything touches the database, and reported as one `UserError` line that names the flag and says
what to do. The same spec is built from the CLI, from the app and from tests, so all agree.

Formats follow SLURM's (`--time`, `--begin`, `--dependency`, `--output` with `%j`/`%x`) so habits
carry over; where we accept less than SLURM, the error says what we do accept.

This module is pure and imports fast: no torch, no database. A training job's config is checked
by the trainer's own validation (sae_dist.contract), whose code is imported only for training jobs.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta, tzinfo
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sae_dist.contract import JOB_ID_ENV, RESERVED_JOB_ENV, TRAIN_FLAG, checked_train_config
from sae_dist.contract.sweep_argv import SWEEP_KEY, CheckedTrain, check_stored, split_stored
from sae_dist.errors import UserError

if TYPE_CHECKING:
    from sae_dist.config import TrainConfig
    from scheduler.snapshot import Snapshot

KINDS = ("command", "train", "batch")
# A batch script (`submit job.sh`): a command (its #! interpreter on a copy of the script) that
# also gets SLURM_JOB_ID, SLURM_JOB_NAME and SLURM_SUBMIT_DIR (scheduler.supervisor.job_environment).
BATCH = "batch"
SUBMIT_DIR_ENV = "SLURM_SUBMIT_DIR"  # stored with a batch job's environment: where it was submitted
EXPORT_ENV = "SAE_DIST_EXPORT"  # stored as NONE with a batch job started from a bare environment
DEPENDENCY_KINDS = ("afterok", "afterany", "afternotok")

# The flag each JobSpec field comes from, so an error names what the user typed (SLURM's spellings).
FLAGS: dict[str, str] = {
    "name": "--job-name", "kind": "submit", "argv": "the command after --", "train_config": TRAIN_FLAG,
    "gpus": "--gpus", "gpu_ids": "--gpu-ids", "mem_per_gpu": "--mem-per-gpu", "priority": "--priority",
    "time_limit_s": "--time", "begin_at": "--begin", "dependencies": "--dependency", "held": "--hold",
    "requeue": "--requeue", "exclusive": "--exclusive", "workdir": "--chdir", "env": "--env",
    "stdout": "--output", "stderr": "--error", "preemptible": "--preemptible", "preempt_grace_s": "--grace-time",
    "submit_dir": "submit", "export_all": "--export", "shared": "--shared",
}

_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_text(value: Any, flag: str) -> None:
    """Text the database stores must be UTF-8: a shell passes bytes that are not (a name typed in
    another encoding) as surrogates, which no database column takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise _err(flag, f"{value!r} is not valid UTF-8 text") from None
# SLURM's nice range; priority = -nice must fit the database's integer column.
MAX_PRIORITY = 2_147_483_645
MAX_NAME_CHARS = 256
# The longest time limit taken (SLURM's own limits are a site's choice; a year is past any
# job's need, and a larger number is a typo). Beyond it: UNLIMITED.
MAX_TIME_LIMIT_S = 365 * 86400
# A preemption's SIGTERM-to-SIGKILL time: SLURM's GraceTime default, and the most taken.
DEFAULT_GRACE_S = 60.0
MAX_GRACE_S = 86400.0


def grace_time(stored: float | None) -> float:
    """A preemptible job's grace time as stored (None: the default)."""
    return DEFAULT_GRACE_S if stored is None else stored
# %x in a file name is cut to this many bytes: a file name component may be at most 255,
# and the pattern may add its own text (or a second %x) around it.
MAX_NAME_IN_PATH_BYTES = 100
# %j, %x and %% (with SLURM's optional zero-padding width for %j, e.g. %5j), and for a job
# array's tasks %A (the array's id) and %a (the task id). Other letters (%N, %u, ...) are refused
# at submit so a ported script never writes a file literally named "%N.out"; a stored pattern
# with one is left literal by expand_output (it never raises).
_OUTPUT_TOKEN = re.compile(r"%([0-9]*)(.?)", re.DOTALL)
OUTPUT_LETTERS = ("j", "x", "%", "A", "a")
ARRAY_LETTERS = ("A", "a")
_PADDED_LETTERS = ("j", "A", "a")


def _err(flag: str, message: str) -> UserError:
    return UserError(f"{flag}: {message}")


# ---------------------------------------------------------------------------------------------
# Parsers: one string (or list) from the command line in, a plain value out.
# ---------------------------------------------------------------------------------------------

_TIME_HELP = ("use minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes, "
              "days-hours:minutes:seconds, or UNLIMITED")


def parse_time_limit(s: str) -> float | None:
    """SLURM's --time formats -> seconds; "UNLIMITED"/"infinite" -> None (no limit).

    "0" is refused: SLURM reads it as "no limit", which is easy to mistype; say UNLIMITED.
    Fields after the first must be in range (minutes and seconds < 60, hours after days < 24).
    """
    text = str(s).strip()
    if text.lower() in ("unlimited", "infinite"):
        return None
    bad = _err("--time", f"{s!r} is not a time limit; {_TIME_HELP}")
    days_text, dash, rest = text.partition("-")
    if dash:
        parts = rest.split(":")
        if not _all_digits([days_text, *parts]) or len(parts) > 3:
            raise bad
        days = int(days_text)
        hours, minutes, seconds = [int(p) for p in parts] + [0] * (3 - len(parts))
        if hours >= 24 or minutes >= 60 or seconds >= 60:
            raise bad
    else:
        parts = text.split(":")
        if not _all_digits(parts) or len(parts) > 3:
            raise bad
        values = [int(p) for p in parts]
        if len(values) == 1:
            days, hours, minutes, seconds = 0, 0, values[0], 0  # a bare number is minutes
        elif len(values) == 2:
            days, hours, (minutes, seconds) = 0, 0, values
        else:
            days, (hours, minutes, seconds) = 0, values
        if any(v >= 60 for v in values[1:]):
            raise bad
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total == 0:
        raise _err("--time", f"{s!r} is a limit of zero; give a positive time, or UNLIMITED for none")
    _check_time_limit_range(total, s)
    return float(total)


def _check_time_limit_range(seconds: float, given: Any) -> None:
    if seconds > MAX_TIME_LIMIT_S:
        raise _err("--time", f"{given!r} is more than the longest limit, 365 days (365-00:00:00); "
                   "use UNLIMITED for no limit")


def _all_digits(parts: list[str]) -> bool:
    # isascii: str.isdigit() also accepts "²" and other digits int() would choke on.
    return all(p.isascii() and p.isdigit() for p in parts)


def parse_dependency(s: str) -> list[tuple[str, int]]:
    """"afterok:1:2,afterany:3" -> [("afterok", 1), ("afterok", 2), ("afterany", 3)].

    Every condition must hold (SLURM's ','). SLURM's '?' (any one of) is not supported.
    Whether the ids exist is checked against the database by the caller.
    """
    text = str(s).strip()
    if "?" in text:
        raise _err("--dependency", f"{s!r}: '?' (any one of) is not supported; "
                   "list conditions with ',' (all must hold)")
    if not text:
        raise _err("--dependency", "empty; write e.g. afterok:12 or afterany:12:13,afternotok:14")
    result: list[tuple[str, int]] = []
    for item in text.split(","):
        kind, _, ids_text = item.strip().partition(":")
        if kind not in DEPENDENCY_KINDS:
            raise _err("--dependency", f"unknown kind {kind!r} in {s!r}; use {', '.join(DEPENDENCY_KINDS)}")
        ids = ids_text.split(":")
        if not ids_text or not _all_digits(ids) or any(int(i) < 1 for i in ids):
            raise _err("--dependency", f"{item.strip()!r} in {s!r} needs positive job ids, e.g. {kind}:12:13")
        for i in ids:
            if (kind, int(i)) not in result:  # "afterok:1:1" is one condition
                result.append((kind, int(i)))
    return result


_BEGIN_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}
_BEGIN_NAMED = {"midnight": time(0), "noon": time(12), "teatime": time(16)}
_BEGIN_HELP = ("use now, now+30 (seconds), now+10minutes, now+2hours, now+1days, HH:MM[:SS], "
               "YYYY-MM-DD[THH:MM[:SS]], today, tomorrow, midnight, noon or teatime")


def parse_begin(s: str, now: datetime | None = None, tz: tzinfo | None = None) -> datetime:
    """SLURM's --begin -> an aware UTC datetime.

    Clock times and ISO times without an offset are local (`tz`, or this machine's zone); an ISO
    time with an offset ("Z", "+02:00") keeps it. "HH:MM" is today, or tomorrow once it has passed.
    A time in the past is allowed: the job is simply eligible at once (as in SLURM).
    """
    now = datetime.now(UTC) if now is None else now
    if now.tzinfo is None:
        raise ValueError("parse_begin needs an aware `now`")
    text = str(s).strip()
    lower = text.lower()
    bad = _err("--begin", f"{s!r} is not a begin time; {_BEGIN_HELP}")

    if lower.startswith("now"):
        offset = lower[3:]
        if not offset:
            return now.astimezone(UTC)
        m = re.fullmatch(r"\+([0-9]+)([a-z]*)", offset)
        if not m:
            raise bad
        unit = m.group(2)
        unit = unit[:-1] if unit.endswith("s") and unit[:-1] in _BEGIN_UNITS else unit
        if unit and unit not in _BEGIN_UNITS:
            raise _err("--begin", f"unknown unit {m.group(2)!r} in {s!r}; use seconds, minutes, hours, "
                       "days or weeks")
        return now.astimezone(UTC) + timedelta(seconds=int(m.group(1)) * _BEGIN_UNITS.get(unit, 1))

    local_now = now.astimezone(tz) if tz is not None else now.astimezone()
    if lower in ("today", "tomorrow"):
        day = local_now.date() + timedelta(days=1 if lower == "tomorrow" else 0)
        return _local(datetime.combine(day, time(0)), tz)
    clock = _BEGIN_NAMED.get(lower) or _parse_clock(text)
    if clock is not None:
        candidate = _local(datetime.combine(local_now.date(), clock), tz)
        if candidate <= now:  # already past today: the same time tomorrow
            candidate = _local(datetime.combine(local_now.date() + timedelta(days=1), clock), tz)
        return candidate
    if not re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}([T ][0-9]{2}:[0-9]{2}(:[0-9]{2})?)?"
                        r"(Z|[+-][0-9]{2}:?[0-9]{2})?", text):
        raise bad
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise _err("--begin", f"{s!r} is not a valid date or time ({_BEGIN_HELP})") from None
    return when.astimezone(UTC) if when.tzinfo is not None else _local(when, tz)


def _parse_clock(text: str) -> time | None:
    """'HH:MM' or 'HH:MM:SS' -> a time; None when the text is not of that shape."""
    m = re.fullmatch(r"([0-9]{1,2}):([0-9]{2})(?::([0-9]{2}))?", text)
    if not m:
        return None
    hour, minute, second = int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)
    if hour > 23 or minute > 59 or second > 59:
        raise _err("--begin", f"{text!r} is not a time of day (HH:MM[:SS], 00:00 to 23:59:59)")
    return time(hour, minute, second)


def _local(naive: datetime, tz: tzinfo | None) -> datetime:
    """A wall-clock time in `tz` (or this machine's zone) as aware UTC."""
    aware = naive.replace(tzinfo=tz) if tz is not None else naive.astimezone()
    return aware.astimezone(UTC)


def parse_env(items: list[str]) -> dict[str, str]:
    """["KEY=VALUE", ...] -> {KEY: VALUE}; the value may contain '='. A later KEY wins, as in a shell."""
    env: dict[str, str] = {}
    for item in items:
        key, eq, value = str(item).partition("=")
        if not eq:
            raise _err("--env", f"{item!r} has no '='; write KEY=VALUE")
        _check_env_entry(key, value)
        env[key] = value
    return env


def _check_env_entry(key: Any, value: Any) -> None:
    if not isinstance(key, str) or not _ENV_KEY.fullmatch(key):
        raise _err("--env", f"{key!r} is not a variable name; use letters, digits and _, not starting "
                   "with a digit")
    if key.startswith("SLURM_"):
        raise _err("--env", f"{key} refused: SLURM_* variables make tools (Lightning, ...) think they "
                   f"run under SLURM; the job gets {JOB_ID_ENV} and friends instead")
    if key in RESERVED_JOB_ENV:  # refused rather than silently overridden
        raise _err("--env", f"{key} is set by the scheduler for every job; drop it")
    if key == EXPORT_ENV:
        raise _err("--env", f"{key} is set by a batch script's --export; use --export NONE")
    if not isinstance(value, str):
        raise _err("--env", f"value of {key} must be a string, got {value!r}")
    if "\0" in value:
        raise _err("--env", f"value of {key} contains a NUL byte, which an environment cannot hold")


def parse_gpu_ids(s: str) -> list[str]:
    """"0,2" -> ["0", "2"]: device indices or uuids, as typed; resolve_devices maps them to uuids."""
    return _check_gpu_ids([part.strip() for part in str(s).split(",")], s)


def _check_gpu_ids(ids: Any, s: str | None = None) -> list[str]:
    """A list of ids, typed as `s` ("0,2"): non-empty, no blanks, no duplicates."""
    if not isinstance(ids, (list, tuple)) or not all(isinstance(i, str) for i in ids):
        raise _err("--gpu-ids", f"must be a list of device ids, got {ids!r}")
    ids = list(ids)
    s = ",".join(ids) if s is None else s
    if not any(ids):
        raise _err("--gpu-ids", f"{s!r} names no device; write indices or uuids, e.g. 0,2")
    if not all(ids):
        raise _err("--gpu-ids", f"{s!r} has an empty entry; write e.g. 0,2")
    for i in ids:
        if any(c.isspace() or c == "," for c in i):
            raise _err("--gpu-ids", f"{i!r} in {s!r} is not a device id; separate ids with ','")
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise _err("--gpu-ids", f"{s!r} names {', '.join(duplicates)} more than once")
    return ids


def priority_from_nice(nice: int) -> int:
    """SLURM's --nice: a higher nice is a lower priority."""
    return -int(nice)


# ---------------------------------------------------------------------------------------------
# The job spec.
# ---------------------------------------------------------------------------------------------


@dataclass
class JobSpec:
    """A job as the user asked for it. Construction validates; a JobSpec that exists is valid."""

    kind: str = "command"  # "command" (an argv, never run through a shell), "train" (a TrainConfig)
    # or "batch" (a batch script: argv is its interpreter, the script's stored copy and its arguments)
    argv: list[str] = field(default_factory=list)  # the command; empty for kind "train"
    # kind "train": a TrainConfig, or a dict of its settings; stored as the validated full dict
    train_config: dict[str, Any] | TrainConfig | None = None
    name: str | None = None  # default: the program's basename; for training the run name, else "train"
    gpus: int | None = None  # devices wanted; default len(gpu_ids), else the train config's N, else 1
    # (exclusive: None stays, meaning every device; see resolve_gpus);
    # 0 = no device (commands only: CPU work that should still queue behind dependencies, etc.)
    gpu_ids: list[str] | None = None  # exact devices as typed: indices ("0") or uuids
    mem_per_gpu: int | None = None  # bytes of free memory needed on each device
    priority: int = 0  # higher runs first; from --nice as -nice
    time_limit_s: float | None = None  # None: unlimited
    begin_at: datetime | None = None  # aware; stored as UTC; not eligible before
    dependencies: list[tuple[str, int]] = field(default_factory=list)  # (afterok|afterany|afternotok, id)
    held: bool = False  # submitted held (JobHeldUser) until `release`
    requeue: bool = False  # requeued instead of ending FAILED/NODE_FAIL
    exclusive: bool = False  # SLURM's --exclusive: holds every device, runs alone, uses `gpus` of them
    workdir: str = field(default_factory=os.getcwd)  # absolute; SLURM's default: where you submit
    env: dict[str, str] = field(default_factory=dict)  # extra environment, on top of the daemon's
    stdout: str | None = None  # pattern with %j/%x; relative to workdir; None: the log directory
    stderr: str | None = None  # same; None: into the stdout file (as SLURM)
    snapshot: Snapshot | None = None  # submit --snapshot: the copy of the checkout it runs (taken after validation)
    shared: bool = False  # runs beside other shared jobs on a GPU while their declared memory fits it
    preemptible: bool = False  # a job of higher priority may take its devices: SIGTERM, grace, requeue
    preempt_grace_s: float | None = None  # its SIGTERM-to-SIGKILL time when preempted (None: 60 s)
    submit_dir: str | None = None  # a batch job's: where it was submitted from (SLURM_SUBMIT_DIR)
    export_all: bool = True  # a batch job's --export: False (NONE) starts it from a bare environment

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check and normalise every field; the first bad one raises a UserError naming its flag."""
        if self.kind not in KINDS:
            raise _err("kind", f"unknown job kind {self.kind!r}; use {' or '.join(KINDS)}")
        self._check_what_to_run()
        self._check_name()
        self._check_devices()
        self._check_scheduling()
        self._check_environment()

    def _check_what_to_run(self) -> None:
        if not isinstance(self.argv, (list, tuple)) or not all(isinstance(a, str) for a in self.argv):
            raise _err(FLAGS["argv"], f"must be a list of strings, got {self.argv!r}")
        self.argv = list(self.argv)
        if self.kind in ("command", BATCH):
            if not self.argv or not self.argv[0].strip():
                raise _err("submit", "empty command; put it after --, e.g. submit --gpus 1 -- python run.py")
            if self.train_config is not None:
                raise _err("--train", "a command job has no training config; submit either a command or --train")
        else:
            if self.argv:
                raise _err("--train", "a training job takes no command; its flags come from the config")
            from sae_dist.config import TrainConfig

            if not isinstance(self.train_config, (dict, TrainConfig, CheckedTrain)):
                raise _err("--train", "a training job needs a config (--train run.toml)")
            # Validated here once (or by the submit that built it: CheckedTrain); the supervisor and
            # sbatch trust the stored dict. A sweep's lists ride in it under one key
            # (sae_dist.contract.sweep_argv), checked against the base settings.
            if isinstance(self.train_config, CheckedTrain):
                self.train_config = self.train_config.stored()
            else:
                plain, lists = split_stored(self.train_config) if isinstance(self.train_config, dict) \
                    else (self.train_config, None)
                self.train_config = checked_train_config(plain).to_dict()
                if lists is not None:
                    self.train_config[SWEEP_KEY] = check_stored(self.train_config, lists)
        if any("\0" in a for a in self.argv):
            raise _err(FLAGS["argv"], "an argument contains a NUL byte, which no program can receive")

    def _check_name(self) -> None:
        if self.name is None:
            if self.kind in ("command", BATCH):
                self.name = os.path.basename(self.argv[0].rstrip("/")) or self.argv[0]
            else:
                self.name = (self.train_config or {}).get("name") or "train"
        _check_text(self.name, "--job-name")
        if not isinstance(self.name, str) or not self.name.strip():
            raise _err("--job-name", "empty; give a name or leave the flag out")
        if any(ord(c) < 32 or ord(c) == 127 for c in self.name):
            raise _err("--job-name", f"{self.name!r} contains control characters; use printable ones")
        if len(self.name) > MAX_NAME_CHARS:
            raise _err("--job-name", f"is {len(self.name)} characters long; at most {MAX_NAME_CHARS}")

    def _check_devices(self) -> None:
        if not isinstance(self.exclusive, bool):
            raise _err("--exclusive", f"must be true or false, got {self.exclusive!r}")
        if self.gpu_ids is not None:
            if self.exclusive:
                # The job holds every device; which ones it runs on is the scheduler's usual choice.
                raise _err("--gpu-ids", "cannot be combined with --exclusive (the job holds every device); "
                           "ask for a count with --gpus N instead")
            self.gpu_ids = _check_gpu_ids(self.gpu_ids)
        config_gpus = self._gpus_from_train_config()
        if self.gpus is not None:
            if isinstance(self.gpus, bool) or not isinstance(self.gpus, int):
                raise _err("--gpus", f"must be a whole number, got {self.gpus!r}")
            if self.gpus < 0:
                raise _err("--gpus", f"{self.gpus} is negative; ask for 1 or more (0: no device)")
        if self.gpu_ids is not None:
            if self.gpus is not None and self.gpus != len(self.gpu_ids):
                raise _err("--gpus", f"{self.gpus} but --gpu-ids names {len(self.gpu_ids)} devices; "
                           "give one of the two")
            self.gpus = len(self.gpu_ids)
        if self.gpus is None:
            # As in `python -m sae_dist train`, flags win over the TOML: the config's cuda:N / cpu:N
            # is only the default count (train_argv replaces it by the allocation anyway).
            # An exclusive job without a count keeps None: every device, known only at submit.
            self.gpus = config_gpus if config_gpus is not None else (None if self.exclusive else 1)
        if self.gpus == 0 and self.kind == "train":
            raise _err("--gpus", "a training job needs at least 1 device (virtual ones on a CPU machine)")
        if self.mem_per_gpu is not None:
            if isinstance(self.mem_per_gpu, bool) or not isinstance(self.mem_per_gpu, int) or self.mem_per_gpu <= 0:
                raise _err("--mem-per-gpu", f"must be a positive number of bytes, got {self.mem_per_gpu!r}")
            if self.gpus == 0:
                raise _err("--mem-per-gpu", "given for a job with --gpus 0; ask for a GPU or drop it")

    def _gpus_from_train_config(self) -> int | None:
        """A training config that says cuda:N or cpu:N sets the device count (auto leaves it to --gpus)."""
        if self.kind != "train" or self.train_config is None:
            return None
        from sae_dist.config import parse_devices

        return parse_devices(self.train_config.get("devices", "auto"))[1]

    def _check_scheduling(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise _err("--priority", f"must be a whole number, got {self.priority!r}")
        if abs(self.priority) > MAX_PRIORITY:  # --priority minus --nice, as the CLI gives it
            raise _err("--priority", f"{self.priority} is out of range; use -{MAX_PRIORITY:,} to {MAX_PRIORITY:,}")
        if self.time_limit_s is not None:
            t = self.time_limit_s
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
                raise _err("--time", f"must be a positive time, got {t!r}; use UNLIMITED for no limit")
            _check_time_limit_range(t, t)
            self.time_limit_s = float(t)
        if self.begin_at is not None:
            if not isinstance(self.begin_at, datetime) or self.begin_at.tzinfo is None:
                raise _err("--begin", f"must be a timezone-aware time, got {self.begin_at!r}")
            self.begin_at = self.begin_at.astimezone(UTC)
        deps: list[tuple[str, int]] = []
        for dep in self.dependencies:
            if not isinstance(dep, (tuple, list)) or len(dep) != 2:
                raise _err("--dependency", f"{dep!r} is not a (kind, job id) pair")
            kind, job_id = dep
            if kind not in DEPENDENCY_KINDS:
                raise _err("--dependency", f"unknown kind {kind!r}; use {', '.join(DEPENDENCY_KINDS)}")
            if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 1:
                raise _err("--dependency", f"job id {job_id!r} must be a positive whole number")
            if (kind, job_id) not in deps:
                deps.append((kind, job_id))
        self.dependencies = deps
        for name in ("held", "requeue", "preemptible", "shared"):
            if not isinstance(getattr(self, name), bool):
                raise _err(FLAGS[name], f"must be true or false, got {getattr(self, name)!r}")
        self._check_grace()
        self._check_shared()

    def _check_shared(self) -> None:
        if not self.shared:
            return
        if self.exclusive:
            raise _err("--shared", "and --exclusive contradict each other (the whole machine, or a share of a GPU)")
        if self.gpus == 0:
            raise _err("--shared", "shares a GPU: ask for one or more with --gpus")
        if self.mem_per_gpu is None:
            raise _err("--shared", "needs --mem, the memory it needs on each GPU: the devices are shared by it")

    def _check_grace(self) -> None:
        g = self.preempt_grace_s
        if g is None:
            return
        if not self.preemptible:
            raise _err("--grace-time", "is a preemptible job's; add --preemptible or drop it")
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g < 0:
            raise _err("--grace-time", f"must be seconds, 0 or more, got {g!r}")
        if g > MAX_GRACE_S:
            raise _err("--grace-time", f"{g:g} s is over a day; a preempted job gives its devices back sooner")
        self.preempt_grace_s = float(g)

    def _check_environment(self) -> None:
        wd = self.workdir
        if not isinstance(wd, (str, os.PathLike)) or not str(wd) or not os.path.isabs(wd):
            raise _err("--chdir", f"{wd!r} is not an absolute path; give the full path")
        self.workdir = str(wd)
        if not os.path.isdir(self.workdir):
            what = "is not a directory" if os.path.exists(self.workdir) else "does not exist"
            raise _err("--chdir", f"{self.workdir} {what}; give an existing directory")
        if not isinstance(self.env, dict):
            raise _err("--env", f"must be a mapping of names to values, got {self.env!r}")
        for key, value in self.env.items():
            _check_env_entry(key, value)
        for name in ("stdout", "stderr"):
            pattern = getattr(self, name)
            if pattern is not None:
                check_output_pattern(pattern, FLAGS[name])
        if self.kind == BATCH:
            if not isinstance(self.submit_dir, str) or not os.path.isabs(self.submit_dir):
                raise _err("submit", f"a batch job's submit directory must be an absolute path, got "
                           f"{self.submit_dir!r}")
            _check_text(self.submit_dir, "submit")
            if "\0" in self.submit_dir:
                raise _err("submit", "the submit directory contains a NUL byte")
        elif self.submit_dir is not None or self.export_all is not True:
            raise _err("--export", "goes with a batch script (submit job.sh), not with a command or --train")
        if not isinstance(self.export_all, bool):
            raise _err("--export", f"must be true or false, got {self.export_all!r}")

    def stored_env(self) -> dict[str, str]:
        """The environment stored with the job: --env's, and a batch job's SLURM_SUBMIT_DIR and
        --export NONE (SAE_DIST_EXPORT=NONE), which the supervisor reads back."""
        if self.kind != BATCH:
            return self.env
        return {**self.env, SUBMIT_DIR_ENV: self.submit_dir, **({} if self.export_all else {EXPORT_ENV: "NONE"})}


# ---------------------------------------------------------------------------------------------
# Devices.
# ---------------------------------------------------------------------------------------------


def resolve_gpus(spec: JobSpec, devices: list[tuple[int, str]]) -> int:
    """The device count to store: the spec's, or for an exclusive job that gave none, every
    device of this machine (given as (index, uuid)). Checked as resolve_devices checks it."""
    if spec.gpus is not None:
        return spec.gpus
    count = len(devices)
    if count == 0 and (spec.kind == "train" or spec.mem_per_gpu is not None):
        what = "a training job needs at least 1 device" if spec.kind == "train" else "--mem-per-gpu needs a device"
        raise _err("--exclusive", f"this machine has no devices; {what}")
    return count


def check_memory_fits(spec: JobSpec, totals: list[int | None]) -> None:
    """Refuse a job whose --mem no device of this machine has (`totals`: each device's memory,
    None where unknown; nothing is refused when none is known): it would wait forever."""
    known = [t for t in totals if t is not None]
    if spec.mem_per_gpu is not None and known and spec.mem_per_gpu > max(known):
        raise _err("--mem", f"{spec.mem_per_gpu / 2**30:.1f} GiB is more than any device here has "
                   f"(the largest: {max(known) / 2**30:.1f} GiB)")


def resolve_devices(spec: JobSpec, devices: list[tuple[int, str]]) -> list[str] | None:
    """The exact devices a spec names, as uuids (None when it asks for a count), checked against
    this machine's devices given as (index, uuid). Ids are indices ("2") or uuids, as typed."""
    gpus = spec.gpus or 0
    count = len(devices)
    if spec.gpu_ids is None:
        if gpus > count:
            plural = "s" if gpus != 1 else ""
            if spec.exclusive:
                raise _err("--exclusive", f"asked to run on {gpus} GPU{plural} of the whole machine, "
                           f"this machine has {count}; ask for at most {count} with --gpus")
            raise UserError(f"asked for {gpus} GPU{plural}, this machine has {count}")
        return None
    by_index = {index: uuid for index, uuid in devices}
    uuids = {uuid for _, uuid in devices}
    resolved: list[str] = []
    for gid in spec.gpu_ids:
        uuid = by_index.get(int(gid)) if _all_digits([gid]) else (gid if gid in uuids else None)
        if uuid is None:
            raise UserError(f"unknown device id {gid}: this machine has {_describe_indices(by_index)} "
                            "(see `info`)")
        if uuid in resolved:  # "0" and device 0's uuid
            raise UserError(f"--gpu-ids names device {gid} twice (once by index, once by uuid)")
        resolved.append(uuid)
    return resolved


def _describe_indices(by_index: dict[int, str]) -> str:
    """[0, 1, 2, 3, 6] -> 'devices 0-3,6'."""
    indices = sorted(by_index)
    if not indices:
        return "no devices"
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"device{'s' if len(indices) != 1 else ''} {text}"


# ---------------------------------------------------------------------------------------------
# Output files.
# ---------------------------------------------------------------------------------------------


def check_output_pattern(pattern: str, flag: str = "--output") -> None:
    """Refuse patterns we cannot honour: empty, NUL, a directory, or %-letters other than %j %x %%."""
    if not isinstance(pattern, str) or not pattern:
        raise _err(flag, "empty; give a file pattern like logs/%x-%j.out, or leave the flag out")
    if "\0" in pattern:
        raise _err(flag, f"{pattern!r} contains a NUL byte")
    if pattern.rsplit("/", 1)[-1] in ("", ".", ".."):
        raise _err(flag, f"{pattern!r} names a directory; add a file name, e.g. {pattern.rstrip('/')}/%j.out")
    for m in _OUTPUT_TOKEN.finditer(pattern):
        width, letter = m.groups()
        if letter not in OUTPUT_LETTERS or (width and letter not in _PADDED_LETTERS):
            raise _err(flag, f"{m.group(0)!r} in {pattern!r} is not supported; use %j (job id), "
                       "%x (job name), %A and %a (an array's id and task id) or %% (a literal %)")


def array_letters_used(pattern: str | None) -> str | None:
    """The first of %A/%a in `pattern` (they need a job array), or None."""
    for m in _OUTPUT_TOKEN.finditer(pattern or ""):
        if m.group(2) in ARRAY_LETTERS:
            return m.group(0)
    return None


SHELL_CHARS = frozenset(" \t$`\"'\\;&|<>*?()[]{}!#~^")
"""Characters a shell reads specially: a log file named with them could not be typed as it shows."""


def safe_name_for_path(name: str) -> str:
    """The job name as harmless file-name text, as a run directory's name is: no '/', NUL,
    control or shell characters (each one '_', so `tail logs/<name>-7.out` is typed as it reads),
    no leading dots (so it can never be '.' or '..' or hide a file), never empty, at most 100
    bytes. Letters of any script stay."""
    text = "".join("_" if c == "/" or ord(c) < 32 or ord(c) == 127 or c in SHELL_CHARS else c for c in name)
    stripped = text.lstrip(".")
    text = "_" * (len(text) - len(stripped)) + stripped
    encoded = text.encode("utf-8", "surrogateescape")[:MAX_NAME_IN_PATH_BYTES]
    return encoded.decode("utf-8", "ignore") or "_"


def job_output_paths(job, log_dir: Path) -> tuple[Path, Path]:
    """The files a job's stdout and stderr go to (the same file when no --error was given); the
    default names live in `log_dir`."""
    workdir = Path(job.workdir)
    array = (job.array_job_id, job.array_task_id) if job.array_job_id is not None else None
    default = "%A_%a-%x.out" if array else "%j-%x.out"  # SLURM's default for a task: slurm-%A_%a.out
    out = expand_output(job.stdout_pattern, job.id, job.name, log_dir, workdir, default=default, array=array)
    err = expand_output(job.stderr_pattern, job.id, job.name, log_dir, workdir, default=default, array=array) \
        if job.stderr_pattern else out
    return out, err


def expand_output(pattern: str | None, job_id: int, name: str, log_dir: Path, workdir: Path,
                  default: str, array: tuple[int, int] | None = None) -> Path:
    """The file a job's stdout/stderr goes to.

    %j -> job id (%5j zero-pads), %x -> the job name made safe for a path, %% -> %; for a task
    of a job array (`array`: its array id and task id) %A and %a (padded as %j). Other
    %-letters stay literal here (submit refuses them; a stored pattern never makes this raise).
    A relative user pattern is relative to the job's workdir, as in SLURM; the default pattern
    (no --output given) lives in log_dir. Nothing is ever passed to a shell.
    """
    base, text = (Path(log_dir), default) if pattern is None else (Path(workdir), pattern)
    safe = safe_name_for_path(name)

    numbers = {"j": job_id, **({"A": array[0], "a": array[1]} if array is not None else {})}

    def substitute(m: re.Match[str]) -> str:
        width, letter = m.groups()
        if letter in numbers:
            return str(numbers[letter]).zfill(int(width)) if width else str(numbers[letter])
        if letter == "x" and not width:
            return safe
        if letter == "%" and not width:
            return "%"
        return m.group(0)

    return base / _OUTPUT_TOKEN.sub(substitute, text)
