"""The one training configuration: built from CLI flags, a TOML file or the app's form, validated here.

Every field carries its help text, so the CLI's `--help`, the TOML reference and the app's form
all say the same thing. `validate()` is the only place that decides what is a bad value; it raises
`ConfigError` naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from sae_dist.defaults import (
    DECAY_FRACTION,
    LR_AT_REFERENCE,
    MATRYOSHKA_DECODER_LR_FACTOR,
    MATRYOSHKA_INNER_WEIGHT_START,
    MATRYOSHKA_INNER_WEIGHT_UNTIL,
    MATRYOSHKA_LR_FACTOR,
    RARE_BIAS_FLOOR,
    RARE_BIAS_STEP,
    RARE_BIAS_UNTIL,
    default_dead_after_samples,
    default_decoder_lr_factor,
    default_lr,
    default_matryoshka_inner_offset,
    default_matryoshka_inner_weight_start,
    default_matryoshka_widths,
    default_rare_bias_floor,
    default_refit_fraction,
    default_warmup_steps,
)
from sae_dist.errors import ConfigError

SYNTHETIC_D_IN = 512  # width of synthetic activations when d_in is not given
MAX_STEPS = 10**9  # a billion steps: years on any machine
ARCHITECTURES = ("topk", "batchtopk", "matryoshka", "standard", "jumprelu")
TOPK_FAMILY = ("topk", "batchtopk", "matryoshka")  # k active latents per sample (on average), AuxK
MATRYOSHKA_SELECTIONS = ("sample", "batch")  # which latents fire: each sample's top k, or the batch's top k x batch


def batch_level(architecture: str, matryoshka_selection: str | None = None) -> bool:
    """Top-k over the whole batch, with a learned threshold at inference (BatchTopK, and Matryoshka
    with `batch` selection) rather than each sample's top k."""
    return architecture == "batchtopk" or (architecture == "matryoshka" and matryoshka_selection == "batch")


SOURCES = ("synthetic", "shards", "model")
SITES = ("resid", "mlp_out", "attn_out", "mlp_in")
PRECISIONS = ("auto", "fp32", "bf16")
COMPRESSIONS = ("none", "bf16", "fp16")
BALANCES = ("equal", "memory", "speed")
ON_RANK_LOSS = ("continue", "fail")
# Accepted spellings that people bring from other tools.
ARCHITECTURE_ALIASES = {"relu": "standard", "batch_topk": "batchtopk", "jump_relu": "jumprelu",
                        "matryoshka_batchtopk": "matryoshka"}


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # --- the SAE ---
    architecture: Literal["topk", "batchtopk", "matryoshka", "standard", "jumprelu"] = _f(
        "topk", "SAE architecture: topk, batchtopk, matryoshka (nested prefixes of the dictionary, each "
                "trained to reconstruct alone), standard (ReLU + L1) or jumprelu")
    d_in: int | None = _f(None, "input width; taken from the source (synthetic default 512), checked if given")
    d_sae: int | None = _f(None, "number of latents; default d_in x expansion_factor")
    expansion_factor: int = _f(8, "d_sae = d_in x this, when d_sae is not given")
    k: int = _f(32, "active latents per sample (topk; batchtopk and matryoshka: on average)")
    matryoshka_widths: str | None = _f(
        None, "matryoshka: the nested prefixes' widths, increasing, the last d_sae (e.g. 256,1024,4096); "
              "default d_sae/4, d_sae")
    matryoshka_selection: str | None = _f(
        None, "matryoshka: which latents fire, each sample's k largest (sample, as TopK) or the batch's k x batch "
              "largest (batch, as BatchTopK and the paper); default sample, which trains far better in one pass "
              "over heavily superposed features (docs/quality.md)")
    matryoshka_inner_weight: float | None = _f(
        None, "matryoshka: the weight of each inner prefix's reconstruction loss beside the whole dictionary's "
              "(default 1, the paper's; lower trades parents for absorption; higher, with the inner offset, "
              "recovers more of a hierarchy's parents at some FVU: docs/quality.md)")
    matryoshka_inner_weight_start: float | None = _f(
        None, "matryoshka: the inner weight at the run's start, held for the first half of "
              "--matryoshka-inner-weight-until and falling linearly to --matryoshka-inner-weight by it: the "
              "strong early pull finds a hierarchy's parents, the whole dictionary then fits around them; "
              f"default {MATRYOSHKA_INNER_WEIGHT_START:g} (or the inner weight, if higher) with the inner offset, "
              "else the inner weight (no schedule): docs/quality.md")
    matryoshka_inner_weight_until: float | None = _f(
        None, "matryoshka, with an inner weight's start: the fraction of the steps by which the inner weight "
              f"has fallen to --matryoshka-inner-weight; default {MATRYOSHKA_INNER_WEIGHT_UNTIL:g}; later (0.8) "
              "recovers more of a hierarchy's parents at some FVU, more cheaply than a higher constant weight "
              "(docs/quality.md)")
    matryoshka_inner_offset: bool | None = _f(
        None, "matryoshka: the inner prefixes reconstruct through the decoder plus a learnt offset of their "
              "rows, trained and checkpointed but not exported, so that their own loss bends the exported "
              "decoder less (a parent's latent hedged toward its children); default on for matryoshka "
              "(sample selection): docs/quality.md")
    l1_coefficient: float = _f(0.05, "L1 sparsity penalty weight (standard)")
    l0_coefficient: float = _f(0.01, "L0 sparsity penalty weight (jumprelu)")
    jumprelu_init_threshold: float = _f(0.001, "initial JumpReLU threshold")
    jumprelu_bandwidth: float = _f(0.001, "JumpReLU straight-through estimator bandwidth")
    auxk_coefficient: float = _f(1 / 32, "AuxK loss weight for dead latents (topk, batchtopk, matryoshka); "
                                         "0 turns it off")
    auxk_k: int | None = _f(None, "latents the AuxK loss uses; default d_in // 2")
    refit_fraction: float | None = _f(
        None, "topk, batchtopk, matryoshka: at the end, the decoder refit by least squares to the codes of this "
              "last fraction of the steps; 0 turns it off; default 0.2 for a matryoshka SAE or a batchtopk or "
              "matryoshka transcoder of at most 16,384 latents (the solve needs 24 x d_sae^2 bytes), else 0 "
              "(docs/training.md)")
    rare_bias_floor: float | None = _f(
        None, "topk, batchtopk, matryoshka: a latent firing on fewer rows than this fraction of the average rate "
              "k/d_sae gets a bias that only chooses which latents fire (their values stay unbiased), raised "
              f"until it fires more; 0 turns it off; default {RARE_BIAS_FLOOR} for matryoshka (sample selection), "
              "else 0 (docs/training.md)")
    rare_bias_step: float | None = _f(
        None, "with the rare-latent bias: each step it moves by this times the mean chosen activation; "
              f"default {RARE_BIAS_STEP}")
    rare_bias_until: float | None = _f(
        None, f"with the rare-latent bias: the fraction of the steps after which it is gone; default {RARE_BIAS_UNTIL}")
    dead_after_samples: int | None = _f(
        None, "a latent is dead (AuxK revives it) when it has not fired in this many samples; "
              "default a tenth of the run's samples, at least one batch, at most 10M")
    # --- the data ---
    source: Literal["synthetic", "shards", "model"] = _f(
        "synthetic", "activation source: synthetic, shards, or model (a transformer run over text as training goes)")
    shards_path: str | None = _f(None, "directory of safetensors activation shards (source = shards)")
    model_path: str | None = _f(None, "a transformers model on disk, never downloaded (source = model)")
    model_layer: int = _f(0, "the model's block whose activations are trained on, from 0 (source = model)")
    model_site: Literal["resid", "mlp_out", "attn_out", "mlp_in"] = _f(
        "resid", "resid (the block's output), mlp_out, attn_out or mlp_in (the MLP's input) (source = model)")
    transcode: str | None = _f(
        None, "train a transcoder, predicting one site from another: IN:OUT at model_layer, such as mlp_in:mlp_out "
              "(source = model), or the pair that paired shards hold (source = shards: harvest --transcode, "
              "pair-shards)")
    skip: bool = _f(False, "a skip transcoder: a linear path from the input to the output beside the latents "
                           "(with transcode)")
    text_path: str | None = _f(None, "a text file or directory the model reads (source = model)")
    context_length: int = _f(128, "tokens per model context, special tokens included (source = model)")
    synthetic_features: int = _f(4096, "planted dictionary size (synthetic)")
    synthetic_active: float = _f(4.0, "features active per sample on average (synthetic)")
    synthetic_power_law: float = _f(0.5, "feature frequency ~ rank^-this (synthetic; 0 = uniform)")
    synthetic_noise: float = _f(0.01, "Gaussian noise std per dimension (synthetic)")
    synthetic_children: int = _f(0, "children per planted parent feature: a hierarchy, each child firing only "
                                    "with its parent (synthetic; 0 = flat features)")
    synthetic_child_prob: float = _f(0.5, "each time a parent fires, the chance that one of its children fires "
                                          "with it (synthetic, with synthetic_children)")
    synthetic_magnitude_sigma: float = _f(0.0, "log-normal feature magnitudes exp(N(0, this)) (synthetic; "
                                               "0 = uniform in [0.5, 2])")
    synthetic_correlation: float = _f(0.0, "correlated firing: features (parents, in a hierarchy) pair up, 0 with 1, "
                                           "2 with 3..., and a firing one brings its partner with this chance "
                                           "(synthetic; 0 = independent)")
    seed: int = _f(0, "random seed for initialisation and data")
    # --- optimisation ---
    batch_size: int = _f(4096, "samples per device per micro-batch; the global batch is this x devices x grad_accum")
    lr: float | None = _f(None, f"Adam learning rate for the global batch; default {LR_AT_REFERENCE} x "
                                f"sqrt(256 / d_in), {MATRYOSHKA_LR_FACTOR:g} times that for matryoshka, from the "
                                "sweeps in scripts/sweep_lr.py and scripts/sweep_matryoshka.py")
    lr_warmup_steps: int | None = _f(None, "linear learning-rate warm-up steps; default 5% of the steps, at most 1000")
    lr_decay_fraction: float | None = _f(None, "linear decay to 0 over this final fraction of the steps; default 0.2")
    decoder_lr_factor: float | None = _f(
        None, f"the decoder's learning rate as a multiple of lr (the encoder and the biases keep lr); "
              f"default {MATRYOSHKA_DECODER_LR_FACTOR:g} for matryoshka (sample selection), else 1")
    steps: int = _f(1000, "optimizer steps")
    precision: Literal["auto", "fp32", "bf16"] = _f(
        "auto", "auto: bf16 autocast on GPUs that support it, fp32 on CPU")
    grad_accum: int = _f(1, "micro-batches of batch_size per device in each optimizer step; one all-reduce per step")
    ddp_bucket_mb: float | None = _f(
        None, "DDP gradient bucket size in MiB; default: the decoder's gradient is a bucket of its own")
    ddp_compress: Literal["none", "bf16", "fp16"] = _f(
        "none", "all-reduce the gradients in bf16 or fp16 (half the bytes, rounded gradients)")
    balance: Literal["equal", "memory", "speed"] = _f(
        "equal", "how each step's samples are shared among the devices: equal, memory (in proportion to "
                 "each device's free memory) or speed (to each device's measured throughput)")
    rebalance: bool = _f(True, "move samples away from a device whose steps stay slower than the others' (stragglers)")
    # --- the run ---
    on_rank_loss: Literal["continue", "fail"] = _f(
        "continue", "when a rank dies: continue from the last checkpoint on the devices still healthy, "
                    "with the same global batch, or fail")
    devices: str = _f("auto", "auto (every visible GPU, else 1 CPU rank), cpu:N, or cuda:N")
    name: str | None = _f(None, "run name; default <architecture>-<d_sae>-<time>")
    out_dir: str | None = _f(None, "run directory; default $SAE_DIST_HOME/runs/<name>")
    log_every: int = _f(10, "steps between metric reports")
    checkpoint_every: int = _f(500, "steps between checkpoints (0: only at the end)")
    keep_checkpoints: int = _f(2, "checkpoints kept on disk")
    eval_rows: int = _f(16384, "rows the run never trains on, evaluated when it ends (FVU, L0, dead latents, "
                               "recovery of planted features): shards hold out their last rows (at most a "
                               "tenth), other sources use rows after the run's last; 0: no evaluation")
    resume: bool = _f(False, "continue from the latest checkpoint in out_dir")
    db: bool = _f(True, "record the run in the state database (off: files only)")

    def __post_init__(self) -> None:
        if self.architecture == "matryoshka_batchtopk" and self.matryoshka_selection is None:
            self.matryoshka_selection = "batch"  # SAELens' name says how it selects
        self.architecture = ARCHITECTURE_ALIASES.get(self.architecture, self.architecture)
        self.validate()

    # Resolved values: a run needs concrete numbers where the config leaves defaults.
    @property
    def resolved_d_sae(self) -> int:
        assert self.d_in is not None, "d_in is set from the source before training"
        return self.d_sae if self.d_sae is not None else self.d_in * self.expansion_factor

    @property
    def resolved_lr(self) -> float:
        # Read every step: a resolved config (what a rank trains with) has its number already.
        return self.lr if self.lr is not None else self.resolved(self._known_world_size()).lr

    def _known_world_size(self) -> int:
        kind, count = parse_devices(self.devices)
        return count if kind == "cpu" and count else 1

    def resolved(self, world_size: int) -> TrainConfig:
        """The config with every rule-based default made a number (sae_dist.defaults), for a run on
        `world_size` devices: what the run stores and the Train page shows before submit."""
        global_batch = self.batch_size * self.grad_accum * world_size
        assert self.d_in is not None, "d_in is set from the source before resolving"
        floor, step, until = self.resolved_rare_bias
        return self._unchecked(
            lr=self.lr if self.lr is not None else float(
                f"{default_lr(global_batch, self.resolved_d_sae, self.k, self.d_in, self.architecture):.3g}"),
            lr_warmup_steps=(self.lr_warmup_steps if self.lr_warmup_steps is not None
                             else default_warmup_steps(self.steps)),
            lr_decay_fraction=self.lr_decay_fraction if self.lr_decay_fraction is not None else DECAY_FRACTION,
            decoder_lr_factor=self.resolved_decoder_lr_factor,
            matryoshka_inner_offset=self.resolved_matryoshka_inner_offset,
            **self._resolved_inner_schedule(),
            dead_after_samples=(self.dead_after_samples if self.dead_after_samples is not None
                                else default_dead_after_samples(self.steps * global_batch, global_batch)),
            refit_fraction=self.resolved_refit_fraction,
            rare_bias_floor=floor, rare_bias_step=step, rare_bias_until=until,
        )

    def _resolved_inner_schedule(self) -> dict[str, float]:
        """The inner weight's start and its end as numbers, for a Matryoshka SAE (the others have none)."""
        if self.architecture != "matryoshka":
            return {}
        _, start, until = self.resolved_matryoshka_inner_weight
        return {"matryoshka_inner_weight_start": start, "matryoshka_inner_weight_until": until}

    def _unchecked(self, **changes: Any) -> TrainConfig:
        """A copy with `changes`, not validated again: only for values valid by construction (the
        rule-based defaults are positive numbers), so a run validates its config once per source
        of new values (its flags, then the source's d_in), not once per copy."""
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    @property
    def resolved_decoder_lr_factor(self) -> float:
        return (self.decoder_lr_factor if self.decoder_lr_factor is not None
                else default_decoder_lr_factor(self.architecture, self.batch_level))

    @property
    def resolved_matryoshka_inner_offset(self) -> bool | None:
        """On or off for a Matryoshka SAE (given, or by default_matryoshka_inner_offset); None for
        the other architectures, which have no inner prefixes."""
        if self.architecture != "matryoshka":
            return None
        return (self.matryoshka_inner_offset if self.matryoshka_inner_offset is not None
                else default_matryoshka_inner_offset(self.architecture, self.batch_level))

    @property
    def resolved_matryoshka_inner_weight(self) -> tuple[float, float, float]:
        """Matryoshka's inner weight as (weight, start, until): the weight after `until` of the
        steps, the weight at the start (equal to it: no schedule), their defaults where unset
        (sae_dist.train.inner_weight). For another architecture: (1, 1, 1), never read."""
        weight = self.matryoshka_inner_weight if self.matryoshka_inner_weight is not None else 1.0
        if self.architecture != "matryoshka":
            return weight, weight, 1.0
        start = (self.matryoshka_inner_weight_start if self.matryoshka_inner_weight_start is not None
                 else default_matryoshka_inner_weight_start(weight, bool(self.resolved_matryoshka_inner_offset)))
        until = (self.matryoshka_inner_weight_until if self.matryoshka_inner_weight_until is not None
                 else MATRYOSHKA_INNER_WEIGHT_UNTIL)
        return weight, start, until

    @property
    def resolved_refit_fraction(self) -> float:
        if self.refit_fraction is not None:
            return self.refit_fraction
        return default_refit_fraction(self.architecture, self.resolved_d_sae, topk_family_transcoder=(
            self.transcode is not None and self.architecture in TOPK_FAMILY))

    @property
    def resolved_rare_bias(self) -> tuple[float, float, float]:
        """The rare-latent bias's floor (0: off), step and stop, their defaults where unset."""
        floor = (self.rare_bias_floor if self.rare_bias_floor is not None
                 else default_rare_bias_floor(self.architecture, self.batch_level))
        return (floor, self.rare_bias_step if self.rare_bias_step is not None else RARE_BIAS_STEP,
                self.rare_bias_until if self.rare_bias_until is not None else RARE_BIAS_UNTIL)

    @property
    def resolved_matryoshka_widths(self) -> tuple[int, ...]:
        """The prefixes' widths, checked against d_sae (the last must be it)."""
        d_sae = self.resolved_d_sae
        if self.matryoshka_widths is None:
            return default_matryoshka_widths(d_sae)
        widths = parse_widths(self.matryoshka_widths)
        if widths[-1] != d_sae:
            raise ConfigError("matryoshka_widths", f"the last width is the whole dictionary: {widths[-1]:,} given, "
                                                   f"d_sae is {d_sae:,}")
        return widths

    @property
    def transcode_sites(self) -> tuple[str, str] | None:
        """(input site, output site) of a transcoder; None for an SAE."""
        return parse_transcode(self.transcode, model_sites=False) if self.transcode else None

    @property
    def model_sites(self) -> list[tuple[int, str]]:
        """The (layer, site) the model source hooks: model_site, or a transcoder's input and output."""
        return [(self.model_layer, site) for site in (self.transcode_sites or (self.model_site,))]

    @property
    def batch_level(self) -> bool:
        return batch_level(self.architecture, self.matryoshka_selection)

    @property
    def resolved_auxk_k(self) -> int:
        assert self.d_in is not None
        return self.auxk_k if self.auxk_k is not None else max(1, self.d_in // 2)

    def validate(self) -> None:
        def choice(name: str, options: tuple[str, ...]) -> None:
            value = getattr(self, name)
            if value not in options:
                raise ConfigError(name, f"unknown value {value!r}; choose one of {', '.join(options)}")

        def positive(name: str, allow_none: bool = False, allow_zero: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
                raise ConfigError(name, f"must be a number, got {value!r}")
            if math.isinf(value):
                raise ConfigError(name, f"must be finite, got {value}")
            if value < 0 or (value == 0 and not allow_zero):
                raise ConfigError(name, f"must be {'non-negative' if allow_zero else 'positive'}, got {value}")

        choice("architecture", ARCHITECTURES)
        choice("source", SOURCES)
        choice("model_site", SITES)
        choice("precision", PRECISIONS)
        choice("ddp_compress", COMPRESSIONS)
        choice("balance", BALANCES)
        choice("on_rank_loss", ON_RANK_LOSS)
        for name in ("expansion_factor", "k", "batch_size", "grad_accum", "steps", "log_every", "keep_checkpoints",
                     "context_length",
                     "synthetic_features", "jumprelu_init_threshold",
                     "jumprelu_bandwidth"):
            positive(name)
        for name in ("d_in", "d_sae", "auxk_k", "lr", "ddp_bucket_mb", "dead_after_samples", "decoder_lr_factor"):
            positive(name, allow_none=True)
        for name in ("l1_coefficient", "l0_coefficient", "auxk_coefficient",
                     "checkpoint_every", "eval_rows", "synthetic_noise", "synthetic_power_law", "synthetic_active",
                     "seed", "model_layer", "synthetic_children", "synthetic_magnitude_sigma"):
            positive(name, allow_zero=True)
        for name in ("lr_warmup_steps", "lr_decay_fraction"):
            if getattr(self, name) is not None:
                positive(name, allow_zero=True)
        for name in ("expansion_factor", "k", "batch_size", "grad_accum", "steps", "log_every", "d_in", "d_sae",
                     "auxk_k", "synthetic_features", "lr_warmup_steps", "dead_after_samples", "eval_rows",
                     "checkpoint_every", "seed", "model_layer", "synthetic_children",
                     "context_length"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, int):
                raise ConfigError(name, f"must be a whole number, got {value!r}")
        # Past this a value is a typo, never a plan (10^15 steps: an ETA of centuries), refused before
        # anything is queued. A huge learning rate is left alone: it is how a test makes a run diverge.
        if self.steps > MAX_STEPS:
            raise ConfigError("steps", f"{self.steps:,} is more than {MAX_STEPS:,}, the most a run may take")
        self._validate_hierarchy_and_prefixes()
        self._validate_transcoder()
        if self.lr_decay_fraction is not None and not 0.0 <= self.lr_decay_fraction <= 1.0:
            raise ConfigError("lr_decay_fraction", f"must be between 0 and 1, got {self.lr_decay_fraction}")
        self._validate_topk_family_settings()
        if self.source == "shards" and not self.shards_path:
            raise ConfigError("shards_path", "source = shards needs the directory of the shards")
        if self.source != "shards" and self.shards_path:
            raise ConfigError("shards_path", f"given, but source is {self.source}; add --source shards")
        if self.source == "model":
            for name in ("model_path", "text_path"):
                if not getattr(self, name):
                    raise ConfigError(name, "source = model needs the model and the text it reads")
        elif self.model_path or self.text_path:
            name = "model_path" if self.model_path else "text_path"
            raise ConfigError(name, f"given, but source is {self.source}; add --source model")
        if self.d_in is not None:
            d_sae = self.resolved_d_sae
            if self.architecture in TOPK_FAMILY and self.k > d_sae:
                raise ConfigError("k", f"k = {self.k} is more than d_sae = {d_sae}")
            if self.architecture == "matryoshka":
                self.resolved_matryoshka_widths  # noqa: B018 (checked against d_sae)
            if self.auxk_k is not None and self.auxk_k > d_sae:
                raise ConfigError("auxk_k", f"auxk_k = {self.auxk_k} is more than d_sae = {d_sae}")
        if self.resume and not self.out_dir:
            raise ConfigError("resume", "needs out_dir: the run directory holding the checkpoints")
        parse_devices(self.devices)  # raises ConfigError("devices", ...) when malformed

    def _validate_hierarchy_and_prefixes(self) -> None:
        """The planted hierarchy's settings and Matryoshka's prefixes (without d_sae: `validate`
        checks them against it once d_in is known)."""
        for name in ("synthetic_child_prob", "synthetic_correlation"):
            if not 0.0 <= getattr(self, name) <= 1.0:  # (also NaN)
                raise ConfigError(name, f"must be between 0 and 1, got {getattr(self, name)}")
        if self.synthetic_children and self.synthetic_features < self.synthetic_children + 1:
            raise ConfigError("synthetic_features", f"{self.synthetic_features} features cannot hold one parent "
                                                    f"with {self.synthetic_children} children")
        if self.matryoshka_widths is not None:
            if self.architecture != "matryoshka":
                raise ConfigError("matryoshka_widths", f"given, but the architecture is {self.architecture}; "
                                                       "add --architecture matryoshka")
            parse_widths(self.matryoshka_widths)
        for name in ("matryoshka_inner_weight", "matryoshka_inner_weight_start", "matryoshka_inner_weight_until"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.architecture != "matryoshka":
                raise ConfigError(name, f"given, but the architecture is {self.architecture}; "
                                        "add --architecture matryoshka")
            if name == "matryoshka_inner_weight_until":
                if not 0.0 < value <= 1.0:  # (also NaN)
                    raise ConfigError(name, f"must be above 0 and at most 1 (a fraction of the steps), got {value}")
            elif not 0.0 <= value < float("inf"):  # a weight (also NaN)
                raise ConfigError(name, f"must be 0 or more, got {value}")
        if self.matryoshka_inner_offset is not None and self.architecture != "matryoshka":
            raise ConfigError("matryoshka_inner_offset", f"given, but the architecture is {self.architecture}; "
                                                         "add --architecture matryoshka")
        if self.matryoshka_selection is not None:
            if self.architecture != "matryoshka":
                raise ConfigError("matryoshka_selection", f"given, but the architecture is {self.architecture}; "
                                                          "add --architecture matryoshka")
            if self.matryoshka_selection not in MATRYOSHKA_SELECTIONS:
                raise ConfigError("matryoshka_selection", f"unknown value {self.matryoshka_selection!r}; choose one "
                                                          f"of {', '.join(MATRYOSHKA_SELECTIONS)}")

    def _validate_topk_family_settings(self) -> None:
        """The decoder refit's and the rare-latent bias's settings: fractions, for TopK-family SAEs."""
        if self.refit_fraction is not None and not 0.0 <= self.refit_fraction <= 1.0:  # (also NaN)
            raise ConfigError("refit_fraction", f"must be between 0 and 1, got {self.refit_fraction}")
        if self.refit_fraction and self.architecture not in TOPK_FAMILY:
            raise ConfigError("refit_fraction", f"refits a decoder to TopK-family codes ({', '.join(TOPK_FAMILY)}); "
                                                f"the architecture is {self.architecture}")
        bounds = {"rare_bias_floor": (0.0, 1.0, True), "rare_bias_step": (0.0, 1.0, False),
                  "rare_bias_until": (0.0, 1.0, False)}
        for name, (low, high, zero) in bounds.items():
            value = getattr(self, name)
            if value is None:
                continue
            if not (low <= value <= high and (zero or value > low)):  # (also NaN)
                side = "from 0" if zero else "above 0"
                raise ConfigError(name, f"must be a fraction {side} up to 1, got {value}")
            if self.architecture not in TOPK_FAMILY and (value or name != "rare_bias_floor"):
                raise ConfigError(name, f"biases which latents a TopK-family SAE chooses ({', '.join(TOPK_FAMILY)}); "
                                        f"the architecture is {self.architecture}")

    def _validate_transcoder(self) -> None:
        if self.skip and not self.transcode:
            raise ConfigError("skip", "a skip path belongs to a transcoder: add --transcode IN:OUT "
                                      "(e.g. mlp_in:mlp_out)")
        if self.transcode is None:
            return
        if self.source == "synthetic":
            raise ConfigError("transcode", "needs the model source (--source model) or paired shards (--source shards)")
        parse_transcode(self.transcode, model_sites=self.source == "model")
        if self.architecture in TOPK_FAMILY and not self.batch_level:
            raise ConfigError("transcode", f"a {self.architecture} transcoder (each sample's top k) has no SAELens "
                                           "class to load it; use --architecture batchtopk (exported as SAELens' "
                                           "JumpReLU transcoder), jumprelu or standard")

    def with_d_in(self, d_in: int) -> TrainConfig:
        """The config with d_in from the source; a given d_in that differs is an error."""
        if self.d_in is not None and self.d_in != d_in:
            raise ConfigError("d_in", f"is {self.d_in} but the source's activations have width {d_in}")
        if self.d_in == d_in:
            return self._unchecked()  # nothing new to check: a rank gets a config whose d_in is known
        return dataclasses.replace(self, d_in=d_in)  # validated: k and auxk_k are checked against d_sae

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def config_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(TrainConfig))


def field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def parse_transcode(text: str, model_sites: bool = True) -> tuple[str, str]:
    """'mlp_in:mlp_out' -> ('mlp_in', 'mlp_out'): two different names, each a site the model
    source reads (`model_sites`; paired shards may name theirs freely), or ConfigError."""
    sites = [s.strip() for s in str(text).split(":")]
    if len(sites) != 2 or not all(sites) or sites[0] == sites[1]:
        raise ConfigError("transcode", f"{text!r}: give two different sites as IN:OUT, e.g. mlp_in:mlp_out")
    unknown = [s for s in sites if s not in SITES]
    if model_sites and unknown:
        raise ConfigError("transcode", f"site {unknown[0]!r} is not one a model is read at; choose from "
                                       f"{', '.join(SITES)}")
    return sites[0], sites[1]


def parse_widths(text: str) -> tuple[int, ...]:
    """'256,1024,4096' (or a TOML list's text, '[256, 1024, 4096]') -> (256, 1024, 4096), strictly
    increasing positive whole numbers, or ConfigError naming what is wrong."""
    raw = str(text).strip().removeprefix("[").removesuffix("]")
    parts = [p.strip() for p in raw.split(",")]
    if not raw.strip() or any(not (p.isascii() and p.isdigit()) for p in parts):
        raise ConfigError("matryoshka_widths", f"{text!r}: give increasing whole numbers such as 256,1024,4096")
    widths = tuple(int(p) for p in parts)
    if widths[0] < 1 or any(b <= a for a, b in zip(widths, widths[1:])):
        raise ConfigError("matryoshka_widths", f"{text!r}: each width must be larger than the one before, "
                                               "from 1 up")
    return widths


def parse_devices(spec: str) -> tuple[str, int | None]:
    """'auto' -> ('auto', None); 'cpu:4' -> ('cpu', 4); 'cuda:2' or 'gpu:2' -> ('cuda', 2); 'cuda' -> all."""
    text = str(spec).strip().lower()
    if text == "auto":
        return "auto", None
    kind, _, count = text.partition(":")
    kind = {"gpu": "cuda"}.get(kind, kind)
    if kind not in ("cpu", "cuda"):
        raise ConfigError("devices", f"unknown device kind in {spec!r}; use auto, cpu:N or cuda:N")
    if not count:
        return kind, (1 if kind == "cpu" else None)
    if not count.isdigit() or int(count) < 1:
        raise ConfigError("devices", f"device count in {spec!r} must be a positive whole number")
    return kind, int(count)


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a run.toml: flat `key = value` lines, or the same keys under a [train] table."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("config", f"no such file: {p}")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("config", f"{p} is not valid TOML: {e}") from None
    if isinstance(data.get("train"), dict):
        data = {**{k: v for k, v in data.items() if k != "train"}, **data["train"]}
    return data


def build_config(values: dict[str, Any]) -> TrainConfig:
    """A validated config from plain values (TOML, form, parsed flags); unknown keys are errors."""
    names = [f.name for f in config_fields()]
    for key in values:
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(key, f"unknown setting{hint}")
    types = field_types()
    clean = {k: _coerce(k, v, types[k]) for k, v in values.items()}
    return TrainConfig(**clean)


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check a TOML/form value against the field's type (ints stay ints, floats accept ints)."""
    if value is None:
        return None
    args = typing.get_args(annotation)
    base = next((a for a in args if a is not type(None)), annotation) if args else annotation
    if typing.get_origin(base) is Literal:
        return str(value)
    if base is bool:
        if not isinstance(value, bool):
            raise ConfigError(name, f"must be true or false, got {value!r}")
        return value
    if base is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(name, f"must be a whole number, got {value!r}")
        return value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(name, f"must be a number, got {value!r}")
        return float(value)
    if base is str:
        return str(value)
    return value
