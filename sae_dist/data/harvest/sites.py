"""Where a site lives in a Hugging Face model: pure lookups, tested with plain data.

Sites, for layer L (0-based):
- resid:    the residual stream after block L (the block's output; hidden_states[L + 1]);
- attn_out: what block L's attention adds to the stream, before the residual sum (for BERT's
            post-LayerNorm blocks, the attention output projection, before its LayerNorm);
- mlp_out:  what block L's MLP adds, likewise;
- mlp_in:   what block L's MLP reads (after its LayerNorm where the block has one there): the
            input of the module whose output is mlp_out, or of the MLP's first layer. With
            mlp_out, the pair a transcoder learns (`INPUT_SITES` are hooked for their input).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sae_dist.errors import UserError

if TYPE_CHECKING:
    from sae_dist.contract.sweep import Sweep

SITES = ("resid", "attn_out", "mlp_out", "mlp_in")
INPUT_SITES = ("mlp_in",)  # hooked for what the module reads, not what it returns

# model_type -> site -> module path in the base model (AutoModel), with {L} for the layer.
_BERT = {"resid": "encoder.layer.{L}", "attn_out": "encoder.layer.{L}.attention.output.dense",
         "mlp_out": "encoder.layer.{L}.output.dense", "mlp_in": "encoder.layer.{L}.intermediate"}
_DECODER = {"resid": "layers.{L}", "attn_out": "layers.{L}.self_attn", "mlp_out": "layers.{L}.mlp",
            "mlp_in": "layers.{L}.mlp"}
MODULE_PATHS: dict[str, dict[str, str]] = {
    "bert": _BERT, "roberta": _BERT, "distilbert": {
        "resid": "transformer.layer.{L}", "attn_out": "transformer.layer.{L}.attention.out_lin",
        "mlp_out": "transformer.layer.{L}.ffn.lin2", "mlp_in": "transformer.layer.{L}.ffn"},
    "gpt2": {"resid": "h.{L}", "attn_out": "h.{L}.attn", "mlp_out": "h.{L}.mlp", "mlp_in": "h.{L}.mlp"},
    "gpt_neox": {"resid": "layers.{L}", "attn_out": "layers.{L}.attention", "mlp_out": "layers.{L}.mlp",
                 "mlp_in": "layers.{L}.mlp"},
    **{name: _DECODER for name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                   "phi3", "olmo", "olmo2")},
}


def module_path(model_type: str, site: str, layer: int, n_layers: int) -> str:
    """The dotted module name to hook; a UserError naming what is wrong otherwise."""
    if site not in SITES:
        raise UserError(f"site {site!r}: unknown; choose one of {', '.join(SITES)}")
    if not 0 <= layer < n_layers:
        raise UserError(f"layer {layer}: the model has {n_layers} layers (0 to {n_layers - 1})")
    paths = MODULE_PATHS.get(model_type)
    if paths is None:
        known = ", ".join(sorted(MODULE_PATHS))
        raise UserError(f"model type {model_type!r} is not one whose layers we know (known: {known})")
    return paths[site].format(L=layer)


def site_module_path(config, site: str, layer: int) -> str:
    """module_path for a transformers config (its model type and layer count)."""
    n_layers = int(getattr(config, "num_hidden_layers", 0) or getattr(config, "n_layer", 0))
    return module_path(config.model_type, site, layer, n_layers)


def model_sites(sweep: Sweep) -> list[tuple[int, str]]:
    """The distinct (layer, site) a model-source sweep's SAEs read, in the sweep's order (one
    forward pass hooks them all: sae_dist/data/sources/model.py); [] for another source."""
    if sweep.points[0].config.source != "model":
        return []
    return list(dict.fromkeys((p.config.model_layer, p.config.model_site) for p in sweep.points))


def check_trainable(sweep: Sweep, model_config: Any = None) -> Any:
    """Before any rank starts: every layer and site a model-source sweep reads exists in its
    model (the model's config read from disk, once for the sweep: the one check here that touches
    it; or `model_config`, one already read). Returns that config (None for another source)."""
    sites = model_sites(sweep)
    if not sites:
        return None
    from sae_dist.contract.sweep import SweepError

    if sweep.points[0].config.transcode and ({"model_layer", "model_site"} & set(sweep.keys)):
        raise SweepError("a transcoder reads the two sites --transcode names at one layer: model_layer and "
                         "model_site cannot vary in its sweep (sweep the layer as a job array)")
    from sae_dist.data.harvest.run import load_tokenizer

    cfg = sweep.points[0].config
    if model_config is None:
        _, model_config = load_tokenizer(cfg.model_path)
    for p in sweep.points:
        try:
            site_module_path(model_config, p.config.model_site, p.config.model_layer)
        except UserError as e:
            raise SweepError(f"{p.name} (model_layer={p.config.model_layer}, model_site={p.config.model_site}) "
                             f"cannot be read from {cfg.model_path}: {e}") from None
    return model_config
