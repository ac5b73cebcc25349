"""The `model` activation source: the trainer runs a transformer over text and trains on its
activations as they come, without writing shards.

Each DDP rank reads its own part of the contexts (every world_size-th one) with its own copy of the
model on its own device. Contexts are taken in a seeded order per epoch, a "fill" of them at a
time; a fill's rows are shuffled (seeded by epoch and fill) and served in batches. The stream's
position is three integers, so a resumed run recomputes the fill it was in and goes on exactly.
A run that continues on a different number of ranks cannot map those positions onto the new
parts: each rank then starts the epoch after the furthest one reached (`start_next_epoch`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sae_dist.errors import UserError
from sae_dist.harvest.contexts import text_files
from sae_dist.harvest.run import HarvestSpec, SiteReader, load_tokenizer, plan
from sae_dist.harvest.sites import site_module_path

FILL_BATCHES = 8  # a fill holds about this many batches: the span rows are shuffled over


def check_model_source(model: str, layer: int, site: str, text: str) -> int:
    """Before any rank starts: the model is on disk, has this layer and site, the text exists.
    Returns d_in, the width of the model's residual stream (what every site of it writes)."""
    _, config = load_tokenizer(model)
    site_module_path(config, site, layer)
    text_files([text])
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise UserError(f"--model-path {model}: its config names no hidden size")


class ModelSource:
    def __init__(self, model: str, layer: int, site: str, text: str, context_length: int, batch_size: int,
                 seed: int, rank: int, world_size: int, device: torch.device):
        self.d_in = check_model_source(model, layer, site, text)
        spec = HarvestSpec(model=model, layer=layer, site=site, texts=[text], out="", context_length=context_length)
        self.reader = SiteReader(spec, device)
        contexts = plan(spec, self.reader.tokenizer, self.reader.config).contexts[rank::world_size]
        if not contexts:
            raise UserError(f"text {text}: too little text for {world_size} ranks (one context each at least)")
        self.contexts = contexts
        self.batch_size, self.seed, self.rank = batch_size, seed, rank
        tokens_per_context = max(1, sum(sum(c.harvest) for c in contexts) // len(contexts))
        self.per_fill = max(1, min(len(contexts), FILL_BATCHES * batch_size // tokens_per_context))
        self.epoch = self.fill = self.offset = 0
        self._rows: Tensor | None = None

    def _generator(self, *parts: int) -> torch.Generator:
        return torch.Generator().manual_seed(hash((self.seed, self.rank, *parts)) & (2**62 - 1))

    def _load_fill(self) -> Tensor:
        order = torch.randperm(len(self.contexts), generator=self._generator(self.epoch))
        chosen = order[self.fill * self.per_fill:(self.fill + 1) * self.per_fill].tolist()
        rows = self.reader.rows([self.contexts[i] for i in chosen], batch_size=32)
        rows = rows.clone()  # an ordinary tensor: inference-mode tensors cannot enter autograd
        return rows[torch.randperm(len(rows), generator=self._generator(self.epoch, self.fill)).to(rows.device)]

    def _advance(self) -> None:
        self.fill, self.offset, self._rows = self.fill + 1, 0, None
        if self.fill * self.per_fill >= len(self.contexts):
            self.epoch, self.fill = self.epoch + 1, 0

    global_stream = False  # each rank reads its own contexts: its position is its own

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Rank's share of each micro-batch of the next step, from this rank's own contexts."""
        return [self.next_batch(device, dtype, plan.shares[rank]) for _ in range(plan.micro_steps)]

    def next_batch(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
                   count: int | None = None) -> Tensor:
        pieces, needed = [], count or self.batch_size
        while needed:
            if self._rows is None:
                self._rows = self._load_fill()
            take = self._rows[self.offset:self.offset + needed]
            pieces.append(take)
            needed -= len(take)
            self.offset += len(take)
            if self.offset >= len(self._rows):
                self._advance()
        return torch.cat(pieces).to(device=device, dtype=dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "fill": self.fill, "offset": self.offset}

    def start_next_epoch(self, states: list[dict[str, Any]]) -> None:
        """Continue after a checkpoint written by a different number of ranks: no context of the
        epochs begun is read again twice within one epoch; the rest of those epochs is skipped."""
        self.epoch, self.fill, self.offset = max(int(s["epoch"]) for s in states) + 1, 0, 0
        self._rows = None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.fill, self.offset = int(state["epoch"]), int(state["fill"]), int(state["offset"])
        self._rows = None
