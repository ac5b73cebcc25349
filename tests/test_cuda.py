"""What only a real GPU can show (marked `cuda`; each test skips, saying why, where torch sees no
CUDA device). `scripts/gpu_check.sh` runs them on the first machine with GPUs; on machines
without one the NVML side is covered by the emulated driver (tests/test_nvml_*.py), and CUDA,
NCCL and bf16 are not covered at all.

- NVML's view (the product's inventory) and CUDA's under CUDA_DEVICE_ORDER=PCI_BUS_ID name the
  same GPU at every index, and their free memory roughly agrees; `--balance memory` finds each
  rank's GPU in NVML by CUDA's UUID and PCI bus id and reads its free memory there;
- the health probe's whole path (NVML, then a CUDA allocation, computation and synchronize) on
  a healthy GPU says HEALTHY with nothing left unchecked;
- one training step on CUDA (fp32) matches the CPU's; a bf16 step stays finite and close;
- a 2-GPU training through the trainer's own command (torchrun, NCCL) completes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_cli

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible to torch here")]

GIB = 2**30
CUDA_VIEW = """
import json, os, torch
os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
rows = []
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    rows.append({"uuid": "GPU-" + str(torch.cuda.get_device_properties(i).uuid), "free": free, "total": total})
print(json.dumps(rows))
"""


def nvml_view() -> list[dict]:
    code = ("import json; from scheduler.devices import nvml_inventory\n"
            "print(json.dumps([{'uuid': d.uuid, 'index': d.index, 'free': d.memory_free, "
            "'total': d.memory_total, 'error': d.error} for d in nvml_inventory() or []]))")
    env = {k: v for k, v in os.environ.items() if k not in ("SAE_DIST_VIRTUAL_GPUS", "CUDA_VISIBLE_DEVICES")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_nvml_and_cuda_in_pci_bus_order_name_the_same_gpus():
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    out = subprocess.run([sys.executable, "-c", CUDA_VIEW], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cuda, nvml = json.loads(out.stdout), nvml_view()
    assert [d["uuid"] for d in nvml] == [d["uuid"] for d in cuda]
    assert all(d["error"] is None for d in nvml), nvml
    for n, c in zip(nvml, cuda):
        assert n["total"] >= c["total"]  # NVML counts memory CUDA reserves for itself
        assert abs(n["free"] - c["free"]) < 2 * GIB, (n, c)  # CUDA's context takes a few hundred MiB


def test_balance_memory_finds_each_gpu_in_nvml_and_reads_what_cuda_sees():
    """`--balance memory` reads a rank's free memory from NVML, finding its GPU by CUDA's UUID or
    PCI bus id (sae_dist.train.free_memory): both ways name a GPU NVML knows, and the figure agrees with
    CUDA's own within 1 GiB (other processes may allocate in between)."""
    from sae_dist.train.free_memory import cuda_identity, free_memory, nvml_free_memory

    for i in range(torch.cuda.device_count()):
        device = torch.device("cuda", i)
        uuid, bus = cuda_identity(device)
        assert uuid is not None, "this torch reports no UUID: the NVML read falls back to the bus id"
        by_uuid, why = nvml_free_memory(uuid)
        assert by_uuid is not None, why
        if bus is not None:
            by_bus, why = nvml_free_memory(None, bus)
            assert by_bus is not None, why
        free, source = free_memory(device)
        assert "NVML" in source, source
        assert abs(free - torch.cuda.mem_get_info(device)[0]) < GIB


def test_the_health_probe_checks_cuda_too_on_a_healthy_gpu():
    from scheduler.health import probe_all

    uuid = nvml_view()[0]["uuid"]
    [result] = probe_all([uuid], timeout_s=180)
    assert result.healthy and result.detail == "health check passed", result.detail  # no "NVML only"


def _one_step(device: str, precision: str):
    """The parameters after one training step, and the step's update to each (after - before)."""
    from sae_dist.config import TrainConfig
    from sae_dist.models.sae import SparseAutoencoder
    from sae_dist.train.step import autocast_for, make_optimizer, train_step

    torch.manual_seed(0)
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(1)).to(device)
    sae = SparseAutoencoder(256, 2048, "topk", 32, seed=0).to(device)
    before = {name: p.detach().float().cpu().clone() for name, p in sae.named_parameters()}
    opt = make_optimizer(sae, 1e-3)
    cfg = TrainConfig(d_in=256, d_sae=2048, precision=precision)
    autocast = autocast_for(cfg, torch.device(device))
    # autocast_for lets fp32 products use TF32 on GPUs (as training does); this compares fp32 alike
    torch.backends.cuda.matmul.allow_tf32 = False
    train_step(sae, sae, opt, [x], None, autocast=autocast)
    after = {name: p.detach().float().cpu() for name, p in sae.named_parameters()}
    return after, {name: after[name] - before[name] for name in after}


def test_a_cuda_step_matches_the_cpu_one_and_bf16_stays_close():
    cpu, cpu_update = _one_step("cpu", "fp32")
    gpu, _ = _one_step("cuda", "fp32")
    for name in cpu:
        assert float((cpu[name] - gpu[name]).norm() / cpu[name].norm()) < 1e-3, name
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    bf16, bf16_update = _one_step("cuda", "bf16")
    assert all(torch.isfinite(p).all() for p in bf16.values())
    for name in cpu:
        if float(cpu[name].norm()) > 2 * float(cpu_update[name].norm()):
            assert float((cpu[name] - bf16[name]).norm() / cpu[name].norm()) < 5e-2, name
        else:
            # A parameter that starts at 0 (b_dec) is its first step alone, and Adam's first step
            # moves each entry by about lr times its gradient's sign: a gradient near 0 that bf16
            # rounds the other way flips that entry (on an H200, 8 of b_dec's 256: 35% apart as
            # vectors). The step must still point the same way.
            cosine = torch.nn.functional.cosine_similarity(cpu_update[name].flatten(), bf16_update[name].flatten(),
                                                           dim=0)
            assert float(cosine) > 0.9, (name, float(cosine))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_two_gpu_training_over_nccl_completes(tmp_path):
    out = run_cli("train", "--d-in", "64", "--d-sae", "512", "--k", "16", "--steps", "20", "--log-every", "5",
                  "--batch-size", "1024", "--devices", "cuda:2", "--out-dir", str(tmp_path / "run"),
                  "--checkpoint-every", "0", timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]  # CUDA ranks join with NCCL (sae_dist/train/loop.py)
