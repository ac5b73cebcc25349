"""The Train page's decisions, as pure functions: the form's first values for the devices at
hand, the devices wanted checked in words, and when a submit would repeat the last one.

Virtual devices are CPU-backed ranks: the trainer's defaults (d_in 512, batch 4,096 a device,
1,000 steps) take many minutes there. Their defaults are a small synthetic run that finishes in
about a minute on 2 ranks of a 2-core machine. Measured on this model, start-up and the
end-of-run evaluation included: the trainer alone, 1,500 steps in 25 s at load 2.5 and 3,000 in
79 s at load 4 to 6; from the Train page through the scheduler with the Monitor open in
Chromium, 2,000 steps in 102 s at load 4.5 to 7, and 1,500 in 40 s from submit to end at load
5 to 6.7. Real GPUs keep the trainer's defaults.
"""

from __future__ import annotations

import json
from typing import Any

VIRTUAL_DEFAULTS = {"tr_d_in": 64, "tr_expansion": 4, "tr_d_sae": 256, "tr_k": 8, "tr_batch": 256,
                    "tr_steps": 1500, "tr_checkpoint_every": 500}
"""The form's first values on virtual devices (the demo's model: 64 wide, 256 latents, k 8)."""
VIRTUAL_DEVICES_WANTED = 2
"""Ranks a virtual run starts with: more CPU ranks than cores only slow each other down."""


def first_values(defaults: dict[str, Any], all_virtual: bool) -> dict[str, Any]:
    """The form's first values: the trainer's `defaults`, made small when every device is virtual."""
    return {**defaults, **VIRTUAL_DEFAULTS} if all_virtual else dict(defaults)


def devices_wanted(idle: int, all_virtual: bool) -> int:
    """How many devices to recommend at first: every idle one on GPUs (people train on what is
    free), at most VIRTUAL_DEVICES_WANTED virtual ones; at least 1."""
    return max(1, min(idle, VIRTUAL_DEVICES_WANTED) if all_virtual else idle)


def wanted_error(wanted: Any, devices: int) -> str | None:
    """Why "GPUs wanted" cannot be used, in words; None when it can."""
    if wanted is None:
        return "give how many devices to recommend (at least 1)"
    if wanted < 1:
        return f"at least 1 device is needed ({wanted} given)"
    if wanted > max(1, devices):
        return f"this machine has {devices} device{'s' if devices != 1 else ''} ({wanted} given)"
    return None


def fingerprint(config: dict[str, Any], priority: int, time_limit_s: float | None,
                devices: int) -> str:
    """What makes two submits the same job: the training configuration (its name aside: a blank
    name gets a new one each time), priority, time limit and how many devices. Which devices is
    left out: after a submit the next free ones are ticked, and that alone is no new job."""
    kept = {key: value for key, value in config.items() if key != "name"}
    return json.dumps([kept, priority, time_limit_s, devices], sort_keys=True, default=str)


def repeats_last(current: str | None, last: str | None, confirmed: bool) -> bool:
    """Whether submitting now would queue the last submitted job again, unasked."""
    return current is not None and current == last and not confirmed
