"""The contract between the scheduler and the trainer, in one torch-free place.

A job reaches its ranks through two channels only: the `python -m sae_dist train` flags that
rebuild its `TrainConfig`, and the environment variables named here. The scheduler writes both,
the launcher and the trainer read them; neither side spells a name on its own.
See docs/architecture.md ("The scheduler-trainer contract").
"""

from __future__ import annotations

# ---- the job's environment (written by scheduler/supervisor.py, read by the launcher and ranks) ----
JOB_ID_ENV = "SAE_DIST_JOB_ID"  # the scheduler's job id; a run records it
JOB_NAME_ENV = "SAE_DIST_JOB_NAME"
NUM_GPUS_ENV = "SAE_DIST_NUM_GPUS"  # how many devices the job was given
DEVICES_ENV = "SAE_DIST_DEVICES"  # the scheduler's device ids of the job, one per local rank
VIRTUAL_DEVICES_ENV = "SAE_DIST_VIRTUAL_DEVICES"  # set when the job's devices are CPU-backed
MASTER_PORT_ENV = "SAE_DIST_MASTER_PORT"  # the rendezvous port reserved for the job

# ---- set by our launcher for its ranks ----
OUR_LAUNCHER_ENV = "SAE_DIST_OUR_LAUNCHER"  # the ranks run under sae_dist.launch, not a bare torchrun
RESTART_NOTE_ENV = "SAE_DIST_RESTART_NOTE"  # JSON: why the launcher restarted without a device
DEVICE_TYPE_ENV = "SAE_DIST_DEVICE_TYPE"  # "cpu" forces CPU ranks (an sbatch script on CPU nodes)
THREADS_PER_RANK_ENV = "SAE_DIST_THREADS_PER_RANK"  # torch threads of each CPU rank

# ---- test and benchmark knobs ----
SLOW_RANKS_ENV = "SAE_DIST_TEST_SLOW_RANKS"  # "1:3" makes rank 1's compute 3x slower (virtual devices)

# Names a user's --export may not set: the scheduler owns them (CUDA's two included).
RESERVED_JOB_ENV = frozenset({"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", JOB_ID_ENV, JOB_NAME_ENV,
                              NUM_GPUS_ENV, DEVICES_ENV, VIRTUAL_DEVICES_ENV, MASTER_PORT_ENV})
