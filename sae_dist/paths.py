"""Where sae-dist keeps its state: one home directory (database, locks, logs, checkpoints), and
where a run writes (its run directory).

Every component asks here, so `SAE_DIST_HOME` and `SAE_DIST_DB_URL` mean the same thing
everywhere and tests can redirect all state to a temporary directory. Torch-free: the scheduler
and the app import it.
"""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from sae_dist.checkpoint import latest_checkpoint
from sae_dist.errors import UserError

if TYPE_CHECKING:
    from sae_dist.config import TrainConfig


def state_home() -> Path:
    """The state directory: `$SAE_DIST_HOME`, default `~/.sae_dist`; created on demand."""
    home = Path(os.environ.get("SAE_DIST_HOME") or "~/.sae_dist").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home


def default_db_url() -> str:
    """The state database: `$SAE_DIST_DB_URL`, default a SQLite file in the state home."""
    url = os.environ.get("SAE_DIST_DB_URL")
    if url:
        return url
    return f"sqlite:///{state_home() / 'state.db'}"


# ---- a run's directory (torch-free: the Train page and the launcher check it before any rank) ----


def safe_name(name: str) -> str:
    """A run name as one harmless path component (names are stored literally elsewhere)."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", name).lstrip(".") or "run"
    return clean[:120]


def default_run_name(cfg: TrainConfig) -> str:
    """A run without --name: its architecture, width and start time."""
    return f"{cfg.architecture}-{cfg.resolved_d_sae}-{datetime.now():%Y%m%d-%H%M%S}"


def check_run_dir(cfg: TrainConfig) -> tuple[str, Path]:
    """(run name, run directory) for a config; a UserError when the directory does not fit."""
    name = cfg.name or default_run_name(cfg)
    run_dir = Path(cfg.out_dir).expanduser() if cfg.out_dir else state_home() / "runs" / safe_name(name)
    if cfg.resume:
        latest = latest_checkpoint(run_dir)
        if latest is None:
            raise UserError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}; "
                            f"start without --resume or point --out-dir at the run to continue")
    elif run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"run directory {run_dir} already exists and is not empty; "
                        f"use --resume to continue it or choose another --out-dir / --name")
    return name, run_dir
