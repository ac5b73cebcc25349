"""Load an SAE folder in SAELens' format for evaluation, computing exactly what SAELens computes.

Reads `cfg.json` and `sae_weights.safetensors` as sae-dist's export writes them and as SAELens 6
`save_inference_model` writes them for `standard` (ReLU), `topk` and `jumprelu` SAEs (BatchTopK
is saved as JumpReLU by both). Encode and decode follow SAELens' inference classes step by step
(`apply_b_dec_to_input`, `rescale_acts_by_decoder_norm`, the JumpReLU mask `pre > threshold`), so
the reconstruction is the one a SAELens user gets. What would need more than the two files to
evaluate correctly (an activation normalisation SAELens applies at run time or expects folded in,
another architecture) is refused with a UserError that says so. SAELens' transcoders (`transcoder`,
`skip_transcoder` and their `jumprelu_` kinds: ReLU or JumpReLU latents, no b_dec on the input,
an output of width d_out, W_skip for the skip path) load too, where d_out equals d_in: their rows
are then pairs [x | y] (sae_dist.data.sources.paired).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from sae_dist.data.sources.paired import PairedRows
from sae_dist.errors import UserError

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "topk", "jumprelu")
# SAELens' transcoder kinds: (the latents' architecture, whether there is a skip path)
TRANSCODERS = {"transcoder": ("standard", False), "skip_transcoder": ("standard", True),
               "jumprelu_transcoder": ("jumprelu", False), "jumprelu_skip_transcoder": ("jumprelu", True)}


@dataclass
class LoadedSae(PairedRows):
    """An SAE read from disk: float32 tensors on CPU (or `device`), SAELens' encode and decode."""

    path: Path
    architecture: str  # "standard", "topk" or "jumprelu" (SAELens' names)
    d_in: int
    d_sae: int
    W_enc: Tensor  # [d_in, d_sae]
    b_enc: Tensor  # [d_sae]
    W_dec: Tensor  # [d_sae, d_in]
    b_dec: Tensor  # [d_in]
    threshold: Tensor | None = None  # [d_sae], jumprelu only
    k: int | None = None  # topk only
    apply_b_dec_to_input: bool = True
    rescale_acts_by_decoder_norm: bool = False  # topk only
    cfg: dict[str, Any] = field(default_factory=dict)
    transcoder: bool = False  # rows [x | y]: predicts y from x
    W_skip: Tensor | None = None  # [d_out, d_in], a skip transcoder's

    @torch.no_grad()
    def predict(self, x: Tensor, acts: Tensor) -> Tensor:
        """A transcoder's output: decode, plus `x @ W_skip.T` for a skip transcoder (SAELens' forward)."""
        out = self.decode(acts)
        return out + x.to(out) @ self.W_skip.t() if self.W_skip is not None else out

    @property
    def device(self) -> torch.device:
        return self.W_dec.device

    def to(self, device: str | torch.device) -> LoadedSae:
        moved = {name: getattr(self, name).to(device) for name in ("W_enc", "b_enc", "W_dec", "b_dec")}
        for name in ("threshold", "W_skip"):
            if getattr(self, name) is not None:
                moved[name] = getattr(self, name).to(device)
        return LoadedSae(**{**self.__dict__, **moved})

    @torch.no_grad()
    def encode(self, x: Tensor) -> Tensor:
        """Dense latent activations [n, d_sae] of rows x [n, d_in] (SAELens' `encode`)."""
        x = x.to(device=self.W_enc.device, dtype=self.W_enc.dtype)
        sae_in = x - self.b_dec if self.apply_b_dec_to_input else x
        pre = sae_in @ self.W_enc + self.b_enc
        if self.architecture == "standard":
            return pre.relu()
        if self.architecture == "jumprelu":
            return pre.relu() * (pre > self.threshold).to(pre.dtype)
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self.W_dec.norm(dim=-1)
        vals, idx = pre.topk(self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, idx, vals.relu())

    @torch.no_grad()
    def decode(self, acts: Tensor) -> Tensor:
        """Reconstruction [n, d_in] from activations [n, d_sae] (SAELens' `decode`)."""
        acts = acts.to(device=self.W_dec.device, dtype=self.W_dec.dtype)
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts * (1 / self.W_dec.norm(dim=-1))
        return acts @ self.W_dec + self.b_dec


def _read_cfg(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((path / CFG).read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path / CFG}: cannot be read ({e})") from e
    except ValueError as e:
        raise UserError(f"{path / CFG} is not valid JSON ({e}); is this an SAE folder?") from e
    if not isinstance(cfg, dict):
        raise UserError(f"{path / CFG} is not a JSON object; is this an SAE folder?")
    return cfg


def _architecture(path: Path, cfg: dict[str, Any]) -> tuple[str, int | None]:
    """SAELens 6 `architecture` (plus `k` for topk); configs before 6.0 name an `activation_fn`."""
    arch = cfg.get("architecture")
    if arch is None:
        # SAELens before 6.0 wrote no architecture: a ReLU SAE, or TopK through activation_fn.
        fn = cfg.get("activation_fn", cfg.get("activation_fn_str", "relu"))
        kwargs = cfg.get("activation_fn_kwargs") or {}
        if fn == "topk" and kwargs.get("k") is not None:
            return "topk", int(kwargs["k"])
        if fn != "relu":
            raise UserError(f"{path / CFG}: activation_fn {fn!r} is not one sae-dist can evaluate "
                            f"(it evaluates relu, topk and jumprelu SAEs)")
        return "standard", None
    if arch in TRANSCODERS:
        return arch, None
    if arch not in ARCHITECTURES:
        raise UserError(f"{path / CFG}: architecture {arch!r} is not one sae-dist can evaluate "
                        f"(it evaluates {', '.join(ARCHITECTURES + tuple(TRANSCODERS))})")
    if arch == "standard" and cfg.get("activation_fn", "relu") not in ("relu", None):
        raise UserError(f"{path / CFG}: a standard SAE with activation_fn {cfg['activation_fn']!r}; "
                        f"sae-dist evaluates ReLU ones only")
    if arch == "topk":
        k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise UserError(f"{path / CFG}: a topk SAE needs a positive integer k, found {k!r}")
        return arch, k
    return arch, None


def load_sae(path: str | Path, device: str | torch.device = "cpu") -> LoadedSae:
    """Read an SAE folder (cfg.json + sae_weights.safetensors); raise UserError for what is not one."""
    p = Path(path)
    if not p.is_dir():
        raise UserError(f"SAE folder {p} does not exist (an SAE folder holds {CFG} and {WEIGHTS})"
                        if not p.exists() else f"{p} is not an SAE folder (a file, not a directory with {CFG} "
                        f"and {WEIGHTS})")
    absent = [name for name in (CFG, WEIGHTS) if not (p / name).is_file()]
    if absent:
        raise UserError(f"{p} is not an SAE folder: it has no {' and no '.join(absent)}")
    cfg = _read_cfg(p)
    arch, k = _architecture(p, cfg)
    arch, skip = TRANSCODERS.get(arch, (arch, None))
    transcoder = skip is not None
    norm = cfg.get("normalize_activations", "none")
    if norm not in ("none", None):
        # SAELens applies layer_norm / constant_norm_rescale per row at run time and expects the
        # others folded in with a factor not in these files: evaluating raw rows would be wrong.
        raise UserError(f"{p / CFG}: normalize_activations={norm!r} is not supported (sae-dist evaluates "
                        f"SAEs that read raw activations, normalize_activations 'none')")
    try:
        d_in, d_sae = int(cfg["d_in"]), int(cfg["d_sae"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{p / CFG} lacks an integer d_in or d_sae") from e
    if k is not None and k > d_sae:
        raise UserError(f"{p / CFG}: k={k} is more than d_sae={d_sae}")
    if transcoder and cfg.get("d_out", d_in) != d_in:
        raise UserError(f"{p / CFG}: a transcoder from width {d_in} to {cfg.get('d_out')}; sae-dist evaluates "
                        f"transcoders between sites of one width (d_out = d_in)")
    try:
        weights = load_file(str(p / WEIGHTS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise UserError(f"{p / WEIGHTS} is not a readable safetensors file ({e}); it may be truncated or "
                        f"corrupted: export the SAE again") from e
    if arch == "jumprelu" and "threshold" not in weights and "log_threshold" in weights:
        weights["threshold"] = weights.pop("log_threshold").float().exp()  # older SAELens files
    shapes = {"W_enc": (d_in, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, d_in), "b_dec": (d_in,)}
    if arch == "jumprelu":
        shapes["threshold"] = (d_sae,)
    if skip:
        shapes["W_skip"] = (d_in, d_in)
    missing = [n for n in shapes if n not in weights]
    if missing:
        raise UserError(f"{p / WEIGHTS} lacks {', '.join(missing)} (a {arch} SAE needs {', '.join(shapes)})")
    bad = [f"{n} is {list(weights[n].shape)}, expected {list(s)}" for n, s in shapes.items()
           if tuple(weights[n].shape) != s]
    if bad:
        raise UserError(f"{p}: weight shapes do not match d_in={d_in}, d_sae={d_sae} in {CFG}: {'; '.join(bad)}")
    # float32 whatever the stored dtype (SAELens would run a bf16 SAE in bf16): the metrics then
    # measure the weights, not bf16 rounding in the products.
    t = {n: weights[n].to(device=device, dtype=torch.float32) for n in shapes}
    if not all(bool(torch.isfinite(v).all()) for v in t.values()):
        raise UserError(f"{p / WEIGHTS} holds NaN or inf weights")
    return LoadedSae(path=p, architecture=arch, d_in=d_in, d_sae=d_sae, W_enc=t["W_enc"], b_enc=t["b_enc"],
                     W_dec=t["W_dec"], b_dec=t["b_dec"], threshold=t.get("threshold"), k=k,
                     apply_b_dec_to_input=not transcoder and bool(cfg.get("apply_b_dec_to_input", True)),
                     rescale_acts_by_decoder_norm=(arch == "topk"
                                                   and bool(cfg.get("rescale_acts_by_decoder_norm", False))),
                     cfg=cfg, transcoder=transcoder, W_skip=t.get("W_skip"))
