"""The sparse autoencoder: TopK, BatchTopK, Matryoshka, standard (ReLU + L1) and JumpReLU in one
module, each also as a transcoder.

Matryoshka (Bussmann, Nabeshima, Karvonen and Nanda, ICML 2025) is a TopK-family SAE whose loss
adds, for each nested prefix of the dictionary (`matryoshka_widths`, the last the whole of it), the
squared error of that prefix's latents reconstructing the input alone, with equal weights, as
SAELens' MatryoshkaBatchTopK does: a prefix must stand on its own, so general features go early
and are not absorbed into their children's latents. Its latents are chosen per sample as TopK's
(`matryoshka_selection="sample"`, the default) or over the batch as BatchTopK's, as the paper does
(`"batch"`): in one pass over heavily superposed planted features, batch selection gives the
samples with the largest norms most of the batch's budget and trains far worse (docs/quality.md).

A transcoder (Dunefsky et al. 2024; `transcoder=True`) predicts a target from an input instead of
reconstructing it: its rows are the pair side by side, [x | y] (each d_in wide), the encoder reads x
less a fixed offset `b_in` (x's mean, set with b_dec from the first batch, as an SAE's input is
centred by b_dec; folded into b_enc at export, where SAELens' transcoders read x as it is), and
the loss is y's squared error. A skip transcoder (Paulo, Shabalin and Belrose 2025; `skip=True`)
adds a linear path, y_hat = decode(encode(x)) + x W_skip^T, W_skip starting at zero as SAELens'.

Weights follow SAELens' layout (W_enc [d_in, d_sae], W_dec [d_sae, d_in]) so export is a copy.
Decoder rows are kept at unit norm (`normalize_decoder`) and the part of their gradient that
would change the norm is removed (`remove_parallel_gradient`); the trainer calls both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sae_dist.config import TOPK_FAMILY, batch_level
from sae_dist.data.sources.paired import PairedRows
from sae_dist.models.sparse_ops import Encoded, sparse_decode, sparse_encode

INIT_SALT = 0x5AE_D157  # added to the seed of the weights' initialisation (see __init__)


@dataclass
class SaeOutput:
    x_hat: Tensor
    loss: Tensor  # what the optimizer minimises
    mse: Tensor  # mean over samples of the summed squared error
    sparsity_loss: Tensor  # L1 (standard) or L0 (jumprelu) penalty before its coefficient; 0 otherwise
    auxk_loss: Tensor  # normalised AuxK loss before its coefficient; 0 when no latent is dead
    prefix_mse: Tensor  # matryoshka: the inner prefixes' squared errors summed (in `loss`); 0 otherwise
    l0: Tensor  # mean active latents per sample
    fired: Tensor  # [d_sae] how many samples each latent fired on in this batch (float)
    # TopK family: the selected latents and what they had to add to b_dec (and a skip path) to
    # reach the target, detached; the trainer's decoder refit reads them (sae_dist.models.refit).
    codes: Encoded | None = None
    goal: Tensor | None = None


class _JumpReLU(torch.autograd.Function):
    """x * (x > t), with a straight-through gradient for the threshold (Rajamanoharan et al. 2024)."""

    @staticmethod
    def forward(ctx, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return x * (x > threshold)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        near = ((x - threshold).abs() < eps / 2).to(grad.dtype)  # rectangle kernel
        grad_threshold = (-(threshold / eps) * near * grad).sum(0)
        return (x > threshold).to(grad.dtype) * grad, grad_threshold, None


class _Step(torch.autograd.Function):
    """Heaviside step H(x - t) for the L0 penalty: straight-through gradient to the threshold only."""

    @staticmethod
    def forward(ctx, x: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(x, threshold)
        ctx.bandwidth = bandwidth
        return (x > threshold).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, threshold = ctx.saved_tensors
        eps = ctx.bandwidth
        near = ((x - threshold).abs() < eps / 2).to(grad.dtype)
        return torch.zeros_like(x), (-(1.0 / eps) * near * grad).sum(0), None


def _unbiased(enc: Encoded, bias: Tensor) -> Encoded:
    """The chosen latents' values without the selection bias that chose them (at least 0: one the
    bias alone lifted fires with 0, firing nothing and learning nothing from this row)."""
    def less(acts, pattern):
        return None if acts is None else (acts - bias[pattern.col]).clamp_min(0)

    return Encoded(less(enc.acts, enc.pattern), enc.pattern, less(enc.aux_acts, enc.aux_pattern), enc.aux_pattern)


class SparseAutoencoder(PairedRows, nn.Module):
    def __init__(
        self,
        d_in: int,
        d_sae: int,
        architecture: str = "topk",
        k: int = 32,
        *,
        l1_coefficient: float = 0.0,
        l0_coefficient: float = 0.0,
        auxk_coefficient: float = 0.0,
        auxk_k: int | None = None,
        jumprelu_init_threshold: float = 0.001,
        jumprelu_bandwidth: float = 0.001,
        matryoshka_widths: tuple[int, ...] | None = None,
        matryoshka_selection: str = "sample",
        matryoshka_inner_weight: float = 1.0,
        matryoshka_inner_offset: bool = False,
        transcoder: bool = False,
        skip: bool = False,
        seed: int | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.d_in, self.d_sae, self.architecture, self.k = d_in, d_sae, architecture, k
        self.l1_coefficient, self.l0_coefficient = l1_coefficient, l0_coefficient
        self.auxk_coefficient = auxk_coefficient
        self.auxk_k = auxk_k if auxk_k is not None else max(1, d_in // 2)
        self.bandwidth = jumprelu_bandwidth
        self.batch_level = batch_level(architecture, matryoshka_selection)
        if skip and not transcoder:
            raise ValueError("a skip path needs a transcoder")
        self.transcoder, self.skip = transcoder, skip
        if architecture == "matryoshka":
            widths = tuple(matryoshka_widths or (d_sae,))
            if widths[-1] != d_sae or any(b <= a for a, b in zip(widths, widths[1:])) or widths[0] < 1:
                raise ValueError(f"matryoshka widths {widths} must increase to d_sae = {d_sae}")
            self.matryoshka_widths = widths
            self.matryoshka_inner_weight = matryoshka_inner_weight

        # Salted: the synthetic source draws its planted dictionary as randn(features, d_in) from
        # Generator(seed), so an unsalted init of the same seed would start at the truth.
        gen = torch.Generator().manual_seed((seed + INIT_SALT) % 2**63) if seed is not None else None
        w_dec = torch.randn(d_sae, d_in, generator=gen)
        w_dec /= w_dec.norm(dim=1, keepdim=True)
        # Encoder starts as the decoder's transpose (Gao et al. 2024): each latent reads the
        # direction it writes, so the first steps already reconstruct something.
        self.W_dec = nn.Parameter(w_dec.to(device))
        self.W_enc = nn.Parameter(w_dec.t().contiguous().to(device))
        self.b_enc = nn.Parameter(torch.zeros(d_sae, device=device))
        self.b_dec = nn.Parameter(torch.zeros(d_in, device=device))
        if architecture == "matryoshka" and matryoshka_inner_offset and len(self.matryoshka_widths) > 1:
            # Added to the inner prefixes' decoder rows in their own reconstructions only
            # (_prefix_mse); trained, checkpointed, never exported.
            rows, width = self.matryoshka_widths[-2], self.W_dec.shape[1]
            self.W_inner_offset = nn.Parameter(torch.zeros(rows, width, device=device))
        if transcoder:
            self.register_buffer("b_in", torch.zeros(d_in, device=device))  # the input's centre, not trained
        if skip:
            self.W_skip = nn.Parameter(torch.zeros(d_in, d_in, device=device))  # [d_out, d_in], SAELens' layout
        if architecture == "jumprelu":
            self.log_threshold = nn.Parameter(
                torch.full((d_sae,), math.log(jumprelu_init_threshold), device=device))
        if self.batch_level:
            # Inference threshold: running mean of the smallest kept activation (SAELens' rule);
            # exported as a JumpReLU threshold, since batch-level top-k needs a batch.
            self.register_buffer("topk_threshold", torch.zeros((), device=device))

    # ---- rows: an SAE's are its inputs, a transcoder's [x | y] (row_width, split: PairedRows) ----
    @property
    def input_offset(self) -> Tensor:
        return self.b_in if self.transcoder else self.b_dec

    @torch.no_grad()
    def set_offsets(self, mean_row: Tensor) -> None:
        """b_dec (and a transcoder's b_in) at the data's mean row, before training."""
        x, y = self.split(mean_row)
        self.b_dec.copy_(y)
        if self.transcoder:
            self.b_in.copy_(x)

    # ---- encode / decode ----
    def pre_acts(self, x: Tensor) -> Tensor:
        return (x - self.input_offset) @ self.W_enc + self.b_enc

    @property
    def threshold(self) -> Tensor:
        if self.architecture == "jumprelu":
            return self.log_threshold.exp()
        if self.batch_level:
            return self.topk_threshold.expand(self.d_sae)
        raise AttributeError(f"{self.architecture} has no threshold")

    def encode(self, x: Tensor) -> Tensor:
        """Dense latent activations for inference (batch-level top-k uses its learned threshold)."""
        pre = self.pre_acts(x)
        if self.architecture in TOPK_FAMILY and not self.batch_level:
            vals, idx = pre.topk(self.k, dim=-1, sorted=False)
            return torch.zeros_like(pre).scatter_(-1, idx, vals.relu())
        if self.architecture == "standard":
            return pre.relu()
        return pre.relu() * (pre > self.threshold)

    def decode(self, acts: Tensor) -> Tensor:
        return acts @ self.W_dec + self.b_dec

    def predict(self, x: Tensor, acts: Tensor) -> Tensor:
        """The output for inputs x from their activations: decode, plus the skip path where there is one."""
        return self.decode(acts) + self._skip_of(x)

    def _skip_of(self, x: Tensor) -> Tensor | float:
        return x @ self.W_skip.t() if self.skip else 0.0

    # ---- training forward ----
    def forward(self, rows: Tensor, dead_mask: Tensor | None = None,
                selection_bias: Tensor | None = None) -> SaeOutput:
        """The training forward. `dead_mask`: the latents AuxK revives; `selection_bias` (TopK
        family): added to each latent's pre-activation only to choose the k that fire, the chosen
        values kept unbiased (sae_dist.train.rare_bias)."""
        x, target = self.split(rows)
        if self.architecture in TOPK_FAMILY:
            return self._forward_sparse(x, target, dead_mask, selection_bias)
        pre = self.pre_acts(x)
        if self.architecture == "standard":
            acts = pre.relu()
            sparsity = acts.sum(-1).mean()  # decoder rows have unit norm, so plain L1
        else:  # jumprelu
            threshold = self.log_threshold.exp()
            acts = _JumpReLU.apply(pre.relu(), threshold, self.bandwidth)
            sparsity = _Step.apply(pre.relu(), threshold, self.bandwidth).sum(-1).mean()
        x_hat = acts @ self.W_dec + self.b_dec + self._skip_of(x)
        active = acts > 0
        mse = (x_hat - target).pow(2).sum(-1).mean()
        coef = self.l1_coefficient if self.architecture == "standard" else self.l0_coefficient
        return SaeOutput(x_hat=x_hat, loss=mse + coef * sparsity, mse=mse, sparsity_loss=sparsity,
                         auxk_loss=pre.new_zeros(()), prefix_mse=pre.new_zeros(()),
                         l0=active.sum(-1).to(pre.dtype).mean(),
                         fired=active.sum(0).to(pre.dtype))

    def _forward_sparse(self, x: Tensor, target: Tensor, dead_mask: Tensor | None,
                        selection_bias: Tensor | None) -> SaeOutput:
        """TopK / BatchTopK through sparse_ops: one dense product, everything else on the k latents."""
        num_dead = int(dead_mask.sum()) if dead_mask is not None and self.auxk_coefficient > 0 else 0
        b_enc = self.b_enc if selection_bias is None else self.b_enc + selection_bias.to(self.b_enc.dtype)
        enc = sparse_encode(x, self.input_offset, self.W_enc, b_enc, self.k,
                            batch_level=self.batch_level,
                            dead_mask=dead_mask if num_dead else None, k_aux=min(self.auxk_k, num_dead))
        if selection_bias is not None:
            enc = _unbiased(enc, selection_bias.to(enc.acts.dtype))
        skip = self._skip_of(x)  # once a step: the prefixes' reconstructions share it
        x_hat = sparse_decode(enc.acts, self.W_dec, enc.pattern) + self.b_dec + skip
        active = (enc.acts > 0).to(enc.acts.dtype)
        if self.batch_level and self.training:
            self._update_threshold(enc.acts.detach())
        mse = (x_hat - target).pow(2).sum(-1).mean()
        goal = target - self.b_dec - skip
        prefix_mse = self._prefix_mse(enc, goal) if self.architecture == "matryoshka" else x_hat.new_zeros(())
        auxk = x_hat.new_zeros(())
        if num_dead:
            # AuxK (Gao et al. 2024): predict the residual e = x - x_hat from the top dead latents,
            # normalised by the residual's variance, scaled down while fewer than auxk_k are dead.
            residual = (target - x_hat).detach()
            e_hat = sparse_decode(enc.aux_acts, self.W_dec, enc.aux_pattern)
            total_variance = (residual - residual.mean(0)).pow(2).sum().clamp_min(1e-12)
            auxk = min(num_dead / self.auxk_k, 1.0) * (e_hat - residual).pow(2).sum() / total_variance
        return SaeOutput(x_hat=x_hat, loss=mse + prefix_mse + self.auxk_coefficient * auxk, mse=mse,
                         sparsity_loss=x_hat.new_zeros(()), auxk_loss=auxk, prefix_mse=prefix_mse,
                         l0=active.sum() / x.shape[0],
                         fired=enc.pattern.column_sums(active), codes=enc, goal=goal.detach())

    def _prefix_mse(self, enc, goal: Tensor) -> Tensor:
        """Matryoshka: the summed squared errors of each inner prefix's reconstruction alone (the
        whole dictionary's is the plain `mse`), against `goal`, what the latents must add to b_dec
        (and a skip path) to reach the target, times `matryoshka_inner_weight`. Each is the same
        sparse decode restricted to the prefix's own entries: the rows of its latents gathered per
        sample a level, no dense pass.

        With an inner offset, the prefixes decode through W_dec plus the offset on their rows. The
        offset takes up what the prefixes alone want of their rows and the whole dictionary does
        not (a parent's latent hedged toward its children's mean, docs/quality.md), so that
        W_dec, the exported decoder, is bent less by it. Only the inner rows are added to it, not
        a copy of the whole decoder each step."""
        total = goal.new_zeros(())
        if len(self.matryoshka_widths) < 2:
            return total
        inner_rows = self.matryoshka_widths[-2]  # every inner prefix lies within these latents
        decoder = self.W_dec[:inner_rows]
        if self.inner_offset is not None:
            decoder = decoder + self.inner_offset
        for width in self.matryoshka_widths[:-1]:
            keep = enc.pattern.col < width
            inner = sparse_decode(enc.acts[keep], decoder, enc.pattern.restricted(keep, inner_rows))
            total = total + (inner - goal).pow(2).sum(-1).mean()
        return self.matryoshka_inner_weight * total

    @property
    def inner_offset(self) -> Tensor | None:
        """Matryoshka's inner offset (`matryoshka_inner_offset`), or None."""
        return getattr(self, "W_inner_offset", None)

    def drop_inner_offset(self) -> None:
        """Train on without the inner offset: a run resumed from a checkpoint written before it
        existed goes on as it began."""
        if self.inner_offset is not None:
            del self.W_inner_offset

    @torch.no_grad()
    def _update_threshold(self, kept: Tensor) -> None:
        """BatchTopK's inference threshold: running mean of the smallest kept positive activation
        (SAELens' rule); exported as a JumpReLU threshold, since batch-level top-k needs a batch."""
        kept = kept[kept > 0]
        if kept.numel():
            self.topk_threshold.lerp_(kept.min().to(self.topk_threshold.dtype), 0.01)

    # ---- decoder constraint ----
    @torch.no_grad()
    def normalize_decoder(self) -> None:
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_gradient(self) -> None:
        """Drop the gradient component along each decoder row (it would only change the norm)."""
        g = self.W_dec.grad
        if g is None:
            return
        parallel = (g * self.W_dec).sum(dim=1, keepdim=True)
        g -= parallel * self.W_dec

    def inference_state_dict(self) -> dict[str, Tensor]:
        """Weights in SAELens' names; batch-level top-k and JumpReLU carry a per-latent `threshold`,
        a skip transcoder its W_skip. A transcoder's b_in is folded into b_enc (SAELens' transcoders
        read x as it is): (x - b_in) W_enc + b_enc = x W_enc + (b_enc - b_in W_enc)."""
        out = {name: getattr(self, name).detach() for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
        if self.transcoder:
            out["b_enc"] = out["b_enc"] - self.b_in @ out["W_enc"]
        if self.skip:
            out["W_skip"] = self.W_skip.detach()
        if self.architecture == "jumprelu" or self.batch_level:
            out["threshold"] = self.threshold.detach().clone()
        return out
