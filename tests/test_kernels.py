"""The compiled CPU top-k kernel against torch.topk, and the trainer without a compiler."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from sae_dist.models.kernels import build_name, cpu_topk, module_name


def kernel_topk(pre, bias, k, dead=None, k_aux=0):
    rows = pre.shape[0]
    vals, idx = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.long)
    aux_vals, aux_idx = torch.empty(rows, max(k_aux, 1)), torch.empty(rows, max(k_aux, 1), dtype=torch.long)
    dead_u8 = dead.to(torch.uint8) if dead is not None else torch.empty(0, dtype=torch.uint8)
    cpu_topk().topk_rows(pre, bias, k, vals, idx, dead_u8, k_aux, aux_vals, aux_idx)
    return vals, idx, aux_vals[:, :k_aux], aux_idx[:, :k_aux]


def as_sets(vals, idx):
    order = idx.argsort(dim=1)
    return vals.gather(1, order), idx.gather(1, order)


# (rows, n, k): n a multiple of the kernel's group of 16 or not, k = n, k = 1, fewer groups than k
@pytest.mark.parametrize("rows,n,k", [(64, 4096, 32), (50, 1000, 7), (9, 50, 50), (33, 17, 1), (5, 300, 40)])
@pytest.mark.parametrize("with_aux", [False, True])
def test_kernel_selects_what_torch_topk_selects(rows, n, k, with_aux):
    assert cpu_topk() is not None, "the kernel did not build (scripts/setup.sh builds it)"
    g = torch.Generator().manual_seed(rows * n + k)
    pre, bias = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)
    dead = torch.rand(n, generator=g) < 0.4 if with_aux else None
    k_aux = min(max(1, n // 3), int(dead.sum())) if with_aux else 0
    vals, idx, aux_vals, aux_idx = kernel_topk(pre, bias, k, dead, k_aux)
    ref_vals, ref_idx = (pre + bias).topk(k, dim=-1)
    for a, b in zip(as_sets(vals, idx), as_sets(ref_vals, ref_idx)):
        assert torch.equal(a, b)
    if with_aux:
        ref = (pre + bias).masked_fill(~dead, float("-inf")).topk(k_aux, dim=-1)
        for a, b in zip(as_sets(aux_vals, aux_idx), as_sets(ref.values, ref.indices)):
            assert torch.equal(a, b)


@pytest.mark.slow
def test_without_a_compiler_training_uses_torch_topk(tmp_path):
    """No compiler: one warning, and the stock path trains (a missing kernel costs speed only)."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "CXX": "/bin/false"}
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "import torch; from sae_dist.models.kernels import cpu_topk; assert cpu_topk() is None;"
            "from sae_dist.models.sae import SparseAutoencoder;"
            "sae = SparseAutoencoder(16, 64, 'topk', 4, seed=0); out = sae(torch.randn(8, 16)); out.loss.backward();"
            "print('trained', float(out.loss) > 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "trained True" in result.stdout
    assert "could not build the topk_cpu kernel" in result.stderr and "using stock PyTorch" in result.stderr


def test_a_build_is_named_by_its_source_and_torch_so_checkouts_never_rebuild_each_others():
    """torch's extension cache is per user: under one name, two checkouts (or one before and after
    an update) rebuilt the kernel in turn at their jobs' start. Alike sources share a build."""
    same = build_name("topk_cpu", b"int f();", "2.13.0+cpu")
    assert same == build_name("topk_cpu", b"int f();", "2.13.0+cpu") and same.startswith("sae_dist_topk_cpu_")
    assert build_name("topk_cpu", b"int f(); // changed", "2.13.0+cpu") != same
    assert build_name("topk_cpu", b"int f();", "2.11.0+cu130") != same
    # Two virtualenvs of one torch: the build names each one's headers, so each has its own.
    assert build_name("topk_cpu", b"int f();", "2.13.0+cpu", "/a/.venv/torch") != \
        build_name("topk_cpu", b"int f();", "2.13.0+cpu", "/b/.venv/torch")
    import torch

    source = (REPO / "sae_dist" / "models" / "kernels" / "topk_cpu.cpp").read_bytes()
    assert module_name("topk_cpu") == build_name("topk_cpu", source, torch.__version__, os.path.dirname(torch.__file__))


@pytest.mark.slow
def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next(tmp_path):
    """torch's build lock is a file: a process killed mid-build (a job cancelled at its start) left
    it behind and every later training waited for it forever. The kernel, already built, copied
    into a fresh extension directory with such a leftover `lock`: a new process loads it."""
    from torch.utils.cpp_extension import _get_build_directory

    assert cpu_topk() is not None  # built (or loaded) here first
    built = Path(_get_build_directory(module_name("topk_cpu"), False))
    copy = tmp_path / "ext" / module_name("topk_cpu")
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock"))
    (copy / "lock").touch()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    code = ("import logging; logging.basicConfig(level=logging.INFO);"
            "from sae_dist.models.kernels import cpu_topk; print('kernel', cpu_topk() is not None)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    assert "kernel True" in result.stdout, result.stderr
    assert "left by a build that was killed" in result.stderr
    assert not (copy / "lock").exists()
    # What a job waits for at its start is in its log (the Monitor shows the last line): the build.
    assert "loading the topk_cpu kernel (built once per source and torch version" in result.stderr
    assert re.search(r"the topk_cpu kernel was ready after \d+ s", result.stderr), result.stderr[-2000:]
