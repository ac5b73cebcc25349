"""The shared training step: gradient accumulation, DDP's buckets, the compression hook."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sae_dist.config import TrainConfig
from sae_dist.distributed import DistContext
from sae_dist.models.sae import SparseAutoencoder
from sae_dist.train.step import ddp_bucket_mb, make_optimizer, train_step, wrap_ddp


def sae_and_sgd(seed: int = 0):
    sae = SparseAutoencoder(32, 256, "topk", 8, seed=seed)
    # Plain SGD: the weight change is the gradient itself, so equal weights mean equal gradients.
    return sae, torch.optim.SGD(sae.parameters(), lr=1.0)


def test_micro_batches_give_the_whole_batch_step():
    x = torch.randn(96, 32, generator=torch.Generator().manual_seed(1))
    whole, opt_w = sae_and_sgd()
    parts, opt_p = sae_and_sgd()
    train_step(whole, whole, opt_w, [x], None)
    result = train_step(parts, parts, opt_p, list(x.chunk(3)), None, grad_norm=True)
    assert len(result.outputs) == 3 and result.grad_norm > 0
    for (name, a), b in zip(whole.named_parameters(), parts.parameters()):
        a, b = a.detach(), b.detach()
        assert float((a - b).norm() / a.norm()) < 1e-6, name


def test_adam_is_fused_and_steps():
    sae = SparseAutoencoder(16, 64, "topk", 4, seed=0)
    opt = make_optimizer(sae, 1e-3)
    assert opt.defaults["fused"] is True
    before = sae.W_enc.detach().clone()
    train_step(sae, sae, opt, [torch.randn(32, 16)], None)
    assert not torch.equal(before, sae.W_enc)
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(64), atol=1e-5)  # decoder rows stay unit


@pytest.fixture
def one_rank_group(tmp_path):
    """A real gloo process group of one rank (DDP's bucketing does not depend on the count)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compress", ["none", "bf16"])
def test_decoder_gradient_is_a_bucket_of_its_own(one_rank_group, compress):
    """So its all-reduce starts while the encoder's backward is still running."""
    sae = SparseAutoencoder(128, 4096, "topk", 8, seed=0)
    cfg = TrainConfig(d_in=128, d_sae=4096, ddp_compress=compress)
    assert ddp_bucket_mb(sae, cfg) == 2.0  # 4096 x 128 fp32
    model = wrap_ddp(sae, DistContext(0, 2, 0, torch.device("cpu"), "gloo"), cfg)
    opt = make_optimizer(sae, 1e-3)
    for _ in range(3):  # DDP rebuilds its buckets in gradient-ready order, then logs them
        train_step(model, sae, opt, [torch.randn(64, 128)], None)
    data = model._get_ddp_logging_data()
    sizes = [int(s) for s in data["rebuilt_bucket_sizes"].split(",")]
    assert sizes[0] == sae.W_dec.numel() * 4 and len(sizes) >= 2
    assert data["rebuilt_per_bucket_param_indices"].split(",")[0].strip() == "0"  # W_dec is parameter 0


@pytest.mark.slow
def test_an_sae_never_loads_the_compiler():
    """torch._dynamo costs 1.5 to 3 s to import: loading the trainer's modules and running an SAE
    forward and backward (TopK with AuxK) must not pull it in. (torch.optim's own param groups
    import it lazily, so a process that builds an optimizer pays it anyway.)"""
    import subprocess
    import sys

    code = ("import sys, torch, sae_dist.train.loop\n"
            "from sae_dist.models.sae import SparseAutoencoder\n"
            "sae = SparseAutoencoder(32, 256, 'topk', 8, auxk_coefficient=1/32, seed=0)\n"
            "sae(torch.randn(64, 32), dead_mask=torch.ones(256, dtype=torch.bool)).loss.backward()\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
