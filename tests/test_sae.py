"""The SAE module against naive dense formulations written here, on fresh random inputs (CPU, fp32).

The references follow the docstrings and papers, not the implementation: TopK/BatchTopK select with a
k-th-largest threshold and decode with a dense matmul; AuxK predicts the residual e = x - x_hat from
the top auxk_k dead latents (Gao et al. 2024); JumpReLU uses the rectangle-kernel straight-through
estimator of Rajamanoharan et al. (2024); Matryoshka adds each inner prefix's reconstruction by the
prefix's own latents (a dense slice of the activations and of the decoder) to the loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from sae_dist.models.kernels import DISABLE_ENV
from sae_dist.models.sae import SparseAutoencoder

PARAMS = ("W_enc", "b_enc", "W_dec", "b_dec")

# (batch, d_in, d_sae, k): odd sizes, a single sample, k = 1, k close to d_sae, and batches that
# the CPU encoder takes in row blocks (d_sae 4096: blocks of 1024 rows; 8192: 512), each here one
# whole block and a short last one.
SHAPES = [(1, 8, 32, 4), (7, 16, 64, 8), (33, 12, 48, 1), (64, 32, 128, 16), (5, 6, 20, 17),
          pytest.param(1100, 16, 4096, 32, marks=pytest.mark.slow),
          pytest.param(600, 8, 8192, 5, marks=pytest.mark.slow)]


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5, what: str = "") -> None:
    """Max abs difference within tol x the reference's largest magnitude (relative, robust to zeros)."""
    assert actual.shape == expected.shape, what
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert err <= tol * max(scale, 1e-12), f"{what}: max abs err {err:.3g} vs scale {scale:.3g}"


def make_sae(arch: str, d_in: int, d_sae: int, k: int = 4, seed: int = 0, **kw) -> SparseAutoencoder:
    """An SAE that looks trained: encoder no longer the decoder transpose, nonzero biases. A
    Matryoshka one has prefixes of a quarter and a half of the dictionary unless told;
    "matryoshka_batch" is Matryoshka with batch-level selection."""
    if arch.startswith("matryoshka"):
        kw.setdefault("matryoshka_widths", tuple(sorted({max(1, d_sae // 4), max(2, d_sae // 2), d_sae})))
        kw.setdefault("matryoshka_selection", "batch" if arch == "matryoshka_batch" else "sample")
        arch = "matryoshka"
    sae = SparseAutoencoder(d_in, d_sae, arch, k=k, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        sae.W_enc.add_(0.3 * torch.randn(d_in, d_sae, generator=g))
        sae.b_enc.copy_(0.2 * torch.randn(d_sae, generator=g))
        sae.b_dec.copy_(0.5 * torch.randn(d_in, generator=g))
    return sae


def rand_x(batch: int, d_in: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, d_in, generator=torch.Generator().manual_seed(seed)) * 2.0


def leaf_params(sae: SparseAutoencoder) -> dict[str, torch.Tensor]:
    return {n: getattr(sae, n).detach().clone().requires_grad_(True) for n in PARAMS}


def dense_pre(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return (x - p["b_dec"]) @ p["W_enc"] + p["b_enc"]


def dense_topk_acts(pre: torch.Tensor, k: int) -> torch.Tensor:
    kth = pre.detach().topk(k, dim=-1).values[:, -1:]
    return pre.relu() * (pre.detach() >= kth)


def dense_batchtopk_acts(pre: torch.Tensor, k: int) -> torch.Tensor:
    acts = pre.relu()
    n = min(k * pre.shape[0], acts.numel())
    kth = acts.detach().flatten().topk(n).values[-1]
    return acts * (acts.detach() >= kth)


def dense_auxk(p, pre, x, x_hat, dead: torch.Tensor, auxk_k: int) -> torch.Tensor:
    """Docstring AuxK: top auxk_k dead pre-acts -> relu -> decode without bias -> squared error to the
    detached residual x - x_hat, over the residual's total variance, times min(num_dead / auxk_k, 1)."""
    num_dead = int(dead.sum())
    k_aux = min(auxk_k, num_dead)
    masked = pre.detach().masked_fill(~dead, float("-inf"))
    kth = masked.topk(k_aux, dim=-1).values[:, -1:]
    sel = dead & (masked >= kth)
    e_hat = (pre.relu() * sel) @ p["W_dec"]
    residual = (x - x_hat).detach()
    total_var = (residual - residual.mean(0)).pow(2).sum().clamp_min(1e-12)  # 0 for a batch of one
    return min(num_dead / auxk_k, 1.0) * (e_hat - residual).pow(2).sum() / total_var


def dense_forward(sae: SparseAutoencoder, x: torch.Tensor, dead: torch.Tensor | None):
    p = leaf_params(sae)
    pre = dense_pre(p, x)
    acts = dense_batchtopk_acts(pre, sae.k) if sae.batch_level else dense_topk_acts(pre, sae.k)
    x_hat = acts @ p["W_dec"] + p["b_dec"]
    mse = (x_hat - x).pow(2).sum(-1).mean()
    aux = dense_auxk(p, pre, x, x_hat, dead, sae.auxk_k) if dead is not None and dead.any() else pre.new_zeros(())
    loss = mse + sae.auxk_coefficient * aux
    for width in getattr(sae, "matryoshka_widths", ())[:-1]:  # each inner prefix alone, weighted
        inner = acts[:, :width] @ p["W_dec"][:width] + p["b_dec"]
        loss = loss + sae.matryoshka_inner_weight * (inner - x).pow(2).sum(-1).mean()
    return p, acts, x_hat, mse, aux, loss


def grads_of(sae: SparseAutoencoder) -> dict[str, torch.Tensor]:
    return {n: getattr(sae, n).grad for n in PARAMS}


def dead_mask_for(d_sae: int, n_dead: int, seed: int = 3) -> torch.Tensor:
    dead = torch.zeros(d_sae, dtype=torch.bool)
    dead[torch.randperm(d_sae, generator=torch.Generator().manual_seed(seed))[:n_dead]] = True
    return dead


# ---------------------------------------------------------------- TopK / BatchTopK vs dense


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "matryoshka_batch"])
@pytest.mark.parametrize("batch,d_in,d_sae,k", SHAPES)
@pytest.mark.parametrize("n_dead", [None, 0, 3, "many"])
@pytest.mark.parametrize("top_k", ["kernel", "torch.topk"])
def test_sparse_forward_matches_dense(arch, batch, d_in, d_sae, k, n_dead, top_k, monkeypatch):
    if top_k == "torch.topk":
        monkeypatch.setenv(DISABLE_ENV, "1")
    auxk_k = max(2, d_in // 2)
    sae = make_sae(arch, d_in, d_sae, k=k, seed=batch * 7 + k, auxk_coefficient=1 / 32, auxk_k=auxk_k)
    x = rand_x(batch, d_in, seed=batch + d_sae)
    if n_dead is None:
        dead = None
    else:
        dead = dead_mask_for(d_sae, {0: 0, 3: 3, "many": 2 * auxk_k + 1}[n_dead])  # scale < 1 and = 1

    out = sae(x, dead)
    out.loss.backward()
    p, acts, x_hat, mse, aux, loss = dense_forward(sae, x, dead)
    loss.backward()

    assert_rel_close(out.x_hat, x_hat, what="x_hat")
    assert_rel_close(out.mse, mse, what="mse")
    assert_rel_close(out.auxk_loss, aux, what="auxk")
    assert_rel_close(out.loss, loss, what="loss")
    if dead is not None and dead.any():
        assert out.auxk_loss.item() > 0
    else:
        assert out.auxk_loss.item() == 0
    for n in PARAMS:
        assert_rel_close(getattr(sae, n).grad, p[n].grad, what=f"grad {n}")
    active = acts > 0
    assert torch.equal(out.fired, active.sum(0).float())
    assert out.l0.item() == pytest.approx(active.sum(-1).float().mean().item())
    if arch == "topk":
        assert (active.sum(-1) <= k).all()


@pytest.mark.parametrize("weight", [0.0, 0.25, 3.0])
def test_matryoshka_inner_weight_scales_the_inner_prefixes_loss(weight):
    sae = make_sae("matryoshka", 16, 64, k=4, seed=2, auxk_coefficient=1 / 32, auxk_k=8,
                   matryoshka_inner_weight=weight)
    x = rand_x(32, 16, seed=4)
    out = sae(x, None)
    out.loss.backward()
    p, _, _, mse, _, loss = dense_forward(sae, x, None)
    loss.backward()
    assert_rel_close(out.loss, loss, what="loss")
    for n in PARAMS:
        assert_rel_close(getattr(sae, n).grad, p[n].grad, what=f"grad {n}")
    if weight == 0:
        assert out.loss.item() == pytest.approx(mse.item(), rel=1e-6)


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "matryoshka_batch"])
def test_sparse_path_gives_the_input_gradient_too(arch):
    """The fast path skips the batch x d_in input gradient unless x asks for one; then it is exact."""
    sae = make_sae(arch, 24, 96, k=6, seed=5, auxk_coefficient=1 / 32, auxk_k=8)
    dead = dead_mask_for(96, 20)
    x = rand_x(40, 24, seed=9).requires_grad_(True)
    sae(x, dead).loss.backward()
    x_ref = x.detach().clone().requires_grad_(True)
    dense_forward(sae, x_ref, dead)[-1].backward()
    assert_rel_close(x.grad, x_ref.grad, what="grad x")


def test_bf16_autocast_runs_the_encoder_product_in_bf16_only():
    """Under autocast the selected values and every gradient stay fp32 and point where the fp32
    step's do (bf16 rounding flips a few near-tied selections, so not equal)."""
    sae = make_sae("topk", 32, 256, k=8, seed=2, auxk_coefficient=1 / 32, auxk_k=16)
    x = rand_x(128, 32, seed=4)
    dead = dead_mask_for(256, 40)
    ref = sae(x, dead)
    ref.loss.backward()
    ref_grads = {n: g.clone() for n, g in grads_of(sae).items()}
    sae.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = sae(x, dead)
    out.loss.backward()
    assert out.x_hat.dtype == torch.float32 and out.loss.dtype == torch.float32
    assert abs(out.loss.item() - ref.loss.item()) < 0.05 * ref.loss.item()
    for n, g in grads_of(sae).items():
        assert g.dtype == torch.float32
        assert float(torch.nn.functional.cosine_similarity(g.flatten(), ref_grads[n].flatten(), dim=0)) > 0.98, n


def test_batchtopk_when_one_sample_takes_most_of_the_batch_budget():
    """Each row offers 4k candidates; a row that deserves more offers all its latents, and the
    result is still the exact batch-level top-k."""
    sae = make_sae("batchtopk", 12, 64, k=4, seed=8)
    x = rand_x(8, 12, seed=2)
    x[0] *= 1000  # its activations dwarf the others': it gets far more than 4k = 16 of the 32
    out = sae(x)
    out.loss.backward()
    p, acts, x_hat, mse, aux, loss = dense_forward(sae, x, None)
    loss.backward()
    assert (acts[0] > 0).sum() > 16
    assert_rel_close(out.x_hat, x_hat, what="x_hat")
    for n in PARAMS:
        assert_rel_close(getattr(sae, n).grad, p[n].grad, what=f"grad {n}")


def test_auxk_only_reaches_dead_latents():
    d_in, d_sae, k = 16, 64, 4
    sae = make_sae("topk", d_in, d_sae, k=k, seed=5, auxk_coefficient=1.0, auxk_k=8)
    dead = dead_mask_for(d_sae, 12)
    with torch.no_grad():
        sae.b_enc[dead] += 1.0  # dead latents have positive pre-acts, so AuxK selects and decodes them
    x = rand_x(32, d_in, seed=9)
    out = sae(x, dead)
    out.auxk_loss.backward()  # the AuxK term alone, without the main loss
    g_enc, g_benc, g_dec = sae.W_enc.grad, sae.b_enc.grad, sae.W_dec.grad
    assert (g_enc[:, ~dead] == 0).all() and (g_benc[~dead] == 0).all() and (g_dec[~dead] == 0).all()
    # every dead latent is among the top auxk_k dead ones for some sample here
    assert (g_enc[:, dead].abs().sum(0) > 0).all()
    assert (g_dec[dead].abs().sum(1) > 0).all()

    # no dead latents: no AuxK term and no gradient from it
    sae.zero_grad()
    out = sae(x, torch.zeros(d_sae, dtype=torch.bool))
    assert out.auxk_loss.item() == 0
    # auxk_coefficient 0: the term is skipped
    sae0 = make_sae("topk", d_in, d_sae, k=k, seed=5, auxk_coefficient=0.0)
    assert sae0(x, dead).auxk_loss.item() == 0


def test_auxk_gradient_points_dead_rows_at_the_residual():
    """AuxK teaches dead latents to predict e = x - x_hat: from zero decoder rows, a descent step
    moves each dead row towards sum_b a_bj e_b, and adding their decode then lowers the main error."""
    d_in, d_sae, auxk_k = 16, 64, 8
    sae = make_sae("topk", d_in, d_sae, k=4, seed=11, auxk_coefficient=1.0, auxk_k=auxk_k)
    dead = dead_mask_for(d_sae, 8)
    with torch.no_grad():
        sae.b_enc[dead] += 1.0
        sae.W_dec[dead] = 0.0
    x = rand_x(64, d_in, seed=12)
    out = sae(x, dead)
    out.auxk_loss.backward()
    with torch.no_grad():
        residual = x - out.x_hat
        pre = sae.pre_acts(x)
        masked = pre.masked_fill(~dead, float("-inf"))
        aux_acts = pre.relu() * (dead & (masked >= masked.topk(auxk_k, -1).values[:, -1:]))
        target = aux_acts.t() @ residual  # [d_sae, d_in]
        g = sae.W_dec.grad
        for j in dead.nonzero().flatten().tolist():
            cos = torch.cosine_similarity(-g[j], target[j], dim=0)
            assert cos > 0.999, (j, cos)
        w_dec = sae.W_dec - 0.5 * g / g[dead].norm()
        e_hat = aux_acts @ w_dec
        assert (residual - e_hat).pow(2).sum() < residual.pow(2).sum()


# ---------------------------------------------------------------- BatchTopK


@pytest.mark.parametrize("batch,d_in,d_sae,k", [(8, 16, 64, 4), (3, 10, 40, 7), (32, 8, 24, 2)])
def test_batchtopk_keeps_k_times_batch(batch, d_in, d_sae, k):
    sae = make_sae("batchtopk", d_in, d_sae, k=k, seed=batch)
    x = rand_x(batch, d_in, seed=batch + 1)
    pre = sae.pre_acts(x).detach()
    assert (pre > 0).sum() > k * batch  # generic input: enough positive candidates
    out = sae(x)
    assert out.l0.item() * batch == pytest.approx(k * batch)
    assert out.fired.sum().item() == k * batch
    # some sample may keep more than k and another fewer: only the batch total is fixed
    acts = dense_batchtopk_acts(pre, k)
    assert int((acts > 0).sum()) == k * batch
    kept, dropped = pre.relu()[acts > 0], pre.relu()[acts == 0]
    assert kept.min() >= dropped.max()


def test_batchtopk_threshold_updates_in_training_only():
    sae = make_sae("batchtopk", 16, 64, k=4, seed=2)
    x = rand_x(16, 16, seed=3)
    assert sae.topk_threshold.item() == 0.0
    sae.eval()
    sae(x)
    sae.encode(x)
    assert sae.topk_threshold.item() == 0.0
    sae.train()
    with torch.no_grad():
        pre = sae.pre_acts(x)
        acts = dense_batchtopk_acts(pre, 4)
        min_kept = acts[acts > 0].min().item()
    sae(x)
    first = sae.topk_threshold.item()
    assert first == pytest.approx(0.01 * min_kept, rel=1e-5)  # running mean of the smallest kept act
    sae(x)
    assert sae.topk_threshold.item() == pytest.approx(first + 0.01 * (min_kept - first), rel=1e-5)
    assert not sae.topk_threshold.requires_grad
    # inference with the learned threshold is a JumpReLU
    t = sae.topk_threshold.item()
    sae.eval()
    before = sae.topk_threshold.clone()
    enc = sae.encode(x)
    assert torch.equal(sae.topk_threshold, before)
    with torch.no_grad():
        pre = sae.pre_acts(x)
    assert torch.equal(enc, pre.relu() * (pre > t))
    assert torch.equal(sae.threshold, torch.full((64,), t))


# ---------------------------------------------------------------- Standard


@pytest.mark.parametrize("batch,d_in,d_sae", [(1, 8, 32), (17, 16, 64), (40, 5, 33)])
def test_standard_l1(batch, d_in, d_sae):
    sae = make_sae("standard", d_in, d_sae, seed=batch, l1_coefficient=0.3)
    x = rand_x(batch, d_in, seed=batch)
    out = sae(x)
    out.loss.backward()
    p = leaf_params(sae)
    acts = dense_pre(p, x).relu()
    x_hat = acts @ p["W_dec"] + p["b_dec"]
    mse = (x_hat - x).pow(2).sum(-1).mean()
    l1 = acts.abs().sum(-1).mean()
    (mse + 0.3 * l1).backward()
    assert_rel_close(out.x_hat, x_hat, what="x_hat")
    assert_rel_close(out.sparsity_loss, l1, what="l1")
    assert_rel_close(out.loss, mse + 0.3 * l1, what="loss")
    for n in PARAMS:
        assert_rel_close(getattr(sae, n).grad, p[n].grad, what=f"grad {n}")
    assert out.auxk_loss.item() == 0
    assert torch.equal(sae.encode(x), acts.detach())
    assert_rel_close(sae.decode(sae.encode(x)), out.x_hat.detach())


# ---------------------------------------------------------------- JumpReLU


def jumprelu_sae(seed: int, bandwidth: float = 0.1, **kw) -> SparseAutoencoder:
    sae = make_sae("jumprelu", 16, 64, seed=seed, jumprelu_bandwidth=bandwidth, **kw)
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        sae.log_threshold.copy_(torch.empty(64).uniform_(math.log(0.2), math.log(1.0), generator=g))
    return sae


@pytest.mark.parametrize("batch", [1, 9, 50])
def test_jumprelu_forward(batch):
    sae = jumprelu_sae(batch, l0_coefficient=0.01)
    x = rand_x(batch, 16, seed=batch)
    out = sae(x)
    with torch.no_grad():
        pre = sae.pre_acts(x)
        t = sae.log_threshold.exp()
        acts = pre.relu() * (pre > t)
    assert (acts > 0).any() and ((pre > 0) & (pre <= t)).any()  # the threshold matters here
    assert torch.equal(sae.encode(x), acts)
    assert_rel_close(out.x_hat, acts @ sae.W_dec + sae.b_dec, what="x_hat")
    l0 = (acts > 0).sum(-1).float().mean()
    assert out.l0.item() == pytest.approx(l0.item())
    assert out.sparsity_loss.item() == pytest.approx(l0.item())
    assert out.loss.item() == pytest.approx(out.mse.item() + 0.01 * l0.item(), rel=1e-6)
    assert torch.equal(out.fired, (acts > 0).sum(0).float())


def test_jumprelu_threshold_gradients():
    eps = 0.1
    sae = jumprelu_sae(4, bandwidth=eps, l0_coefficient=1.0)
    x = rand_x(64, 16, seed=5)
    with torch.no_grad():
        pre = sae.pre_acts(x).relu()
        t = sae.log_threshold.exp()
        near = ((pre - t).abs() < eps / 2).float()
    assert near.sum(0).gt(0).sum() >= 5 and near.sum(0).eq(0).sum() >= 1

    # reconstruction term: d mse / d t_j = sum_b -(t_j / eps) near_bj dmse/dacts_bj; d/dlog t = t d/dt
    out = sae(x)
    out.mse.backward()
    g_rec = sae.log_threshold.grad.clone()
    with torch.no_grad():
        dacts = 2.0 / x.shape[0] * (out.x_hat - x) @ sae.W_dec.t()
        expect_rec = t * (-(t / eps) * near * dacts).sum(0)
    assert_rel_close(g_rec, expect_rec, what="reconstruction grad of log_threshold")
    assert (g_rec[near.sum(0) > 0] != 0).any()
    assert (g_rec[near.sum(0) == 0] == 0).all()

    # L0 term: d L0 / d t_j = -(1 / eps) * mean_b near_bj, strictly negative where anything is near
    sae.zero_grad()
    xg = x.clone().requires_grad_(True)
    out = sae(xg)
    out.sparsity_loss.backward()
    g_l0 = sae.log_threshold.grad
    expect_l0 = t * (-(1.0 / eps) * near).sum(0) / x.shape[0]
    assert_rel_close(g_l0, expect_l0, what="L0 grad of log_threshold")
    assert (g_l0[near.sum(0) > 0] < 0).all()
    # the step function passes no gradient to its input: nor to x, W_enc, b_enc, b_dec, W_dec
    assert xg.grad is None or (xg.grad == 0).all()
    for n in PARAMS:
        g = getattr(sae, n).grad
        assert g is None or (g == 0).all(), n

    # the full loss carries both
    sae.zero_grad()
    sae(x).loss.backward()
    assert_rel_close(sae.log_threshold.grad, expect_rec + expect_l0, what="total grad of log_threshold")


def test_jumprelu_input_gradient_passes_only_active_latents():
    sae = jumprelu_sae(6)
    x = rand_x(20, 16, seed=6)
    out = sae(x)
    out.mse.backward()
    p = leaf_params(sae)
    pre = dense_pre(p, x)
    t = sae.log_threshold.exp().detach()
    acts = pre.relu() * (pre.detach() > t)
    ((acts @ p["W_dec"] + p["b_dec"] - x).pow(2).sum(-1).mean()).backward()
    for n in PARAMS:
        assert_rel_close(getattr(sae, n).grad, p[n].grad, what=f"grad {n}")


# ---------------------------------------------------------------- decoder constraint and init


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "standard", "jumprelu"])
def test_remove_parallel_gradient(arch):
    sae = SparseAutoencoder(16, 48, arch, k=4, seed=1, l1_coefficient=0.1, l0_coefficient=0.1)
    sae(rand_x(10, 16, seed=2)).loss.backward()
    g0, w = sae.W_dec.grad.clone(), sae.W_dec.detach()
    assert (g0 * w).sum(1).abs().max() > 1e-4  # there was a parallel component
    sae.remove_parallel_gradient()
    g = sae.W_dec.grad
    dots = (g * w).sum(1)
    assert dots.abs().max() <= 1e-6 * g0.norm(dim=1).max()
    # only the parallel part is removed
    assert_rel_close(g, g0 - (g0 * w).sum(1, keepdim=True) * w, what="orthogonal part")
    # other gradients untouched; no gradient at all is fine
    SparseAutoencoder(4, 8, arch, k=2, seed=0).remove_parallel_gradient()


@pytest.mark.slow  # the first optimizer here imports torch._dynamo (1.5-3 s)
def test_trainer_step_keeps_unit_rows_and_stays_on_sphere():
    sae = make_sae("topk", 16, 64, k=4, seed=3, auxk_coefficient=1 / 32, auxk_k=8)
    with torch.no_grad():
        sae.W_dec /= sae.W_dec.norm(dim=1, keepdim=True)
    opt = torch.optim.Adam(sae.parameters(), lr=1e-2)
    dead = dead_mask_for(64, 10)
    for i in range(5):
        opt.zero_grad()
        sae(rand_x(32, 16, seed=i), dead).loss.backward()
        sae.remove_parallel_gradient()
        opt.step()
        sae.normalize_decoder()
        assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(64), atol=1e-6)


def test_normalize_decoder():
    sae = SparseAutoencoder(12, 40, "standard", seed=0)
    with torch.no_grad():
        sae.W_dec.mul_(torch.rand(40, 1) * 5 + 0.1)
    direction = sae.W_dec.detach() / sae.W_dec.detach().norm(dim=1, keepdim=True)
    sae.normalize_decoder()
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(40), atol=1e-6)
    assert_rel_close(sae.W_dec.detach(), direction)
    assert sae.W_dec.requires_grad


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "standard", "jumprelu"])
def test_init(arch):
    a = SparseAutoencoder(16, 64, arch, k=4, seed=123, jumprelu_init_threshold=0.01)
    b = SparseAutoencoder(16, 64, arch, k=4, seed=123, jumprelu_init_threshold=0.01)
    c = SparseAutoencoder(16, 64, arch, k=4, seed=124, jumprelu_init_threshold=0.01)
    assert torch.equal(a.W_enc, a.W_dec.t())
    assert torch.allclose(a.W_dec.norm(dim=1), torch.ones(64), atol=1e-6)
    assert (a.b_enc == 0).all() and (a.b_dec == 0).all()
    for (n, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.W_dec, c.W_dec)
    if arch == "jumprelu":
        assert torch.allclose(a.threshold, torch.full((64,), 0.01))
    names = {n for n, _ in a.named_parameters()}
    assert names == set(PARAMS) | ({"log_threshold"} if arch == "jumprelu" else set())


@pytest.mark.parametrize("seed", [0, 7])
def test_init_does_not_start_at_the_synthetic_truth_of_the_same_seed(seed):
    """The synthetic source plants randn(features, d_in) from Generator(seed); an SAE of the same
    seed once drew its decoder the same way, so its first rows were the planted features and every
    planted benchmark began at the answer."""
    from sae_dist.data.sources.synthetic import SyntheticSource

    source = SyntheticSource(d_in=32, n_features=64, active=2, power_law=0.5, noise=0.01, seed=seed,
                             rank=0, world_size=1, batch_size=8)
    sae = SparseAutoencoder(32, 128, "topk", k=4, seed=seed)
    best = (sae.W_dec.detach() @ source.dictionary.t()).abs().max(dim=0).values
    assert best.max() < 0.9, f"a planted feature is already a decoder row (best |cos| {best.max():.3f})"


# ---------------------------------------------------------------- inference encode


@pytest.mark.parametrize("batch,d_in,d_sae,k", SHAPES)
def test_topk_encode_matches_training_path(batch, d_in, d_sae, k):
    sae = make_sae("topk", d_in, d_sae, k=k, seed=batch + 3)
    x = rand_x(batch, d_in, seed=batch + 4)
    with torch.no_grad():
        out = sae(x)
        enc = sae.encode(x)
        expect = dense_topk_acts(sae.pre_acts(x), k)
    assert_rel_close(enc, expect, what="encode")
    assert torch.equal(out.fired, (enc > 0).sum(0).float())
    assert out.l0.item() == pytest.approx((enc > 0).sum(-1).float().mean().item())
    assert_rel_close(sae.decode(enc), out.x_hat, what="decode(encode(x)) vs training x_hat")


@pytest.mark.parametrize("arch", ["topk", "batchtopk", "matryoshka", "matryoshka_batch", "standard", "jumprelu"])
def test_encode_accepts_leading_dims(arch):
    sae = make_sae(arch, 8, 32, k=3, seed=1)
    x = torch.randn(2, 5, 8)
    enc = sae.encode(x)
    assert enc.shape == (2, 5, 32)
    assert_rel_close(enc, sae.encode(x.reshape(10, 8)).reshape(2, 5, 32))
    assert sae.decode(enc).shape == (2, 5, 8)
