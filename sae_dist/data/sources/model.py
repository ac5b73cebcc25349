"""The `model` activation source: the trainer runs a transformer over text and trains on its
activations as they come, without writing shards.

One stream over all the text, the same on every rank, as for shards: contexts are taken in an
order seeded by (seed, epoch), a "fill" of them at a time; a fill's rows are shuffled (seeded by
epoch and fill) and a step takes the next global-batch rows, each rank reading its slice of each
micro-batch (sae_dist.train.balance.BatchPlan). So a step's samples do not depend on the ranks' shares
(nor on the number of ranks): rebalancing changes who computes what, never what is learnt.

The model's work is still split: rank r runs the model over every world_size-th context of the
fill only, and one all-gather gives every rank the whole fill. Running the whole fill on every
rank would cost world_size x the model time; fixed shares would lose rebalancing. The price is
memory: every rank holds the fill (about FILL_BATCHES global batches of rows) on its device. The
stream's position is three integers, so a resumed run, on as many ranks or not, recomputes the
fill it was in and goes on exactly.

A sweep over the model's layers or sites (sae_dist/sweeps/setup.py) hooks every (layer, site) it
needs in one forward pass (`sites`): its rows are [rows, n_sites, d_in], each token's sites
together, so one shuffle orders every site alike and each SAE takes its site's slice (`site_of`).
Its fill holds n_sites x as much memory. With one site (every run but such a sweep) rows stay
[rows, d_in] and everything is as above.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from sae_dist import distributed as D
from sae_dist.data.harvest.contexts import text_files
from sae_dist.data.harvest.run import HarvestSpec, SiteReader, load_tokenizer, plan
from sae_dist.data.harvest.sites import site_module_path
from sae_dist.data.source_memory import SourceMemory, for_model_config, model_directory, safetensors_bytes
from sae_dist.data.sources.base import UnseenRows
from sae_dist.errors import UserError

log = logging.getLogger(__name__)

FILL_BATCHES = 8  # a fill holds about this many global batches: the span rows are shuffled over
READ_BATCH = 32  # contexts per forward pass of the model


def check_model_source(model: str, layer: int, site: str, text: str, config=None) -> int:
    """Before any rank starts: the model is on disk, has this layer and site, the text exists.
    Returns d_in, the width of the model's residual stream (what every site of it writes).
    `config`: the model's, when already read (a sweep reads it once)."""
    return check_model_sites(model, [(layer, site)], text, config)


def check_model_sites(model: str, sites: list[tuple[int, str]], text: str, config=None) -> int:
    """check_model_source for several (layer, site): the first bad one is the error."""
    if config is None:
        _, config = load_tokenizer(model)
    for layer, site in sites:
        site_module_path(config, site, layer)
    text_files([text])
    for name in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    raise UserError(f"--model-path {model}: its config names no hidden size")


def launcher_memory(cfg, model_config, n_sites: int, global_batch: int) -> SourceMemory:
    """The source's memory per device before any rank starts: the weights from the model's
    safetensors headers (unknown without them), the fill at its full size (the text not read)."""
    directory = model_directory(cfg.model_path)
    weights = safetensors_bytes(directory) if directory is not None else None
    return for_model_config(model_config, weights, n_sites, cfg.d_in, cfg.context_length, global_batch,
                            READ_BATCH, FILL_BATCHES)


class ModelSource:
    def __init__(self, model: str, layer: int, site: str, text: str, context_length: int, batch_size: int,
                 seed: int, rank: int, world_size: int, device: torch.device, global_batch: int | None = None,
                 sites: list[tuple[int, str]] | None = None):
        self.sites = list(sites) if sites else [(layer, site)]
        layer, site = self.sites[0]
        spec = HarvestSpec(model=model, layer=layer, site=site, texts=[text], out="", context_length=context_length)
        self.reader = SiteReader(spec, device, self.sites if len(self.sites) > 1 else None)
        self.d_in = check_model_sites(model, self.sites, text, self.reader.config)  # the config the model came with
        # One row: [d_in], or [n_sites, d_in] when several sites are hooked.
        self.row_shape = (self.d_in,) if len(self.sites) == 1 else (len(self.sites), self.d_in)
        self.contexts = plan(spec, self.reader.tokenizer, self.reader.config).contexts
        if not self.contexts:
            raise UserError(f"text {text}: too little text (not one context)")
        self.rows_per_context = [sum(c.harvest) for c in self.contexts]
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.context_length = context_length
        self.device = device
        self.use_global_batch(global_batch or batch_size * world_size)
        self.epoch = self.fill = self.offset = 0
        self._rows: Tensor | None = None

    @property
    def planted_features(self) -> None:
        return None

    def site_of(self, layer: int, site: str) -> int | None:
        """The index of (layer, site) in a row of several sites; None when rows are one site's."""
        return None if len(self.sites) == 1 else self.sites.index((layer, site))

    def memory(self) -> SourceMemory:
        """What it holds on this device (sae_dist/data/source_memory.py): the loaded model's tensors,
        counted; the forward pass and the fill, estimated."""
        model = self.reader.model
        weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        return for_model_config(self.reader.config, weights, len(self.sites), self.d_in, self.context_length,
                                self.global_batch, READ_BATCH, FILL_BATCHES, sum(self.rows_per_context))

    def use_global_batch(self, global_batch: int) -> None:
        """Fills sized for this global batch (a resumed run keeps its checkpoint's, so its fills are
        the same contexts whatever the number of ranks)."""
        n = len(self.contexts)
        self.global_batch = global_batch
        tokens_per_context = max(1, sum(self.rows_per_context) // n)
        self.per_fill = max(1, min(n, FILL_BATCHES * global_batch // tokens_per_context))

    def _generator(self, *parts: int) -> torch.Generator:
        # Integers only: their hash is the same in every process (a str's is salted per process).
        return torch.Generator().manual_seed(hash((self.seed, *parts)) & (2**62 - 1))

    def _load_fill(self) -> Tensor:
        """The current fill's rows, shuffled: every rank calls this at the same step (a collective)."""
        order = torch.randperm(len(self.contexts), generator=self._generator(self.epoch))
        chosen = order[self.fill * self.per_fill:(self.fill + 1) * self.per_fill].tolist()
        assigned = [chosen[r::self.world_size] for r in range(self.world_size)]
        mine = assigned[self.rank]
        if mine:
            rows = self.reader.rows([self.contexts[i] for i in mine], batch_size=READ_BATCH).clone()
        else:  # a fill of fewer contexts than ranks
            rows = torch.empty(0, *self.row_shape, device=self.device)
        sizes = [sum(self.rows_per_context[i] for i in part) for part in assigned]
        parts = _all_gather_rows(rows, sizes)
        # Back in the fill's context order, whatever the number of ranks that computed it.
        by_context: dict[int, Tensor] = {}
        for part, contexts in zip(parts, assigned):
            by_context.update(zip(contexts, part.split([self.rows_per_context[i] for i in contexts])))
        rows = torch.cat([by_context[i] for i in chosen])
        return rows[torch.randperm(len(rows), generator=self._generator(self.epoch, self.fill)).to(rows.device)]

    def _advance(self) -> None:
        self.fill, self.offset, self._rows = self.fill + 1, 0, None
        if self.fill * self.per_fill >= len(self.contexts):
            self.epoch, self.fill = self.epoch + 1, 0

    def _take(self, total: int, ranges: list[tuple[int, int]], device, dtype) -> list[Tensor]:
        """Advance the stream by `total` rows (on every rank alike: fills load at the same step) and
        return the rows at each (start, count) of them."""
        segments: list[tuple[int, Tensor]] = []
        pos = 0
        while pos < total:
            if self._rows is None:
                self._rows = self._load_fill()
            take = self._rows[self.offset:self.offset + total - pos]
            segments.append((pos, take))
            pos += len(take)
            self.offset += len(take)
            if self.offset >= len(self._rows):
                self._advance()
        out = []
        for lo, count in ranges:
            pieces = [t[max(0, lo - s):lo + count - s] for s, t in segments if s < lo + count and s + len(t) > lo]
            out.append(torch.cat(pieces).to(device=device, dtype=dtype))
        return out

    def next_batches(self, plan, rank: int, device=None, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """Rank's slice of each micro-batch of the next step of the global stream."""
        ranges = [(j * plan.micro_batch + plan.offset(rank), plan.shares[rank]) for j in range(plan.micro_steps)]
        return self._take(plan.global_batch, ranges, device, dtype)

    def next_batch(self, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
        """This rank's equal part of the next batch_size x world_size rows."""
        return self._take(self.batch_size * self.world_size, [(self.rank * self.batch_size, self.batch_size)],
                          device, dtype)[0]

    def unseen_rows(self, rows: int, batch_rows: int, ctx, plan) -> UnseenRows | None:
        """The stream's next `rows` rows (the text after the run's), drawn in whole steps by every
        rank and gathered on rank 0 (sae_dist.data.sources.base). Rows of several sites stay
        [rows, n_sites, d_in]: the caller takes its site's slice (site_of)."""
        mine: list[Tensor] = []
        for _ in range(-(-rows // plan.global_batch)):
            mine += [x.detach().float().cpu() for x in self.next_batches(plan, ctx.rank, ctx.device)]
        gathered = D.gather_objects(mine)
        if not ctx.is_main:
            return None
        drawn = torch.cat([x for rank_rows in gathered for x in rank_rows])[:rows]
        return UnseenRows(drawn.split(batch_rows), f"the model's next {len(drawn):,} rows (text after the run's)")

    def state_dict(self) -> dict[str, Any]:
        return {"stream": "global", "epoch": self.epoch, "fill": self.fill, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rows = None
        if state.get("stream") != "global":
            # Written when each rank read its own contexts: those positions mean nothing here.
            self.epoch, self.fill, self.offset = int(state.get("epoch", 0)) + 1, 0, 0
            log.warning("the checkpoint's model-source position is of an earlier sae-dist (one stream per "
                        "rank); continuing at the start of epoch %d", self.epoch)
            return
        self.epoch, self.fill, self.offset = int(state["epoch"]), int(state["fill"]), int(state["offset"])


def _all_gather_rows(rows: Tensor, sizes: list[int]) -> list[Tensor]:
    """Every rank's rows (rank r has sizes[r] of them), on every rank; padded to one size, as
    all_gather needs."""
    if len(sizes) == 1 or not (dist.is_available() and dist.is_initialized()):
        return [rows]
    most = max(sizes)
    padded = torch.zeros(most, *rows.shape[1:], dtype=rows.dtype, device=rows.device)
    padded[:len(rows)] = rows
    out = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(out, padded)
    return [part[:n] for part, n in zip(out, sizes)]
