"""Synthetic activations from a planted dictionary: needs nothing, and the truth is known.

Each sample is a sparse non-negative combination of F unit-norm "true features" in d_in
dimensions (feature i fires with frequency ~ (i+1)^-alpha), plus Gaussian noise. The data is a
pure function of (seed, global sample index): rank r at step s reads samples
[s*G + r*b, s*G + (r+1)*b) of one infinite stream (G = global batch, b = per-device batch). So
ranks draw disjoint data without coordinating, and the global batch at a step is the same
whatever the number of devices (which is what the gradient-synchronisation test relies on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # samples generated per seeded chunk: the unit of determinism


class SyntheticSource:
    def __init__(self, d_in: int, n_features: int, active: float, power_law: float, noise: float,
                 seed: int, rank: int, world_size: int, batch_size: int):
        self.d_in, self.n_features, self.noise, self.seed = d_in, n_features, noise, seed
        self.rank, self.world_size, self.batch_size = rank, world_size, batch_size
        gen = torch.Generator().manual_seed(seed)
        dictionary = torch.randn(n_features, d_in, generator=gen)
        self.dictionary = dictionary / dictionary.norm(dim=1, keepdim=True)
        freq = (torch.arange(n_features, dtype=torch.float64) + 1).pow(-power_law)
        self.probs = (freq / freq.sum()).float()
        # Active features per sample: a Poisson-like count around `active`, at least one.
        self.active = active
        self.max_active = max(1, int(round(active * 3)))
        self.step = 0  # data position: batches this rank has drawn

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    def next_batch(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        global_batch = self.batch_size * self.world_size
        start = self.step * global_batch + self.rank * self.batch_size
        self.step += 1
        x = self.samples(start, self.batch_size)
        return x.to(device=device, dtype=dtype, non_blocking=True)

    def samples(self, start: int, count: int) -> Tensor:
        """Samples [start, start + count) of the stream."""
        first, last = start // CHUNK, (start + count - 1) // CHUNK
        chunks = torch.cat([self._chunk(c) for c in range(first, last + 1)])
        offset = start - first * CHUNK
        return chunks[offset:offset + count]

    def _chunk(self, index: int) -> Tensor:
        gen = torch.Generator().manual_seed((self.seed * 2**32 + index) % 2**63)
        m = self.max_active
        feats = torch.multinomial(self.probs, CHUNK * m, replacement=True, generator=gen).view(CHUNK, m)
        # Bernoulli mask keeps `active` features per sample on average; slot 0 always on.
        keep = torch.rand(CHUNK, m, generator=gen) < (self.active / m)
        keep[:, 0] = True
        mags = (torch.rand(CHUNK, m, generator=gen) * 1.5 + 0.5) * keep
        x = F.embedding_bag(feats, self.dictionary, per_sample_weights=mags, mode="sum")
        return x + self.noise * torch.randn(CHUNK, self.d_in, generator=gen)


@torch.no_grad()
def dictionary_recovery(true_features: Tensor, W_dec: Tensor, threshold: float = 0.9) -> tuple[float, float]:
    """(mean over true features of the best cosine with a decoder row, fraction above threshold)."""
    truth = true_features / true_features.norm(dim=1, keepdim=True)
    dec = W_dec.float().cpu()
    dec = dec / dec.norm(dim=1, keepdim=True).clamp_min(1e-12)
    best = torch.zeros(truth.shape[0])
    for i in range(0, dec.shape[0], 8192):  # bounded memory for large d_sae
        best = torch.maximum(best, (truth @ dec[i:i + 8192].t()).max(dim=1).values)
    return float(best.mean()), float((best > threshold).float().mean())
