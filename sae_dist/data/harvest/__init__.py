"""Activations from a local transformer model, harvested into the trainer's shards format."""
