"""Where activations come from: a synthetic planted dictionary or safetensors shards."""
