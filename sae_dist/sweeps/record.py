"""Rank 0's row of a sweep in the state database (sae_dist/db/sweeps.py): created at start, or
found again by its directory on --resume, and its end (how many SAEs failed, and why)."""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract import JOB_ID_ENV
from sae_dist.contract.sweep import Sweep
from sae_dist.sweeps.placement import Placement


class SweepRecord:
    def __init__(self, cfg: TrainConfig, ctx: D.DistContext, name: str, run_dir: str, sweep: Sweep,
                 placement: Placement):
        self.engine = None
        self.sweep_id: int | None = None
        if cfg.db and ctx.is_main:
            from sae_dist.db import get_engine
            from sae_dist.db.sweeps import create_sweep, find_sweep_by_dir, update_sweep

            self.engine = get_engine()
            fields = {"status": "RUNNING", "placement_json": json.dumps(placement.to_dict()),
                      "world_size": ctx.world_size, "finished_at": None, "error": None}
            existing = find_sweep_by_dir(self.engine, run_dir) if cfg.resume else None
            if existing is not None:
                self.sweep_id = existing.id
                update_sweep(self.engine, self.sweep_id, **fields)
            else:
                job = os.environ.get(JOB_ID_ENV, "")
                self.sweep_id = create_sweep(
                    self.engine, name=name, run_dir=run_dir, job_id=int(job) if job.isdigit() else None,
                    keys_json=json.dumps(list(sweep.keys)), config_json=json.dumps(cfg.to_dict()), **fields)
        # Every rank learns the id (rank 0's runs name it; the others only pass it on).
        self.sweep_id = D.broadcast_object(self.sweep_id)

    def finish(self, status: str, error: str | None) -> None:
        if self.engine is not None:
            from sae_dist.db.sweeps import update_sweep

            update_sweep(self.engine, self.sweep_id, status=status, error=error,
                         finished_at=datetime.now(timezone.utc))

