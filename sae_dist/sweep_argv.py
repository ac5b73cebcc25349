"""A queued sweep job: its lists stored beside the job's config, and the `--sweep` flags they become.

A sweep is one job (issue 20). The job's stored training config (`jobs.train_config_json`) holds
the base settings as always, plus one key, `sweep`: {setting: [values]} in the sweep's order, the
values as the validated points hold them. The job's command line is the base config's flags
(sae_dist.contract.stored_train_argv) and one `--sweep=KEY=V1,V2` per swept setting, which the
trainer reads back into the same grid (sae_dist.sweep.parse_sweep_flags). Only lists travel: an
explicit `[[sweep.points]]` list has no flag spelling, so it is refused at submit (a job array
runs explicit points as separate jobs). Torch-free: `python -m scheduler` imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from sae_dist.errors import ConfigError, UserError

SWEEP_KEY = "sweep"  # the key of the stored config dict that holds the lists
SWEEP_FLAG = "--sweep"


def split_stored(stored: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]] | None]:
    """A stored training config as (its plain settings, its sweep lists or None)."""
    plain = dict(stored)
    return plain, plain.pop(SWEEP_KEY, None)


def sweep_size(stored: Mapping[str, Any] | None) -> int | None:
    """How many SAEs a stored config trains in one job: None when it is no sweep."""
    lists = (stored or {}).get(SWEEP_KEY)
    if not lists:
        return None
    return math.prod(len(v) for v in lists.values())


def checked_lists(base: Mapping[str, Any], table: Any = None,
                  flag_lists: Mapping[str, list[Any]] | None = None) -> dict[str, list[Any]] | None:
    """The lists to store for a sweep given as a TOML [sweep] table and/or parsed --sweep flags
    over the user's own settings `base` (no defaults filled in, so a key both set and swept is
    caught); None when there is no sweep. Every mistake is one UserError naming the sweep."""
    from sae_dist.sweep import build_sweep

    if isinstance(table, Mapping) and "points" in table:
        raise UserError(f"{SWEEP_FLAG}: [[sweep.points]] cannot be queued: a job's command line carries "
                        "lists only (--sweep KEY=V1,V2); give [sweep] lists, or run the points as a job "
                        "array ([[array]] tables), one job per point")
    sweep = build_sweep(base, table, flag_lists)
    if sweep is None:
        return None
    return lists_of(sweep)


def lists_of(sweep: Any) -> dict[str, list[Any]]:
    """A built grid sweep's lists back, each key's values in the order they first appear (the
    cartesian product of these is the sweep again, in its order)."""
    lists: dict[str, list[Any]] = {key: [] for key in sweep.keys}
    for point in sweep.points:
        for key, value in point.settings.items():
            if value not in lists[key]:
                lists[key].append(value)
    for key, values in lists.items():
        for value in values:
            if isinstance(value, str) and "," in value:
                raise UserError(f"{SWEEP_FLAG}: {key} value {value!r} holds a comma, which no --sweep flag can carry")
    return lists


def check_stored(config: Mapping[str, Any], lists: Any) -> dict[str, list[Any]]:
    """Stored lists checked again against a full (defaults filled in) base config: the base's
    own value of a swept key is dropped (the sweep sets it). Returns the lists as coerced."""
    from sae_dist.sweep import build_sweep

    if not isinstance(lists, Mapping) or not lists:
        raise UserError(f"{SWEEP_FLAG}: a sweep is a table of lists, e.g. {{'k': [16, 32]}}")
    base = {k: v for k, v in config.items() if k not in lists}
    try:
        sweep = build_sweep(base, dict(lists))
    except ConfigError as e:
        raise UserError(f"{SWEEP_FLAG}: {str(e).removeprefix('sweep: ')}") from None
    return lists_of(sweep)


def flag_value(value: Any) -> str:
    """A value as the trainer's --sweep reads it back (3e-4 as 0.0003: float() takes both)."""
    return repr(value) if isinstance(value, float) else str(value)


def sweep_flags(lists: Mapping[str, list[Any]] | None) -> list[str]:
    """One `--sweep=KEY=V1,V2` per swept setting, in the sweep's order ('=' keeps a value that
    starts with '-' from reading as a flag)."""
    return [f"{SWEEP_FLAG}={key}={','.join(flag_value(v) for v in values)}" for key, values in (lists or {}).items()]


def stored_job_flags(stored: Mapping[str, Any], devices_flag: str) -> list[str]:
    """The `python -m sae_dist train` flags of a stored training config, a sweep's included: the
    base config's (a swept key's own value left out: the sweep sets it), then the --sweep flags."""
    from sae_dist.contract import stored_train_argv

    plain, lists = split_stored(stored)
    if lists:
        plain = {k: v for k, v in plain.items() if k not in lists}
    return [*stored_train_argv(plain, devices_flag), *sweep_flags(lists)]
