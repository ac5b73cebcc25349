"""The data: where activations come from and how they are stored.

`sources` (a synthetic planted dictionary, safetensors shards, or a transformer read on the fly),
`harvest` (a local model's activations written as shards), `shard_format` (the shards' layout,
read and written without torch where it can be), `source_memory` (what the model source holds on
a device). The harvest never imports the sources; the `model` source reads a model with the
harvest's reader.

May import the leaves of sae_dist (config, contract, defaults, distributed, errors, format);
nothing of the trainer, the scheduler or the app. Nothing is imported here.
"""
