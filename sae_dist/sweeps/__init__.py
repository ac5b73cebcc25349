"""Sweeps: many SAEs trained in one job from one activation stream.

`placement` (a pure plan of which devices train which SAE), `members` (each SAE's model,
optimizer and DDP group), `train` (the sweep's loop), `record` (the sweep's row in the database),
`eval` (each SAE's end-of-run evaluation). What a sweep is, and how it travels as flags, belongs
to the scheduler-trainer contract (`sae_dist.contract.sweep`, `sae_dist.contract.sweep_argv`).

May import the trainer and everything it may; never the scheduler or the app. Nothing is imported
here: the app reads `placement` without torch.
"""
