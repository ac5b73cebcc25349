"""A queued sweep job: its sweep stored beside the job's config, and the flags it becomes.

A sweep is one job (issue 20). The job's stored training config (`jobs.train_config_json`) holds
the base settings as always, plus one key, `sweep`, in the shape of a run TOML's [sweep] table:
either {setting: [values]} in the sweep's order (a grid), or {"points": [{setting: value}, ...]}
(an explicit list), the values as the validated points hold them. The job's command line is the
base config's flags (sae_dist.contract.stored_train_argv) and, for a grid, one
`--sweep=KEY=V1,V2` per swept setting, which the trainer reads back into the same grid
(sae_dist.contract.sweep.parse_sweep_flags); for points, one `--sweep-points=JSON` (the list as compact
JSON: a shell-quoted word in an sbatch script too). Torch-free: `python -m scheduler` imports it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sae_dist.errors import ConfigError, UserError

SWEEP_KEY = "sweep"  # the key of the stored config dict that holds the lists
SWEEP_FLAG = "--sweep"
POINTS_FLAG = "--sweep-points"
POINTS = "points"  # the stored sweep's key for an explicit list, as in a TOML's [[sweep.points]]


def split_stored(stored: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]] | None]:
    """A stored training config as (its plain settings, its sweep lists or None)."""
    plain = dict(stored)
    return plain, plain.pop(SWEEP_KEY, None)


def sweep_size(stored: Mapping[str, Any] | None) -> int | None:
    """How many SAEs a stored config trains in one job: None when it is no sweep."""
    lists = (stored or {}).get(SWEEP_KEY)
    if not lists:
        return None
    if POINTS in lists:
        return len(lists[POINTS])
    return math.prod(len(v) for v in lists.values())


def swept_keys(lists: Mapping[str, Any] | None) -> list[str]:
    """The settings a stored sweep sets, in its order (a grid's keys; every key of its points)."""
    if not lists:
        return []
    if POINTS in lists:
        return list(dict.fromkeys(k for point in lists[POINTS] for k in point))
    return list(lists)


@dataclass(frozen=True)
class CheckedTrain:
    """A training config and its sweep as stored (checked_lists), both checked by the submit that
    built them: a JobSpec stores them as they are, so each config is validated once a submit."""

    config: Any  # a TrainConfig (not imported: this module stays torch- and config-free)
    sweep: dict[str, list[Any]] | None = None

    def stored(self) -> dict[str, Any]:
        out = self.config.to_dict()
        if self.sweep is not None:
            out[SWEEP_KEY] = self.sweep
        return out


def checked_lists(base: Mapping[str, Any], table: Any = None,
                  flag_lists: Mapping[str, list[Any]] | None = None) -> dict[str, list[Any]] | None:
    """The sweep to store for a TOML [sweep] table (lists or [[sweep.points]]) and/or parsed --sweep
    flags over the user's own settings `base` (no defaults filled in, so a key both set and swept is
    caught); None when there is no sweep. Every mistake is one UserError naming the sweep."""
    from sae_dist.contract.sweep import build_sweep

    sweep = build_sweep(base, table, flag_lists)
    if sweep is None:
        return None
    return points_of(sweep) if isinstance(table, Mapping) and POINTS in table else lists_of(sweep)


def points_of(sweep: Any) -> dict[str, list[dict[str, Any]]]:
    """A built points sweep as stored: {"points": [each point's settings, validated]}."""
    return {POINTS: [dict(p.settings) for p in sweep.points]}


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
    """A stored sweep (lists or points) checked again against a full (defaults filled in) base
    config: the base's own value of a swept key is dropped (the sweep sets it). Returns the sweep
    as coerced."""
    from sae_dist.contract.sweep import build_sweep

    if not isinstance(lists, Mapping) or not lists:
        raise UserError(f"{SWEEP_FLAG}: a sweep is a table of lists, e.g. {{'k': [16, 32]}}, or of points, "
                        f"{{'points': [{{'k': 16}}, {{'k': 32, 'lr': 1e-3}}]}}")
    points = lists.get(POINTS)
    well_formed = isinstance(points, list) and all(isinstance(p, Mapping) for p in points)
    # Malformed points keep every base key: build_sweep then says what is wrong with them.
    swept = swept_keys(lists) if well_formed else [k for k in lists if k != POINTS]
    base = {k: v for k, v in config.items() if k not in swept}
    try:
        sweep = build_sweep(base, dict(lists))
    except ConfigError as e:
        raise UserError(f"{SWEEP_FLAG}: {str(e).removeprefix('sweep: ')}") from None
    return points_of(sweep) if POINTS in lists else lists_of(sweep)


def flag_value(value: Any) -> str:
    """A value as the trainer's --sweep reads it back (3e-4 as 0.0003: float() takes both)."""
    return repr(value) if isinstance(value, float) else str(value)


def sweep_flags(lists: Mapping[str, list[Any]] | None) -> list[str]:
    """One `--sweep=KEY=V1,V2` per swept setting, in the sweep's order ('=' keeps a value that
    starts with '-' from reading as a flag); for points, one `--sweep-points=JSON`."""
    if lists and POINTS in lists:
        return [f"{POINTS_FLAG}={json.dumps(lists[POINTS], separators=(',', ':'))}"]
    return [f"{SWEEP_FLAG}={key}={','.join(flag_value(v) for v in values)}" for key, values in (lists or {}).items()]


def stored_job_flags(stored: Mapping[str, Any], devices_flag: str) -> list[str]:
    """The `python -m sae_dist train` flags of a stored training config, a sweep's included: the
    base config's (a swept key's own value left out: the sweep sets it), then the --sweep flags."""
    from sae_dist.contract import stored_train_argv

    plain, lists = split_stored(stored)
    swept = set(swept_keys(lists))
    plain = {k: v for k, v in plain.items() if k not in swept}
    return [*stored_train_argv(plain, devices_flag), *sweep_flags(lists)]

