"""Import rules of the trainer's side: the run-directory helpers stay torch-free (the app and the
launcher check a run directory before any rank starts: sae_dist.paths, sae_dist.train.checkpoint),
and the harvest never imports the sources (the `model` source reads a model with the harvest's
reader; a harvest writes shards with sae_dist.data.shard_format), so the arrow between the two
packages goes one way."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from sae_dist.data.shard_format import write_shards

HARVEST = REPO / "sae_dist" / "data" / "harvest"


def test_paths_is_torch_free():
    code = ("import sys, sae_dist.paths as p; assert p.safe_name('../a b') == '_a_b', p.safe_name('../a b'); "
            "import sae_dist.train.checkpoint as c; assert c.check_run_dir is not None; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at any depth (module level and inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return out


def test_harvest_does_not_import_the_sources():
    files = sorted(HARVEST.glob("*.py"))
    assert files
    found = {f.name: sorted(m for m in _imports(f)
                            if m == "sae_dist.data.sources" or m.startswith("sae_dist.data.sources."))
             for f in files}
    assert not any(found.values()), found


@pytest.mark.slow
def test_the_train_page_reads_shards_without_torch(tmp_path):
    # The page's own module-level imports, run as written, then what it calls for a shards directory.
    page = ast.parse((REPO / "pages" / "1_Train.py").read_text())
    imports = "\n".join(ast.unparse(node) for node in page.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    write_shards(tmp_path / "acts", [torch.randn(5, 12), torch.randn(3, 12)])
    code = (f"import sys\n{imports}\nlayout = read_layout({str(tmp_path / 'acts')!r})\n"
            "assert (layout.d_in, layout.total_rows, layout.dtype_name) == (12, 8, 'float32'), layout\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
