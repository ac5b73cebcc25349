"""Checkpoints that a crash can never leave half-written.

A checkpoint is a directory `checkpoints/step_00001000/` holding the weights (safetensors), and
the rest of the training state (optimizer, step, every rank's data position, dead-latent
counters, RNG) in one torch file. It is written under a temporary name and renamed into place, so
`latest_checkpoint` only ever sees complete ones.

Finding checkpoints is torch-free (the launcher and sae_dist.paths look before any rank starts);
only saving and loading import torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sae_dist.errors import UserError
from sae_dist.paths import run_dir_for

if TYPE_CHECKING:
    import torch

    from sae_dist.config import TrainConfig

_NAME = re.compile(r"^step_(\d{8,})$")
WEIGHTS = "sae.safetensors"
STATE = "trainer_state.pt"
META = "meta.json"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save_checkpoint(run_dir: Path, step: int, weights: dict[str, torch.Tensor], state: dict[str, Any],
                    meta: dict[str, Any], keep: int = 2) -> Path:
    import torch
    from safetensors.torch import save_file

    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
    torch.save(state, tmp / STATE)
    (tmp / META).write_text(json.dumps({"step": step, **meta}, indent=2))
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and (p / STATE).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def check_run_dir(cfg: TrainConfig) -> tuple[str, Path]:
    """(run name, run directory) for a config; a UserError when the directory does not fit: empty
    or new to start, holding a checkpoint to resume."""
    name, run_dir = run_dir_for(cfg)
    if cfg.resume:
        if latest_checkpoint(run_dir) is None:
            raise UserError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; "
                            f"start without --resume or point --out-dir at the run to continue")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run directory {run_dir} already exists and is not empty; "
                        f"use --resume to continue it or choose another --out-dir / --name")
    return name, run_dir


def checkpoint_world_size(path: Path) -> int | None:
    """How many ranks wrote a checkpoint (from its small meta file; None if unreadable)."""
    try:
        return int(json.loads((path / META).read_text())["world_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(weights, trainer state, meta) of one checkpoint directory."""
    import torch
    from safetensors.torch import load_file

    try:
        weights = load_file(str(path / WEIGHTS))
        state = torch.load(path / STATE, map_location="cpu", weights_only=False)
        meta = json.loads((path / META).read_text())
    except Exception as e:  # a damaged file: say which checkpoint, not a torch traceback
        raise UserError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); "
                        f"delete it to resume from the one before") from None
    return weights, state, meta


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
