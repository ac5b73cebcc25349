"""SAEs on disk in SAELens' format, so `sae_lens.SAE.load_from_disk(path)` loads what we train.

A folder with `cfg.json` (SAELens 6 keys), `sae_weights.safetensors` (W_enc [d_in, d_sae], b_enc,
W_dec [d_sae, d_in], b_dec, and `threshold` for JumpReLU) and `sparsity.safetensors` (log10
feature density). BatchTopK and Matryoshka BatchTopK are saved as JumpReLU with the learned
threshold, as SAELens does: at inference a batch-level top-k has no batch to look at (the
metadata keeps the trained architecture and, for Matryoshka, its prefixes' widths).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sae_dist.models.sae import SparseAutoencoder

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
SPARSITY = "sparsity.safetensors"
# The SAELens config format we write (not a SAELens we ran): 6.x reads it without conversion.
SAELENS_FORMAT_VERSION = "6.0.0"


def saelens_architecture(sae: SparseAutoencoder) -> str:
    """How SAELens runs it at inference: batch-level top-k as a JumpReLU with the learned threshold,
    per-sample top-k as TopK; a transcoder as SAELens' (skip_)transcoder, ReLU or JumpReLU (SAELens
    has no TopK transcoder: the config refuses one)."""
    if sae.architecture in ("standard", "jumprelu"):
        base = sae.architecture
    else:
        base = "jumprelu" if sae.batch_level else "topk"
    if not sae.transcoder:
        return base
    kind = "skip_transcoder" if sae.skip else "transcoder"
    return {"standard": kind, "jumprelu": f"jumprelu_{kind}"}[base]


def export_saelens(sae: SparseAutoencoder, out_dir: Path, feature_density: torch.Tensor | None = None,
                   metadata: dict[str, Any] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.float().contiguous().cpu() for k, v in sae.inference_state_dict().items()}
    cfg: dict[str, Any] = {
        "architecture": saelens_architecture(sae),
        "d_in": sae.d_in,
        "d_sae": sae.d_sae,
        "dtype": "float32",
        "device": "cpu",
        "apply_b_dec_to_input": not sae.transcoder,  # a transcoder's input offset is folded into b_enc
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
    if sae.architecture == "matryoshka":
        cfg["metadata"]["matryoshka_widths"] = list(sae.matryoshka_widths)
        cfg["metadata"]["matryoshka_selection"] = "batch" if sae.batch_level else "sample"
    if sae.transcoder:
        cfg["d_out"] = sae.d_in
    if cfg["architecture"] == "topk":
        cfg["k"] = sae.k
        cfg["rescale_acts_by_decoder_norm"] = False
    save_file(weights, str(out / WEIGHTS))
    density = feature_density if feature_density is not None else torch.zeros(sae.d_sae)
    save_file({"sparsity": torch.log10(density.float().cpu().clamp_min(1e-10))}, str(out / SPARSITY))
    (out / CFG).write_text(json.dumps(cfg, indent=2))
    return out


def load_sae(path: str | Path, device: str | torch.device = "cpu") -> SparseAutoencoder:
    """Our SparseAutoencoder from an SAE folder in SAELens format (ours or SAELens' own topk /
    standard / jumprelu): read and checked by sae_dist.evaluate's loader, then folded so that our
    encode gives SAELens' activations."""
    from sae_dist.evaluate.load import load_sae as read_sae_folder

    read = read_sae_folder(path, device)
    sae = SparseAutoencoder(read.d_in, read.d_sae, read.architecture, k=read.k or 1, device=device,
                            transcoder=read.transcoder, skip=read.W_skip is not None)
    state = {"W_enc": read.W_enc, "b_enc": read.b_enc, "W_dec": read.W_dec, "b_dec": read.b_dec}
    if read.transcoder:
        state["b_in"] = torch.zeros_like(read.b_dec)  # SAELens' transcoders read x as it is
    if read.W_skip is not None:
        state["W_skip"] = read.W_skip
    if not read.apply_b_dec_to_input and not read.transcoder:
        # SAELens encodes x @ W_enc + b_enc; ours subtracts b_dec first, so fold it into b_enc.
        state["b_enc"] = state["b_enc"] + state["b_dec"] @ state["W_enc"]
    if read.rescale_acts_by_decoder_norm:
        # Fold the decoder norms into the encoder (exact for TopK, as SAELens' fold_W_dec_norm).
        norms = state["W_dec"].norm(dim=1).clamp_min(1e-8)
        state["W_dec"] = state["W_dec"] / norms[:, None]
        state["W_enc"] = state["W_enc"] * norms
        state["b_enc"] = state["b_enc"] * norms
    if read.architecture == "jumprelu":
        state["log_threshold"] = read.threshold.clamp_min(1e-12).log()
    sae.load_state_dict(state)
    return sae.eval()


def load_feature_density(path: str | Path) -> torch.Tensor:
    return 10 ** load_file(str(Path(path) / SPARSITY))["sparsity"]
