"""The SAE models and their kernels: `sae` (TopK, BatchTopK, ReLU and JumpReLU autoencoders),
`sparse_ops` (the sparse encoder and decoder products, with their backward), `kernels` (compiled
CPU kernels, with a stock-PyTorch fallback) and `export` (SAELens' format on disk).

May import the leaves of sae_dist (errors, format, memory) and evaluation's loader; nothing of the
trainer, the scheduler or the app.
"""
