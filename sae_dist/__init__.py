"""sae-dist: distributed sparse-autoencoder training."""
