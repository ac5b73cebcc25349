"""The one trainer: SAEs trained by N DDP ranks from one activation stream, read top to bottom. A
single run is one SAE on every rank; a sweep is many, each on the ranks its placement gives it.

`loop` (the DDP story and the one loop over named pieces), `members` (the SAEs one rank trains:
group, rows, model, counters), `state` (where a run is; start or resume; what a checkpoint
holds), `window` (the steps between two reports), `step` (one optimizer step, shared with the
benchmarks), `shares` + `balance` (how a step's samples are shared among unequal ranks, and when
to move them), `launch` + `survive` (one device in-process, more through torchrun; going on when
a rank loses its device), `checkpoint`, `lr`, `metrics`, `run_record` (rank 0's link to the state
database), `free_memory` (a GPU's free memory for `--balance memory`).

May import the leaves of sae_dist (config, contract, distributed, errors, memory, paths), the
models, the data sources, evaluation, the database and what a sweep adds (sae_dist.sweeps: its
placement, stream and records); never the scheduler, the app or the benchmarks. Nothing is
imported here: `checkpoint` and the run-directory check stay torch-free for the launcher and the
app.
"""
