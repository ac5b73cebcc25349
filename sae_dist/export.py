"""SAEs on disk in SAELens' format, so `sae_lens.SAE.load_from_disk(path)` loads what we train.

A folder with `cfg.json` (SAELens 6 keys), `sae_weights.safetensors` (W_enc [d_in, d_sae], b_enc,
W_dec [d_sae, d_in], b_dec, and `threshold` for JumpReLU) and `sparsity.safetensors` (log10
feature density). BatchTopK is saved as JumpReLU with its learned threshold, as SAELens does:
at inference a batch-level top-k has no batch to look at.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sae_dist.errors import UserError
from sae_dist.sae import SparseAutoencoder

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SPARSITY = "sparsity.safetensors"
# The SAELens config format we write (not a SAELens we ran): 6.x reads it without conversion.
SAELENS_FORMAT_VERSION = "6.0.0"


def saelens_architecture(architecture: str) -> str:
    return {"topk": "topk", "standard": "standard", "jumprelu": "jumprelu", "batchtopk": "jumprelu"}[architecture]


def export_saelens(sae: SparseAutoencoder, out_dir: Path, feature_density: torch.Tensor | None = None,
                   metadata: dict[str, Any] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.float().contiguous().cpu() for k, v in sae.inference_state_dict().items()}
    cfg: dict[str, Any] = {
        "architecture": saelens_architecture(sae.architecture),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": True,
        "normalize_activations": "none",
        "reshape_activations": "none",
        "metadata": {
            "sae_lens_version": SAELENS_FORMAT_VERSION,
            "sae_lens_training_version": None,
            "trained_with": "sae-dist",
            "trained_architecture": sae.architecture,
            **(metadata or {}),
        },
    }
    if sae.architecture == "topk":
        cfg["k"] = sae.k
        cfg["rescale_acts_by_decoder_norm"] = False
    save_file(weights, str(out / WEIGHTS))
    density = feature_density if feature_density is not None else torch.zeros(sae.d_sae)
    save_file({"sparsity": torch.log10(density.float().cpu().clamp_min(1e-10))}, str(out / SPARSITY))
    (out / CFG).write_text(json.dumps(cfg, indent=2))
    return out


def load_sae(path: str | Path, device: str | torch.device = "cpu") -> SparseAutoencoder:
    """Load an SAE folder in SAELens format (ours or SAELens' own topk / standard / jumprelu)."""
    p = Path(path)
    if not (p / CFG).is_file() or not (p / WEIGHTS).is_file():
        raise UserError(f"{p} is not an SAE folder: it needs {CFG} and {WEIGHTS}")
    cfg = json.loads((p / CFG).read_text())
    arch = cfg.get("architecture", "standard")
    if arch not in ("topk", "standard", "jumprelu"):
        raise UserError(f"{p}: architecture {arch!r} is not one sae-dist can load")
    if "d_in" not in cfg or "d_sae" not in cfg:
        raise UserError(f"{p / CFG} lacks d_in or d_sae")
    if cfg.get("normalize_activations", "none") not in ("none", None):
        raise UserError(f"{p}: normalize_activations={cfg['normalize_activations']!r} is not supported "
                        "(sae-dist loads SAEs that read raw activations)")
    weights = load_file(str(p / WEIGHTS))
    d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    sae = SparseAutoencoder(d_in, d_sae, arch, k=int(cfg.get("k", 1)), device=device)
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if arch == "jumprelu":
        shapes["threshold"] = (d_sae,)
    absent = [n for n in shapes if n not in weights]
    if absent:
        raise UserError(f"{p / WEIGHTS} lacks {', '.join(absent)} (a {arch} SAE needs {', '.join(shapes)})")
    bad = [f"{n} is {tuple(weights[n].shape)}, expected {s}" for n, s in shapes.items()
           if tuple(weights[n].shape) != s]
    if bad:
        raise UserError(f"{p}: weight shapes do not match d_in={d_in}, d_sae={d_sae} in {CFG}: {'; '.join(bad)}")
    state = {name: weights[name].float() for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
    if not cfg.get("apply_b_dec_to_input", True):
        # SAELens encodes x @ W_enc + b_enc; ours subtracts b_dec first, so fold it into b_enc.
        state["b_enc"] = state["b_enc"] + state["b_dec"] @ state["W_enc"]
    if arch == "topk" and cfg.get("rescale_acts_by_decoder_norm", False):
        # Fold the decoder norms into the encoder (exact for TopK, as SAELens' fold_W_dec_norm).
        norms = state["W_dec"].norm(dim=1).clamp_min(1e-8)
        state["W_dec"] = state["W_dec"] / norms[:, None]
        state["W_enc"] = state["W_enc"] * norms
        state["b_enc"] = state["b_enc"] * norms
    if arch == "jumprelu":
        state["log_threshold"] = weights["threshold"].float().clamp_min(1e-12).log()
    sae.load_state_dict(state)
    return sae.eval()


def load_feature_density(path: str | Path) -> torch.Tensor:
    return 10 ** load_file(str(Path(path) / SPARSITY))["sparsity"]
