"""A sweep: many SAEs trained in one job from one activation stream, defined and checked here.

A run TOML's `[sweep]` table of lists (`k = [16, 32]`, `expansion_factor = [8, 16]`) gives the
cartesian product of its lists; `[[sweep.points]]` tables give an explicit list instead. On the
command line `--sweep KEY=V1,V2` (repeatable) adds or replaces a list (flags win over the TOML,
as for every setting). Each point becomes a full, validated TrainConfig (the base settings plus
the point's), named from its settings (`k32-x16`, `L3-k32`). Every mistake is one ConfigError naming
the sweep; nothing here touches torch, the disk or a device (placement: sae_dist/sweeps/placement.py;
whether a model-source sweep's layers and sites exist in its model: sae_dist/data/harvest/sites.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sae_dist.config import TOPK_FAMILY, TrainConfig, _coerce, build_config, config_fields, field_types
from sae_dist.errors import ConfigError

MAX_SAES = 256  # SAEs in one job: past this, a job array of sweeps

# What may vary between the SAEs of one job, and how a name spells it (`k32`, `x16`, `lr3e-4`;
# a choice is its own value: `topk`, `mlp_out`). Every other setting is the job's: the data
# stream (source, seed, batch, steps) and the devices are shared by all its SAEs; a sweep over
# those is a job array (one job per point).
NAME_PREFIX = {
    "architecture": "", "d_sae": "d", "expansion_factor": "x", "k": "k", "lr": "lr",
    "lr_warmup_steps": "warm", "lr_decay_fraction": "decay", "l1_coefficient": "l1c",
    "l0_coefficient": "l0c", "jumprelu_init_threshold": "thr", "jumprelu_bandwidth": "bw",
    "auxk_coefficient": "auxk", "auxk_k": "auxkk", "dead_after_samples": "dead",
    "model_layer": "L", "model_site": "", "matryoshka_inner_weight": "iw", "refit_fraction": "refit",
    "rare_bias_floor": "rare", "rare_bias_step": "rstep", "rare_bias_until": "runtil", "decoder_lr_factor": "declr",
    "matryoshka_inner_offset": "ioff", "matryoshka_inner_weight_start": "iws", "matryoshka_inner_weight_until": "iwu",
}
SWEEPABLE = tuple(NAME_PREFIX)

# Settings one architecture never reads (sae_dist/models/sae.py): two points that differ only there
# train the same SAE.
USED_BY = {
    "k": TOPK_FAMILY, "auxk_coefficient": TOPK_FAMILY, "auxk_k": TOPK_FAMILY, "refit_fraction": TOPK_FAMILY,
    "rare_bias_floor": TOPK_FAMILY, "rare_bias_step": TOPK_FAMILY, "rare_bias_until": TOPK_FAMILY,
    "l1_coefficient": ("standard",),
    "l0_coefficient": ("jumprelu",), "jumprelu_init_threshold": ("jumprelu",),
    "jumprelu_bandwidth": ("jumprelu",), "matryoshka_inner_weight": ("matryoshka",),
    "matryoshka_inner_offset": ("matryoshka",), "matryoshka_inner_weight_start": ("matryoshka",),
    "matryoshka_inner_weight_until": ("matryoshka",),
}
MODEL_ONLY = ("model_layer", "model_site")  # read by the model source only (one forward pass hooks every one swept)
MAX_NAME = 100


class SweepError(ConfigError):
    """A mistake in a sweep; the message says which key or point."""

    def __init__(self, message: str):
        super().__init__("sweep", message)


@dataclass(frozen=True)
class SweepPoint:
    name: str  # from its settings: short, filesystem-safe, unique in its sweep
    settings: dict[str, Any]  # the swept settings, as the validated config holds them
    config: TrainConfig  # the base settings plus these, validated


@dataclass(frozen=True)
class Sweep:
    keys: tuple[str, ...]  # the swept settings, in the order given
    points: tuple[SweepPoint, ...]

    def __len__(self) -> int:
        return len(self.points)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.points]

    def with_d_in(self, d_in: int) -> Sweep:
        """Every point with the source's width, checked again (k > d_sae shows only now)."""
        points = []
        for p in self.points:
            try:
                points.append(dataclasses.replace(p, config=p.config.with_d_in(d_in)))
            except ConfigError as e:
                raise SweepError(f"{p.name} ({_describe(p.settings)}): {e}") from None
        _check_distinct([p.settings for p in points], [p.config for p in points])
        return Sweep(self.keys, tuple(points))

    def to_dict(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "points": [{"name": p.name, "settings": dict(p.settings)}
                                                    for p in self.points]}


# ---- reading: a TOML's [sweep] table, the --sweep flags ----


def split_sweep(values: Mapping[str, Any]) -> tuple[dict[str, Any], Any]:
    """A loaded run TOML (config.load_toml) as (its plain settings, its [sweep] table or None)."""
    plain = dict(values)
    return plain, plain.pop("sweep", None)


def parse_sweep_flags(flags: Sequence[str]) -> dict[str, list[Any]]:
    """`--sweep KEY=V1,V2` flags (in order) as {key: [values]}, each value read as its setting's
    type (`k=16,32` -> [16, 32]; `lr=3e-4,1e-3` -> floats). A key given twice is an error."""
    types = field_types()
    lists: dict[str, list[Any]] = {}
    for flag in flags:
        key, eq, text = str(flag).partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise SweepError(f"--sweep {flag!r}: write KEY=V1,V2 (e.g. --sweep k=16,32)")
        _check_key(key, f"--sweep {key}")
        if key in lists:
            raise SweepError(f"--sweep {key} given twice; put every value in one flag: {key}=V1,V2")
        items = [t.strip() for t in text.split(",")] if text.strip() else []
        if not items or any(not t for t in items):
            raise SweepError(f"--sweep {key}={text}: an empty value; list one or more values, e.g. {key}=V1,V2")
        lists[key] = [_from_text(key, t, types[key]) for t in items]
    return lists


def _from_text(key: str, text: str, annotation: Any) -> Any:
    """A flag's text as its setting's type, then the config's own coercion."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if args and typing.get_origin(annotation) is not Literal else annotation
    if base is bool:
        words = {"true": True, "on": True, "1": True, "false": False, "off": False, "0": False}
        if text.strip().lower() not in words:
            raise SweepError(f"--sweep {key}: {text!r} is not on or off (true/false, 1/0)")
        return words[text.strip().lower()]
    try:
        value = int(text) if base is int else float(text) if base is float else text
    except ValueError:
        kind = "a whole number" if base is int else "a number"
        raise SweepError(f"--sweep {key}: {text!r} is not {kind}") from None
    return _coerce(key, value, annotation)


def _check_key(key: str, where: str) -> None:
    if key in SWEEPABLE:
        return
    if key in {f.name for f in config_fields()}:
        raise SweepError(f"{where}: the job's own setting, shared by all its SAEs (the data stream, the "
                         f"devices), so it cannot vary in one sweep; sweep it as a job array")
    close = difflib.get_close_matches(key, SWEEPABLE, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else f"; a sweep varies {', '.join(SWEEPABLE)}"
    raise SweepError(f"{where}: unknown setting{hint}")


def _grid_and_points(table: Any, flag_lists: Mapping[str, list[Any]]) -> tuple[dict[str, list], list | None]:
    """The TOML table's lists (with the flags' over them) and its explicit points, checked in shape."""
    if table is not None and not isinstance(table, Mapping):
        raise SweepError("[sweep] must be a table: [sweep] with KEY = [V1, V2] lines, or [[sweep.points]] tables")
    table = dict(table or {})
    points = table.pop("points", None)
    grid: dict[str, list] = {}
    for key, values in table.items():
        _check_key(key, key)
        if not isinstance(values, list):
            raise SweepError(f"{key} = {values!r} is one value, not a list; write {key} = [{values!r}], "
                             f"or set {key} outside the sweep")
        if not values:
            raise SweepError(f"{key} = []: an empty list; give one or more values")
        grid[key] = values
    if points is not None:
        if grid:
            raise SweepError(f"both lists ({', '.join(grid)}) and [[sweep.points]] given; use one: "
                             "lists for their cartesian product, points for an explicit list")
        if flag_lists:
            raise SweepError(f"--sweep {next(iter(flag_lists))} cannot be combined with [[sweep.points]]")
        return {}, _checked_points(points)
    grid.update(flag_lists)  # flags win over the TOML, as for any setting
    return grid, None


def _checked_points(points: Any) -> list[dict[str, Any]]:
    if not isinstance(points, list) or not points or not all(isinstance(p, Mapping) for p in points):
        raise SweepError("[[sweep.points]] must be one or more tables of settings, e.g. "
                         "[[sweep.points]] then k = 32 on the next line")
    for i, point in enumerate(points, 1):
        if not point:
            raise SweepError(f"point {i} of [[sweep.points]] sets nothing; give it the settings that make it differ")
        for key, value in point.items():
            _check_key(key, f"point {i} of [[sweep.points]]: {key}")
            if isinstance(value, (list, Mapping)):
                raise SweepError(f"point {i} of [[sweep.points]]: {key} = {value!r}: one value per point")
    return [dict(p) for p in points]


# ---- building: the points as validated configs, named ----


def build_sweep(base: Mapping[str, Any], table: Any = None,
                flag_lists: Mapping[str, list[Any]] | None = None) -> Sweep | None:
    """The sweep that the run's plain settings (`base`: TOML keys and flags, no `sweep`), its
    TOML [sweep] table and its parsed --sweep flags describe; None when there is no sweep."""
    flag_lists = dict(flag_lists or {})
    if table is None and not flag_lists:
        return None
    grid, points = _grid_and_points(table, flag_lists)
    if points is None:
        if not grid:
            raise SweepError("[sweep] lists nothing: give KEY = [V1, V2] lines or [[sweep.points]] tables")
        count = math.prod(len(v) for v in grid.values())
        _check_count(count, " x ".join(f"{len(v)} {k}" for k, v in grid.items()))
        points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    else:
        _check_count(len(points), "[[sweep.points]]")
    keys = tuple(dict.fromkeys(k for p in points for k in p))
    for key in keys:
        if key in base:
            raise SweepError(f"{key} is given both as a setting ({key} = {base[key]!r}) and in the sweep; "
                             f"keep one")
    configs = [_point_config(base, p, i) for i, p in enumerate(points, 1)]
    settings = [{k: getattr(c, k) for k in p} for p, c in zip(points, configs)]
    _check_distinct(settings, configs)
    names = unique_names([point_name(s) for s in settings])
    return Sweep(keys, tuple(SweepPoint(n, s, c) for n, s, c in zip(names, settings, configs)))


def _check_count(count: int, how: str) -> None:
    if count > MAX_SAES:
        raise SweepError(f"{count:,} SAEs ({how}); one job trains at most {MAX_SAES}: "
                         "sweep fewer values, or split the sweep over a job array")


def _point_config(base: Mapping[str, Any], point: Mapping[str, Any], index: int) -> TrainConfig:
    try:
        return build_config({**base, **point})
    except ConfigError as e:
        raise SweepError(f"point {index} ({_describe(point)}): {e}") from None


def _describe(settings: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


def _check_distinct(settings: list[dict[str, Any]], configs: list[TrainConfig]) -> None:
    """Two points that train the same SAE (equal settings, or differing only where their
    architecture or source never reads): one error naming both."""
    seen: dict[tuple, int] = {}
    for i, cfg in enumerate(configs):
        key = tuple(sorted((k, repr(v)) for k, v in effective(cfg).items()))
        if key in seen:
            j = seen[key]
            keys = dict.fromkeys([*settings[j], *settings[i]])
            differ = [k for k in keys if getattr(cfg, k) != getattr(configs[j], k)]
            why = (f": {'; '.join(_why_same(k, cfg) for k in differ)}; list the points you mean with "
                   f"[[sweep.points]]") if differ else ""
            raise SweepError(f"point {i + 1} ({_describe(settings[i])}) trains the same SAE as point "
                             f"{j + 1} ({_describe(settings[j])}){why}")
        seen[key] = i


def _why_same(key: str, cfg: TrainConfig) -> str:
    if key in USED_BY:
        return f"{key} is not read by {cfg.architecture}"
    if key in MODEL_ONLY:
        return f"{key} is read by the model source only (source is {cfg.source})"
    return f"{key} gives the same width (d_sae {cfg.resolved_d_sae if cfg.d_in else cfg.d_sae})"


def effective(cfg: TrainConfig) -> dict[str, Any]:
    """The settings that shape the SAE a config trains: names and places dropped, and settings
    its architecture (or source) never reads put back to their defaults."""
    defaults = {f.name: f.default for f in config_fields()}
    values = cfg.to_dict()
    for name in ("name", "out_dir", "resume"):
        values.pop(name)
    for name, archs in USED_BY.items():
        if cfg.architecture not in archs:
            values[name] = defaults[name]
    if cfg.source != "model":
        for name in MODEL_ONLY:
            values[name] = defaults[name]
    if cfg.d_sae is not None or cfg.d_in is not None:  # the width is known: its spelling is not
        values["d_sae"] = cfg.resolved_d_sae if cfg.d_in is not None else cfg.d_sae
        values["expansion_factor"] = defaults["expansion_factor"]
    return values


def point_name(settings: Mapping[str, Any]) -> str:
    """`k32-x16`, `topk-lr3e-4`, `L3-mlp_out`: each setting's prefix and value, in order."""
    parts = [NAME_PREFIX[k] + _short(v) for k, v in settings.items()]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts)).strip("._-")
    return name[:MAX_NAME] or "sae"


def _short(value: Any) -> str:
    """A value as written in a name: 3e-4 not 0.0003, 0.05 not 5e-2 (the shorter; plain on a tie)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, float):
        return str(value)
    plain = format(value, "g")
    mantissa, _, exponent = format(value, "e").partition("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    sci = mantissa if int(exponent) == 0 else f"{mantissa}e{int(exponent)}"
    return sci if len(sci) < len(plain) else plain


def unique_names(names: Sequence[str]) -> list[str]:
    """Names made unique in order: the first keeps its name, a later equal one gets -2, -3, ..."""
    taken = set(names)
    out: list[str] = []
    used: set[str] = set()
    for name in names:
        if name in used:
            n = 2
            while f"{name}-{n}" in taken or f"{name}-{n}" in used:
                n += 1
            name = f"{name}-{n}"
        used.add(name)
        out.append(name)
    return out
