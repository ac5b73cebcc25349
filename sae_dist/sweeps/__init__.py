"""What a sweep (many SAEs trained in one job from one activation stream) adds to the one trainer
in sae_dist.train, which trains a sweep as it trains a single run.

`placement` (a pure plan of which devices train which SAE), `setup` (the sweep's one stream and
the job's devices as the placement sees them), `record` (the sweep's row in the database). What
a sweep is, and how it travels as flags, belongs to the scheduler-trainer contract
(`sae_dist.contract.sweep`, `sae_dist.contract.sweep_argv`).

May import what the trainer may (the leaves, the data sources, the database); never the trainer
itself (it imports this), the scheduler or the app. Nothing is imported here: the app reads
`placement` without torch.
"""
