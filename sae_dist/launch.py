"""Start one training job on N devices: in this process for one, through torchrun's launcher for more.

We do not re-implement process management: `torch.distributed.run` (torchrun) spawns the ranks,
runs the rendezvous on a free port (or the port the scheduler reserved for the job) and tears
every rank down when one fails. Ranks find themselves in worker mode through torchrun's RANK /
WORLD_SIZE variables and run `sae_dist.train.train`.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from sae_dist.config import TrainConfig, parse_devices
from sae_dist.distributed import DEVICE_TYPE_ENV
from sae_dist.errors import USER_ERROR_EXIT, UserError

log = logging.getLogger(__name__)

# The scheduler reserves a rendezvous port per job so two jobs never meet on torchrun's 29500.
PORT_ENV = "SAE_DIST_MASTER_PORT"


OUR_LAUNCHER_ENV = "SAE_DIST_OUR_LAUNCHER"


def in_worker() -> bool:
    """True inside a rank started by torchrun (ours or the user's, e.g. under SLURM)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


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


def launch(cfg: TrainConfig, argv: list[str], command: str = "train", in_process=None) -> int:
    """Run the job; argv is the `command` line (train, bench-point), handed unchanged to every
    rank. One device runs in this process: `in_process()` (default: train(cfg))."""
    kind, n = resolve_devices(cfg.devices)
    os.environ[DEVICE_TYPE_ENV] = kind
    os.environ[OUR_LAUNCHER_ENV] = "1"  # our ranks leave reporting a stop to this launcher
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if n == 1:
        if in_process is not None:
            in_process()
            return 0
        from sae_dist.train import train

        train(cfg)
        return 0
    if kind == "cpu":
        # Each gloo rank gets its share of the cores (torchrun would give each 1 thread).
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    port = os.environ.get(PORT_ENV)
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"] if port else ["--standalone"]
    args = get_args_parser().parse_args(
        [*rdzv, "--nnodes", "1", "--nproc-per-node", str(n), "--max-restarts", "0",
         "--module", "sae_dist", command, *argv])
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(args)
    except SignalException as e:  # torchrun passed the signal on to the ranks and waited for them
        print(f"training stopped by {signal.Signals(e.sigval).name}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if any(f.exitcode == USER_ERROR_EXIT for f in e.failures.values()):
            # A rank printed the one line that explains it; the others were stopped after it.
            return USER_ERROR_EXIT
        rank, failure = e.get_first_failure()
        if failure.exitcode in (128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT):
            signum = abs(failure.exitcode) % 128  # the ranks were stopped (not this launcher)
            print(f"training stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            return 128 + signum
        print(f"error: training failed on rank {rank} (exit code {failure.exitcode}); "
              f"its message is above", file=sys.stderr)
        return failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
    return 0
