"""Where a sweep's SAEs train: a pure plan from their memory estimates and the job's devices.

Three cases:
  * at least as many devices as SAEs: each SAE gets a DDP group of its own, the devices split as
    evenly as possible (groups differ by one device at most; the extra devices go to the
    heaviest SAEs, which have the most to compute), in device order;
  * more SAEs than devices: several SAEs share a device, one device each, heaviest first, each
    onto an empty device while there is one (so every device is used), then onto the device
    with the most room left (the least full when a capacity is unknown).
A sweep that cannot fit is one error naming each SAE that does not, its device and how much
memory it lacks there. The plan says per SAE its devices, per device its estimated memory and
why; it is printed at start (`lines()`) and stored (`to_dict()`).

SAEs that share a device step one after another on the same batch, so what a device holds is
its runtime once, every SAE's weights, gradients and Adam states, and the largest SAE's step
temporaries (each SAE's are freed before the next one's step): `device_bytes`. A sweep from the
model source also runs the model on every device (each rank computes its share of every fill and
holds the whole fill): its weights, forward pass and fill (sae_dist/data/source_memory.py) are added to
every device, and the reason says so, with the parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sae_dist.data.source_memory import SourceMemory
from sae_dist.errors import UserError
from sae_dist.format import fmt_bytes
from sae_dist.memory import MemoryEstimate, estimate_for_config

if TYPE_CHECKING:
    from sae_dist.config import TrainConfig


class PlacementError(UserError):
    """The sweep's SAEs do not fit the job's devices; the message names each and by how much."""


@dataclass(frozen=True)
class Device:
    name: str  # as the job names it: "cuda:0", a UUID, "cpu:1"
    capacity: int | None  # bytes; None: unknown (nothing is checked against it)


@dataclass(frozen=True)
class SaeNeed:
    name: str
    alone: MemoryEstimate  # per device, trained on one device
    in_group: MemoryEstimate  # per device, in a DDP group (any size above one: memory.estimate_memory)

    def on(self, group_size: int) -> MemoryEstimate:
        return self.alone if group_size == 1 else self.in_group


@dataclass(frozen=True)
class SaeSlot:
    name: str
    devices: tuple[str, ...]  # its DDP group (one device: no DDP)
    bytes_per_device: int  # this SAE's own estimate on each of them


@dataclass(frozen=True)
class DeviceLoad:
    device: str
    capacity: int | None
    saes: tuple[str, ...]
    bytes: int  # estimated, all its SAEs together (device_bytes); 0 when it holds none
    reason: str  # a sentence: what it holds and why


@dataclass(frozen=True)
class Placement:
    mode: str  # "groups" (a DDP group per SAE), "shared" (several SAEs per device) or "everywhere"
    saes: tuple[SaeSlot, ...]  # in the sweep's order
    devices: tuple[DeviceLoad, ...]  # in the job's device order
    reason: str

    def group_of(self, name: str) -> tuple[str, ...]:
        return next(s.devices for s in self.saes if s.name == name)

    def lines(self) -> list[str]:
        """What the trainer prints at start: the reason, then one line per device."""
        return [self.reason, *(f"  {d.device}: {d.reason}" for d in self.devices)]

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "reason": self.reason,
                "saes": [{"name": s.name, "devices": list(s.devices), "bytes_per_device": s.bytes_per_device}
                         for s in self.saes],
                "devices": [{"device": d.device, "capacity": d.capacity, "saes": list(d.saes),
                             "bytes": d.bytes, "reason": d.reason} for d in self.devices]}


def device_bytes(estimates: Sequence[MemoryEstimate], source: int = 0) -> int:
    """Estimated bytes of one device holding these SAEs' estimates and `source` bytes of the
    model source's (see the module's docstring)."""
    if not estimates:
        return source
    runtime = max(e.runtime for e in estimates)
    kept = sum(e.params + e.grads + e.optimizer + e.ddp_buckets for e in estimates)
    temporaries = max(e.activations + e.heap for e in estimates)
    return runtime + kept + temporaries + source


def needs_for(points: Sequence[tuple[str, TrainConfig]], device_type: str) -> list[SaeNeed]:
    """The memory needs of named configs whose d_in is known (sae_dist.memory's estimate)."""
    return [SaeNeed(name, estimate_for_config(cfg, 1, device_type), estimate_for_config(cfg, 2, device_type))
            for name, cfg in points]


def place(needs: Sequence[SaeNeed], devices: Sequence[Device], source: SourceMemory | None = None,
          everywhere: bool = False) -> Placement:
    """The plan for these SAEs on these devices, or a PlacementError naming what does not fit;
    `source`: the model source's memory, on every device. `everywhere` (a sweep with --balance
    speed or memory): every SAE on every device, so the stream's shares set each device's work."""
    if not needs:
        raise UserError("placement: no SAE to place")
    if not devices:
        raise UserError("placement: the job has no device")
    names = [n.name for n in needs]
    if len(set(names)) != len(names):
        raise UserError(f"placement: two SAEs share a name: {sorted({n for n in names if names.count(n) > 1})}")
    extra = source.total if source is not None else 0
    if everywhere and len(devices) > 1:
        plan = _everywhere(needs, devices, extra)
    else:
        plan = _groups(needs, devices, extra) if len(devices) >= len(needs) else _shared(needs, devices, extra)
    if source is None:
        return plan
    return dataclasses.replace(plan, reason=f"{plan.reason}; {source.describe()}")


def place_sweep(sweep: Any, device_type: str, devices: Sequence[Device],
                source: SourceMemory | None = None) -> Placement:
    """A sweep (sae_dist.contract.sweep.Sweep) on a job's devices: its points' memory needs on
    `device_type`, every SAE on every device when the job balances its shares (`--balance speed`
    or `memory`: the job's setting, the same on every point, never swept). The one way the
    launcher, the ranks and the Train page place a sweep."""
    needs = needs_for([(p.name, p.config) for p in sweep.points], device_type)
    return place(needs, devices, source, everywhere=sweep.points[0].config.balance != "equal")


def _heaviest_first(needs: Sequence[SaeNeed]) -> list[SaeNeed]:
    return sorted(needs, key=lambda n: -n.alone.total)  # sorted() is stable: ties keep the sweep's order


def _group_sizes(needs: Sequence[SaeNeed], count: int) -> dict[str, int]:
    """Devices per SAE: count // SAEs each, one more for the heaviest count % SAEs."""
    size, extra = divmod(count, len(needs))
    return {n.name: size + (1 if i < extra else 0) for i, n in enumerate(_heaviest_first(needs))}


def _groups(needs: Sequence[SaeNeed], devices: Sequence[Device], extra: int) -> Placement:
    sizes = _group_sizes(needs, len(devices))
    slots: dict[str, SaeSlot] = {}
    loads: list[DeviceLoad] = []
    overflows: list[tuple[str, str]] = []
    start = 0
    for need in _heaviest_first(needs):
        size = sizes[need.name]
        group = devices[start:start + size]
        start += size
        own = need.on(size).total
        per_device = own + extra
        slots[need.name] = SaeSlot(need.name, tuple(d.name for d in group), own)
        what = f"{need.name}, alone" if size == 1 else f"{need.name}, one of its {size} DDP ranks"
        what += _with_source(extra)
        for d in group:
            loads.append(DeviceLoad(d.name, d.capacity, (need.name,), per_device, f"{what}: {_of(per_device, d)}"))
            if d.capacity is not None and per_device > d.capacity:
                company = " alone" if size == 1 else f" as one of its {size} DDP ranks"
                overflows.append((need.name, _overflow(need.name, d, per_device, company + _with_source(extra))))
    _raise_if(overflows, needs, devices)
    sizes_text = _sizes_text(sorted(sizes.values(), reverse=True))
    each = "one device each" if max(sizes.values()) == 1 else f"a DDP group each ({sizes_text})"
    reason = f"{len(needs)} SAE{_s(needs)} on {len(devices)} device{_s(devices)}: {each}"
    if len(set(sizes.values())) > 1:
        reason += "; the extra devices go to the SAEs with the most to compute"
    order = {d.name: i for i, d in enumerate(devices)}
    return Placement("groups", tuple(slots[n.name] for n in needs),
                     tuple(sorted(loads, key=lambda d: order[d.device])), reason + _unchecked(devices))


def _shared(needs: Sequence[SaeNeed], devices: Sequence[Device], extra: int) -> Placement:
    held: list[list[SaeNeed]] = [[] for _ in devices]
    overflows: list[tuple[str, str]] = []
    for need in _heaviest_first(needs):
        index = _choose(need, held, devices, extra)
        if index is None:
            overflows.append((need.name, _worst_case(need, held, devices, extra)))
        else:
            held[index].append(need)
    _raise_if(overflows, needs, devices)
    loads = []
    for d, saes in zip(devices, held):
        total = device_bytes([n.alone for n in saes], extra)
        listed = ", ".join(n.name for n in saes)
        what = f"{listed}, alone" if len(saes) == 1 else f"{listed} ({len(saes)} SAEs, one after another)"
        what += _with_source(extra)
        loads.append(DeviceLoad(d.name, d.capacity, tuple(n.name for n in saes), total, f"{what}: {_of(total, d)}"))
    where = {n.name: devices[i].name for i, saes in enumerate(held) for n in saes}
    slots = tuple(SaeSlot(n.name, (where[n.name],), n.alone.total) for n in needs)
    reason = (f"{len(needs)} SAEs on {len(devices)} device{_s(devices)}: several per device, placed largest first, "
              f"each onto an empty device while one was left, then onto the one with the most room"
              + _unchecked(devices))
    return Placement("shared", slots, tuple(loads), reason)


def _everywhere(needs: Sequence[SaeNeed], devices: Sequence[Device], extra: int) -> Placement:
    """Every SAE a DDP group of all the devices: each device holds them all and steps them one
    after another on its share of the rows."""
    total = device_bytes([n.in_group for n in needs], extra)
    names = tuple(n.name for n in needs)
    over = [d for d in devices if d.capacity is not None and total > d.capacity]
    if over:
        raise PlacementError(
            f"with --balance speed or memory every SAE of the sweep trains on every device, and its {len(needs)} "
            f"SAE{_s(needs)} need {fmt_bytes(total)} on each: "
            + "; ".join(f"{d.name} has {fmt_bytes(d.capacity)}, {fmt_bytes(total - d.capacity)} short" for d in over)
            + "; use --balance equal to give the SAEs devices of their own, or sweep fewer or smaller SAEs")
    what = (f"{names[0]}, one of its {len(devices)} DDP ranks" if len(needs) == 1
            else f"{', '.join(names)} ({len(needs)} SAEs, each one of its {len(devices)} DDP ranks)")
    what += _with_source(extra)
    loads = tuple(DeviceLoad(d.name, d.capacity, names, total, f"{what}: {_of(total, d)}") for d in devices)
    slots = tuple(SaeSlot(n.name, tuple(d.name for d in devices), n.in_group.total) for n in needs)
    reason = (f"{len(needs)} SAE{_s(needs)} on {len(devices)} devices: every SAE on every device, so that the "
              f"shares of each step (--balance) set each device's work" + _unchecked(devices))
    return Placement("everywhere", slots, loads, reason)


def _choose(need: SaeNeed, held: list[list[SaeNeed]], devices: Sequence[Device], extra: int) -> int | None:
    """The device for this SAE: an empty one if any fits, else the one with the most room after
    it (the least full where any capacity is unknown); None when none has room."""
    fits = []
    for i, d in enumerate(devices):
        after = device_bytes([*(n.alone for n in held[i]), need.alone], extra)
        if d.capacity is None or after <= d.capacity:
            fits.append((i, after))
    if not fits:
        return None
    empty = [(i, after) for i, after in fits if not held[i]]
    known = all(d.capacity is not None for d in devices)
    pool = empty or fits
    if known:
        return max(pool, key=lambda f: (devices[f[0]].capacity - f[1], -f[0]))[0]
    return min(pool, key=lambda f: (f[1], f[0]))[0]


def _worst_case(need: SaeNeed, held: list[list[SaeNeed]], devices: Sequence[Device], extra: int) -> str:
    """The overflow of an SAE that fits nowhere, on the device where it lacks least."""
    options = []
    for i, d in enumerate(devices):
        after = device_bytes([*(n.alone for n in held[i]), need.alone], extra)
        options.append((after - d.capacity, i, after))  # every capacity is known here: none fitted
    _, i, after = min(options)
    company = f" beside {', '.join(n.name for n in held[i])}" if held[i] else " alone"
    return _overflow(need.name, devices[i], after, company + _with_source(extra))


def _overflow(name: str, device: Device, need: int, company: str) -> str:
    return (f"{name} on {device.name}{company} needs {fmt_bytes(need)} of its {fmt_bytes(device.capacity)}: "
            f"{fmt_bytes(need - device.capacity)} over")


def _raise_if(overflows: list[tuple[str, str]], needs: Sequence[SaeNeed], devices: Sequence[Device]) -> None:
    if not overflows:
        return
    count = len({name for name, _ in overflows})
    raise PlacementError(
        f"the sweep does not fit the job's {len(devices)} device{_s(devices)}: {count} of its "
        f"{len(needs)} SAE{_s(needs)} {'has' if count == 1 else 'have'} no room "
        f"({'; '.join(text for _, text in overflows)}); sweep fewer or smaller SAEs, lower "
        f"batch_size, or ask for more devices or devices with more memory")


def _with_source(extra: int) -> str:
    return f", and the model source ({fmt_bytes(extra)})" if extra else ""


def _of(used: int, device: Device) -> str:
    if device.capacity is None:
        return f"{fmt_bytes(used)} estimated (capacity unknown: not checked)"
    return f"{fmt_bytes(used)} of {fmt_bytes(device.capacity)} estimated ({used / device.capacity:.0%})"


def _unchecked(devices: Sequence[Device]) -> str:
    unknown = [d.name for d in devices if d.capacity is None]
    if not unknown:
        return ""
    return f"; memory not checked on {', '.join(unknown)} (capacity unknown)"


def _sizes_text(sizes: list[int]) -> str:
    groups: dict[int, int] = {}
    for size in sizes:
        groups[size] = groups.get(size, 0) + 1
    return ", ".join(f"{count} of {size} device{'s' if size > 1 else ''}" for size, count in groups.items())


def _s(items: Sequence[Any]) -> str:
    return "" if len(items) == 1 else "s"
