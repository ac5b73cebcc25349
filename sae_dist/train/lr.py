"""The learning-rate schedule: linear warm-up, constant, optional linear decay to zero at the end."""

from __future__ import annotations


def lr_at(step: int, base_lr: float, total_steps: int, warmup_steps: int = 0, decay_fraction: float = 0.0) -> float:
    """Learning rate for optimizer step `step` (1-based)."""
    if warmup_steps and step <= warmup_steps:
        return base_lr * step / warmup_steps
    decay_steps = int(total_steps * decay_fraction)
    decay_start = total_steps - decay_steps
    if decay_steps and step > decay_start:
        return base_lr * (total_steps - step + 1) / (decay_steps + 1)
    return base_lr
