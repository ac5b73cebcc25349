"""The SLURM-style local scheduler (built in issue 3)."""
