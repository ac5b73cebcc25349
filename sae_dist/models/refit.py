"""A least-squares refit of a TopK-family decoder to the codes of the run's last steps.

SGD leaves each decoder row where its last noisy steps put it. Given which latents fired and how
strongly (the codes Z of the training rows) and what they had to add to b_dec (the goal Y), the
decoder that reconstructs those rows best is one linear solve: W = (Z^T Z + R)^-1 (Z^T Y + R W_old),
the ridge R (diagonal) pulling latents that barely fired towards their trained rows, as if each
trained row were a few more firings of its latent (the method of optimal directions of dictionary
learning). The trainer gathers Z^T Z and Z^T Y from the forward passes of
its last steps, so the refit costs no pass over the data of its own; the encoder is left as it is,
so every row's codes are unchanged and only what they write moves.

The sums are kept in fixed point (int64): integer sums do not depend on their order, so a run
stopped and resumed inside the window refits to the decoder of a run that never stopped (exactly
on the same ranks; on others, as its weights, to rounding: Z^T Y is rounded to the grid a
micro-batch at a time).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from sae_dist.models.sparse_ops import Pattern

FRACTION_BITS = 24  # a product of two values at the window's largest magnitudes is 2**24 units
RIDGE = 1e-4  # of the mean squared code of a latent, over all latents: the least any row is held
PSEUDO_FIRINGS = 32  # a trained row counts as this many firings of its latent (docs/quality.md)


def _scale_of(largest: float) -> float:
    """A power of two at least `largest` (1 for nothing seen): the fixed point's unit is set by it."""
    return 2.0 ** math.ceil(math.log2(largest)) if largest > 0 and math.isfinite(largest) else 1.0


class DecoderRefit:
    """Z^T Z and Z^T Y of the rows seen since the window began, on this rank."""

    def __init__(self, d_sae: int, d_out: int, device: torch.device | str):
        self.gram = torch.zeros(d_sae, d_sae, dtype=torch.int64, device=device)
        self.cross = torch.zeros(d_sae, d_out, dtype=torch.int64, device=device)
        self.firings: Tensor | None = torch.zeros(d_sae, dtype=torch.int64, device=device)
        self.scales: tuple[float, float] | None = None  # (codes, goal): set by the window's first batch

    def set_scales(self, acts: Tensor, goal: Tensor, group=None, ranks: int = 1) -> None:
        """The fixed point's units from the first batch's largest |code| and |goal|, the largest
        over the SAE's ranks so that every rank counts in the same units."""
        largest = torch.stack([acts.detach().abs().max() if acts.numel() else acts.new_zeros(()),
                               goal.detach().abs().max() if goal.numel() else goal.new_zeros(())]).double()
        if ranks > 1:
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        self.scales = (_scale_of(float(largest[0])), _scale_of(float(largest[1])))

    @torch.no_grad()
    def add(self, pattern: Pattern, acts: Tensor, goal: Tensor) -> None:
        """One micro-batch: `acts` in `pattern`'s order (sparse_ops.Encoded), `goal` [rows, d_out]
        what the latents had to add to b_dec (and a skip path) to reach each row's target."""
        assert self.scales is not None, "set_scales before the window's first add"
        unit_z, unit_y = self.scales
        z = acts.detach().double() / unit_z
        y = goal.detach().double() / unit_y
        cols, vals = _rows_block(pattern, z)
        if cols.shape[1] == 0:
            return
        # Each unordered pair of a row's latents once (slot a <= b): Z^T Z is this sum plus its
        # transpose less its diagonal (`solve`), at about half the additions.
        a, b = torch.triu_indices(cols.shape[1], cols.shape[1], device=cols.device)
        d_sae = self.gram.shape[0]
        pairs = (cols[:, a] * d_sae + cols[:, b]).reshape(-1)
        self.gram.view(-1).index_add_(0, pairs, _fixed((vals[:, a] * vals[:, b]).reshape(-1)))
        if self.firings is not None:
            self.firings += torch.bincount(cols[vals != 0], minlength=d_sae)
        # Z^T Y in float64 first (no [entries, d_out] block), then in fixed point: the micro-batch's
        # own sum is rounded to the grid, far finer than a row's share of it.
        self.cross += _fixed(pattern.t_matmul(z, y))

    def reduce_to(self, leader: int, group=None, ranks: int = 1, is_leader: bool = True) -> None:
        """The SAE's ranks' sums onto its leader, the others left at zero: where a checkpoint
        keeps them and the solve reads them (the total stays exact, whatever rank holds it)."""
        if ranks > 1:
            for t in (self.gram, self.cross, self.firings):
                if t is None:  # a checkpoint from before the firing counts resumed
                    continue
                dist.reduce(t, dst=leader, group=group)
                if not is_leader:
                    t.zero_()

    def normal_equations(self) -> tuple[Tensor, Tensor]:
        """(Z^T Z, Z^T Y) in float64 from the (reduced) sums: the half kept made whole."""
        assert self.scales is not None
        unit_z, unit_y = self.scales
        diagonal = self.gram.diagonal().double()
        gram = self.gram.double()
        gram = gram + gram.T  # (one float64 copy at a time beside the sums: the estimate's bound)
        gram.diagonal().sub_(diagonal)
        gram *= unit_z * unit_z / 2.0 ** FRACTION_BITS
        return gram, self.cross.double() * (unit_z * unit_y / 2.0 ** FRACTION_BITS)

    def solve(self, w_old: Tensor) -> Tensor:
        """The refit decoder [d_sae, d_out] from the (reduced) sums."""
        return refit_decoder(*self.normal_equations(), w_old, firings=self.firings)

    def state_dict(self) -> dict:
        return {"gram": self.gram.cpu(), "cross": self.cross.cpu(), "scales": self.scales,
                "firings": self.firings.cpu() if self.firings is not None else None}

    def load_state_dict(self, state: dict, keep: bool = True) -> None:
        """Sums saved at a checkpoint (the leader's total); `keep` False: this rank starts at zero."""
        self.scales = tuple(state["scales"]) if state["scales"] is not None else None
        for name in ("gram", "cross"):
            own = getattr(self, name)
            own.copy_(state[name]) if keep else own.zero_()
        if state.get("firings") is None:  # sums saved before the counts were kept: the ridge alone
            self.firings = None
        else:
            self.firings.copy_(state["firings"]) if keep else self.firings.zero_()


def _rows_block(pattern: Pattern, values: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's latents and values as [rows, most] blocks: a view where every row has the same
    count (TopK), else padded with latent 0 at value 0 (BatchTopK), which adds nothing."""
    counts = pattern.crow.diff()
    most = int(counts.max()) if counts.numel() else 0
    if pattern.n_rows and bool((counts == most).all()):
        return pattern.col.view(pattern.n_rows, most), values.view(pattern.n_rows, most)
    rows = pattern.row_of_entry()
    slot = torch.arange(pattern.col.numel(), device=values.device) - pattern.crow[:-1][rows]
    cols = torch.zeros(pattern.n_rows, most, dtype=torch.int64, device=values.device)
    vals = torch.zeros(pattern.n_rows, most, dtype=values.dtype, device=values.device)
    cols[rows, slot], vals[rows, slot] = pattern.col, values
    return cols, vals


def _fixed(values: Tensor) -> Tensor:
    return torch.round(values * 2.0 ** FRACTION_BITS).to(torch.int64)


def refit_decoder(gram: Tensor, cross: Tensor, w_old: Tensor, ridge: float = RIDGE,
                  firings: Tensor | None = None, pseudo_firings: float = PSEUDO_FIRINGS) -> Tensor:
    """argmin_W ||Y - Z W||^2 + sum_i r_i ||W_i - w_old_i||^2 from gram = Z^T Z and cross = Z^T Y
    (float64). Each latent's r_i is `pseudo_firings` times its mean squared code (`firings`: how
    often each latent fired in the window): its trained row counts as that many more firings, so a
    latent that fired a few times stays near it, where a plain least-squares row would fit those
    few rows' noise (a short run's window: held-out FVU 0.33 to 0.54 with a global ridge alone).
    Never less than `ridge` times the mean of gram's diagonal, so a latent that never fired keeps
    its old row. In w_old's dtype and device. `gram` is used up: its diagonal is raised in place
    (one d_sae^2 copy less at the solve)."""
    diagonal = gram.diagonal()
    floor = ridge * float(diagonal.mean()) if gram.numel() else 0.0
    if floor <= 0:  # nothing fired in the window
        return w_old.detach().clone()
    r = torch.full_like(diagonal, floor)
    if firings is not None and pseudo_firings > 0:
        r = torch.maximum(r, pseudo_firings * diagonal / firings.to(diagonal).clamp_min(1))
    rhs = cross + r[:, None] * w_old.detach().to(gram)
    diagonal.add_(r)
    return torch.linalg.solve(gram, rhs).to(w_old)
