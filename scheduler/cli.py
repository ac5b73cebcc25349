"""`python -m scheduler ...` (or `sae-sched ...`): SLURM's habits without SLURM.

submit / queue / show / update / cancel / hold / release / requeue / info / acct / recommend / export-sbatch /
daemon / metrics. Every listing takes --json. A mistake is one line on stderr and exit code 2.
Starts fast: nothing here imports torch, Streamlit or Altair.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import Any

from sae_dist.contract import NUM_GPUS_ENV
from sae_dist.contract.sweep_argv import SWEEP_KEY, sweep_size
from sae_dist.errors import USER_ERROR_EXIT, UserError

_STARTED = time.monotonic()  # a lock error sooner after this than the busy timeout was no long wait
STORAGE_ERROR_EXIT = 1  # the state database could not be used (scheduler.storage_errors says why)

STATE_ORDER = {"RUNNING": 0, "PENDING": 1}
SUBMITTED_STATE = "PENDING"  # every job is queued PENDING (held ones too, with the reason JobHeldUser)


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (argparse prints its whole usage block first)."""

    def error(self, message: str):
        self.exit(USER_ERROR_EXIT, f"{self.prog}: error: {message} (see --help)\n")


class _RaisingParser(argparse.ArgumentParser):
    """argparse, but a bad flag raises a UserError (a batch script's directive names its line)."""

    def error(self, message: str):
        raise UserError(message)


COMMAND_NAMES = ("submit", "queue", "show", "update", "cancel", "hold", "release", "requeue", "info", "acct",
                 "recommend", "export-sbatch", "daemon", "metrics")


def _parser(argv: list[str] | None = None, parser_class: type = _OneLineParser) -> argparse.ArgumentParser:
    """The parser; given the arguments, only the named command's part is built (each command's
    flags cost argparse ~3 ms to set up, a third of a `submit`)."""
    p = parser_class(prog="python -m scheduler", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    only = argv[0] if argv and argv[0] in COMMAND_NAMES else None
    for names, add in _BUILDERS:
        if only is None or only in names:
            add(sub)
    return p


def _add_submit(sub) -> None:
    s = sub.add_parser("submit", help="queue a command (after --), an SAE training (--train run.toml) or a "
                                      "batch script with #SBATCH lines (job.sh ARGS, as sbatch)")
    s.add_argument("--train", metavar="TOML", help="an SAE training config (the trainer's TOML keys; "
                                                   "[[array]] tables: one task per table, with its overrides; "
                                                   "a [sweep] table of lists: many SAEs in one job)")
    s.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="with --train: sweep a setting over these values, all SAEs in one job (repeatable; "
                        "over the TOML's [sweep] list for that key)")
    s.add_argument("-a", "--array", help="a job array: task ids 0-99, 1,3,5 or 0-15:4, then %%N to run at most N "
                                         "at once; each task gets SLURM_ARRAY_TASK_ID (and %%a in --output)")
    s.add_argument("-G", "--gpus", type=_whole_number,
                   help="number of GPUs (default 1; with --exclusive, every device)")
    s.add_argument("--gpu-ids", help="exact devices, by index or UUID: 0,2")
    s.add_argument("--mem", help="memory needed per GPU: 20GiB, 512M (plain number: MB, as SLURM)")
    s.add_argument("-J", "--job-name", help="job name (default: the program's name, or 'train')")
    s.add_argument("--priority", type=_whole_number, default=0, help="higher runs first (default 0)")
    s.add_argument("--nice", type=_whole_number, default=0, help="SLURM's nice: priority -= nice")
    s.add_argument("-t", "--time", help="time limit: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], UNLIMITED")
    s.add_argument("-d", "--dependency", help="afterok:ID[:ID...], afterany:..., afternotok:... (comma-separated)")
    s.add_argument("--begin", help="start no earlier than: now+10minutes, 16:00, 2026-12-01T09:00")
    s.add_argument("-H", "--hold", action="store_true", help="submit held (release it later)")
    s.add_argument("--requeue", action="store_true", help="requeue automatically when it fails")
    s.add_argument("--exclusive", action="store_true",
                   help="SLURM's --exclusive: the job gets the whole machine. It starts once every device is "
                        "free and no other job runs, holds every device while it runs (nothing else starts), "
                        f"and runs on --gpus N of them (default: all; {NUM_GPUS_ENV}=N); not with --gpu-ids")
    s.add_argument("--shared", action="store_true",
                   help="share GPUs with other --shared jobs while their --mem (declared, per GPU) fits each "
                        "card; never beside an unshared job")
    s.add_argument("--preemptible", action="store_true",
                   help="a job of higher --priority may take its devices: SIGTERM, --grace-time, SIGKILL, then it "
                        "is requeued (a training checkpoints at its next report and resumes from it)")
    s.add_argument("--grace-time", metavar="SECONDS", type=float,
                   help="with --preemptible: seconds from SIGTERM to SIGKILL when preempted (default 60, "
                        "SLURM's GraceTime)")
    s.add_argument("-D", "--chdir", help="working directory (default: the current one)")
    s.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeatable)")
    s.add_argument("-o", "--output", help="stdout file; %%j = job id, %%x = job name, %%A/%%a = array id/task id")
    s.add_argument("-e", "--error", help="stderr file (default: with stdout)")
    s.add_argument("--snapshot", action="store_true",
                   help="run a copy of the git checkout as it is now (commits, uncommitted changes and new "
                        "files git does not ignore), not as it is when the job starts; kept until the job ends")
    s.add_argument("--export", help="with a batch script, as sbatch: ALL (default: the environment every job "
                                    "gets), NONE (a bare one), or NAME[=VALUE],... (ALL,NAME=VALUE keeps the rest)")
    s.add_argument("--json", action="store_true")
    s.add_argument("--parsable", action="store_true", help="print only the job id (sbatch's --parsable)")
    s.add_argument("--cluster", choices=["slurm"],
                   help="run it on a SLURM cluster through sbatch instead of on this machine's devices")
    s.add_argument("--nodes", type=int, help="with --cluster: nodes (default 1)")
    s.add_argument("--gpus-per-node", type=int, help="with --cluster: GPUs (ranks) per node (default: --gpus)")
    s.add_argument("--cpu", action="store_true", help="with --cluster: ranks on CPUs (gloo), no GPU request")
    s.add_argument("argv", nargs=argparse.REMAINDER,
                   help="-- PROGRAM ARGS... (never run through a shell), or SCRIPT ARGS... (no --): a batch "
                        "script, its #SBATCH lines read as sbatch reads them; these flags win over them")


def _add_queue(sub) -> None:
    q = sub.add_parser("queue", help="pending and running jobs (squeue)")
    q.add_argument("--all", action="store_true", help="finished jobs too")
    q.add_argument("-j", "--jobs", help="only these jobs: 3,5 (an array's id: its tasks; 12_7: one task)")
    q.add_argument("-t", "--states", help="only jobs in these states: PD,R (codes or names: PENDING, COMPLETED...; "
                   "all: every state); default PD,R (--all: every state)")
    q.add_argument("-n", "--name", help="only jobs of these names: sweep1,sweep2")
    q.add_argument("--start", action="store_true",
                   help="pending jobs with their expected start (squeue --start): known for the job the "
                        "scheduler reserves devices for, by the running jobs' time limits; N/A otherwise")
    q.add_argument("--json", action="store_true")


def _add_show(sub) -> None:
    s = sub.add_parser("show", help="one job whole: state, times, devices, command, where its output goes "
                                    "(scontrol show job)")
    s.add_argument("job_ids", nargs="+", type=_job_ref, help="job ids; 12 is every task of array 12, 12_7 one task")
    s.add_argument("--json", action="store_true")


def _add_update(sub) -> None:
    u = sub.add_parser("update", help="change a pending job's priority, time limit or begin time "
                                      "(scontrol update)")
    u.add_argument("job_ids", nargs="+", type=_job_ref, help="job ids; 12 is every task of array 12, 12_7 one task")
    u.add_argument("--priority", type=_whole_number, help="its new priority (higher runs first)")
    u.add_argument("-t", "--time", help="its new time limit: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]], UNLIMITED")
    u.add_argument("--begin", help="start no earlier than: now+10minutes, 16:00, 2026-12-01T09:00; now: no wait")


def _add_actions(sub) -> None:
    for name, what in (("cancel", "cancel jobs (SIGTERM, then SIGKILL after the grace period)"),
                       ("hold", "keep pending jobs from starting"), ("release", "let held jobs start"),
                       ("requeue", "put jobs back in the queue")):
        c = sub.add_parser(name, help=what)
        c.add_argument("job_ids", nargs="+" if name != "cancel" else "*",
                       type=_job_ref if name != "cancel" else _job_or_cluster_id,
                       help="job ids; 12 is every task of array 12, 12_7 one task, 12_[3-5] some")
        if name == "cancel":  # scancel's filters: alone, every job they match; with ids, those of them
            c.add_argument("-t", "--state", help="only jobs in these states: PD,R (codes or names)")
            c.add_argument("-n", "--name", help="only jobs of these names: sweep1,sweep2")


def _add_info(sub) -> None:
    i = sub.add_parser("info", help="every device and its state (sinfo); a device a training rank died "
                                    "on reads failed (--json: unavailable, with its fault) until a "
                                    "health check passes")
    i.add_argument("--recheck", action="store_true",
                   help="probe every failed device now and clear the faults of those that pass "
                        "(with --json: {rechecked, devices})")
    i.add_argument("--json", action="store_true")


def _add_acct(sub) -> None:
    a = sub.add_parser("acct", help="finished and running jobs with their usage (sacct)")
    a.add_argument("-j", "--jobs", help="only these jobs: 3,5 (an array's id: its tasks; 12_7: one task)")
    a.add_argument("-s", "--state", help="only jobs in these states: CD,F,TO (codes or names: COMPLETED...)")
    a.add_argument("--name", help="only jobs of these names: sweep1,sweep2")
    a.add_argument("-D", "--duplicates", action="store_true",
                   help="also each job's earlier runs (requeued: PREEMPTED, or after a failure), as sacct -D")
    a.add_argument("--json", action="store_true")


def _add_recommend(sub) -> None:
    r = sub.add_parser("recommend", help="which free devices fit a job")
    r.add_argument("--mem", help="memory needed per device: 20GiB")
    r.add_argument("--count", type=int, default=1)
    r.add_argument("--json", action="store_true")


def _add_export_sbatch(sub) -> None:
    e = sub.add_parser("export-sbatch", help="a SLURM batch script for a job, to run it on a cluster")
    e.add_argument("job_id", type=_job_id)
    e.add_argument("--nodes", type=int, default=1)
    e.add_argument("--gpus-per-node", type=int, help="GPUs (ranks) per node (default: the job's GPU count)")
    e.add_argument("--cpu", action="store_true", help="run the ranks on CPUs (gloo): no GPU request")
    e.add_argument("-o", "--out", help="write the script here (default: stdout)")


def _add_daemon(sub) -> None:
    d = sub.add_parser("daemon", help="run the scheduler daemon in the foreground")
    how = d.add_mutually_exclusive_group()
    how.add_argument("--detach", action="store_true", help="start it in the background and return")
    how.add_argument("--stop", action="store_true",
                     help="stop the running daemon (SIGTERM); running jobs carry on, the queue waits")


def _add_metrics(sub) -> None:
    m = sub.add_parser("metrics", help="serve the devices and the queue to Prometheus (OpenMetrics), in the "
                                       "foreground until SIGINT or SIGTERM")
    m.add_argument("--listen", metavar="HOST:PORT",
                   help="where to listen (default 127.0.0.1:9400: this machine only); another address only "
                        "as given: 0.0.0.0:9400 is every interface, [::1]:9400 IPv6")


_BUILDERS = [(("submit",), _add_submit), (("queue",), _add_queue), (("show",), _add_show), (("update",), _add_update),
             (("cancel", "hold", "release", "requeue"), _add_actions), (("info",), _add_info),
             (("acct",), _add_acct), (("recommend",), _add_recommend),
             (("export-sbatch",), _add_export_sbatch), (("daemon",), _add_daemon), (("metrics",), _add_metrics)]
"""The commands each builder adds, in the order `--help` lists them (every name in COMMAND_NAMES)."""


def _job_or_cluster_id(text: str) -> int | str:
    """A local job id, or slurm:N for a job handed to a SLURM cluster."""
    if text.startswith("slurm:"):
        from scheduler.cluster import parse_cluster_id

        try:
            return f"slurm:{parse_cluster_id(text)}"
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return _job_ref(text)


def _job_ref(text: str):
    """A job (or a whole array) by id, or tasks of an array: 12, 12_7, 12_[3-5]."""
    from scheduler.arrays import parse_job_ref

    try:
        return parse_job_ref(text, MAX_SQL_INT)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _whole_number(text: str) -> int:
    """An integer flag, in ASCII digits: int() also takes "٣" and "０", which nobody means."""
    body = text.strip()
    body = body[1:] if body[:1] in ("-", "+") else body  # one sign at most: int() takes no more
    if not (body.isascii() and body.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(text)


def _checked_priority(priority: int, nice: int) -> int:
    """The job's priority, --priority minus --nice; each flag out of range is named on its own."""
    from scheduler.spec import MAX_PRIORITY

    for flag, value in (("--priority", priority), ("--nice", nice)):
        if abs(value) > MAX_PRIORITY:
            raise UserError(f"{flag}: {value} is out of range; use -{MAX_PRIORITY:,} to {MAX_PRIORITY:,}")
    return priority - nice


def _job_id(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"job id must be a positive number, got {text!r}")
    if int(text) > MAX_SQL_INT:  # no job has it, and the database could not even look it up
        raise argparse.ArgumentTypeError(f"no job {text}: job ids go up to {MAX_SQL_INT}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    if args.command == "submit":  # a batch script's directives go before the flags typed
        args.typed = argv[1:len(argv) - len(args.argv)]
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # here, so a reader that went away is seen here, not at exit
        return code
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `queue | head`: the reader has what it wanted
        return _reader_gone()
    except Exception as e:
        line = _storage_line(e)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return STORAGE_ERROR_EXIT


def sbatch_main(argv: list[str] | None = None) -> int:
    """The `sbatch` console script: `submit` (sbatch job.sh ARGS, sbatch --parsable -t 10 job.sh)."""
    return main(["submit", *(sys.argv[1:] if argv is None else argv)])


def _reader_gone() -> int:
    """Quiet, as coreutils are: nothing on stderr, and the status of a death by SIGPIPE. Python
    would report the unflushed rest again at exit, so stdout now goes nowhere."""
    import signal

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _storage_line(error: Exception) -> str | None:
    """The one line for a storage fault (locked, read-only, full...), None for anything else."""
    from scheduler.storage_errors import storage_line

    try:
        from sae_dist.paths import busy_timeout_s

        waited = busy_timeout_s()
    except UserError:
        waited = None
    return storage_line(error, waited, ran_s=time.monotonic() - _STARTED)


# ---- helpers ----

def _engine():
    from sae_dist.db import get_engine

    return get_engine()


def _devices_now():
    """Live inventory (NVML or virtual) with each device's state; no process sampling. Read
    without SQLAlchemy (scheduler.device_view)."""
    from scheduler.device_view import devices_now

    return devices_now()


def _print_table(rows: list[dict], columns: list[tuple[str, str]]) -> None:
    cells = [["—" if (value := r.get(key)) is None else str(value) for key, _ in columns] for r in rows]
    widths = [max(len(title), max((len(c[i]) for c in cells), default=0)) for i, (_, title) in enumerate(columns)]
    lines = ["  ".join(t.ljust(w) for (_, t), w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(c, widths)).rstrip() for c in cells]
    sys.stdout.write("\n".join(lines) + "\n")  # one write: 10,000 rows print in a fraction of the time


def _duration(seconds: float | None) -> str | None:
    from scheduler.show import duration

    return None if seconds is None else duration(seconds)


MAX_SQL_INT = 2**63 - 1


def _parsed(flag: str, parse, text: str, *more):
    """A parser's value; a number too large for it (OverflowError) is one error line, not a traceback."""
    try:
        return parse(text, *more)
    except (OverflowError, ValueError):  # UserError is neither: it passes through with its own message
        raise UserError(f"{flag}: {text!r} is out of range") from None


def _parse_memory(text: str, flag: str = "--mem") -> int:
    from scheduler.recommend import parse_memory

    try:
        size = _parsed(flag, parse_memory, text)
    except UserError as e:
        raise UserError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None
    if size > MAX_SQL_INT:
        raise UserError(f"{flag}: {text!r} is more memory than any device has")
    return size


def _iso(dt: datetime | None) -> str | None:
    if dt is None:
        return None
    return (dt if dt.tzinfo is timezone.utc else dt.astimezone(timezone.utc)).isoformat(timespec="seconds")


# ---- commands ----

def cmd_submit(args) -> int:
    from scheduler import spec as S
    from scheduler.arrays import parse_array

    now = datetime.now(timezone.utc)
    batch = args.argv[:1] not in ([], ["--"])  # submit job.sh ARGS: a batch script
    if batch:
        args = _batch_script_args(args, now)
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    train_config, overrides = None, None
    array = _parsed("--array", parse_array, args.array) if args.array is not None else None
    if args.train:
        from sae_dist.config import build_config, load_toml
        from sae_dist.contract.sweep import parse_sweep_flags
        from sae_dist.contract.sweep_argv import CheckedTrain, checked_lists
        from scheduler.array_submit import ARRAY_TABLE, array_from_overrides

        if argv:
            raise UserError(f"give either --train run.toml or {'a batch script' if batch else 'a command after --'}, "
                            "not both")
        values = load_toml(args.train)
        overrides = values.pop(ARRAY_TABLE, None)
        if overrides is not None:  # [[array]]: a task per table
            if not isinstance(overrides, list):
                raise UserError("--train: 'array' must be [[array]] tables, one per task")
            array = array_from_overrides(overrides, array)
        table = values.pop(SWEEP_KEY, None)
        # Built (validated) once here, and its sweep's points once: JobSpec keeps them as they are.
        # A sweep is checked over the user's own settings (a key both set and swept is refused).
        train_config = CheckedTrain(build_config(values), checked_lists(values, table, parse_sweep_flags(args.sweep)))
    elif args.sweep:
        raise UserError("--sweep: goes with --train run.toml (a command job has no training settings)")
    elif not argv:
        raise UserError("empty command: put the program and its arguments after --, or use --train run.toml")
    kind = "train" if args.train else S.BATCH if batch else "command"
    job_spec = _job_spec(args, kind, argv, train_config, now)
    from scheduler.newjob import check_dependencies_found

    # No job has an id past SQLite's integers (and SQLite could not even look one up).
    check_dependencies_found((d for _, d in job_spec.dependencies if d > MAX_SQL_INT), ())
    for pattern, flag in ((job_spec.stdout, "--output"), (job_spec.stderr, "--error")):
        if array is None and S.array_letters_used(pattern):
            raise UserError(f"{flag}: {S.array_letters_used(pattern)} is a job array's; submit with --array")
    if args.cluster:
        if overrides is not None:
            raise UserError("--cluster slurm: [[array]] tables are for this machine's queue; "
                            "give SLURM a plain --array")
        if args.snapshot:
            raise UserError("--snapshot: for this machine's queue; a cluster job runs the files its script names")
        if batch:
            raise UserError("--cluster slurm: a batch script goes to this machine's queue; on the cluster, give "
                            "it to SLURM's own sbatch")
        return _submit_to_cluster(args, job_spec, array)
    if args.nodes is not None or args.gpus_per_node is not None or args.cpu:
        raise UserError("--nodes, --gpus-per-node and --cpu are for --cluster slurm")
    if not args.snapshot:
        return _submit_here(args, job_spec, array, overrides, batch)
    from scheduler.snapshot import taken

    with taken(job_spec.workdir) as job_spec.snapshot:  # the copy is removed if storing the job fails
        return _submit_here(args, job_spec, array, overrides, batch)


def _submit_here(args, job_spec, array, overrides, batch: bool) -> int:
    """Store the job on this machine's queue and say so, as sbatch does."""
    from scheduler.quick_submit import submit_quick

    if batch:
        _keep_copy(*args.copy)
    # On this machine's devices; starts a daemon if none runs.
    job_id = submit_quick(job_spec, array=array, overrides=overrides)
    if job_id is None:  # not a SQLite file at the head revision: the regular path migrates it
        from scheduler.submit import submit_spec

        job_id = submit_spec(_engine(), job_spec, array=array, overrides=overrides)
    answer = {"job_id": job_id, "state": SUBMITTED_STATE}
    if array is not None:
        answer.update(array=str(array), tasks=len(array.task_ids))
    if job_spec.snapshot is not None:
        answer["snapshot_commit"] = job_spec.snapshot.commit
    # SLURM's words, array or not; --parsable: the id alone, as sbatch's
    print(json.dumps(answer) if args.json else job_id if args.parsable else f"Submitted batch job {job_id}")
    return 0


def _job_spec(args, kind: str, argv: list[str], train_config, now: datetime):
    """The JobSpec the flags in `args` ask for (validated: the first bad value is a UserError
    naming its flag)."""
    from scheduler import spec as S

    export_all, exported = True, {}
    if args.export is not None:
        if kind != S.BATCH:
            raise UserError("--export: goes with a batch script (submit job.sh), not with a command or --train")
        from scheduler.batch_script import parse_export

        export_all, exported = parse_export(args.export, os.environ)
        try:
            S.parse_env([f"{k}={v}" for k, v in exported.items()])
        except UserError as e:
            raise UserError(f"--export: {str(e).removeprefix('--env: ')}") from None
    return S.JobSpec(
        name=args.job_name, kind=kind, argv=argv, train_config=train_config,
        gpus=args.gpus,  # None: from --gpu-ids, the training config's devices, or 1
        gpu_ids=S.parse_gpu_ids(args.gpu_ids) if args.gpu_ids is not None else None,
        mem_per_gpu=_parse_memory(args.mem) if args.mem is not None else None,
        priority=_checked_priority(args.priority, args.nice),
        time_limit_s=_parsed("--time", S.parse_time_limit, args.time) if args.time is not None else None,
        begin_at=_parsed("--begin", S.parse_begin, args.begin, now) if args.begin is not None else None,
        dependencies=S.parse_dependency(args.dependency) if args.dependency is not None else [],
        held=args.hold, requeue=args.requeue, exclusive=args.exclusive,
        preemptible=args.preemptible, preempt_grace_s=args.grace_time, shared=args.shared,
        workdir=os.path.abspath(args.chdir or os.getcwd()),
        env={**exported, **S.parse_env(args.env)}, stdout=args.output, stderr=args.error,
        submit_dir=os.getcwd() if kind == S.BATCH else None, export_all=export_all)


def _batch_script_args(args, now: datetime):
    """`submit job.sh ARGS` as the flags of its #SBATCH lines, then those typed (which win), to
    run the script's copy with its #! interpreter. Each directive is checked on its own first, so
    a bad value is one error naming its line; each one ignored is one warning line."""
    from scheduler.arrays import parse_array
    from scheduler.batch_script import read_script
    from scheduler.spec import BATCH

    path, script_args = args.argv[0], args.argv[1:]
    if args.train:
        raise UserError(f"give either --train run.toml or a batch script ({path}), not both")
    data = _read_batch_script(path)
    try:
        script = read_script(data.decode("utf-8", "surrogateescape"))
    except UserError as e:
        raise UserError(f"{path}:{e}") from None
    for warning in script.warnings:
        print(f"warning: {path}:{warning}", file=sys.stderr)
    parser = _parser(["submit"], _RaisingParser)
    for d in script.directives:
        try:
            alone = parser.parse_args(["submit", *d.argv])
            if alone.array is not None:
                _parsed("--array", parse_array, alone.array)
            _job_spec(alone, BATCH, ["true"], None, now)
        except UserError as e:
            raise UserError(f"{path}:{d.line}: #SBATCH {d.text}: {e}") from None
    flags = [flag for d in script.directives for flag in d.argv]
    merged = _parser(["submit"]).parse_args(["submit", *flags, *getattr(args, "typed", [])])
    merged.copy = _copy_path(data), data  # written once all is checked, before the job is stored
    merged.argv = ["--", *script.interpreter, str(merged.copy[0]), *script_args]
    if merged.job_name is None:  # sbatch's default: the script's name
        merged.job_name = os.path.basename(path.rstrip("/")) or path
    if merged.output is None:  # sbatch's default, in the job's working directory
        merged.output = "slurm-%A_%a.out" if merged.array is not None else "slurm-%j.out"
    return merged


def _read_batch_script(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such batch script (to run a program, put it after --: "
                        f"submit -- {path} ...)") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a directory, not a batch script") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read the batch script ({e.strerror or e})") from None


def _copy_path(data: bytes):
    """Where a script's copy lives: the state directory's batch/, named by its content (sha256)."""
    import hashlib

    from sae_dist.paths import state_home

    return state_home() / "batch" / hashlib.sha256(data).hexdigest()


def _keep_copy(path, data: bytes) -> None:
    """The script's copy, so that an edit after submit does not change the queued job, as sbatch's
    copy; written once (the same content is the same file), atomically."""
    import tempfile

    path.parent.mkdir(exist_ok=True)
    if not path.is_file():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def _submit_to_cluster(args, job_spec, array=None) -> int:
    from sae_dist.paths import default_db_url, state_home
    from scheduler import cluster
    from scheduler.sbatch import sbatch_script

    if args.hold or args.dependency or args.begin or args.requeue or args.gpu_ids or args.mem:
        raise UserError("with --cluster slurm, SLURM decides when and where: -H, -d, --begin, --requeue, "
                        "--gpu-ids and --mem are for this machine's queue")
    if job_spec.gpus is None and args.gpus_per_node is None:  # --exclusive without a count
        raise UserError("--exclusive with --cluster slurm: give --gpus-per-node (or --gpus); the GPUs of "
                        "a cluster's node cannot be counted from here")
    task_configs = None
    if array is not None and job_spec.kind == "train":  # each task its own run name, as here
        from scheduler.array_submit import task_configs as configs_of

        task_configs = configs_of(job_spec, array)
    script = sbatch_script(cluster.script_job(job_spec), nodes=args.nodes or 1, gpus_per_node=args.gpus_per_node,
                           cpu=args.cpu, db_url=default_db_url(), array=str(array) if array else None,
                           task_configs=task_configs)
    slurm_id = cluster.submit(_engine(), job_spec, script, state_home() / "slurm")
    print(json.dumps({"job_id": f"slurm:{slurm_id}", "state": SUBMITTED_STATE}) if args.json
          else f"Submitted batch job slurm:{slurm_id}")
    return 0


def _cluster_rows(final_too: bool, now: float) -> list[dict[str, Any]]:
    """Our SLURM jobs, as SLURM reports them now, in the shape of local rows (marked cluster)."""
    from scheduler import cluster

    rows = []
    for j in cluster.refresh(_engine()):
        if not final_too and j.state in cluster.FINAL:
            continue
        start = j.started_at.timestamp() if j.started_at else None
        end = j.ended_at.timestamp() if j.ended_at else None
        rows.append({
            "job_id": f"slurm:{j.cluster_job_id}", "name": j.name, "user": j.user, "state": j.state, "reason": None,
            "gpus": None, "devices": [], "priority": None, "submitted": _iso(j.submitted_at),
            "start": _iso(j.started_at), "end": _iso(j.ended_at),
            "elapsed_s": (end or now) - start if start else None, "time_limit_s": None,
            "exit_code": j.exit_code, "signal": j.signal, "kind": j.kind, "held": False,
            "exclusive": None, "cluster": j.cluster, "label": f"slurm:{j.cluster_job_id}",
            "array_job_id": None, "array_task_id": None,
            "array_max_running": None})  # SLURM's to know; not recorded here
    return rows


def _job_row(job, now: float) -> dict[str, Any]:
    start = job.started_at.timestamp() if job.started_at else None
    end = job.ended_at.timestamp() if job.ended_at else None
    return {
        "job_id": job.id, "name": job.name, "user": job.user, "state": job.state, "reason": job.reason,
        "gpus": job.gpus, "devices": job.devices,
        "priority": job.priority, "submitted": _iso(job.submitted_at), "start": _iso(job.started_at),
        "end": _iso(job.ended_at), "elapsed_s": (end or now) - start if start else None,
        "time_limit_s": job.time_limit_s, "exit_code": job.exit_code, "signal": job.signal,
        "kind": job.kind, "held": job.held, "exclusive": job.exclusive,
        "array_job_id": job.array_job_id, "array_task_id": job.array_task_id,
        "array_max_running": job.array_max_running, "saes": _sweep_saes(job),
        "snapshot_commit": job.snapshot_commit, "preemptible": job.preemptible, "shared": job.shared,
        # Its earlier runs, requeued after a preemption or a failure (SLURM's sacct -D), oldest first.
        "attempts": json.loads(job.attempts_json) if job.attempts_json else [],
        "expected_start": _iso(job.expected_start_at),
    }


def _sweep_saes(job) -> int | None:
    """A sweep job's SAE count (None for any other job; the text test spares the JSON of most)."""
    if not job.train_config_json or f'"{SWEEP_KEY}"' not in job.train_config_json:
        return None
    return sweep_size(job.train_config())


def _table_name(row: dict) -> str:
    return f"{row['name']} ({row['saes']} SAEs)" if row.get("saes") else row["name"]


def cmd_queue(args) -> int:
    from sae_dist.array_notation import label_rows
    from sae_dist.job_listing import has_cluster_jobs, pending_task_groups, read_jobs
    from scheduler.job_filters import ACTIVE, parse_states

    now = time.time()
    states = parse_states(args.states, "--states") if args.states is not None else None if args.all else ACTIVE
    if args.start:  # squeue --start: the pending ones
        states = tuple(s for s in states or ("PENDING",) if s == "PENDING")
    chosen = _chosen_jobs(args.jobs, args.name, "--name")
    if args.json:  # every task, as it is
        jobs, groups = read_jobs(states=states, **chosen), {}
    else:  # an array's pending tasks as one row (12_[3-999%8]): one decoded row for each group
        groups = pending_task_groups(**chosen) if states is None or "PENDING" in states else {}
        jobs = read_jobs(states=states, pending_tasks=False, **chosen) + (read_jobs(job_ids=groups) if groups else [])
    jobs.sort(key=lambda j: (STATE_ORDER.get(j.state, 2), -j.priority if j.state == "PENDING" else 0, j.id))
    rows = label_rows([_job_row(j, now) for j in jobs], groups)
    if chosen["job_ids"] is None and has_cluster_jobs() is not False:  # -j takes local job ids only
        typed = states if args.states is not None or args.start else None  # else SLURM's own active states too
        rows += [r for r in _cluster_rows(args.all or args.states is not None, now)
                 if _among(r, typed, chosen["names"])]
    held = _exclusive_allocations(rows)
    for r in rows:  # what each job holds now: its devices, or for an exclusive job every device
        r["allocated"] = held.get(r["job_id"], r["devices"]) if r["state"] == "RUNNING" else []
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    from scheduler.job_filters import CODES

    for r in rows:
        r["st"] = CODES.get(r["state"], r["state"])
        r["name"] = _table_name(r)
        r["elapsed"] = _duration(r["elapsed_s"]) or "0:00"
        r["limit"] = _duration(r["time_limit_s"]) or "UNLIMITED"
        r["why"] = _running_devices(r) if r["state"] == "RUNNING" else (r["reason"] or "")
        r["start_time"] = r.get("expected_start") or "N/A"
    if args.start:
        _print_table(rows, [("label", "JOBID"), ("name", "NAME"), ("user", "USER"), ("st", "ST"), ("gpus", "GPUS"),
                            ("start_time", "START_TIME"), ("why", "DEVICES(REASON)")])
        _say_if_nothing_schedules(bool(rows))
        return 0
    _print_table(rows, [("label", "JOBID"), ("name", "NAME"), ("user", "USER"), ("st", "ST"), ("gpus", "GPUS"),
                        ("elapsed", "TIME"), ("limit", "TIME_LIMIT"), ("why", "DEVICES(REASON)")])
    _say_if_nothing_schedules(any(r["state"] == "PENDING" for r in rows))
    return 0


def _chosen_jobs(jobs: str | None, names: str | None, name_flag: str) -> dict[str, Any]:
    """`-j`'s and the name flag's selection, as `read_jobs` takes it (None: no such filter)."""
    from scheduler.job_filters import parse_names

    chosen: dict[str, Any] = {"job_ids": None, "array_ids": None,
                              "names": parse_names(names, name_flag) if names is not None else None}
    if jobs is not None:
        from scheduler.job_refs import listed_jobs

        chosen["job_ids"], chosen["array_ids"] = listed_jobs(jobs)
    return chosen


def _among(row: dict, states: tuple[str, ...] | None, names: tuple[str, ...] | None) -> bool:
    """Whether a cluster job's row passes the state and name filters (None: any)."""
    return (states is None or row["state"] in states) and (names is None or row["name"] in names)


def _say_if_nothing_schedules(pending: bool) -> None:
    """Pending jobs with no daemon here to start them: say so (on stderr, the table stays clean).
    A shared PostgreSQL database may be scheduled from another machine: nothing is said then."""
    if not pending or os.environ.get("SAE_DIST_DB_URL", "").startswith("postgresql"):
        return
    from sae_dist.paths import state_home
    from scheduler.control import daemon_running

    if not daemon_running():
        print(f"note: no scheduler daemon runs for {state_home()}: pending jobs wait until one starts "
              "(python -m scheduler daemon --detach)", file=sys.stderr)


def _exclusive_allocations(rows: list[dict]) -> dict[int, list[str]]:
    """Every device each running exclusive job holds (job id -> uuids, in the order allocated:
    by index); read only when one runs, so the usual `queue` reads nothing more."""
    wanted = {r["job_id"] for r in rows if r["exclusive"] and r["state"] == "RUNNING"}
    if not wanted:
        return {}
    from sae_dist.job_listing import read_allocations

    held = read_allocations()
    return {job_id: uuids for job_id, uuids in held.items() if job_id in wanted}


def _running_devices(row: dict) -> str:
    """A running job's devices; an exclusive job's also say which others it holds."""
    text = ",".join(row["devices"])
    others = [u for u in row["allocated"] if u not in row["devices"]]
    if row["exclusive"]:
        text = f"{text} (exclusive, also holds {','.join(others)})" if others else f"{text} (exclusive)"
    if row.get("shared"):
        text = f"{text} (shared)"
    return text.strip()


def _each_job(args, action, on_tasks=None) -> int:
    """`action(engine, job_id)` on each job named, or `on_tasks(engine, ref, ids)` on the tasks of
    an array at once (default: `act_on_tasks` for the command); each one line, exit 2 if any
    was refused."""
    from scheduler.job_refs import act_on_tasks, resolve

    engine = _engine()
    failed = False
    for ref in args.job_ids:
        try:
            if isinstance(ref, str):  # slurm:N (cancel only)
                from scheduler import cluster

                print(cluster.cancel(engine, ref.split(":", 1)[1]))
                continue
            ids = resolve(ref, engine)
            if ref.tasks is None and ids == [ref.job_id]:  # a job
                print(action(engine, ref.job_id))
            else:  # tasks of an array: at once
                print(on_tasks(engine, ref, ids) if on_tasks else act_on_tasks(engine, args.command, ref, ids))
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    from scheduler.control import wake_daemon

    wake_daemon()
    return USER_ERROR_EXIT if failed else 0


def cmd_cancel(args) -> int:
    from scheduler import actions

    if args.state is None and args.name is None:
        if not args.job_ids:
            raise UserError("cancel: name the jobs: job ids (12, 12_7, 12_[3-5]), or -t/--state and -n/--name")
        return _each_job(args, actions.cancel)
    return _cancel_matching(args)


def _cancel_matching(args) -> int:
    """scancel's filters: every pending or running job in the states and of the names given,
    among the job ids given if any; one line saying what became of them."""
    from sae_dist.job_listing import read_jobs
    from scheduler.control import wake_daemon
    from scheduler.job_filters import ACTIVE, parse_states
    from scheduler.job_refs import CANCEL_WORDS, cancel_jobs, resolve, summary

    states = parse_states(args.state, "--state") if args.state is not None else None
    chosen = _chosen_jobs(None, args.name, "--name")
    engine = _engine()
    if args.job_ids:
        if any(isinstance(ref, str) for ref in args.job_ids):
            raise UserError("cancel: -t/--state and -n/--name select local jobs; cancel slurm:N by its id alone")
        chosen["job_ids"] = sorted({i for ref in args.job_ids for i in resolve(ref, engine)})
    ids = [j.id for j in read_jobs(states=[s for s in ACTIVE if states is None or s in states], **chosen)]
    outcomes = cancel_jobs(engine, ids)
    wake_daemon()
    print(summary(outcomes, CANCEL_WORDS, noun="job") if ids else "no pending or running job matches")
    return 0


def cmd_show(args) -> int:
    """scontrol show job: each job named, whole (an array's id: every task of it)."""
    from sae_dist.paths import state_home
    from scheduler import store
    from scheduler.job_refs import resolve
    from scheduler.show import show_fields, show_text
    from scheduler.spec import job_output_paths

    engine = _engine()
    ids = list(dict.fromkeys(i for ref in args.job_ids for i in resolve(ref, engine)))
    now = datetime.now(timezone.utc)
    blocks = []
    for job_id in ids:
        job = store.get_job(engine, job_id)
        if job.stdout_path:  # where it went, once started
            out, err = job.stdout_path, job.stderr_path or job.stdout_path
        else:  # where it will go
            out, err = (str(p) for p in job_output_paths(job, state_home() / "logs"))
        blocks.append(show_fields(job.model_dump(), now, _command_of(job), out, err))
    if args.json:
        print(json.dumps([{k: v for line in fields for k, v in line} for fields in blocks], indent=1))
    else:
        print("\n\n".join(show_text(fields) for fields in blocks))
    return 0


def cmd_update(args) -> int:
    """scontrol update: new values for pending jobs (a running job's supervisor keeps the limit
    it started with); each job, or array, one line; any refused: exit 2."""
    from scheduler import spec as S
    from scheduler import store
    from scheduler.job_refs import summary

    values, said = {}, []
    if args.priority is not None:
        values["priority"] = _checked_priority(args.priority, 0)
        said.append(f"priority {values['priority']}")
    if args.time is not None:
        values["time_limit_s"] = _parsed("--time", S.parse_time_limit, args.time)
        said.append(f"time limit {_duration(values['time_limit_s']) or 'UNLIMITED'}")
    if args.begin is not None:
        values["begin_at"] = _parsed("--begin", S.parse_begin, args.begin, datetime.now(timezone.utc))
        said.append(f"begin {_iso(values['begin_at'])}")
    if not values:
        raise UserError("update: nothing to change; give --priority, -t/--time or --begin")

    def one(engine, job_id: int) -> str:
        outcome = store.update_pending(engine, [job_id], values).get(job_id)
        if outcome is None:
            raise UserError(f"no job {job_id} (see `queue --all`)")
        if outcome != "done":
            raise UserError(f"job {job_id} is {outcome}: only a pending job can be updated")
        return f"job {job_id}: {', '.join(said)}"

    def tasks(engine, ref, ids: list[int]) -> str:
        return f"{ref}: " + summary(store.update_pending(engine, ids, values), {"done": f"updated ({', '.join(said)})"})

    return _each_job(args, one, tasks)


def _command_of(job) -> list[str]:
    """A job's command; a training's is its settings as the trainer's flags (those not at their
    default), the --devices flag left to its start, which gives it the devices."""
    if job.kind != "train":
        return json.loads(job.argv_json)
    from sae_dist.contract.sweep_argv import stored_job_flags

    placeholder = "cpu:1"  # a valid flag, dropped again
    flags = stored_job_flags(json.loads(job.train_config_json), placeholder)
    return ["python", "-m", "sae_dist", "train", *(f for f in flags if f != f"--devices={placeholder}")]


def cmd_hold(args) -> int:
    from scheduler import actions

    return _each_job(args, actions.hold)


def cmd_release(args) -> int:
    from scheduler import actions

    return _each_job(args, actions.release)


def cmd_requeue(args) -> int:
    from scheduler import actions

    return _each_job(args, actions.requeue)


def _recheck() -> list[dict]:
    """Probe the failed devices now (no daemon needed); what each probe said."""
    from scheduler.control import wake_daemon
    from scheduler.health import recheck_now

    results = recheck_now(_engine())
    if any(r.healthy for r in results):
        wake_daemon()  # a job waiting on a device cleared now starts at once
    return [{"uuid": r.device_uuid, "cleared": r.healthy, "detail": r.detail} for r in results]


def _print_recheck(results: list[dict]) -> None:
    if not results:
        print("No failed device to check.")
    for r in results:
        print(f"{r['uuid']}: {r['detail']}, fault cleared" if r["cleared"]
              else f"{r['uuid']}: still failing: {r['detail']}")
    print()


def cmd_info(args) -> int:
    from sae_dist.format import fmt_bytes
    from scheduler.device_view import device_sharers, sharing_text

    rechecked = _recheck() if args.recheck else None
    devices, states, _ = _devices_now()
    latest = _latest_samples()
    shared = device_sharers()
    rows = []
    for d in devices:
        s = states[d.uuid]
        # Memory is read now; utilisation needs a window, so the daemon's last second when fresh.
        sample = latest.get(d.uuid, {})
        rows.append({
            "index": d.index, "uuid": d.uuid, "name": d.name, "virtual": d.virtual, "state": s.state,
            "job_id": s.job_id, "reason": s.reason, "memory_total": d.memory_total, "memory_used": d.memory_used,
            "utilization_pct": sample.get("utilization_pct", d.utilization_pct),
            "temperature_c": d.temperature_c, "power_w": d.power_w, "error": d.error,
            "fault": d.fault.as_dict() if d.fault else None, "sharers": shared.get(d.uuid)})
    if args.json:
        print(json.dumps(rows if rechecked is None else {"rechecked": rechecked, "devices": rows}, indent=1))
        return 0
    if rechecked is not None:
        _print_recheck(rechecked)
    for r in rows:
        r["kind"] = "virtual" if r["virtual"] else "gpu"
        if r["fault"]:  # a rank died on it: unavailable until a health check passes
            r["state"] = "failed"
        r["mem"] = f"{fmt_bytes(r['memory_used']) if r['memory_used'] is not None else '—'} / " \
                   f"{fmt_bytes(r['memory_total']) if r['memory_total'] else '—'}"
        r["util"] = f"{r['utilization_pct']:.0f}%" if r["utilization_pct"] is not None else None
        r["temp"] = f"{r['temperature_c']:.0f}C" if r["temperature_c"] is not None else None
        r["power"] = f"{r['power_w']:.0f}W" if r["power_w"] is not None else None
        r["what"] = f"job {r['job_id']}" if r["job_id"] else (r["reason"] if r["state"] != "idle" else "")
        if r["sharers"]:
            r["what"] = sharing_text(r["sharers"], r["memory_total"], fmt_bytes)
    _print_table(rows, [("index", "ID"), ("name", "NAME"), ("kind", "KIND"), ("state", "STATE"), ("mem", "MEMORY"),
                        ("util", "UTIL"), ("temp", "TEMP"), ("power", "POWER"), ("what", "JOB/REASON")])
    return 0


def _latest_samples() -> dict[str, dict]:
    """The newest sample of each device if it is fresh (the daemon samples once a second)."""
    from scheduler.device_view import latest_samples

    return latest_samples()


def cmd_acct(args) -> int:
    from sae_dist.array_notation import task_label
    from sae_dist.format import fmt_bytes
    from sae_dist.job_listing import has_cluster_jobs, read_jobs
    from scheduler.job_filters import parse_states
    from scheduler.usage import job_usage, summarize

    states = parse_states(args.state, "--state") if args.state is not None else None
    chosen = _chosen_jobs(args.jobs, args.name, "--name")
    jobs = read_jobs(states=states, **chosen)  # filtered by the database, without SQLAlchemy
    now = time.time()
    rows = []
    filtered = states is not None or any(v is not None for v in chosen.values())
    usage = job_usage(None, [j.id for j in jobs] if filtered else None)
    no_samples = summarize([])  # every usage key, null: a job without samples has unknown usage
    for j in jobs:
        row = _job_row(j, now)
        row.update(usage.get(j.id) or no_samples)
        rows.append(row)
    if chosen["job_ids"] is None and has_cluster_jobs() is not False:  # -j takes local job ids only
        rows += [r for r in _cluster_rows(True, now) if _among(r, states, chosen["names"])]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        r["exit"] = f"{r['exit_code'] if r['exit_code'] is not None else 0}:{r['signal'] or 0}" \
            if r["state"] not in ("PENDING", "RUNNING") else None
        r["elapsed"] = _duration(r["elapsed_s"])
        r["util"] = (f"{r['mean_util_pct']:.0f}% / {r['peak_util_pct']:.0f}%"
                     if r.get("mean_util_pct") is not None else None)
        r["mem"] = fmt_bytes(r["peak_memory_bytes"]) if r.get("peak_memory_bytes") is not None else None
        r["wh"] = f"{r['energy_wh']:.2f}" if r.get("energy_wh") is not None else None
    for r in rows:
        r["label"] = task_label(r["job_id"], r["array_job_id"], r["array_task_id"])
        r["name"] = _table_name(r)
    if args.duplicates:
        rows = [row for r in rows for row in [*_attempt_rows(r), r]]
    _print_table(rows, [("label", "JOBID"), ("name", "NAME"), ("state", "STATE"), ("exit", "EXITCODE"),
                        ("start", "START"), ("end", "END"), ("elapsed", "ELAPSED"), ("gpus", "GPUS"),
                        ("util", "UTIL mean/peak"), ("mem", "PEAK MEM"), ("wh", "ENERGY Wh"),
                        ("reason", "REASON")])
    return 0


def _attempt_rows(row: dict) -> list[dict]:
    """A job's earlier runs as acct rows of their own (its id and name; their state, times, exit)."""
    from sae_dist.job_listing import attempt_times

    out = []
    for a in row.get("attempts") or []:
        start, end, elapsed_s = attempt_times(a)
        out.append({"label": row["label"], "name": row["name"], "state": a["state"], "reason": a.get("reason"),
                    "exit": f"{a.get('exit_code') or 0}:{a.get('signal') or 0}", "start": _iso(start), "end": _iso(end),
                    "elapsed": _duration(elapsed_s), "gpus": len(a.get("devices") or [])})
    return out


def cmd_recommend(args) -> int:
    from sae_dist.format import fmt_bytes
    from scheduler.recommend import recommend

    if args.count < 1:
        raise UserError(f"--count must be at least 1, got {args.count}")
    devices, states, _ = _devices_now()
    mem = _parse_memory(args.mem) if args.mem else None
    rec = recommend(devices, states, args.count, mem)
    if args.json:
        print(json.dumps({"chosen": rec.chosen, "passed_over": rec.passed_over, "error": rec.error}, indent=1))
        return 0 if rec.error is None else USER_ERROR_EXIT
    by_uuid = {d.uuid: d for d in devices}
    if rec.error:
        print(f"error: {rec.error}", file=sys.stderr)
    for uuid in rec.chosen:
        d = by_uuid[uuid]
        free = fmt_bytes(d.memory_free) if d.memory_free is not None else "unknown"
        print(f"use    {d.index}  {d.name}  ({free} free)")
    for uuid, why in rec.passed_over.items():
        print(f"skip   {by_uuid[uuid].index}  {by_uuid[uuid].name}: {why}")
    return 0 if rec.error is None else USER_ERROR_EXIT


def cmd_export_sbatch(args) -> int:
    from scheduler.arrays import ArraySpec
    from scheduler.sbatch import sbatch_script
    from scheduler.store import array_of, get_job

    engine = _engine()
    job = get_job(engine, args.job_id)
    if job.kind == "batch":  # its copy lives in this machine's state directory
        raise UserError(f"job {job.id} is a batch script already: give the script itself to SLURM's sbatch")
    tasks = array_of(engine, args.job_id)  # an array's id: the whole array, as SLURM's
    array = str(ArraySpec(tuple(t.array_task_id for t in tasks), job.array_max_running)) if tasks else None
    configs = {t.array_task_id: json.loads(t.train_config_json) for t in tasks} \
        if tasks and job.kind == "train" else None
    script = sbatch_script(job, nodes=args.nodes, gpus_per_node=args.gpus_per_node, cpu=args.cpu,
                           array=array, task_configs=configs)
    if args.out:
        with open(args.out, "w") as f:
            f.write(script)
        print(f"wrote {args.out}")
    else:
        print(script, end="")
    return 0


def cmd_daemon(args) -> int:
    from sae_dist.paths import state_home
    from scheduler.control import daemon_running, start_daemon_detached, stop_daemon
    from scheduler.daemon import main as run_daemon

    if args.stop:
        pid = stop_daemon()
        print(f"daemon {pid} stopped" if pid else f"no daemon runs for {state_home()}")
        return 0
    if args.detach:
        if daemon_running() or not start_daemon_detached():
            print(f"a daemon already runs for {state_home()}")
            return 0
        print(f"daemon started for {state_home()} (log: {state_home() / 'daemon.log'})")
        return 0
    return run_daemon()


def cmd_metrics(args) -> int:
    from scheduler.metrics import listen_address, serve

    return serve(listen_address(args.listen))


COMMANDS = {"submit": cmd_submit, "queue": cmd_queue, "show": cmd_show, "update": cmd_update, "cancel": cmd_cancel,
            "hold": cmd_hold, "release": cmd_release, "requeue": cmd_requeue, "info": cmd_info, "acct": cmd_acct,
            "recommend": cmd_recommend, "export-sbatch": cmd_export_sbatch, "daemon": cmd_daemon,
            "metrics": cmd_metrics}
