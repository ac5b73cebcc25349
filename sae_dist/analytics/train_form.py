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


# ---- a sweep: many SAEs in one job (issue 20) ----

SWEEP_FIELDS = ("architecture", "k", "expansion_factor", "lr")
"""The settings the form sweeps (sae_dist.contract.sweep takes more from a TOML file or the CLI)."""


def sweep_lists(texts: dict[str, str], architectures: list[str]) -> tuple[dict[str, list[Any]], dict[str, str]]:
    """The form's sweep fields as {setting: [values]}, and an error per field that cannot be
    read ("16, 32, 64": each value as its setting's type). A blank field is not swept."""
    from sae_dist.contract.sweep import parse_sweep_flags
    from sae_dist.errors import ConfigError

    lists: dict[str, list[Any]] = {"architecture": list(architectures)} if architectures else {}
    errors: dict[str, str] = {}
    for key, text in texts.items():
        if not text.strip():
            continue
        try:
            lists.update(parse_sweep_flags([f"{key}={text}"]))
        except ConfigError as e:
            errors[key] = _sweep_message(e, key)
    return lists, errors


def form_sweep(values: dict[str, Any], texts: dict[str, str], architectures: list[str]
               ) -> tuple[Any, dict[str, list[Any]], dict[str, str]]:
    """(the sweep or None, its lists, the errors by field) of the form's sweep fields over its
    other `values`: every field that reads is checked for its values even when another does not
    read (each bad field says so at once); the grid as a whole only when all read. Nothing is
    checked against a base that is itself invalid (its own field says why)."""
    from sae_dist.config import build_config
    from sae_dist.errors import ConfigError

    lists, errors = sweep_lists(texts, architectures)
    if errors and not lists:
        return None, lists, errors
    try:  # a mistake in the other fields is shown under them once, not again under each swept one
        build_config(_without(values, lists))
    except ConfigError:
        return None, lists, errors
    sweep, value_errors = checked_sweep(values, lists)
    if errors:
        value_errors.pop("sweep", None)
    errors = {**value_errors, **errors}
    return (None if errors else sweep), lists, errors


def checked_sweep(values: dict[str, Any], lists: dict[str, list[Any]]) -> tuple[Any, dict[str, str]]:
    """The sweep the form describes over its other `values` (a swept setting's own field is
    left out), or None and the errors: one per bad field (its values checked alone), else one
    for the whole grid ("sweep": two points that train the same SAE, too many SAEs)."""
    from sae_dist.contract.sweep import build_sweep
    from sae_dist.errors import ConfigError

    if not lists:
        return None, {"sweep": "list values in at least one field (e.g. 16, 32, 64 in k), or turn the sweep off"}
    errors: dict[str, str] = {}
    for key, values_of_key in lists.items():
        try:
            build_sweep(_without(values, [key]), None, {key: values_of_key})
        except ConfigError as e:
            errors[key] = _sweep_message(e, key)
    if errors:
        return None, errors
    try:
        return build_sweep(_without(values, lists), None, lists), {}
    except ConfigError as e:
        return None, {"sweep": str(e).removeprefix("sweep: ")}


def _without(values: dict[str, Any], keys) -> dict[str, Any]:
    return {k: v for k, v in values.items() if k not in keys}


def _sweep_message(error: Exception, key: str) -> str:
    """A sweep error as shown above its field: without the "sweep: --sweep k:" the CLI needs."""
    return str(error).removeprefix("sweep: ").removeprefix(f"--sweep {key}: ")


def sweep_plan(sweep: Any, devices: list[tuple[str, int | None]], device_type: str) -> dict[str, Any]:
    """What the Train page shows before a sweep's submit: its SAEs' names and, on the chosen
    devices (label, capacity in bytes or None: unknown), the placement's reason and one row per
    device with its estimated memory; or the placement's error (which SAE lacks how much)."""
    from sae_dist.errors import UserError
    from sae_dist.format import fmt_bytes
    from sae_dist.sweeps.placement import Device, place_sweep

    shown: dict[str, Any] = {"count": len(sweep), "names": sweep.names, "reason": None, "rows": [], "error": None}
    if not devices:
        return shown
    if any(p.config.d_in is None for p in sweep.points):
        shown["error"] = "the memory per device needs d_in (the shards' width)"
        return shown
    try:
        plan = place_sweep(sweep, device_type, [Device(label, capacity) for label, capacity in devices])
    except UserError as e:
        shown["error"] = str(e)
        return shown
    shown["reason"] = plan.reason
    shown["rows"] = [{"Device": d.device, "SAEs": ", ".join(d.saes) or "—", "Estimated memory": fmt_bytes(d.bytes),
                      "Capacity": fmt_bytes(d.capacity) if d.capacity is not None else "unknown (virtual)"}
                     for d in plan.devices]
    return shown


def devices_asked(selected: list[str], wanted: int) -> dict[str, Any]:
    """What a submit asks the scheduler for: the devices ticked (it waits for those), or, with
    none ticked, any `wanted` devices (it starts the job on the first that are free), as SLURM's
    `--gpus N`. Submitting never needs a free device: the job waits in the queue."""
    if selected:
        return {"gpu_ids": list(selected), "gpus": len(selected)}
    return {"gpu_ids": None, "gpus": max(1, wanted)}


def asked_in_words(asked: dict[str, Any], labels: dict[str, str], free: int) -> str:
    """The devices a submit asks for, in words, and whether it will wait for them."""
    if asked["gpu_ids"]:
        return ", ".join(labels.get(u, u) for u in asked["gpu_ids"])
    n = asked["gpus"]
    devices = f"any {n} device{'s' if n != 1 else ''}"
    if free >= n:
        return f"{devices} (the scheduler picks; {free} free now)"
    return f"{devices}, queued until {'they are' if n != 1 else 'one is'} free ({free} free now)"


def job_status(job: dict[str, Any] | None, explain) -> str:
    """Where a submitted job stands, as the Queue page says it: its state, what a pending job
    waits for (`explain`: the reason code in words), the devices a running one got."""
    if job is None:
        return "no longer in the queue"
    state = job["state"]
    if state == "PENDING":
        return f"PENDING, {explain(job.get('reason'))}"
    if state == "RUNNING":
        return f"RUNNING on {', '.join(job.get('devices') or []) or 'its devices'}"
    return state


def form_config(fields: dict[str, Any], sweep_texts: dict[str, str] | None,
                swept_architectures: list[str]) -> tuple[Any, Any, dict[str, list[Any]], dict[str, str]]:
    """(the TrainConfig or None, the sweep or None, its lists, errors by form field) from the
    form's fields as drawn: the fields its architecture and width choice show (`width_by`:
    "d_sae" or "expansion"), the learning rate, Matryoshka's inner weight schedule and the name
    as typed (blank: the default), and with
    `sweep_texts` (the sweep toggled on) the swept values, which leave the base config. The
    trainer's own validation (build_config): each message names the field it goes under."""
    from sae_dist.config import TOPK_FAMILY, build_config
    from sae_dist.errors import ConfigError

    errors: dict[str, str] = {}
    values = {key: fields[key] for key in ("architecture", "source", "batch_size", "grad_accum", "steps",
                                           "precision", "checkpoint_every", "balance", "rebalance",
                                           "on_rank_loss")}
    for key in ("d_in", "shards_path", "transcode"):
        if fields.get(key) is not None:
            values[key] = fields[key]
    if fields.get("transcode") and fields.get("skip"):
        values["skip"] = True
    width = "d_sae" if fields["width_by"] == "d_sae" else "expansion_factor"
    values[width] = fields[width]
    sparsity = ("k" if fields["architecture"] in TOPK_FAMILY
                else "l1_coefficient" if fields["architecture"] == "standard" else "l0_coefficient")
    values[sparsity] = fields[sparsity]
    typed = {"lr": ("lr_text", "2e-4")}  # numbers typed as text (blank: the default): field and an example
    if fields["architecture"] == "matryoshka":  # its own fields, drawn only for it
        widths_text = (fields.get("matryoshka_widths") or "").strip()
        if widths_text:  # blank: the default widths
            values["matryoshka_widths"] = widths_text
        if fields.get("matryoshka_selection"):
            values["matryoshka_selection"] = fields["matryoshka_selection"]
        inner = fields.get("matryoshka_inner_weight")
        if inner is not None and inner != 1.0:  # 1: the default, unset
            values["matryoshka_inner_weight"] = float(inner)
        typed |= {"matryoshka_inner_weight_start": ("matryoshka_inner_weight_start", "8"),
                  "matryoshka_inner_weight_until": ("matryoshka_inner_weight_until", "0.8")}
    for key, (field, example) in typed.items():
        text = (fields.get(field) or "").strip()
        if text:
            try:
                values[key] = float(text)
            except ValueError:
                errors[key] = f"{text!r} is not a number; write e.g. {example}, or leave it blank for the default"
    if fields.get("name", "").strip():
        values["name"] = fields["name"].strip()
    sweep, lists = None, {}
    if sweep_texts is not None:  # the swept settings leave the base config: the sweep sets them
        sweep, lists, sweep_errors = form_sweep(values, sweep_texts, swept_architectures)
        errors.update({"sweep" if k == "sweep" else f"sweep_{k}": m for k, m in sweep_errors.items()})
        values = {k: v for k, v in values.items() if k not in lists}
    config = None
    try:
        config = build_config(values)
    except ConfigError as error:
        errors.setdefault(error.field, str(error).removeprefix(f"{error.field}: "))
    return config, sweep, lists, errors
