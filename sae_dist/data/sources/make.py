"""The source a config names, for one rank (the transformers and shard readers are imported only
by the runs that use them)."""

from __future__ import annotations

from sae_dist import distributed as D
from sae_dist.config import SYNTHETIC_D_IN, TrainConfig
from sae_dist.data.sources.base import ActivationSource
from sae_dist.defaults import heldout_rows_of


def source_in_words(cfg: TrainConfig) -> str:
    """What `make_source` is about to open, as a starting job's log says it."""
    if cfg.source == "model":
        return (f"the model {cfg.model_path}, layer {cfg.model_layer} ({cfg.model_site}), loaded on every "
                f"device, over the text {cfg.text_path}")
    if cfg.source == "shards":
        return f"the activation shards in {cfg.shards_path}"
    hierarchy = (f", a hierarchy of {cfg.synthetic_children} children a parent" if cfg.synthetic_children else "")
    return f"synthetic activations (d_in {cfg.d_in or SYNTHETIC_D_IN}{hierarchy})"


def make_source(cfg: TrainConfig, ctx: D.DistContext) -> ActivationSource:
    if cfg.source == "synthetic":
        from sae_dist.data.sources.synthetic import SyntheticSource

        return SyntheticSource(
            d_in=cfg.d_in or SYNTHETIC_D_IN, n_features=cfg.synthetic_features, active=cfg.synthetic_active,
            power_law=cfg.synthetic_power_law, noise=cfg.synthetic_noise, seed=cfg.seed,
            rank=ctx.rank, world_size=ctx.world_size, batch_size=cfg.batch_size, children=cfg.synthetic_children,
            child_prob=cfg.synthetic_child_prob, magnitude_sigma=cfg.synthetic_magnitude_sigma,
            correlation=cfg.synthetic_correlation)
    from sae_dist.data.shard_format import input_width
    from sae_dist.data.sources.paired import PairedSource

    pair = cfg.transcode_sites
    if cfg.source == "model":
        from sae_dist.data.sources.model import ModelSource

        source = ModelSource(cfg.model_path, cfg.model_layer, cfg.model_site, cfg.text_path, cfg.context_length,
                             cfg.batch_size, cfg.seed, ctx.rank, ctx.world_size, ctx.device,
                             global_batch=cfg.batch_size * ctx.world_size * cfg.grad_accum,
                             sites=cfg.model_sites if pair else None)
        return PairedSource(source, source.d_in) if pair else source
    from sae_dist.data.sources.shards import ShardStream, open_shards

    # One stream over all the data, the same on every rank; each reads its slice of a step.
    dataset = open_shards(cfg.shards_path)
    d_in = input_width(dataset, pair)  # the shards suit the config: pairs for a transcoder, one site for an SAE
    stream = ShardStream(dataset, rank=0, world_size=1, batch_size=cfg.batch_size * ctx.world_size * cfg.grad_accum,
                         seed=cfg.seed, holdout_rows=heldout_rows_of(cfg.eval_rows, dataset.total_rows))
    return PairedSource(stream, d_in) if pair else stream
