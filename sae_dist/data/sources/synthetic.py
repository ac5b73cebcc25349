"""Synthetic activations from a planted dictionary: needs nothing, and the truth is known.

Each sample is a sparse non-negative combination of F unit-norm "true features" in d_in
dimensions (feature i fires with frequency ~ (i+1)^-alpha), plus Gaussian noise.

With `children` > 0 the dictionary is a hierarchy, as real features nest ("animal", then "dog"):
its first P = F // (children + 1) features are parents, drawn as above, and each has `children`
features of its own (parent p's are P + p * children + j), each a random direction. A child
fires only with its parent: each time the parent fires, one of its children (uniformly) fires
too with probability `child_prob`. This is the data on which a TopK SAE absorbs a parent into
its children's latents. With `correlation` > 0 features fire together: the features (the parents,
in a hierarchy) pair up, 0 with 1, 2 with 3, ..., and each time one fires its partner fires too
with that probability (with a magnitude of its own). Magnitudes are uniform in [0.5, 2], or with `magnitude_sigma` > 0
log-normal, exp(N(0, sigma)), heavy-tailed as real activations are. The data is a
pure function of (seed, global sample index): a step takes the next G samples of one infinite
stream (G = the global batch), cut into micro-batches and, within each, into the ranks' shares
(see sae_dist.train.balance). So ranks draw disjoint data without coordinating, and a step's samples are
the same whatever the number of devices or their shares (which is what the gradient tests and a
run that continues on fewer devices rely on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sae_dist.data.sources.base import UnseenRows

CHUNK = 64  # samples generated per seeded chunk: the unit of determinism


class SyntheticSource:
    def __init__(self, d_in: int, n_features: int, active: float, power_law: float, noise: float,
                 seed: int, rank: int, world_size: int, batch_size: int, children: int = 0,
                 child_prob: float = 0.5, magnitude_sigma: float = 0.0, correlation: float = 0.0):
        self.noise, self.seed, self.correlation = noise, seed, correlation
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        self.children, self.child_prob, self.magnitude_sigma = children, child_prob, magnitude_sigma
        # Parents (all features when flat), then each parent's children.
        self.parents = n_features // (children + 1)
        self.d_in, self.n_features = d_in, self.parents * (children + 1)
        gen = torch.Generator().manual_seed(seed)
        dictionary = torch.randn(self.n_features, d_in, generator=gen)
        self.dictionary = dictionary / dictionary.norm(dim=1, keepdim=True)
        freq = (torch.arange(self.parents, dtype=torch.float64) + 1).pow(-power_law)
        self.probs = (freq / freq.sum()).float()  # over the parents (every feature when flat)
        # Active features per sample: a Poisson-like count around `active`, at least one.
        self.active = active
        self.max_active = max(1, int(round(active * 3)))
        self.position = 0  # samples of the stream taken by all ranks together

    @property
    def planted_features(self) -> Tensor:
        return self.dictionary

    def use_global_batch(self, global_batch: int) -> None:
        """Nothing to size: each step takes the plan's global batch of the stream."""

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if "position" in state:
            self.position = int(state["position"])
        else:  # written before shares existed: `step` equal batches of batch_size x world_size
            self.position = int(state["step"]) * self.batch_size * self.world_size

    def next_batch(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """This rank's part of the next batch_size x world_size samples (equal shares)."""
        start = self.position + self.rank * self.batch_size
        self.position += self.batch_size * self.world_size
        return self.samples(start, self.batch_size).to(device=device, dtype=dtype, non_blocking=True)

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Rank's slice of each micro-batch of the next step (a sae_dist.train.balance.BatchPlan)."""
        out = []
        for j in range(plan.micro_steps):
            start = self.position + j * plan.micro_batch + plan.offset(rank)
            out.append(self.samples(start, plan.shares[rank]).to(device=device, dtype=dtype, non_blocking=True))
        self.position += plan.global_batch
        return out

    def unseen_rows(self, rows: int, batch_rows: int, ctx, plan) -> UnseenRows | None:
        """The stream's `rows` samples after the run's last (sae_dist.data.sources.base), on rank 0."""
        if not ctx.is_main:
            return None
        start = self.position  # the stream's rows after the run's last: never trained on
        batches = (self.samples(start + i, min(batch_rows, rows - i)) for i in range(0, rows, batch_rows))
        return UnseenRows(batches, f"{rows:,} synthetic rows after the run's last sample", first_row=start)

    def samples(self, start: int, count: int) -> Tensor:
        """Samples [start, start + count) of the stream."""
        first, last = start // CHUNK, (start + count - 1) // CHUNK
        chunks = torch.cat([self._chunk(c) for c in range(first, last + 1)])
        offset = start - first * CHUNK
        return chunks[offset:offset + count]

    def codes(self, start: int, count: int) -> Tensor:
        """[count, F]: each feature's magnitude in samples [start, start + count) of the stream (0
        where absent), the ground truth an SAE's latents are judged against."""
        first, last = start // CHUNK, (start + count - 1) // CHUNK
        chunks = torch.cat([self._chunk(c, codes=True) for c in range(first, last + 1)])
        offset = start - first * CHUNK
        return chunks[offset:offset + count]

    def _chunk(self, index: int, codes: bool = False) -> Tensor:
        """The chunk's samples, or with `codes` its features' magnitudes (the same draws)."""
        gen = torch.Generator().manual_seed((self.seed * 2**32 + index) % 2**63)
        m = self.max_active
        feats = torch.multinomial(self.probs, CHUNK * m, replacement=True, generator=gen).view(CHUNK, m)
        # Bernoulli mask keeps `active` features per sample on average; slot 0 always on.
        keep = torch.rand(CHUNK, m, generator=gen) < (self.active / m)
        keep[:, 0] = True
        mags = self._magnitudes(gen, (CHUNK, m)) * keep
        slots = [(feats, mags)]
        if self.children:  # (drawn after the flat draws: flat data is the same stream as before)
            child = self.parents + feats * self.children + torch.randint(self.children, (CHUNK, m), generator=gen)
            fires = keep & (torch.rand(CHUNK, m, generator=gen) < self.child_prob)
            slots.append((child, self._magnitudes(gen, (CHUNK, m)) * fires))
        if self.correlation:  # (drawn after the others: data without it is the same stream as before)
            partner = feats ^ 1
            paired = partner < self.parents  # an odd count leaves the last feature without a partner
            brings = keep & paired & (torch.rand(CHUNK, m, generator=gen) < self.correlation)
            slots.append((torch.where(paired, partner, feats), self._magnitudes(gen, (CHUNK, m)) * brings))
        if codes:  # a feature drawn in two slots of a row adds up, as in the row itself
            out = torch.zeros(CHUNK, self.n_features)
            for index_, weight in slots:
                out.scatter_add_(1, index_, weight)
            return out
        x = sum(F.embedding_bag(i, self.dictionary, per_sample_weights=w, mode="sum") for i, w in slots)
        return x + self.noise * torch.randn(CHUNK, self.d_in, generator=gen)

    def _magnitudes(self, gen: torch.Generator, shape: tuple[int, int]) -> Tensor:
        if self.magnitude_sigma > 0:
            return torch.exp(self.magnitude_sigma * torch.randn(shape, generator=gen))
        return torch.rand(shape, generator=gen) * 1.5 + 0.5
