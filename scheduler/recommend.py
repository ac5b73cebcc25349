"""Which devices should a job get? A pure choice by free memory, with the reasons for the rest.

`recommend --mem 20GiB --count 2` and the scheduler's placement both ask: of the idle devices,
which have room for the job's memory per device (the trainer's estimate)? Taking the ones with
the most free memory leaves the job headroom; naming why every other device was passed over
tells the user what to wait for or change. Memory strings follow SLURM's `--mem` habits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from sae_dist.errors import UserError
from sae_dist.format import fmt_bytes
from scheduler.busy import DeviceState
from scheduler.devices import DeviceInfo

_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?)(B?)\s*", re.IGNORECASE)


def parse_memory(text: str) -> int:
    """Bytes in a memory size such as "20GiB", "512M", "1.5G", "64KB" or "1024".

    As SLURM's --mem: units K, M, G, T are powers of 1024 (with or without "i" and "B", any case),
    and a plain number means MiB. "B" alone means bytes.
    """
    match = _MEMORY_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise UserError(f"bad memory size {text!r}: write a number with an optional unit K, M, G or T "
                        "(powers of 1024; a plain number means MiB), e.g. 20GiB or 512M")
    number, unit, binary_i, byte_b = match.groups()
    unit = unit.upper()
    if binary_i and not unit:
        raise UserError(f"bad memory size {text!r}: 'i' needs a unit before it, as in 20GiB")
    if not unit and not byte_b:
        unit = "M"  # SLURM's default unit
    size = int(float(number) * 1024 ** _UNITS[unit])
    if size <= 0:
        raise UserError(f"bad memory size {text!r}: it must be more than 0 bytes")
    return size


@dataclass
class Recommendation:
    chosen: list[str] = field(default_factory=list)  # uuids, most free memory first
    passed_over: dict[str, str] = field(default_factory=dict)  # uuid -> why it was not chosen
    error: str | None = None  # set (and `chosen` empty) when fewer than `count` devices fit


def _why_not(device: DeviceInfo, state: DeviceState | None, mem_per_device: int | None) -> str | None:
    """Why this device cannot take the job, or None when it can."""
    if state is None or state.state == "unavailable":
        return f"unavailable: {state.reason if state else 'no state known'}"
    if state.state == "allocated":
        return f"allocated to job {state.job_id}"
    if state.state == "busy":
        return f"busy: {state.reason}"
    if mem_per_device is not None:
        if device.memory_free is None:
            return f"free memory unknown, {fmt_bytes(mem_per_device)} needed"
        if device.memory_free < mem_per_device:
            return f"low memory: {fmt_bytes(device.memory_free)} free, {fmt_bytes(mem_per_device)} needed"
    return None


def recommend(devices: list[DeviceInfo], states: dict[str, DeviceState], count: int,
              mem_per_device: int | None) -> Recommendation:
    """The `count` idle devices with enough free memory and the most of it (ties: lowest index)."""
    if count < 1:
        raise UserError(f"--count must be at least 1, not {count}")
    passed_over: dict[str, str] = {}
    fits: list[DeviceInfo] = []
    for device in devices:
        why = _why_not(device, states.get(device.uuid), mem_per_device)
        if why is None:
            fits.append(device)
        else:
            passed_over[device.uuid] = why
    fits.sort(key=lambda d: (-(d.memory_free or 0), d.index))
    if len(fits) < count:
        need = f" with {fmt_bytes(mem_per_device)} free each" if mem_per_device is not None else ""
        if count > len(devices):
            head = f"{count} devices requested but this machine has {len(devices)}"
        else:
            head = f"{count} devices requested{need}, but only {len(fits)} fit"
        by_label = {d.uuid: d.label for d in devices}
        details = "; ".join(f"{by_label[uuid]}: {why}" for uuid, why in passed_over.items())
        return Recommendation([], passed_over, head + (f" ({details})" if details else ""))
    chosen = fits[:count]
    for device in fits[count:]:
        passed_over[device.uuid] = (f"not needed: {count} device{'s' if count > 1 else ''} "
                                     "with at least as much free memory chosen")
    return Recommendation([d.uuid for d in chosen], passed_over, None)
