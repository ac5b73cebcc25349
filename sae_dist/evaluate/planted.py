"""Planted data on disk: shards of the synthetic source's rows, with the dictionary they came from.

`write_planted_shards` writes stream positions 0..rows-1 of `SyntheticSource` with the given
settings, so the shards hold exactly what `--source synthetic` with the same settings trains on.
The dictionary and each feature's frequency go to `planted/dictionary.safetensors` in the shard
directory (a subfolder: the shards source refuses `.safetensors` files its manifest does not list),
and the settings to the manifest under "planted".
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from sae_dist.data.shard_format import MANIFEST, SUFFIX, write_shards
from sae_dist.data.sources.shards import open_shards
from sae_dist.data.sources.synthetic import SyntheticSource
from sae_dist.errors import DataError, UserError
from sae_dist.evaluate.metrics import Planted

PLANTED_KEY = "planted"  # the manifest's key for the settings
PLANTED_FILE = "planted/dictionary.safetensors"


def presence_frequencies(source: SyntheticSource) -> Tensor:
    """[F] probability that each feature is present in a row of `source`.

    A row draws max_active feature slots with replacement (parent i with probability p_i); slot 0
    is always kept, each other slot with probability active / max_active. So parent i is absent
    with probability (1 - p_i) * (1 - p_i * q)^(max_active - 1). A kept slot of parent i brings
    each of its c children with probability child_prob / c: the same formula with p_i * child_prob / c.
    With correlation r, a kept slot of i's partner j also brings i with probability r: a slot gives
    i with probability p_i + r p_j (the two events are disjoint).
    """
    p = source.probs.double()
    drawn = p  # a partner brought along brings no children
    if source.correlation:
        partner = torch.arange(len(p)) ^ 1
        paired = partner < len(p)
        p = p + source.correlation * torch.where(paired, p[partner.clamp_max(len(p) - 1)], torch.zeros_like(p))
    m = source.max_active
    q = min(1.0, source.active / m)

    def present(per_slot: Tensor) -> Tensor:
        return 1 - (1 - per_slot) * (1 - per_slot * q).pow(m - 1)

    if not source.children:
        return present(p).float()
    child = (drawn * source.child_prob / source.children).repeat_interleave(source.children)
    return torch.cat([present(p), present(child)]).float()


def planted_from_settings(d_in: int, features: int, active: float, power_law: float, noise: float,
                          seed: int, children: int = 0, child_prob: float = 0.5,
                          magnitude_sigma: float = 0.0, correlation: float = 0.0) -> Planted:
    """The Planted of the synthetic source with these settings (what `--source synthetic` plants).
    A hierarchy's settings say so ("children", "parents"): the evaluation then reports its parents
    and children apart."""
    source = SyntheticSource(d_in=d_in, n_features=features, active=active, power_law=power_law, noise=noise,
                             seed=seed, rank=0, world_size=1, batch_size=1, children=children,
                             child_prob=child_prob, magnitude_sigma=magnitude_sigma, correlation=correlation)
    settings = {"d_in": d_in, "features": features, "active": active, "power_law": power_law,
                "noise": noise, "seed": seed}
    if children:
        settings.update(children=children, child_prob=child_prob, parents=source.parents,
                        features=source.n_features)
    if magnitude_sigma:
        settings["magnitude_sigma"] = magnitude_sigma
    if correlation:
        settings["correlation"] = correlation
    return Planted(dictionary=source.dictionary.clone(), frequencies=presence_frequencies(source),
                   settings=settings, truth=source.codes)


def _check_settings(rows: int, d_in: int, features: int, active: float, power_law: float, noise: float,
                    rows_per_shard: int, children: int, child_prob: float, magnitude_sigma: float,
                    correlation: float = 0.0) -> None:
    for name, value in (("rows", rows), ("d_in", d_in), ("features", features), ("rows_per_shard", rows_per_shard)):
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name.replace('_', '-')} {value}: must be a positive integer")
    if not active > 0:
        raise UserError(f"active {active}: must be positive")
    if not power_law >= 0:
        raise UserError(f"power-law {power_law}: must be 0 or more")
    if not noise >= 0:
        raise UserError(f"noise {noise}: must be 0 or more")
    if not isinstance(children, int) or children < 0:
        raise UserError(f"children {children}: must be 0 or a positive integer")
    if children and features < children + 1:
        raise UserError(f"features {features}: too few for one parent with {children} children")
    if not 0 <= child_prob <= 1:
        raise UserError(f"child-prob {child_prob}: must be between 0 and 1")
    if not magnitude_sigma >= 0:
        raise UserError(f"magnitude-sigma {magnitude_sigma}: must be 0 or more")
    if not 0 <= correlation <= 1:
        raise UserError(f"correlation {correlation}: must be between 0 and 1")


def write_planted_shards(out_dir: str | os.PathLike, rows: int, d_in: int, features: int, active: float = 4.0,
                         power_law: float = 0.5, noise: float = 0.01, seed: int = 0,
                         rows_per_shard: int = 65536, children: int = 0, child_prob: float = 0.5,
                         magnitude_sigma: float = 0.0, correlation: float = 0.0) -> Path:
    """Write `rows` synthetic rows as shards in `out_dir`, with their planted dictionary; returns out_dir."""
    _check_settings(rows, d_in, features, active, power_law, noise, rows_per_shard, children, child_prob,
                    magnitude_sigma, correlation)
    hierarchy = {"children": children, "child_prob": child_prob, "magnitude_sigma": magnitude_sigma,
                 "correlation": correlation}
    out = Path(out_dir)
    if out.exists() and (any(out.glob("*" + SUFFIX)) or (out / MANIFEST).exists()):
        raise DataError(f"{out} already holds shards; write to a new directory, or delete the old shards "
                        f"and manifest.json first")
    planted = planted_from_settings(d_in, features, active, power_law, noise, seed, **hierarchy)
    source = SyntheticSource(d_in=d_in, n_features=features, active=active, power_law=power_law, noise=noise,
                             seed=seed, rank=0, world_size=1, batch_size=1, **hierarchy)
    # The dictionary first: the manifest, written last, marks a complete directory.
    dict_path = out / PLANTED_FILE
    dict_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = dict_path.with_name(f".{dict_path.name}.tmp-{os.getpid()}")
    save_file({"dictionary": planted.dictionary.contiguous(), "frequencies": planted.frequencies.contiguous()},
              str(tmp))
    os.replace(tmp, dict_path)

    def chunks() -> Iterator[Tensor]:
        for start in range(0, rows, rows_per_shard):
            yield source.samples(start, min(rows_per_shard, rows - start))

    settings = {**planted.settings, "rows": rows, "rows_per_shard": rows_per_shard, "file": PLANTED_FILE,
                "source": "sae_dist.data.sources.synthetic.SyntheticSource, stream positions 0..rows-1"}
    return write_shards(out, chunks(), metadata={PLANTED_KEY: settings})


def load_planted(shards_dir: str | os.PathLike) -> Planted | None:
    """The planted dictionary of a shard directory written by write_planted_shards; None for others."""
    directory = Path(shards_dir)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        if not directory.exists():
            raise DataError(f"shard directory {directory} does not exist")
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{manifest_path}: cannot be read as JSON ({e})") from e
    settings = manifest.get(PLANTED_KEY) if isinstance(manifest, dict) else None
    if not isinstance(settings, dict):
        return None
    path = directory / str(settings.get("file", PLANTED_FILE))
    try:
        tensors = load_file(str(path))
    except FileNotFoundError as e:
        raise DataError(f"{manifest_path} says the shards are planted, but {path} is missing; regenerate "
                        f"them with make-planted") from e
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DataError(f"{path} is not a readable safetensors file ({e}); regenerate the shards") from e
    dictionary, frequencies = tensors.get("dictionary"), tensors.get("frequencies")
    if dictionary is None or frequencies is None or dictionary.dim() != 2 or frequencies.shape != dictionary.shape[:1]:
        raise DataError(f"{path} does not hold a dictionary [F, d_in] and its frequencies [F]; regenerate the shards")
    if manifest.get("d_in") is not None and dictionary.shape[1] != manifest["d_in"]:
        raise DataError(f"{path} has width {dictionary.shape[1]} but the shards have d_in={manifest['d_in']}")
    return Planted(dictionary=dictionary.float(), frequencies=frequencies.float(), settings=dict(settings),
                   truth=_truth_of(settings))


def _truth_of(settings: dict[str, Any]):
    """The ground truth of planted shards (rows are stream positions 0..rows-1 of the synthetic
    source with these settings), or None for shards written before the settings said enough."""
    try:
        source = SyntheticSource(d_in=settings["d_in"], n_features=settings["features"], active=settings["active"],
                                 power_law=settings["power_law"], noise=settings["noise"], seed=settings["seed"],
                                 rank=0, world_size=1, batch_size=1, children=settings.get("children", 0),
                                 child_prob=settings.get("child_prob", 0.5),
                                 magnitude_sigma=settings.get("magnitude_sigma", 0.0),
                                 correlation=settings.get("correlation", 0.0))
    except (KeyError, TypeError, ValueError):
        return None
    return source.codes


def planted_settings(shards_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest's "planted" settings, or None (no data read)."""
    manifest = open_shards(shards_dir).manifest
    settings = manifest.get(PLANTED_KEY)
    return settings if isinstance(settings, dict) else None
