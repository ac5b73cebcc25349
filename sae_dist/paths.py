"""Where sae-dist keeps its state: one home directory (database, locks, logs, checkpoints).

Every component asks here, so `SAE_DIST_HOME` and `SAE_DIST_DB_URL` mean the same thing
everywhere and tests can redirect all state to a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path


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
