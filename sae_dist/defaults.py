"""Default optimisation settings, as rules of the run's shape: what a config leaves unset.

The rules come from the learning-rate sweep in scripts/sweep_lr.py (docs/quality.md: "How the defaults were
chosen"); each is a pure function so the Train page, the CLI and the trainer resolve the same
numbers, and a test pins their outputs.
"""

from __future__ import annotations

# lr = LR_AT_REFERENCE * (d_in / 256) ** LR_D_IN_EXPONENT. Adam's step is in the weights' own
# units and a unit-norm decoder row has entries ~ 1 / sqrt(d_in); with that slope, the constant is
# the least-squares fit to the best lr of each swept shape (docs/quality.md, "How the defaults were chosen").
LR_AT_REFERENCE = 1.8e-3
LR_D_IN_EXPONENT = -0.5
WARMUP_FRACTION = 0.05  # of the run's steps
WARMUP_MAX_STEPS = 1000
DECAY_FRACTION = 0.2  # linear decay to 0 over the last fifth of the steps
DEAD_AFTER_FRACTION = 0.1  # of the run's samples
DEAD_CHECK_STEPS = 10  # the dead-latent set moves every this many steps, whatever --log-every
DEAD_AFTER_MAX = 10_000_000  # the usual window of long runs (sparsify, OpenAI)


# Matryoshka at twice the rule's lr, with prefixes d_sae/4 and d_sae: ahead of the other settings
# on both seeds of a planted hierarchy, and then on the benchmark's hierarchies, at an FVU within
# 10% of TopK's on its flat sets and MiniLM (docs/quality.md, "Matryoshka prefixes", 2026-11-27).
MATRYOSHKA_LR_FACTOR = 2.0
MATRYOSHKA_FRACTIONS = (4, 1)  # d_sae // each


# The decoder refit (sae_dist.models.refit) over the last fifth of the steps (the lr decay's), for
# Matryoshka SAEs: it lowered FVU and raised MCC and children on every planted hierarchy, on flat
# data and on MiniLM; the last half did no better (h1 worse by 0.001, h2 better by 0.0004, h3
# the same) at x1.27 the run's time on CPU against x1.1 (docs/quality.md, "The decoder refit").
# TopK-family transcoders too: on MiniLM's MLP at one pass it took the transcoder's FVU from
# 0.129 to 0.121 and the skip transcoder's from 0.108 to 0.102 (docs/quality.md, "Transcoders"),
# where a BatchTopK SAE gained nothing. Off by default above REFIT_MAX_D_SAE latents: its float64
# solve holds 3 d_sae^2 matrices (6.4 GB at 16,384; 103 GB at 65,536), so larger dictionaries ask
# for it by --refit-fraction.
REFIT_FRACTION = 0.2
REFIT_MAX_D_SAE = 16_384


# The selection bias for rare latents (sae_dist.train.rare_bias) for Matryoshka SAEs: on the
# planted hierarchies, one pass, a floor of 0.2 took held-out FVU from 0.151 to 0.137 (h1, its
# parents from 58% to 79%), 0.120 to 0.114 (h2) and 0.130 to 0.115 (h3), with more children and
# a higher MCC; 0.1 gained about half as much. 0.4 recovers 1-3 points more of h1's parents than
# 0.2 at each of three seeds (79-80% against 77-78%), with a higher MCC and the same FVU, and
# fewer dead latents on flat data and MiniLM for under 1% of FVU; 0.6 and 0.8 recover fewer
# (77% and 76% at seed 0). TopK's and BatchTopK's SAEs, and Matryoshka's batch selection, stay
# as measured without it (docs/quality.md, "The rare-latent bias").
RARE_BIAS_FLOOR = 0.4  # of the average rate k / d_sae
RARE_BIAS_STEP = 0.01  # of the mean chosen activation, a step
RARE_BIAS_UNTIL = 0.7  # of the steps


# The decoder's Adam step as a multiple of the lr, the encoder's and the biases' staying at the lr
# (sae_dist.train.step.make_optimizer). For Matryoshka choosing each row's top k, 3: on the planted
# hierarchies, one pass, held-out FVU fell 0.5-3% (h1 0.1363 to 0.1342, h2 0.1129 to 0.1115, u2
# 0.1268 to 0.1229) with more parents and a higher MCC, and the flat sets and MiniLM stayed within
# 0.7% (docs/quality.md, "The decoder's learning rate"). TopK's and BatchTopK's SAEs, and
# Matryoshka's batch selection, stay as measured at 1.
MATRYOSHKA_DECODER_LR_FACTOR = 3.0


# Matryoshka's inner weight (the inner prefixes' losses beside the whole dictionary's) at 8 for
# the first 30% of the steps, then falling linearly to the configured weight (1) by 60%
# (sae_dist.train.inner_weight), with the inner offset: on the planted hierarchies, one pass,
# held-out FVU fell on all five (h1 0.1289 to 0.1265, u2 0.1212 to 0.1118, h2, h3 and u1 by
# 1.4-3.2%) with as many parents or more (h1 90.2% to 91.2%, u2 21.6% to 32.6%), and the flat
# sets and MiniLM stayed within the flat goal (docs/quality.md, "The inner weight's schedule").
MATRYOSHKA_INNER_WEIGHT_START = 8.0
MATRYOSHKA_INNER_WEIGHT_UNTIL = 0.6  # of the steps; held at the start for the first half of it


def per_row_matryoshka(architecture: str, batch_level: bool) -> bool:
    """Matryoshka choosing each row's top k: the case the rare-latent bias and the decoder's
    factor were measured on. Its batch selection and the TopK family keep the settings they were
    measured with."""
    return architecture == "matryoshka" and not batch_level


def default_decoder_lr_factor(architecture: str, batch_level: bool = False) -> float:
    """The decoder's lr factor when none is given: MATRYOSHKA_DECODER_LR_FACTOR for the measured
    case (`per_row_matryoshka`), else 1."""
    return MATRYOSHKA_DECODER_LR_FACTOR if per_row_matryoshka(architecture, batch_level) else 1.0


def default_matryoshka_inner_offset(architecture: str, batch_level: bool = False) -> bool:
    """Whether the inner prefixes decode through their own offset when nothing is given: on for the
    measured case (`per_row_matryoshka`), else off. On the planted hierarchies, one pass, it took
    h1's parents from 81% to 90% (FVU 0.1342 to 0.1289) and u2's from 9% to 22%, with lower FVU on
    h2, h3 and MiniLM (0.0976 to 0.0917, dead latents 8.6% to 0.5%); the inner prefix alone
    reconstructs worse through the exported decoder (docs/quality.md, "The inner prefixes' offset")."""
    return per_row_matryoshka(architecture, batch_level)


def default_matryoshka_inner_weight_start(weight: float, inner_offset: bool) -> float:
    """The inner weight at a Matryoshka run's start when none is given: MATRYOSHKA_INNER_WEIGHT_START
    (or the weight, if higher) with the inner offset, measured with it; else the weight itself,
    no schedule (without the offset a higher inner weight bends the exported decoder toward the
    children: docs/quality.md)."""
    return max(MATRYOSHKA_INNER_WEIGHT_START, weight) if inner_offset else weight


def default_rare_bias_floor(architecture: str, batch_level: bool = False) -> float:
    """The rare-latent bias's floor when none is given: RARE_BIAS_FLOOR for the measured case
    (`per_row_matryoshka`), else 0 (off)."""
    return RARE_BIAS_FLOOR if per_row_matryoshka(architecture, batch_level) else 0.0


def default_refit_fraction(architecture: str, d_sae: int, topk_family_transcoder: bool = False) -> float:
    """The decoder refit's share of the steps when none is given: REFIT_FRACTION for a Matryoshka
    SAE or a TopK-family transcoder of at most REFIT_MAX_D_SAE latents, else 0 (off: TopK's and
    BatchTopK's SAEs stay as measured)."""
    wanted = architecture == "matryoshka" or topk_family_transcoder
    return REFIT_FRACTION if wanted and d_sae <= REFIT_MAX_D_SAE else 0.0


def default_lr(global_batch: int, d_sae: int, k: int, d_in: int, architecture: str = "topk") -> float:
    """Adam learning rate for a TopK-family SAE of this shape trained with this global batch."""
    del global_batch, d_sae, k  # too few swept shapes to fit these terms (docs/quality.md)
    factor = MATRYOSHKA_LR_FACTOR if architecture == "matryoshka" else 1.0
    return factor * LR_AT_REFERENCE * (d_in / 256) ** LR_D_IN_EXPONENT


def default_matryoshka_widths(d_sae: int) -> tuple[int, ...]:
    """The prefixes' widths when none are given: d_sae/4, d_sae (a prefix of fewer than one latent
    left out)."""
    return tuple(sorted({d_sae // f for f in MATRYOSHKA_FRACTIONS if d_sae // f >= 1}))


def default_warmup_steps(steps: int) -> int:
    return min(WARMUP_MAX_STEPS, int(steps * WARMUP_FRACTION))


def default_dead_after_samples(total_samples: int, global_batch: int) -> int:
    """A latent is dead after this many samples without firing: a tenth of the run, at least one
    step's batch, at most 10M, so AuxK acts in short runs too."""
    return int(min(DEAD_AFTER_MAX, max(global_batch, total_samples * DEAD_AFTER_FRACTION)))


def describe_resolved(given, resolved) -> str:
    """One line for the Train page and the CLI: the optimisation settings a run will use, each
    marked "default" where the rule chose it (given: the config as written; resolved: after
    TrainConfig.resolved)."""
    def mark(name: str, text: str) -> str:
        return f"{text} (default)" if getattr(given, name) is None else text

    inner_weight = 1.0 if resolved.matryoshka_inner_weight is None else resolved.matryoshka_inner_weight
    return ", ".join([
        mark("lr", f"lr {resolved.lr:.3g}"),
        *([mark("decoder_lr_factor", f"decoder at {resolved.decoder_lr_factor:g}x the lr")]
          if resolved.decoder_lr_factor != 1 else []),
        *([mark("matryoshka_inner_offset", "inner prefixes through their own offset")]
          if resolved.matryoshka_inner_offset else []),
        *([mark("matryoshka_inner_weight_start", f"inner weight {resolved.matryoshka_inner_weight_start:g} "
                f"falling to {inner_weight:g} by {resolved.matryoshka_inner_weight_until:.0%} of the steps")]
          if resolved.architecture == "matryoshka" and resolved.matryoshka_inner_weight_start != inner_weight else []),
        mark("lr_warmup_steps", f"warm-up {resolved.lr_warmup_steps:,} steps"),
        mark("lr_decay_fraction", f"decay to 0 over the last {resolved.lr_decay_fraction:.0%} of the steps"),
        mark("dead_after_samples", f"dead after {resolved.dead_after_samples:,} samples without firing"),
        mark("refit_fraction", f"decoder refit to the last {resolved.refit_fraction:.0%} of the steps"
             if resolved.refit_fraction else "no decoder refit"),
        mark("rare_bias_floor", f"rare-latent bias under {resolved.rare_bias_floor:g} of the average rate for "
             f"the first {resolved.rare_bias_until:.0%} of the steps" if resolved.rare_bias_floor
             else "no rare-latent bias"),
    ])


def heldout_rows_of(eval_rows: int, total_rows: int) -> int:
    """Rows of a shard set held out from training for the end-of-run evaluation: the config's
    eval_rows, but never more than a tenth of the data."""
    return max(0, min(eval_rows, total_rows // 10))
