"""A real SLURM batch script for a queued job: when one machine is not enough, hand it to SLURM.

Training jobs become one `srun` task per node, each running torchrun with a c10d rendezvous on
the first node of the allocation, so `-m sae_dist train` runs as nodes x GPUs DDP ranks. Other
commands run once per node under srun. Every argument is shell-quoted: the script never
evaluates what a job name or an argument contains.
"""

from __future__ import annotations

import json
import re
import shlex

from sae_dist.contract import DEVICE_TYPE_ENV
from sae_dist.contract.sweep_argv import stored_job_flags

RDZV_PORT = 29400  # torchrun's documented c10d default; the cluster job owns its nodes


def slurm_time(seconds: float) -> str:
    """SLURM's D-HH:MM:SS (minutes rounded up: a limit is never shortened)."""
    total = int(-(-seconds // 60)) * 60
    days, rest = divmod(total, 86400)
    h, rest = divmod(rest, 3600)
    m = rest // 60
    return f"{days}-{h:02d}:{m:02d}:00" if days else f"{h:02d}:{m:02d}:00"


def _safe_line(text: str) -> str:
    """A value for an #SBATCH line: one line, no shell meaning (sbatch reads it, no shell does)."""
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text)[:200] or "job"


def _flags(flags: list[str], shared_db: bool) -> str:
    """The trainer's flags, shell-quoted; without a shared database, metrics stay in the run directory."""
    flags = [f for f in flags if f != "--db"] + ([] if shared_db else ["--no-db"])
    return " ".join(shlex.quote(f) for f in flags)


def sbatch_script(job, nodes: int = 1, gpus_per_node: int | None = None, cpu: bool = False,
                  db_url: str | None = None, array: str | None = None,
                  task_configs: dict[int, dict] | None = None) -> str:
    """The batch script. `cpu=True` runs gpus_per_node gloo ranks per node on CPUs (no GPU request):
    for CPU partitions, and for trying a job on a small cluster first. With `db_url` (a database
    every node reaches, not SQLite) the training records its metrics there. With `array` (the
    `--array` text, e.g. 0-99%8) a job array; a training array's tasks each have their config in
    `task_configs` (task id -> config), chosen by SLURM_ARRAY_TASK_ID."""
    from sae_dist.errors import UserError

    if nodes < 1:
        raise UserError(f"--nodes must be at least 1, got {nodes}")
    ranks = gpus_per_node if gpus_per_node is not None else max(1, job.gpus)
    if ranks < 1:
        raise UserError(f"--gpus-per-node must be at least 1, got {ranks}")
    name = _safe_line(job.name)
    lines = [
        "#!/bin/bash",
        f"# Exported by sae-dist from local job {job.id} ({job.kind})." if job.id is not None
        else f"# Submitted by sae-dist ({job.kind}).",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=%x-%A_%a.out" if array else "#SBATCH --output=%x-%j.out",
    ]
    if array:
        if not re.fullmatch(r"[0-9,:%-]+", array):  # ours (ArraySpec's text): digits and , - : %
            raise ValueError(f"not an --array text: {array!r}")
        lines.append(f"#SBATCH --array={array}")
    if not cpu:
        lines.insert(5, f"#SBATCH --gpus-per-node={ranks}")
    if getattr(job, "exclusive", False):
        lines.append("#SBATCH --exclusive")  # the nodes to itself, as it asked here
    if job.time_limit_s:
        lines.append(f"#SBATCH --time={slurm_time(job.time_limit_s)}")
    lines += ["", "set -euo pipefail", f"cd {shlex.quote(job.workdir)}", "export CUDA_DEVICE_ORDER=PCI_BUS_ID"]
    if cpu:
        lines.append(f"export {DEVICE_TYPE_ENV}=cpu")
    for key, value in json.loads(job.env_json or "{}").items():
        lines.append(f"export {key}={shlex.quote(value)}")
    shared_db = bool(db_url) and not db_url.startswith("sqlite")
    if shared_db:
        lines.append(f"export SAE_DIST_DB_URL={shlex.quote(db_url)}")
    if job.kind == "train":  # a stored job's config, or a JobSpec's: validated at submit either way
        devices = f"{'cpu' if cpu else 'cuda'}:{ranks}"
        configs = task_configs or {None: json.loads(job.train_config_json)}
        flags = {task: _flags(stored_job_flags(config, devices), shared_db) for task, config in configs.items()}
        if not shared_db:
            lines += ["# Metrics go to the run directory only: SQLite on a shared (NFS) home is refused. To record",
                      "# them in a shared database, export SAE_DIST_DB_URL=postgresql+psycopg://... and drop --no-db."]
        # Tasks of an array may share a node: each its own rendezvous port.
        port = f"$(({RDZV_PORT} + SLURM_ARRAY_TASK_ID % 500))" if array else str(RDZV_PORT)
        lines += ['head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)']
        if task_configs:
            lines += ['case "$SLURM_ARRAY_TASK_ID" in']
            lines += [f"  {task}) flags=({task_flags}) ;;" for task, task_flags in flags.items()]
            lines += ['  *) echo "no config for array task $SLURM_ARRAY_TASK_ID" >&2; exit 1 ;;', "esac"]
            train = '    -m sae_dist train "${flags[@]}"'
        else:
            train = "    -m sae_dist train " + flags[None]
        lines += [
            "srun torchrun --nnodes \"$SLURM_JOB_NUM_NODES\" "
            f"--nproc-per-node {ranks} --rdzv-backend c10d "
            f"--rdzv-endpoint \"$head_node:{port}\" --rdzv-id \"$SLURM_JOB_ID\" \\",
            train,
        ]
    else:
        lines.append("srun " + " ".join(shlex.quote(a) for a in json.loads(job.argv_json)))
    return "\n".join(lines) + "\n"
