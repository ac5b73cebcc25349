"""Evaluation of an SAE on rows of activations: pure computations, streamed over batches.

Any object with `encode(x) -> acts`, `decode(acts) -> x_hat`, `W_dec` [d_sae, d_in] and `d_sae`
can be evaluated: a LoadedSae read from disk, or the trainer's in-memory SparseAutoencoder.
Everything is accumulated in float64 over the batches, so memory stays bounded by one batch and
the result does not depend on how the rows were cut into batches (beyond float rounding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from sae_dist.errors import DataError, UserError

# Feature-density histogram: log10 of each latent's firing frequency, in fixed bins of 0.5 from
# -8 to 0 (so histograms of different SAEs and row counts compare bin for bin). Latents that never
# fired have no logarithm and are counted apart ("never").
DENSITY_EDGES = tuple(-8.0 + 0.5 * i for i in range(17))
DENSE_DIVISOR = 10  # a latent firing on more than rows / 10 rows is "dense" (integers: exact)
RARE_PART = 10  # recovery is also reported for the rarest 1/RARE_PART of the planted features


class Evaluable(Protocol):
    d_sae: int
    W_dec: Tensor

    def encode(self, x: Tensor) -> Tensor: ...

    def decode(self, acts: Tensor) -> Tensor: ...


@dataclass
class Density:
    edges: list[float]  # len(counts) + 1 bin edges of log10(frequency); bins [a, b), the last [a, b]
    counts: list[int]  # latents per bin (frequencies below 1e-8 count in the first bin)
    never: int  # latents that never fired

    def to_dict(self) -> dict[str, Any]:
        return {"edges": list(self.edges), "counts": list(self.counts), "never": self.never}


@dataclass
class Recovery:
    """How well the decoder rows recover a planted dictionary: per planted feature, the best
    cosine with any decoder row; its mean and the fractions above 0.9 and 0.8, over all planted
    features and over the rarest tenth (by planted frequency; ties: the later features)."""

    features: int
    mean_best_cos: float
    frac_above_0_9: float
    frac_above_0_8: float
    rare_features: int
    rare_mean_best_cos: float
    rare_frac_above_0_9: float
    rare_frac_above_0_8: float
    # MCC: the mean |cosine| of a one-to-one (Hungarian) matching of planted features to decoder
    # rows, as SAELens' synthetic benchmark defines it; None when the cost matrix would be too big.
    mcc: float | None = None
    # A planted hierarchy: its parents (the first `parents` features) recovered at cos > 0.9 and
    # its children at cos > 0.8; None for flat features.
    parents: int | None = None
    parents_frac_above_0_9: float | None = None
    children_frac_above_0_8: float | None = None
    # Absorption: the parents with no latent of their own (best cosine 0.9 or less), and how much of
    # its parent the latent that best matches each child carries (mean cosine with the parent's
    # direction; about 0 when the child's latent is the child's alone).
    absorbed_parents: float | None = None
    parent_in_children: float | None = None
    # The other way: how much of its children's mean direction the latent that best matches each
    # parent carries (mean cosine; about 0 when the parent's latent is its own). A Matryoshka inner
    # prefix pulls a parent's latent toward the parent plus its children's mean: what reconstructs
    # best when a parent's family has one latent there.
    children_in_parents: float | None = None
    # Of the parents with no latent of their own, the share whose best-matching latent is also one
    # of their children's best (absorbed: a latent of the parent with a child); the rest match best
    # a latent no child shares (hedged, the parent with some of its children's mean, or not found).
    parents_in_a_childs_latent: float | None = None
    # Each latent as a detector of its best-matching planted feature (by |cosine|) on the rows:
    # the means over latents of precision, recall, F1 and accuracy, as SAELens' synthetic evals.
    precision: float | None = None
    recall: float | None = None
    f1: float | None = None
    accuracy: float | None = None
    # SAELens' uniqueness: the distinct planted features that are some latent's best match (by
    # |cosine|), over the number of latents (1: every latent tracks a feature of its own).
    uniqueness: float | None = None
    # What the latents that fired on the rows are, by their best |cosine| with any planted feature:
    # one feature (> 0.9), a mixture (0.5 to 0.9: a parent with a child, say), or none (0.5 or
    # less), as shares of those latents and of their firings.
    latents_on_a_feature: float | None = None
    latents_mixed: float | None = None
    latents_on_none: float | None = None
    firings_on_a_feature: float | None = None
    firings_mixed: float | None = None
    firings_on_none: float | None = None

    def to_dict(self) -> dict[str, Any]:
        """What was measured: a figure that was not (no hierarchy, too big to match) is absent."""
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class Planted:
    """A planted dictionary: `dictionary` [F, d_in] (unit rows) and each feature's `frequencies`
    [F], the probability that it is present in a row; `settings` as the data was generated."""

    dictionary: Tensor
    frequencies: Tensor
    settings: dict[str, Any] = field(default_factory=dict)
    # The ground truth of the evaluated rows, where the generator is known: truth(start, count) is
    # each feature's magnitude in stream rows [start, start + count), and `first_row` the stream
    # position of the first row evaluated. Without both, no precision, recall or F1.
    truth: Callable[[int, int], Tensor] | None = None
    first_row: int | None = None


@dataclass
class Evaluation:
    """An SAE's metrics on `rows` rows.

    fvu: fraction of variance unexplained, sum ||x - x_hat||^2 / sum ||x - mean(x)||^2 with the
    mean over all evaluated rows; explained_variance = 1 - fvu. Both None when the rows do not
    vary (one row, or identical rows). mse: mean over rows of the summed squared error. cosine:
    mean over rows of cos(x, x_hat). l0: mean active (non-zero) latents per row. dead_fraction:
    latents that never fired on these rows; dense_fraction: latents firing on more than 10% of
    them. density: histogram of log10 firing frequency. recovery: only for planted data.
    model_check: filled in by the model-splice check, carried as is.
    """

    rows: int
    d_sae: int
    fvu: float | None
    explained_variance: float | None
    mse: float
    cosine: float
    l0: float
    dead_fraction: float
    dense_fraction: float
    density: Density
    recovery: Recovery | None = None
    model_check: dict[str, Any] | None = None
    core: dict[str, float | None] = field(default_factory=dict)  # SAEBench's core metrics (`core_metrics`)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: NaN and inf become None."""
        out = {name: _finite(getattr(self, name)) for name in
               ("rows", "d_sae", "fvu", "explained_variance", "mse", "cosine", "l0", "dead_fraction",
                "dense_fraction")}
        out["core"] = {k: _finite(v) for k, v in self.core.items()}
        out["density"] = self.density.to_dict()
        out["recovery"] = {k: _finite(v) for k, v in self.recovery.to_dict().items()} if self.recovery else None
        out["model_check"] = self.model_check
        return out


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class FiringMatch:
    """Counts, per latent, how its firing agrees with its best-matching planted feature's (SAELens'
    ClassificationMetricsCalculator): true and false positives and negatives over the rows."""

    def __init__(self, W_dec: Tensor, dictionary: Tensor):
        self.best = best_abs_matches(W_dec, dictionary)  # [d_sae]
        self.counts = torch.zeros(4, W_dec.shape[0], dtype=torch.float64)  # tp, fp, fn, tn

    def add(self, acts: Tensor, truth: Tensor) -> None:
        fires, real = acts.detach().cpu() != 0, truth[:, self.best] > 0
        for i, hit in enumerate((fires & real, fires & ~real, ~fires & real, ~fires & ~real)):
            self.counts[i] += hit.sum(0).double()

    def result(self) -> dict[str, float]:
        tp, fp, fn, tn = self.counts
        precision = torch.where(tp + fp > 0, tp / (tp + fp), 0.0)
        recall = torch.where(tp + fn > 0, tp / (tp + fn), 0.0)
        f1 = torch.where(precision + recall > 0, 2 * precision * recall / (precision + recall), 0.0)
        accuracy = (tp + tn) / (tp + fp + fn + tn).clamp_min(1e-8)
        return {"precision": float(precision.mean()), "recall": float(recall.mean()), "f1": float(f1.mean()),
                "accuracy": float(accuracy.mean())}


class Accumulator:
    """Running float64 sums of one SAE's evaluation; `add` a batch at a time, then `result`."""

    def __init__(self, d_sae: int, match: FiringMatch | None = None):
        self.d_sae = d_sae
        self.match = match  # with the rows' ground truth: each latent as a feature detector
        self.rows = 0
        self.shift: Tensor | None = None  # the first batch's mean: keeps the variance sums well conditioned
        self.sum_x: Tensor | None = None  # per dim, of x - shift
        self.sum_x2: Tensor | None = None
        self.sum_sq_err = 0.0
        self.sum_cos = 0.0
        self.sum_norm_in = self.sum_norm_out = self.sum_l2_ratio = 0.0
        self.sum_out_sq = self.sum_in_dot_out = self.sum_l1 = 0.0
        self.active = 0
        self.fired = torch.zeros(d_sae, dtype=torch.int64)

    @torch.no_grad()
    def add(self, x: Tensor, x_hat: Tensor, acts: Tensor, truth: Tensor | None = None) -> None:
        # Reduced on the batch's device (float64 there too); only per-dim and scalar sums move.
        x64, xh64 = x.detach().double(), x_hat.detach().double()
        if self.shift is None:
            self.shift = x64.mean(0).cpu()
            self.sum_x = torch.zeros_like(self.shift)
            self.sum_x2 = torch.zeros_like(self.shift)
        centred = x64 - self.shift.to(x64.device)
        self.sum_x += centred.sum(0).cpu()
        self.sum_x2 += centred.pow(2).sum(0).cpu()
        self.sum_sq_err += float((x64 - xh64).pow(2).sum())
        self.sum_cos += float(F.cosine_similarity(x64, xh64, dim=-1, eps=1e-12).sum())
        norm_in, norm_out = x64.norm(dim=-1), xh64.norm(dim=-1)
        self.sum_norm_in += float(norm_in.sum())
        self.sum_norm_out += float(norm_out.sum())
        # SAELens' rule: a row whose norm is under 1e-4 is divided by 1, not by its norm.
        self.sum_l2_ratio += float((norm_out / torch.where(norm_in.abs() < 1e-4, 1.0, norm_in)).sum())
        self.sum_out_sq += float(norm_out.pow(2).sum())
        self.sum_in_dot_out += float((x64 * xh64).sum())
        self.sum_l1 += float(acts.detach().double().abs().sum())
        on = acts.detach() != 0
        fired = on.sum(0)
        self.active += int(fired.sum())
        self.fired += fired.cpu().to(torch.int64)
        self.rows += x.shape[0]
        if self.match is not None and truth is not None:
            self.match.add(acts, truth)

    def result(self, W_dec: Tensor | None = None, planted: Planted | None = None) -> Evaluation:
        if self.rows == 0:
            raise DataError("no rows to evaluate on (0 rows selected)")
        n = self.rows
        total_var = float((self.sum_x2 - self.sum_x.pow(2) / n).sum())
        mean_square = float((self.sum_x2 + 2 * self.shift * self.sum_x + n * self.shift.pow(2)).sum())
        # Rows that do not vary leave only rounding in total_var: FVU is then undefined, not huge.
        fvu = self.sum_sq_err / total_var if total_var > 1e-12 * mean_square else None
        core = core_metrics(self, fvu)
        return Evaluation(core=core,
            rows=n, d_sae=self.d_sae, fvu=fvu, explained_variance=None if fvu is None else 1.0 - fvu,
            mse=self.sum_sq_err / n, cosine=self.sum_cos / n, l0=self.active / n,
            dead_fraction=int((self.fired == 0).sum()) / self.d_sae,
            dense_fraction=int((self.fired * DENSE_DIVISOR > n).sum()) / self.d_sae,
            density=density_histogram(self.fired, n),
            recovery=(recovery(planted.dictionary, planted.frequencies, W_dec, planted.settings.get("parents"),
                               self.match.result() if self.match is not None else None, self.fired)
                      if planted is not None else None),
        )


def core_metrics(acc: Accumulator, fvu: float | None) -> dict[str, float | None]:
    """SAEBench's core evaluation, by the names and formulas of SAELens' evals
    (get_sparsity_and_variance_metrics), over every evaluated row: explained variance
    1 - E||x - x_hat||^2 / Var(x) (its calculator's, our 1 - FVU); mse, the mean summed squared
    error; cossim; l2_norm_in and _out, the mean norms; l2_ratio, the mean ||x_hat|| / ||x||;
    relative_reconstruction_bias, E||x_hat||^2 / E[x . x_hat] (Gao et al.'s equation 10; SAELens
    averages it over its batches, here it is over all rows at once); l0 and l1 of the latents;
    frac_alive, the latents that fired at least once; freq_over_1_percent and _10_percent, the
    latents firing on more than 1% and 10% of the rows."""
    n = acc.rows
    return {
        "explained_variance": None if fvu is None else 1.0 - fvu,
        "mse": acc.sum_sq_err / n, "cossim": acc.sum_cos / n,
        "l2_norm_in": acc.sum_norm_in / n, "l2_norm_out": acc.sum_norm_out / n, "l2_ratio": acc.sum_l2_ratio / n,
        "relative_reconstruction_bias": (acc.sum_out_sq / acc.sum_in_dot_out if acc.sum_in_dot_out else None),
        "l0": acc.active / n, "l1": acc.sum_l1 / n,
        "frac_alive": int((acc.fired > 0).sum()) / acc.d_sae,
        "freq_over_1_percent": int((acc.fired * 100 > n).sum()) / acc.d_sae,
        "freq_over_10_percent": int((acc.fired * 10 > n).sum()) / acc.d_sae,
    }


def density_histogram(fired: Tensor, rows: int) -> Density:
    """Histogram of log10(fired / rows) over DENSITY_EDGES; latents with fired == 0 counted apart."""
    fired = fired.to(torch.int64)
    live = fired[fired > 0].double()
    log_freq = torch.log10(live / rows)
    width = DENSITY_EDGES[1] - DENSITY_EDGES[0]
    bins = len(DENSITY_EDGES) - 1
    index = torch.floor((log_freq - DENSITY_EDGES[0]) / width).long().clamp(0, bins - 1)
    counts = torch.bincount(index, minlength=bins)
    return Density(edges=list(DENSITY_EDGES), counts=[int(c) for c in counts], never=int((fired == 0).sum()))


@torch.no_grad()
def fvu(target: Tensor, predicted: Tensor) -> float:
    """The fraction of variance unexplained of one batch held whole, as `Accumulator.result`
    computes it over many: squared error over the rows' variance about their mean (float64)."""
    target, predicted = target.double(), predicted.double()
    return float((target - predicted).pow(2).sum() / (target - target.mean(0)).pow(2).sum())


@torch.no_grad()
def best_cosines(dictionary: Tensor, W_dec: Tensor, chunk: int = 8192) -> Tensor:
    """[F]: each planted feature's largest cosine with any decoder row (in chunks of decoder rows)."""
    truth = dictionary.double().cpu()
    truth = truth / truth.norm(dim=1, keepdim=True).clamp_min(1e-12)
    dec_all = W_dec.detach().double().cpu()
    best = torch.full((truth.shape[0],), -1.0, dtype=torch.float64)
    for i in range(0, dec_all.shape[0], chunk):
        dec = dec_all[i:i + chunk]
        dec = dec / dec.norm(dim=1, keepdim=True).clamp_min(1e-12)
        best = torch.maximum(best, (truth @ dec.t()).max(dim=1).values)
    return best


@torch.no_grad()
def best_abs(queries: Tensor, keys: Tensor, chunk: int = 1024) -> tuple[Tensor, Tensor]:
    """([len(queries)], [len(queries)]): each query row's largest |cosine| with a key row, and
    that key row's index, `chunk` queries at a time (a [chunk, keys] matrix, never the whole
    [queries, keys] one)."""
    q = F.normalize(queries.detach().double().cpu(), dim=1)
    k = F.normalize(keys.detach().double().cpu(), dim=1)
    values, indices = zip(*((q[i:i + chunk] @ k.T).abs().max(dim=1) for i in range(0, q.shape[0], chunk)))
    return torch.cat(values), torch.cat(indices)


def best_abs_matches(queries: Tensor, keys: Tensor, chunk: int = 1024) -> Tensor:
    """[len(queries)]: the index of each query row's key row of largest |cosine|."""
    return best_abs(queries, keys, chunk)[1]


MIXED_BELOW, NONE_AT_MOST = 0.9, 0.5  # a latent's best |cosine| with a planted feature: the census's bands


def latent_census(dictionary: Tensor, W_dec: Tensor, fired: Tensor | None) -> dict[str, float]:
    """SAELens' uniqueness, and what the latents that fired (`fired`: [d_sae] firings on the
    rows) are: each latent's best |cosine| with a planted feature puts it on one feature (over
    0.9), mixed (0.5 to 0.9) or on none, as shares of the latents that fired and of their firings.
    Without firings (none counted, or none fired) only the uniqueness."""
    best, feature = best_abs(W_dec, dictionary)
    out = {"uniqueness": len(feature.unique()) / W_dec.shape[0]}
    if fired is None or not bool((fired > 0).any()):
        return out
    on = fired.cpu() > 0
    best, weight = best[on], fired.cpu()[on].double()
    bands = {"on_a_feature": best > MIXED_BELOW, "mixed": (best > NONE_AT_MOST) & (best <= MIXED_BELOW),
             "on_none": best <= NONE_AT_MOST}
    for name, band in bands.items():
        out[f"latents_{name}"] = float(band.double().mean())
        out[f"firings_{name}"] = float(weight[band].sum() / weight.sum())
    return out


def dictionary_recovery(true_features: Tensor, W_dec: Tensor, threshold: float = 0.9) -> tuple[float, float]:
    """(mean over true features of the best cosine with a decoder row, fraction above threshold):
    the trainer's recovery figure during a synthetic run."""
    best = best_cosines(true_features, W_dec)
    return float(best.mean()), float((best > threshold).double().mean())


def matching_text(rec: dict[str, Any]) -> str:
    """A recovery's MCC, its latents as feature detectors and, for a hierarchy, its parents' and
    children's recovery, in words ("" when none was measured): one text for the trainer's log and
    `evaluate`'s report."""
    parts = []
    if rec.get("mcc") is not None:
        parts.append(f"MCC {rec['mcc']:.3f}")
    if rec.get("f1") is not None:
        parts.append(f"latents as feature detectors: precision {rec['precision']:.3f}, recall {rec['recall']:.3f}, "
                     f"F1 {rec['f1']:.3f}")
    if rec.get("uniqueness") is not None:
        parts.append(f"uniqueness {rec['uniqueness']:.3f}")
    if rec.get("latents_on_a_feature") is not None:
        parts.append("latents that fired: " + ", ".join(
            f"{100 * rec['latents_' + key]:.1f}% {words} ({band}{100 * rec['firings_' + key]:.1f}% of firings)"
            for key, words, band in (("on_a_feature", "on one feature", "cos > 0.9; "),
                                     ("mixed", "mixed", "0.5-0.9; "), ("on_none", "on none", ""))))
    if rec.get("parents"):
        children = rec.get("children_frac_above_0_8")
        parts.append(f"parents {100 * rec['parents_frac_above_0_9']:.1f}% at cos > 0.9"
                     + ("" if children is None else f", children {100 * children:.1f}% at cos > 0.8"))
        if rec.get("parent_in_children") is not None:
            parts.append(f"absorption: children's latents carry their parent at cos "
                         f"{rec['parent_in_children']:.3f}")
        if rec.get("children_in_parents") is not None:
            parts.append(f"parents' latents carry their children's mean at cos {rec['children_in_parents']:.3f}")
        if rec.get("parents_in_a_childs_latent") is not None:
            absorbed, in_child = rec["absorbed_parents"], rec["parents_in_a_childs_latent"]
            parts.append(f"parents without a latent of their own: {100 * absorbed:.1f}% ({100 * in_child:.1f}% "
                         f"in a child's latent, {100 * (absorbed - in_child):.1f}% in a latent no child shares)")
    return "; ".join(parts)


MCC_MAX_ENTRIES = 64 * 2**20  # features x latents the matching takes (512 MiB of float64 costs)


def mean_correlation_coefficient(features: Tensor, W_dec: Tensor) -> float:
    """MCC (as SAELens' synthetic evals): |cosine| between every planted feature and decoder row,
    the one-to-one matching that maximises its sum (scipy's Hungarian), the mean over the pairs
    matched (min(features, latents) of them)."""
    from scipy.optimize import linear_sum_assignment

    a = F.normalize(features.double(), dim=1)
    b = F.normalize(W_dec.detach().double().cpu(), dim=1)
    similarity = (a @ b.T).abs()
    rows, cols = linear_sum_assignment(similarity.numpy(), maximize=True)
    return float(similarity[torch.as_tensor(rows), torch.as_tensor(cols)].mean())


@torch.no_grad()
def absorption(dictionary: Tensor, W_dec: Tensor, parents: int, parents_best: Tensor) -> dict[str, float]:
    """A hierarchy's absorption (features [0, parents) are parents, then each parent's children
    in order): the share of parents without a latent of their own, the mean cosine between each
    child's best-matching latent and that child's parent, between each parent's best-matching
    latent and the mean direction of its children, and the share of parents without a latent of
    their own whose best latent is also a child's (absorbed rather than hedged)."""
    children = dictionary.shape[0] - parents
    unrecovered = parents_best.cpu() <= 0.9  # no latent of their own
    out = {"absorbed_parents": float(unrecovered.double().mean())}
    if children <= 0:
        return out
    per_parent = children // parents
    decoder = F.normalize(W_dec.detach().double().cpu(), dim=1)
    truth = F.normalize(dictionary.double().cpu(), dim=1)
    latent = best_abs_matches(truth[parents:], decoder)  # each child's latent
    parent = truth[torch.arange(children) // per_parent]  # each child's parent
    out["parent_in_children"] = float((decoder[latent] * parent).sum(dim=1).abs().mean())
    families = truth[parents:parents + per_parent * parents].view(parents, per_parent, -1)
    family_mean = F.normalize(families.mean(1), dim=1)
    parent_latent = best_abs_matches(truth[:parents], decoder)
    out["children_in_parents"] = float((decoder[parent_latent] * family_mean).sum(dim=1).abs().mean())
    childs_latent = (latent[:per_parent * parents].view(parents, per_parent) == parent_latent[:, None]).any(dim=1)
    out["parents_in_a_childs_latent"] = float((childs_latent & unrecovered).double().mean())
    return out


def recovery(dictionary: Tensor, frequencies: Tensor, W_dec: Tensor, parents: int | None = None,
             detection: dict[str, float] | None = None, fired: Tensor | None = None) -> Recovery:
    if dictionary.shape[1] != W_dec.shape[1]:
        raise UserError(f"the planted dictionary has width {dictionary.shape[1]} but the SAE's d_in is "
                        f"{W_dec.shape[1]}")
    best = best_cosines(dictionary, W_dec)
    count = best.shape[0]
    # The rarest tenth, at least one feature; among equal frequencies the later features count as rarer.
    rare_n = max(1, count // RARE_PART)
    reverse = torch.arange(count - 1, -1, -1)
    order = reverse[torch.argsort(frequencies.double()[reverse], stable=True)]
    rare = best[order[:rare_n]]

    def stats(b: Tensor) -> tuple[float, float, float]:
        return float(b.mean()), float((b > 0.9).double().mean()), float((b > 0.8).double().mean())

    m, f9, f8 = stats(best)
    rm, rf9, rf8 = stats(rare)
    mcc = (mean_correlation_coefficient(dictionary.cpu(), W_dec)
           if dictionary.shape[0] * W_dec.shape[0] <= MCC_MAX_ENTRIES else None)
    hierarchy = {}
    if parents:
        hierarchy = {"parents": parents, "parents_frac_above_0_9": stats(best[:parents])[1],
                     "children_frac_above_0_8": stats(best[parents:])[2] if count > parents else None,
                     **absorption(dictionary, W_dec, parents, best[:parents])}
    return Recovery(features=count, mean_best_cos=m, frac_above_0_9=f9, frac_above_0_8=f8,
                    rare_features=rare_n, rare_mean_best_cos=rm, rare_frac_above_0_9=rf9, rare_frac_above_0_8=rf8,
                    mcc=mcc, **hierarchy, **(detection or {}), **latent_census(dictionary, W_dec, fired))


def _device_of(sae: Evaluable) -> torch.device:
    return sae.W_dec.device


def _d_in_of(sae: Evaluable) -> int:
    return int(getattr(sae, "d_in", sae.W_dec.shape[1]))


@torch.no_grad()
def evaluate_sae(sae: Evaluable, batches: Iterable[Tensor], planted: Planted | None = None) -> Evaluation:
    """Evaluate `sae` on every row of `batches` (each [n, d_in]), one batch in memory at a time. A
    transcoder's rows are [x | y] ([n, 2 d_in]): it is judged on predicting y from x (every metric,
    FVU included, is then of y).

    Raises DataError for zero rows, rows of another width than the SAE's, or non-finite rows.
    """
    d_in = _d_in_of(sae)
    width = int(getattr(sae, "row_width", d_in))
    device = _device_of(sae)
    dtype = sae.W_dec.dtype if sae.W_dec.dtype.is_floating_point else torch.float32
    if planted is not None and planted.dictionary.shape[1] != d_in:
        raise UserError(f"the planted dictionary has width {planted.dictionary.shape[1]} but the SAE's "
                        f"d_in is {d_in}")
    known = planted is not None and planted.truth is not None and planted.first_row is not None
    acc = Accumulator(int(sae.d_sae), FiringMatch(sae.W_dec, planted.dictionary) if known else None)
    for x in batches:
        if x.dim() != 2 or x.shape[1] != width:
            what = (f"a transcoder with d_in={d_in}: its rows must be pairs [input | target], [rows, {width}]"
                    if width != d_in else f"an SAE with d_in={d_in}: the activations must be [rows, {d_in}]")
            raise DataError(f"rows of shape {list(x.shape)} cannot be evaluated by {what}")
        if x.shape[0] == 0:
            continue
        if not bool(torch.isfinite(x).all()):
            raise DataError("the rows hold NaN or inf values")
        truth = planted.truth(planted.first_row + acc.rows, x.shape[0]) if known else None
        x = x.to(device=device, dtype=dtype)
        if width != d_in:
            x, target = sae.split(x)
            acts = sae.encode(x)
            acc.add(target, sae.predict(x, acts), acts, truth)
        else:
            acts = sae.encode(x)
            acc.add(x, sae.decode(acts), acts, truth)
    return acc.result(sae.W_dec, planted)
