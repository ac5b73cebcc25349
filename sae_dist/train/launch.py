"""Start one training job on N devices: in this process for one, through torchrun's launcher for more.

We do not re-implement process management: `torch.distributed.run` (torchrun) spawns the ranks,
runs the rendezvous on a free port (or the port the scheduler reserved for the job) and tears
every rank down when one fails. Ranks find themselves in worker mode through torchrun's RANK /
WORLD_SIZE variables and run `sae_dist.train.loop.train`.

CPU (gloo) ranks are forked from this launcher once it has imported the trainer (torchrun's own
`--start-method fork --run-path`): a fresh Python spends ~4 s of CPU per rank importing torch, the
optimizer's torch._dynamo and the database layer, which on a laptop delayed every job's first
step by seconds. CUDA ranks are always started fresh (spawn): CUDA must never be initialised
before a fork, and a fresh process is how torchrun is tested on GPUs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from sae_dist.config import TrainConfig, parse_devices
from sae_dist.contract import DEVICE_TYPE_ENV, FORKED_RANK_ENV, JOB_ID_ENV, MASTER_PORT_ENV, OUR_LAUNCHER_ENV
from sae_dist.errors import USER_ERROR_EXIT, UserError
from sae_dist.train import survive

FORKED_RANK = Path(__file__).resolve().parents[1] / "cli" / "forked_rank.py"

log = logging.getLogger(__name__)


def in_worker() -> bool:
    """True inside a rank started by torchrun (ours or the user's, e.g. under SLURM)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def exit_rank(code: int) -> NoReturn:
    """Leave a rank without the interpreter's teardown, which can abort with std::terminate in
    gloo's threads while peers leave too. A forked rank raises SystemExit instead: torchrun's
    process wrapper then reports the rank done and ends it with os._exit itself (an os._exit
    here would leave the launcher waiting forever for the rank's result)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.environ.get(FORKED_RANK_ENV):
        raise SystemExit(code)
    os._exit(code)


def die_with_parent() -> None:
    """Make this rank die when its launcher dies, even by SIGKILL.

    torchrun starts each rank in a session of its own, so a signal to the launcher's process
    group never reaches the ranks: without this, a killed launcher leaves orphans that keep
    training and writing checkpoints. Linux only (prctl PR_SET_PDEATHSIG); elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() == 1:  # the launcher died before we asked
        os._exit(1)


def resolve_devices(spec: str) -> tuple[str, int]:
    """('cpu' | 'cuda', number of ranks) for a --devices value on this machine."""
    kind, count = parse_devices(spec)
    if kind in ("auto", "cuda"):
        import torch

        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if kind == "auto":
            return ("cuda", available) if available else ("cpu", 1)
        if available == 0:
            raise UserError(f"--devices {spec}: no CUDA GPU is visible here; use --devices cpu:N")
        if count is not None and count > available:
            raise UserError(f"--devices {spec}: {count} GPUs asked for, {available} visible "
                            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        return "cuda", count or available
    return kind, count or 1


def launch(cfg: TrainConfig, argv: list[str], command: str = "train", in_process=None, sweep=None) -> int:
    """Run the job; argv is the `command` line (train, bench-point), handed unchanged to every
    rank. One device runs in this process: `in_process()` (default: train(cfg, sweep)). A rank
    that loses its device restarts the training, a sweep's too, on the devices left."""
    kind, n = resolve_devices(cfg.devices)
    os.environ[DEVICE_TYPE_ENV] = kind
    os.environ[OUR_LAUNCHER_ENV] = "1"  # our ranks leave reporting a stop to this launcher
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if n == 1:
        if in_process is not None:
            in_process()
            return 0
        from sae_dist.train.loop import train

        train(cfg, sweep)
        return 0
    if kind == "cpu":
        # Each gloo rank gets its share of the cores (torchrun would give each 1 thread).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    restartable = command == "train" and cfg.on_rank_loss == "continue"
    run_dir = None
    if restartable:
        argv, run_dir = _pin_run_dir(cfg, argv)
    ids, known = survive.device_ids(kind, n)
    while True:
        code, failures = _torchrun(argv, n, command, fork=kind == "cpu")
        if not failures:
            return code
        lost = survive.lost_ranks(failures)
        if not (restartable and lost and len(lost) < n):
            return _report_failure(failures)
        argv, n, ids = _continue_without(cfg, kind, argv, run_dir, ids, known, lost, failures)


def _torchrun(argv: list[str], n: int, command: str, fork: bool) -> tuple[int, list[survive.Failure] | None]:
    """(exit code, None) when the job ended as a whole (done, stopped, a user error); (0, the
    failed ranks) when a rank failed and torchrun stopped the others."""
    if fork:
        _import_what_ranks_need()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(torchrun_argv(argv, n, command, fork, os.environ.get(MASTER_PORT_ENV)))
    for noisy in ("torch.distributed.elastic", "torch.multiprocessing.spawn"):  # we report failures ourselves
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:  # torchrun passed the signal on to the ranks and waited for them
        print(f"training stopped by {signal.Signals(e.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval), None
    except ChildFailedError as e:
        if any(f.exitcode == USER_ERROR_EXIT for f in e.failures.values()):
            # A rank printed the one line that explains it; the others were stopped after it.
            return USER_ERROR_EXIT, None
        rank, failure = e.get_first_failure()
        if failure.exitcode in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT):
            signum = abs(failure.exitcode) % 128  # the ranks were stopped (not this launcher)
            print(f"training stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            return 128 + signum, None
        first = survive.Failure(rank, failure.exitcode)
        others = [survive.Failure(r, f.exitcode) for r, f in e.failures.items() if r != rank]
        return 0, [first, *others]
    return 0, None


def torchrun_argv(argv: list[str], n: int, command: str, fork: bool, port: str | None) -> list[str]:
    """torchrun's command line for `command argv` on n local ranks: forked from this process
    (CPU) or fresh ones; on the port the scheduler reserved for the job (so two jobs never meet
    on torchrun's 29500), else a free one."""
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"] if port else ["--standalone"]
    how = ["--start-method", "fork", "--run-path", str(FORKED_RANK)] if fork else ["--module", "sae_dist"]
    return [*rdzv, "--nnodes", "1", "--nproc-per-node", str(n), "--max-restarts", "0", *how, command, *argv]


def _import_what_ranks_need() -> None:
    """Import, before forking, what every rank would otherwise import on its own. No tensor
    operation may run here: GNU OpenMP's thread pool does not survive a fork."""
    import torch._dynamo  # noqa: F401  (torch.optim imports it on the first step)

    import sae_dist.db  # noqa: F401
    import sae_dist.train.loop  # noqa: F401  (and the step, the model, the sources a benchmark uses)


def _report_failure(failures: list[survive.Failure]) -> int:
    first = failures[0]
    print(f"error: training failed on rank {first.rank} ({first.describe()}); its message is above",
          file=sys.stderr)
    return first.exitcode if first.exitcode > 0 else 1


def _pin_run_dir(cfg: TrainConfig, argv: list[str]) -> tuple[list[str], Path]:
    """Name the run directory on the command line, so that a restart finds the same one."""
    from sae_dist.train.checkpoint import check_run_dir

    name, run_dir = check_run_dir(cfg)
    return [*argv, "--name", name, "--out-dir", str(run_dir)], run_dir


def _continue_without(cfg, kind, argv, run_dir, ids, known, lost, failures):
    """Record the lost devices, then the arguments and environment of the job on the others."""
    from sae_dist.contract import RESTART_NOTE_ENV
    from sae_dist.train.checkpoint import latest_checkpoint

    by_rank = {f.rank: f for f in failures}
    reason = "; ".join(f"rank {r} ({ids[r]}): {by_rank[r].describe()}" for r in lost)
    n = len(ids) - len(lost)
    checkpoint = latest_checkpoint(run_dir)
    where = f"from {checkpoint.name}" if checkpoint else "from the start (no checkpoint yet)"
    print(f"warning: {reason}; continuing {where} on the {n} other device{'s' if n > 1 else ''}",
          file=sys.stderr, flush=True)
    if known and cfg.db:
        _record_faults(ids, lost, by_rank)
    env, devices_flag = survive.survivors_env(kind, ids, lost, known)
    os.environ.update(env)
    os.environ[RESTART_NOTE_ENV] = json.dumps({
        "lost_ranks": lost, "lost_devices": [ids[r] for r in lost], "reason": reason,
        "world_size_before": len(ids)})
    argv = [*argv, "--devices", devices_flag, *(["--resume"] if checkpoint else [])]
    return argv, n, survive.survivors(ids, lost)


def _record_faults(ids: list[str], lost: list[int], by_rank: dict) -> None:
    from sae_dist.db import get_engine, record_fault

    job = os.environ.get(JOB_ID_ENV)
    engine = get_engine()
    for r in lost:
        record_fault(engine, ids[r], f"training rank {r} {by_rank[r].describe()}",
                     job_id=int(job) if job and job.isdigit() else None, rank=r)
