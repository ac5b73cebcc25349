"""The steps between two reports: each adds its sums on its own device, and a report turns them
into the run's numbers with a few small collectives (no device sync per step).

A report is also where the run checks itself: NaN or inf in the data or the loss stops it (the
last good checkpoint left as it was). The dead-latent counters move on at their own cadence, every
DEAD_CHECK_STEPS steps (`check_dead`), not at reports: how often a run reports does not change
how it trains. Both come from all-reduced sums, so every rank sees the same numbers and takes the
same decisions.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sae_dist import distributed as D
from sae_dist.defaults import DEAD_CHECK_STEPS
from sae_dist.errors import UserError
from sae_dist.memory import PeakMemory
from sae_dist.train.balance import BatchPlan, WindowTimes, imbalance
from sae_dist.train.checkpoint import latest_checkpoint
from sae_dist.train.metrics import IDX, SUMS, WindowMetrics, find_stragglers, window_metrics
from sae_dist.train.state import TrainState


class TrainingDiverged(UserError):
    """NaN or inf in the data or the loss; the last good checkpoint is left as it was."""

    shared = True  # seen in all-reduced sums, so on every rank at once


@dataclass
class WindowReport:
    """One report's numbers, the same on every rank (from all-reduced or gathered values)."""

    m: WindowMetrics
    samples_total: int
    dead_fraction: float
    samples_per_s: float | None
    peak_bytes: int | None  # this rank's peak memory in the window, before any checkpoint's copies
    per_rank: list[list[float]]  # each rank's [median step s, median compute s, peak bytes]
    times: list[WindowTimes]  # each rank's compute-time quartiles: what rebalancing decides on
    stragglers: list[int]

    @property
    def compute_times(self) -> list[float]:
        return [r[1] for r in self.per_rank]

    def metrics(self, lr: float, grad_norm: float | None, limited_rank: int | None,
                recovery: tuple[float, float] | None) -> dict:
        """The row the database and the log get."""
        m = self.m
        return {
            "samples_seen": self.samples_total, "loss": m.loss, "mse": m.mse, "fvu": m.fvu,
            "explained_variance": m.explained_variance, "l0": m.l0,
            "dead_fraction": self.dead_fraction, "auxk_loss": m.auxk_loss, "lr": lr,
            "grad_norm": grad_norm, "samples_per_s": self.samples_per_s,
            "straggler_rank": self.stragglers[0] if self.stragglers else None,
            "imbalance": imbalance(self.compute_times), "balance_limited_rank": limited_rank,
            "recovery_mean_cos": recovery[0] if recovery else None,
            "recovery_frac": recovery[1] if recovery else None,
        }

    def rank_rows(self, device_ids: list[str], plan: BatchPlan) -> list[dict]:
        """One row a rank for the database; `plan`: the one the window's steps ran with."""
        return [{"rank": r, "device": device_ids[r], "step_time_s": t, "compute_time_s": c,
                 "peak_memory_bytes": int(p) if p else None, "is_straggler": r in self.stragglers,
                 "batch_size": plan.per_step(r)}
                for r, (t, c, p) in enumerate(self.per_rank)]


class MetricsWindow:
    def __init__(self, d_in: int, d_sae: int, device: torch.device, chosen: bool = False):
        self.device = device
        self.chosen = chosen  # sum the chosen activations (only the rare-latent bias reads them)
        self.sums = torch.zeros(len(SUMS) + d_in, dtype=torch.float64, device=device)  # then sum(x)
        self.fired = torch.zeros(d_sae, dtype=torch.float64, device=device)
        # Since the last check: each latent's firings, then the chosen activations' sum and count
        # (the rare-latent bias's scale); all-reduced at checks.
        self.since_check = torch.zeros(d_sae + 2, dtype=torch.float64, device=device)
        self.step_times: list[float] = []
        self.compute_times: list[float] = []
        self.started = time.perf_counter()

    def add(self, batches: list[Tensor], outputs) -> None:
        """A step's micro-batches and their forward outputs, added on the device."""
        acc = self.sums
        with torch.no_grad():
            for x, out in zip(batches, outputs):
                b = x.shape[0]
                flat = x.reshape(-1)
                x_sq = torch.dot(flat, flat).double()  # not finite when x has a NaN or an inf
                acc[IDX["loss"]] += out.loss.detach().double() * b
                acc[IDX["mse"]] += out.mse.detach().double() * b
                acc[IDX["x_sq"]] += x_sq
                acc[IDX["l0"]] += out.l0.detach().double() * b
                acc[IDX["auxk"]] += out.auxk_loss.detach().double() * b
                acc[IDX["sparsity"]] += out.sparsity_loss.detach().double() * b
                acc[IDX["samples"]] += b
                acc[IDX["bad_data"]] += (~torch.isfinite(x_sq)).double()
                acc[IDX["bad_loss"]] += (~torch.isfinite(out.loss.detach())).double()
                acc[len(SUMS):] += x.sum(0, dtype=torch.float64)
                self.fired += out.fired.detach().double()
                self.since_check[:-2] += out.fired.detach().double()
                if self.chosen and out.codes is not None:
                    self.since_check[-2] += out.codes.acts.detach().sum(dtype=torch.float64)
                    self.since_check[-1] += out.codes.acts.numel()

    def end_step(self, started: float, compute_s: float) -> None:
        """The step's times; on a GPU it waits for the step first, so the time is the step's own."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.step_times.append(time.perf_counter() - started)
        self.compute_times.append(compute_s)

    def report(self, step: int, state: TrainState, run_dir: Path, peak: PeakMemory) -> WindowReport:
        """All-reduce the window, stop on NaN / inf, move `state`'s sample and firing counts on
        (its dead set moves at checks, not here), gather every rank's times; the window then
        starts again empty."""
        D.all_reduce_sum(self.sums)
        D.all_reduce_sum(self.fired)
        m = window_metrics(self.sums)
        if m.bad_data or m.bad_loss:
            raise _diverged(m, step - len(self.step_times) + 1, step, run_dir)
        state.samples_total += m.samples
        state.fire_total += self.fired
        dead_fraction = 0.0 if state.dead is None else float(state.dead.double().mean())  # as the last check left it
        elapsed = time.perf_counter() - self.started
        peak_bytes = peak.peak_bytes()  # read before this report's checkpoint adds its own copies
        per_rank, times = self._gather_times(peak_bytes)
        self.sums.zero_()
        self.fired.zero_()
        self.step_times.clear()
        self.compute_times.clear()
        return WindowReport(m, state.samples_total, dead_fraction,
                            m.samples / elapsed if elapsed > 0 else None, peak_bytes, per_rank, times,
                            find_stragglers([r[1] for r in per_rank]))

    def check(self, state: TrainState, step: int, samples: int, dead_after_samples: int) -> None:
        """The dead-latent set and the rare-latent bias moved on by the `samples` global samples
        of the DEAD_CHECK_STEPS steps to `step` (one small all-reduce, on every rank at the same
        steps)."""
        self.park_fired(state)
        since, state.parked_fired = state.parked_fired, None
        state.latents_fired(since[:-2], samples, dead_after_samples)
        state.move_rare_bias(step, since[:-2], samples, since[-2:], DEAD_CHECK_STEPS)

    def park_fired(self, state: TrainState) -> None:
        """The firings since the last check, all-reduced, added to `state`'s parked ones: before a
        checkpoint between two checks (which keeps them, so the next check counts them whether or
        not the run stops), and at a check."""
        fired = D.all_reduce_sum(self.since_check).clone()  # (the buffer is zeroed below)
        state.parked_fired = fired if state.parked_fired is None else state.parked_fired + fired
        self.since_check.zero_()

    def _gather_times(self, peak_bytes: int | None) -> tuple[list[list[float]], list[WindowTimes]]:
        # Medians and quartiles: the first step after a start carries one-time costs that are not
        # speed, and a busy neighbour on a shared machine makes single steps slow.
        quartiles = WindowTimes.of(self.compute_times)
        row = torch.tensor([statistics.median(self.step_times), quartiles.median, float(peak_bytes or 0),
                            *quartiles.row()], dtype=torch.float64, device=self.device)
        gathered = D.all_gather_rows(row).cpu().tolist()
        return [r[:3] for r in gathered], [WindowTimes.from_row(r[3:]) for r in gathered]


def _diverged(m: WindowMetrics, first: int, last: int, run_dir: Path) -> TrainingDiverged:
    what = "the input activations" if m.bad_data else "the loss"
    ckpt = latest_checkpoint(run_dir)
    return TrainingDiverged(
        f"NaN or inf in {what} between steps {first} and {last}; stopped. "
        + (f"The last good checkpoint {ckpt} is intact." if ckpt else "No checkpoint was written yet.")
        + ("" if m.bad_data else " Try a lower --lr."))


def progress_line(step: int, total: int, m: dict, stragglers: list[int]) -> str:
    """The log line of a report."""
    line = (f"step {step:>6}/{total} | loss {m['loss']:.4f} | fvu {m['fvu']:.4f} | L0 {m['l0']:.1f} | "
            f"dead {100 * m['dead_fraction']:.1f}% | {m['samples_per_s'] or 0:,.0f} samples/s")
    if m.get("recovery_frac") is not None:
        line += f" | recovered {100 * m['recovery_frac']:.0f}%"
    if stragglers:
        line += f" | straggler: rank {', '.join(map(str, stragglers))}"
    return line
