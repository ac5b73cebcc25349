"""Which ranks of a failed job lost their device, and how the job goes on without them.

torchrun stops every rank when one fails; our launcher then asks `lost_ranks` which failures were
a device dying (a rank killed by SIGKILL/SIGSEGV/SIGBUS..., or one that exited with
DEVICE_ERROR_EXIT after a CUDA error) rather than the peers that merely lost their connection to
it, or a bug or a mistake that would fail again anywhere. The job is restarted from its last
checkpoint on the other devices (the trainer keeps the global batch, see sae_dist.train.balance) and
the lost device is recorded in the state database, where the scheduler keeps it out of new jobs
until it reads healthy again.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from sae_dist.contract import DEVICES_ENV, NUM_GPUS_ENV, device_channels

# A rank that hit a CUDA error (not out-of-memory) exits with this, so its launcher can tell a
# device failure from a bug (sysexits' EX_IOERR).
DEVICE_ERROR_EXIT = 74

DEVICE_SIGNALS = frozenset({signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL,
                            signal.SIGFPE})


@dataclass(frozen=True)
class Failure:
    rank: int
    exitcode: int

    @property
    def signal(self) -> int | None:
        if self.exitcode < 0:
            return -self.exitcode
        return self.exitcode - 128 if self.exitcode > 128 else None

    def describe(self) -> str:
        if self.exitcode == DEVICE_ERROR_EXIT:
            return "a device error"
        if self.signal is not None:
            return f"killed by {signal.Signals(self.signal).name}"
        return f"exit code {self.exitcode}"


def lost_ranks(failures: list[Failure]) -> list[int]:
    """The ranks whose device is to blame: killed by a signal that is not a stop (SIGTERM/SIGINT
    are a cancel), or exited after a device error. Ordinary failures blame no device."""
    lost = []
    for f in failures:
        if f.exitcode == DEVICE_ERROR_EXIT or (f.signal is not None and f.signal in DEVICE_SIGNALS):
            lost.append(f.rank)
    return sorted(set(lost))


def is_device_error(error: BaseException) -> bool:
    """A CUDA error that says the device is in trouble (not out-of-memory, which is the job's)."""
    import torch

    text = str(error)
    if "out of memory" in text.lower():
        return False
    accelerator = getattr(torch, "AcceleratorError", None)
    return (accelerator is not None and isinstance(error, accelerator)) or "CUDA error" in text \
        or "fallen off the bus" in text or "ECC error" in text


def is_peer_loss(error: BaseException) -> bool:
    """A collective failed because another rank went away (gloo reports a plain RuntimeError)."""
    import torch.distributed as dist

    text = str(error)
    return isinstance(error, dist.DistError) or (
        "gloo" in text and any(w in text for w in ("Connection reset", "Connection closed", "Read error",
                                                     "Broken pipe", "Timed out")))


def device_ids(kind: str, n: int) -> tuple[list[str], bool]:
    """The job's devices, one per local rank, and whether they are identities the scheduler knows
    (its uuids) rather than plain positions."""
    given = [d for d in os.environ.get(DEVICES_ENV, "").split(",") if d]
    if len(given) == n:
        return given, True
    if kind == "cuda":
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
        return (visible if len(visible) == n else [str(i) for i in range(n)]), False
    return [f"cpu:{i}" for i in range(n)], False


def survivors(ids: list[str], lost: list[int]) -> list[str]:
    """The devices of the ranks not lost, in rank order: the restarted job's devices."""
    return [d for r, d in enumerate(ids) if r not in lost]


def survivors_env(kind: str, ids: list[str], lost: list[int], known: bool) -> tuple[dict[str, str], str]:
    """Environment and --devices value of the restarted job: only the devices still healthy are
    visible to it (contract.device_channels: the channels the scheduler set, for fewer devices).
    CPU ranks leave CUDA_VISIBLE_DEVICES as it was; ids that are plain positions (`known` False)
    are not the scheduler's, so its variables are not written."""
    env, devices_flag = device_channels(survivors(ids, lost), kind)
    if kind != "cuda":
        del env["CUDA_VISIBLE_DEVICES"]
    if not known:
        del env[DEVICES_ENV], env[NUM_GPUS_ENV]
    return env, devices_flag
