"""Where a site lives in a Hugging Face model: pure lookups, tested with plain data.

Sites, for layer L (0-based):
- resid:    the residual stream after block L (the block's output; hidden_states[L + 1]);
- attn_out: what block L's attention adds to the stream, before the residual sum (for BERT's
            post-LayerNorm blocks, the attention output projection, before its LayerNorm);
- mlp_out:  what block L's MLP adds, likewise.
"""

from __future__ import annotations

from sae_dist.errors import UserError

SITES = ("resid", "attn_out", "mlp_out")

# model_type -> site -> module path in the base model (AutoModel), with {L} for the layer.
_BERT = {"resid": "encoder.layer.{L}", "attn_out": "encoder.layer.{L}.attention.output.dense",
         "mlp_out": "encoder.layer.{L}.output.dense"}
_DECODER = {"resid": "layers.{L}", "attn_out": "layers.{L}.self_attn", "mlp_out": "layers.{L}.mlp"}
MODULE_PATHS: dict[str, dict[str, str]] = {
    "bert": _BERT, "roberta": _BERT, "distilbert": {
        "resid": "transformer.layer.{L}", "attn_out": "transformer.layer.{L}.attention.out_lin",
        "mlp_out": "transformer.layer.{L}.ffn.lin2"},
    "gpt2": {"resid": "h.{L}", "attn_out": "h.{L}.attn", "mlp_out": "h.{L}.mlp"},
    "gpt_neox": {"resid": "layers.{L}", "attn_out": "layers.{L}.attention", "mlp_out": "layers.{L}.mlp"},
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
