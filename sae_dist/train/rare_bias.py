"""A selection bias for rare latents: the rule that moves it, as a pure function of plain tensors.

In one pass over many rare features, a TopK-family SAE leaves latents that fire on almost no rows,
while the children of rarer parents stay unlearnt (docs/quality.md). Each latent gets a bias added
to its pre-activation only to choose each row's top k; the chosen values, the loss and the
gradients stay unbiased (sae_dist.models.sae). The rule follows DeepSeek-V3's auxiliary-loss-free
load balancing of MoE routers: a latent whose firing rate is under a floor has its bias raised,
any other has it lowered, never below 0. The trainer moves it at every dead-set check from the
global batch's all-reduced firings, so it is the same on every rank and one rank matches many, and
takes it away for good at a fraction of the steps, so the run's last part and its refit train on
the selection the SAE will be used with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sae_dist.config import TrainConfig

RATE_EMA_PER_STEP = 0.01  # the firing-rate average's weight of one step's rate


@dataclass(frozen=True)
class RareBiasRule:
    floor_rate: float  # a latent firing on fewer than this fraction of rows is rare
    step: float  # each step, the bias moves by this times the mean chosen activation
    stop_step: int  # from this step on the bias is gone


def rule_of(floor: float, step: float, until: float, k: int, d_sae: int, steps: int) -> RareBiasRule | None:
    """The rule for a run's settings: `floor` a fraction of the average rate k / d_sae, `until` a
    fraction of the run's `steps`; None where it is off (floor 0)."""
    if floor <= 0:
        return None
    return RareBiasRule(floor * k / d_sae, step, max(1, round(until * steps)))


def rule_for(cfg: TrainConfig) -> RareBiasRule | None:
    """The rule of a config whose d_in is known (its defaults where it leaves them unset; a
    floor above 0 is refused outside the TopK family, so others have none)."""
    return rule_of(*cfg.resolved_rare_bias, cfg.k, cfg.resolved_d_sae, cfg.steps)


def moved(bias: Tensor, rate: Tensor, fired: Tensor, rows: int, act_mean: float, steps: int,
          rule: RareBiasRule) -> tuple[Tensor, Tensor]:
    """The bias and the firing-rate average after `steps` steps of `rows` rows in all, in which
    latent i fired fired[i] times and the chosen activations averaged `act_mean`: the average takes
    the window's rate with the weight `steps` single steps would give it, then each latent's bias
    moves by `steps` steps of the rule, up where the average is under the floor, else down to 0 at
    least."""
    weight = 1 - (1 - RATE_EMA_PER_STEP) ** steps
    rate = rate.lerp(fired.to(rate.dtype) / max(rows, 1), weight)
    push = steps * rule.step * act_mean
    bias = (bias + torch.where(rate < rule.floor_rate, push, -push).to(bias.dtype)).clamp_min(0)
    return bias, rate
