"""The TopK SAE step without dense passes it does not need.

A TopK step's one unavoidable dense product is the encoder's (batch x d_in) @ (d_in x d_sae).
Autograd through `topk` and a dense decoder would add four more of that size (the decoder
forward, the scatter of the top-k gradient into a dense matrix, and two encoder backward
products), so the encoder and decoder here are autograd Functions that carry the k selected
latents per sample as a CSR pattern and compute every gradient from it:

- decoder forward: `embedding_bag` (a gather-sum of k decoder rows per sample);
- latent gradients: `sampled_addmm`, g @ W_dec^T only at the selected entries;
- weight gradients: the transposed pattern (CSR, d_sae x batch) times a dense batch matrix,
  never a batch x k x d_in temporary;
- b_enc's gradient is a segment sum; b_dec's through the encoder is W_enc @ grad_b_enc (the
  column sums of the sparse gradient), so no batch x d_in input gradient is formed at all.

On a CPU the encoder works through the batch in row blocks that stay in cache, and each block's
top-k (bias added in the scan, AuxK's selection in the same pass) is the compiled kernel of
`sae_dist.models.kernels` where it could be built. Under autocast only the encoder product runs in the
low precision; the selected values and every gradient stay in the parameters' dtype.
`dense_topk_reference` is the plain autograd version the tests and the benchmark compare against.

Nothing here is decorated with `torch.compiler.disable`: that decorator imports torch._dynamo
(1.5 to 3 s) in every process that loads an SAE (evaluate, export, the launcher, the app's
helpers), and the trainer never compiles. The CSR patterns are data-dependent; `torch.compile` of
an SAE is not supported.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from sae_dist.memory import encoder_rows_at_once
from sae_dist.models.kernels import cpu_topk

# torch warns once that CSR is "beta"; the operations used here are tested against the dense
# reference in tests/test_sparse_ops.py.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


@dataclass(eq=False)
class Pattern:
    """Which latents are active in each sample: CSR row pointers and column (latent) indices."""

    crow: Tensor  # [batch + 1]
    col: Tensor  # [nnz]
    n_latents: int
    _transposed: tuple[Tensor, Tensor, Tensor] | None = field(default=None, repr=False)

    @property
    def n_rows(self) -> int:
        return self.crow.numel() - 1

    @classmethod
    def per_row(cls, idx: Tensor, n_latents: int) -> "Pattern":
        """k latents in every row (TopK): idx is [batch, k]."""
        rows, k = idx.shape
        crow = torch.arange(0, rows * k + 1, k, device=idx.device)
        return cls(crow, idx.reshape(-1), n_latents)

    def row_of_entry(self) -> Tensor:
        counts = self.crow.diff()
        return torch.repeat_interleave(torch.arange(self.n_rows, device=self.col.device), counts,
                                       output_size=self.col.numel())

    def transposed(self) -> tuple[Tensor, Tensor, Tensor]:
        """(row pointers over latents, sample of each entry, entry order): the d_sae x batch CSR.

        Computed once per pattern and shared by the encoder's and the decoder's backward.
        """
        if self._transposed is None:
            order = self.col.argsort(stable=True)
            counts = torch.bincount(self.col, minlength=self.n_latents)
            crow_t = torch.zeros(self.n_latents + 1, dtype=self.crow.dtype, device=self.col.device)
            torch.cumsum(counts, 0, out=crow_t[1:])
            self._transposed = (crow_t, self.row_of_entry()[order], order)
        return self._transposed

    def restricted(self, keep: Tensor, n_latents: int) -> "Pattern":
        """The entries where `keep` (a bool per entry) holds, over the first n_latents latents
        (every kept entry's latent is below it): a prefix's own pattern, so that decoding it
        gathers from those latents' rows alone."""
        counts = torch.bincount(self.row_of_entry()[keep], minlength=self.n_rows)
        crow = torch.zeros_like(self.crow)
        torch.cumsum(counts, 0, out=crow[1:])
        return Pattern(crow, self.col[keep], n_latents)

    def csr(self, values: Tensor) -> Tensor:
        return torch.sparse_csr_tensor(self.crow, self.col, values, size=(self.n_rows, self.n_latents),
                                       check_invariants=False)

    def t_matmul(self, values: Tensor, dense: Tensor) -> Tensor:
        """(this pattern with these values)^T @ dense: [n_latents, dense.shape[1]]."""
        crow_t, rows, order = self.transposed()
        a_t = torch.sparse_csr_tensor(crow_t, rows, values[order], size=(self.n_latents, self.n_rows),
                                      check_invariants=False)
        return a_t @ dense

    def column_sums(self, values: Tensor) -> Tensor:
        return torch.zeros(self.n_latents, dtype=values.dtype, device=values.device).index_add_(0, self.col, values)

    def sampled_rows_dot(self, left: Tensor, right_t: Tensor) -> Tensor:
        """(left @ right_t.T) at the pattern's entries only: [nnz]."""
        zeros = torch.zeros(self.col.numel(), dtype=left.dtype, device=left.device)
        return torch.sparse.sampled_addmm(self.csr(zeros), left, right_t.t(), beta=0.0).values()


BLOCK_ROWS_ENV = "SAE_DIST_ENCODE_BLOCK_ROWS"  # to tune (or, with 0, turn off) the blocking


def block_rows(batch: int, n_latents: int, device: torch.device) -> int:
    """Rows of the pre-activation matrix encoded at once. On a CPU a block of ~16 MB stays in
    cache between the product and its top-k (measured: ~10% faster than the whole matrix at
    4096 x 4096, and the batch x d_sae matrix is never held whole); a GPU wants one big product."""
    override = os.environ.get(BLOCK_ROWS_ENV)
    if override:
        return int(override) or batch
    return encoder_rows_at_once(batch, n_latents, device.type)


def _encode_topk_blocked(xc: Tensor, w_enc: Tensor, b_enc: Tensor, k: int, dead_mask: Tensor | None,
                         k_aux: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor] | None]:
    """Per-row top-k of xc @ W_enc + b_enc (and AuxK's), a block of rows at a time."""
    rows, n_latents = xc.shape[0], w_enc.shape[1]
    step = block_rows(rows, n_latents, xc.device)
    kind = xc.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else w_enc.dtype
    with torch.autocast(kind, enabled=False):  # cast once here, not once per block
        xc, w_enc, b_enc = xc.to(dtype), w_enc.to(dtype), b_enc.to(dtype)
        buffer = torch.empty(min(step, rows), n_latents, dtype=dtype, device=xc.device)  # reused by every block
        vals = torch.empty(rows, k, dtype=dtype, device=xc.device)
        idx = torch.empty(rows, k, dtype=torch.long, device=xc.device)
        if dead_mask is not None:
            aux_vals = torch.empty(rows, k_aux, dtype=dtype, device=xc.device)
            aux_idx = torch.empty(rows, k_aux, dtype=torch.long, device=xc.device)
        kernel = cpu_topk() if kind == "cpu" and dtype == torch.float32 else None
        if kernel is not None:
            dead_u8 = dead_mask.to(torch.uint8) if dead_mask is not None else torch.empty(0, dtype=torch.uint8)
        for start in range(0, rows, step):
            end = min(rows, start + step)
            if kernel is not None:  # the bias is added inside the kernel's scan, not by a copy here
                pre = torch.mm(xc[start:end], w_enc, out=buffer[: end - start])
                kernel.topk_rows(pre, b_enc, k, vals[start:end], idx[start:end], dead_u8,
                                 k_aux if dead_mask is not None else 0,
                                 aux_vals[start:end] if dead_mask is not None else vals,
                                 aux_idx[start:end] if dead_mask is not None else idx)
                continue
            pre = torch.addmm(b_enc, xc[start:end], w_enc, out=buffer[: end - start])
            torch.topk(pre, k, dim=-1, sorted=False, out=(vals[start:end], idx[start:end]))
            if dead_mask is not None:
                torch.topk(pre.masked_fill_(~dead_mask, float("-inf")), k_aux, dim=-1, sorted=False,
                           out=(aux_vals[start:end], aux_idx[start:end]))
    return vals, idx, ((aux_vals, aux_idx) if dead_mask is not None else None)


BATCH_TOPK_CANDIDATES = 4  # per-row candidates, as a multiple of k, for BatchTopK's selection


def _select_batch_topk(cand_vals: Tensor, cand_idx: Tensor, k: int, n_latents: int,
                       pre_rows) -> tuple[Tensor, Pattern]:
    """The k * batch largest of the whole batch, in row order (BatchTopK, Bussmann et al. 2024).

    A top-k over the flattened batch is slow (16M values on the benchmark), so each row first
    offers its top m = 4k (cand_vals/cand_idx, from the blocked encoder) and the k * batch largest
    of those are chosen. A row whose m candidates all reach the smallest chosen value may deserve
    more (BatchTopK's counts per sample are skewed: at initialisation a few samples take 10-20k
    latents); such rows offer all their latents (pre_rows(rows) recomputes them) and the choice is
    made again. That is exact: every latent not offered is below a row minimum that is below the
    threshold, and offering more only raises the threshold."""
    rows, m = cand_vals.shape
    total = min(k * rows, rows * n_latents)
    vals, pos = cand_vals.reshape(-1).topk(total, sorted=False)
    flat = (pos // m) * n_latents + cand_idx.reshape(-1)[pos]
    if m < n_latents:
        full = (cand_vals.amin(dim=1) >= vals.min()).nonzero().flatten()
        if len(full):
            rest = torch.ones(rows, dtype=torch.bool, device=cand_vals.device)
            rest[full] = False
            row_ids = torch.arange(rows, device=cand_vals.device)
            offered_vals = torch.cat([cand_vals[rest].reshape(-1), pre_rows(full).reshape(-1).to(cand_vals.dtype)])
            offered = torch.cat([(row_ids[rest, None] * n_latents + cand_idx[rest]).reshape(-1),
                                 (full[:, None] * n_latents + torch.arange(n_latents, device=full.device)).reshape(-1)])
            vals, pos = offered_vals.topk(total, sorted=False)
            flat = offered[pos]
    order = flat.argsort()
    flat, vals = flat[order], vals[order]
    counts = torch.bincount(flat // n_latents, minlength=rows)
    crow = torch.zeros(rows + 1, dtype=flat.dtype, device=flat.device)
    torch.cumsum(counts, 0, out=crow[1:])
    return vals, Pattern(crow, flat % n_latents, n_latents)


@dataclass
class Encoded:
    acts: Tensor  # [nnz] the selected activations after ReLU, in pattern order
    pattern: Pattern
    aux_acts: Tensor | None = None  # AuxK: the top dead latents per sample, after ReLU
    aux_pattern: Pattern | None = None


class _SparseEncode(torch.autograd.Function):
    """x -> the selected activations; the patterns go out through `patterns_out` (not tensors)."""

    @staticmethod
    def forward(ctx, x, b_dec, w_enc, b_enc, k, batch_level, dead_mask, k_aux, patterns_out: list):
        xc = x - b_dec
        n_latents = w_enc.shape[1]
        if batch_level:  # per-row candidates first, then the batch-level choice among them
            m = min(n_latents, BATCH_TOPK_CANDIDATES * k)
            cand_vals, cand_idx, aux = _encode_topk_blocked(xc, w_enc, b_enc, m, dead_mask, k_aux)
            vals, pattern = _select_batch_topk(cand_vals, cand_idx, k, n_latents,
                                               lambda rows: torch.addmm(b_enc, xc[rows], w_enc))
        else:
            vals, idx, aux = _encode_topk_blocked(xc, w_enc, b_enc, k, dead_mask, k_aux)
            pattern = Pattern.per_row(idx, n_latents)
        acts = vals.reshape(-1).to(w_enc.dtype).relu()
        aux_acts, aux_pattern = acts.new_zeros(0), None
        if aux is not None:
            aux_acts, aux_pattern = aux[0].reshape(-1).to(w_enc.dtype).relu(), Pattern.per_row(aux[1], n_latents)
        ctx.patterns = (pattern, aux_pattern)
        patterns_out.extend(ctx.patterns)
        ctx.save_for_backward(xc, w_enc, acts, aux_acts)
        return acts, aux_acts

    @staticmethod
    def backward(ctx, grad_acts, grad_aux):
        xc, w_enc, acts, aux_acts = ctx.saved_tensors
        pattern, aux_pattern = ctx.patterns
        with torch.autocast(xc.device.type, enabled=False):
            grads = [(pattern, grad_acts * (acts > 0))]  # through the ReLU
            if aux_pattern is not None and grad_aux is not None:
                grads.append((aux_pattern, grad_aux * (aux_acts > 0)))
            grad_w_enc_t = sum(p.t_matmul(g, xc) for p, g in grads)  # [d_sae, d_in]
            grad_b_enc = sum(p.column_sums(g) for p, g in grads)
            # d/d b_dec of sum_b G[b] . ((x_b - b_dec) W_enc)  =  -W_enc @ (column sums of G)
            grad_b_dec = -(w_enc @ grad_b_enc) if ctx.needs_input_grad[1] else None
            grad_x = sum(p.csr(g) @ w_enc.t() for p, g in grads) if ctx.needs_input_grad[0] else None
        return grad_x, grad_b_dec, grad_w_enc_t.t(), grad_b_enc, None, None, None, None, None


def sparse_encode(x: Tensor, b_dec: Tensor, w_enc: Tensor, b_enc: Tensor, k: int, *, batch_level: bool = False,
                  dead_mask: Tensor | None = None, k_aux: int = 0) -> Encoded:
    """TopK (or BatchTopK) encode of x - b_dec, with AuxK's dead-latent selection when dead_mask is given."""
    patterns: list[Pattern | None] = []
    acts, aux_acts = _SparseEncode.apply(x, b_dec, w_enc, b_enc, k, batch_level, dead_mask, k_aux, patterns)
    pattern, aux_pattern = patterns
    return Encoded(acts, pattern, aux_acts if aux_pattern is not None else None, aux_pattern)


class _SparseDecode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acts, w_dec, pattern: Pattern):
        ctx.pattern = pattern
        ctx.save_for_backward(acts, w_dec)
        return F.embedding_bag(pattern.col, w_dec, pattern.crow[:-1], mode="sum", per_sample_weights=acts,
                               include_last_offset=False)

    @staticmethod
    def backward(ctx, grad_out):
        acts, w_dec = ctx.saved_tensors
        pattern = ctx.pattern
        grad_out = grad_out.contiguous()
        grad_acts = pattern.sampled_rows_dot(grad_out, w_dec) if ctx.needs_input_grad[0] else None
        grad_w_dec = pattern.t_matmul(acts, grad_out) if ctx.needs_input_grad[1] else None
        return grad_acts, grad_w_dec, None


def sparse_decode(acts: Tensor, w_dec: Tensor, pattern: Pattern) -> Tensor:
    """sum over each sample's active latents of act * W_dec[latent]: [batch, d_in] (no b_dec)."""
    return _SparseDecode.apply(acts, w_dec, pattern)


def dense_topk_reference(x: Tensor, b_dec: Tensor, w_enc: Tensor, b_enc: Tensor, w_dec: Tensor, k: int, *,
                         batch_level: bool = False, dead_mask: Tensor | None = None,
                         k_aux: int = 0) -> tuple[Tensor, Tensor | None]:
    """The same function through plain autograd and dense matrices: (x_hat, AuxK's e_hat or None).

    What a naive TopK SAE does: the selected values are scattered into a dense batch x d_sae
    matrix and decoded with a dense product; autograd then runs dense products backward too.
    """
    pre = torch.addmm(b_enc, x - b_dec, w_enc)
    if batch_level:
        flat = pre.reshape(-1)
        vals, idx = flat.topk(min(k * pre.shape[0], flat.numel()), sorted=False)
        acts = torch.zeros_like(flat).scatter(0, idx, vals.relu()).view_as(pre)
    else:
        vals, idx = pre.topk(k, dim=-1, sorted=False)
        acts = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    x_hat = acts @ w_dec + b_dec
    e_hat = None
    if dead_mask is not None:
        vals, idx = pre.masked_fill(~dead_mask, float("-inf")).topk(k_aux, dim=-1, sorted=False)
        e_hat = torch.zeros_like(pre).scatter(-1, idx, vals.relu()) @ w_dec
    return x_hat, e_hat
