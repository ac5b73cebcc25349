"""Rank 0's link to the state database: the run's row, its metrics, rank statistics and events
(or nothing, with --no-db, and on the other ranks)."""

from __future__ import annotations

import json
import logging
import os
import socket
from datetime import datetime, timezone

from sae_dist import distributed as D
from sae_dist.config import TrainConfig
from sae_dist.contract import JOB_ID_ENV, RESTART_NOTE_ENV
from sae_dist.train.balance import BalanceDecision, BatchPlan, imbalance

log = logging.getLogger(__name__)


class RunRecord:
    """Rank 0's link to the state database (or nothing, with --no-db)."""

    def __init__(self, cfg: TrainConfig, ctx: D.DistContext, name: str, run_dir: str, device_ids: list[str]):
        self.engine = self.writer = None
        self.run_id: int | None = None
        if not (cfg.db and ctx.is_main):
            return
        from sae_dist.db import DatabaseMetricsLogger, create_run, delete_metrics_after, find_run_by_dir, get_engine

        self.engine = get_engine()
        existing = find_run_by_dir(self.engine, run_dir) if cfg.resume else None
        if existing is not None:
            self.run_id = existing.id
        else:
            now = datetime.now(timezone.utc)
            self.run_id = create_run(
                self.engine, name=name, status="RUNNING", architecture=cfg.architecture,
                config_json=json.dumps(cfg.to_dict()), world_size=ctx.world_size, backend=ctx.backend,
                device_ids=json.dumps(device_ids), host=socket.gethostname(), run_dir=run_dir,
                total_steps=cfg.steps, job_id=_job_id(), created_at=now, started_at=now)
        self._delete_after = delete_metrics_after
        self.writer = DatabaseMetricsLogger(self.engine, self.run_id)

    def resumed_at(self, step: int, world_size: int, device_ids: list[str]) -> None:
        if self.engine is not None:
            # Rows logged after the checkpoint by the interrupted run are replaced by the new ones.
            self._delete_after(self.engine, self.run_id, step)
            self.writer.update_run(status="RUNNING", error=None, finished_at=None, world_size=world_size,
                                   device_ids=json.dumps(device_ids))

    def event(self, step: int, kind: str, message: str, details: dict) -> None:
        if self.writer is not None:
            self.writer.log_event(step, kind, message, details)

    def restart_event(self, step: int, plan: BatchPlan, say: bool = True) -> None:
        """Our launcher restarted the ranks without a device that failed: say so beside the curves
        (and in the log, unless another SAE of the job `say`s it)."""
        note = os.environ.get(RESTART_NOTE_ENV)
        if not note:
            return
        details = {**json.loads(note), "resumed_from_step": step, "world_size_after": plan.world_size,
                   "grad_accum": plan.micro_steps, "global_batch": plan.global_batch, "shares": list(plan.shares)}
        message = (f"rank {', '.join(map(str, details.get('lost_ranks', [])))} lost "
                   f"({details.get('reason', 'failed')}); continued from step {step} on {plan.world_size} "
                   f"devices, global batch {plan.global_batch} in {plan.micro_steps} micro-batches")
        if say:
            log.warning("%s", message)
        self.event(step, "degraded", message, details)

    def rebalanced(self, step: int, before: BatchPlan, after: BatchPlan, times: list[float],
                   decision: BalanceDecision, say: bool = True) -> None:
        """`times`: the window's median compute times per rank; `decision` holds the figures of
        the windows that passed the rule."""
        message = f"shares {list(before.shares)} -> {list(after.shares)}: {decision.describe()}"
        if say:
            log.info("rebalanced %s", message)
        self.event(step, "rebalance", f"rebalanced {message}",
                   {"before": list(before.shares), "after": list(after.shares), "compute_time_s": times,
                    "imbalance": imbalance(times), "slow_rank": decision.slow_rank,
                    "threshold": decision.threshold, "moves": decision.state.moves if decision.state else None,
                    "evidence": [{"slow_low_s": lo, "fastest_high_s": hi, "ratio": r}
                                 for lo, hi, r in decision.evidence]})

    def balance_limited(self, step: int, decision, say: bool = True) -> None:
        message = (f"rank {decision.limited_rank} stays {decision.predicted_imbalance:.1f}x slower than the "
                   f"fastest even at its smallest share: rebalancing cannot even it out")
        if say:
            log.warning("%s", message)
        self.event(step, "balance_limited", message,
                   {"rank": decision.limited_rank, "slowdown": decision.predicted_imbalance})

    def log(self, metrics: dict, step: int, rank_rows: list[dict]) -> None:
        if self.writer is not None:
            self.writer.log(metrics, step)
            self.writer.log_rank_stats(step, rank_rows)
            self.writer.update_run(last_step=step)

    def finish(self, **fields) -> None:
        if self.writer is not None:
            self.writer.update_run(finished_at=datetime.now(timezone.utc), **fields)
            self.writer.close()


def _job_id() -> int | None:
    value = os.environ.get(JOB_ID_ENV)
    return int(value) if value and value.isdigit() else None

