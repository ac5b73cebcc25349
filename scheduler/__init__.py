"""The SLURM-style local scheduler: jobs and devices (docs/architecture.md)."""
