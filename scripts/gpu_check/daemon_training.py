"""A training through the real daemon on the real driver, as a user queues one.

    python3 scripts/gpu_check/daemon_training.py HOME            # one GPU: bf16, d_in 768, d_sae 24,576, k 32
    python3 scripts/gpu_check/daemon_training.py HOME --virtual  # the rehearsal: one CPU-backed device

`submit --gpus 1 --train` a run; while it runs, a command job shows the CUDA_VISIBLE_DEVICES a job
gets; then: the job COMPLETED on the GPU the scheduler allocated (NVML's UUID) and the rank saw the
same GPU (CUDA's UUID, in the run's record), the SAE was exported in SAELens' layout, `evaluate`
scores it on planted shards of the same source, and the daemon's samples of the GPU during the job
carry all four readings (memory, utilisation, temperature, power) and name the job.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from harness import CheckFailed, Daemon, cli, cli_json, expect, home_args, run_step, submit, wait_ended

GIB = 2**30


SHAPES = {  # the GPU's run, and the rehearsal's on one CPU-backed device
    False: dict(d_in=768, d_sae=24576, k=32, steps=300, batch_size=4096, precision="bf16", eval_rows=16384),
    True: dict(d_in=64, d_sae=512, k=8, steps=40, batch_size=256, precision="fp32", eval_rows=1024),
}


def main() -> int:
    home, virtual = home_args("one CPU-backed device, a small fp32 run (rehearsal)")
    shape = SHAPES[virtual]
    toml = home / "run.toml"
    toml.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in shape.items())
                    + f'log_every = 20\ncheckpoint_every = 0\nname = "gpu-check"\nout_dir = "{home / "run"}"\n')
    ended, visible, took = train_through_the_daemon(home, toml)
    devices = check_devices(ended, visible, virtual)
    run = training_run(ended.id)
    print(f"run {run.id}: {run.status}, backend {run.backend}, ranks on {json.loads(run.device_ids)}, final FVU "
          f"{run.final_fvu}, L0 {run.final_l0}, {run.final_samples_per_s} samples/s")
    expect(run.status == "COMPLETED", f"the run's record says {run.status}: {run.error}")
    if not virtual:
        expect(json.loads(run.device_ids) == devices,
               f"the rank ran on {run.device_ids} (CUDA's UUID), not on {devices} (NVML's)")
    expect(run.final_fvu is not None and math.isfinite(run.final_fvu) and run.final_fvu < 1,
           f"final FVU {run.final_fvu}")
    fvu = check_export_and_evaluate(Path(run.export_dir or home / "run" / "sae"), home, shape)
    samples = check_samples(devices[0], ended.id, virtual)
    print(f"trained {shape['steps']} {shape['precision']} steps of d_sae {shape['d_sae']} on {devices[0]} through "
          f"the daemon in {took:.0f} s ({run.final_samples_per_s or 0:,.0f} samples/s), evaluate FVU "
          f"{fvu:.3f}; {samples} samples name the job, all four readings "
          + ("known" if not virtual else "as a virtual device has them"))
    return 0


def train_through_the_daemon(home: Path, toml: Path):
    """(the ended training job, the CUDA_VISIBLE_DEVICES a job on its device got, seconds)."""
    probe_out = home / "visible.out"
    with Daemon(home):
        started = time.monotonic()
        train_id = submit("--gpus", "1", "--train", str(toml), "-J", "gpu-check-train")
        probe_id = submit("--gpus", "1", "-J", "visible", "-o", str(probe_out), "-d", f"afterany:{train_id}",
                          "--", "sh", "-c", 'echo "$CUDA_VISIBLE_DEVICES"')
        ended = wait_ended(train_id, 150)  # the step's limit is 240 s
        took = time.monotonic() - started
        log = Path(ended.stdout_path).read_text(errors="replace") if ended.stdout_path else ""
        expect(ended.state == "COMPLETED", f"the training job ended {ended.state} (exit {ended.exit_code}): "
                                           f"{log.strip().splitlines()[-1] if log.strip() else 'no log'}")
        probe = wait_ended(probe_id, 60)
        expect(probe.state == "COMPLETED", f"the CUDA_VISIBLE_DEVICES job ended {probe.state}")
    print(log[-3000:])
    return ended, probe_out.read_text().strip(), took


def check_devices(ended, visible: str, virtual: bool) -> list[str]:
    devices = json.loads(ended.devices_json)
    print(f"allocated {devices}; the next job on it saw CUDA_VISIBLE_DEVICES={visible!r}")
    expect(len(devices) == 1, f"one device wanted, {devices} allocated")
    if virtual:
        expect(visible == "", f"a virtual device must hide the GPUs: CUDA_VISIBLE_DEVICES={visible!r}")
    else:
        expect(devices[0].startswith("GPU-") and visible == devices[0],
               f"CUDA_VISIBLE_DEVICES={visible!r}, not the allocated GPU's UUID {devices[0]}")
    return devices


def check_export_and_evaluate(sae_dir: Path, home: Path, shape: dict) -> float:
    """The export is in SAELens' layout and `evaluate` scores it on planted shards: its FVU."""
    expect((sae_dir / "cfg.json").exists() and (sae_dir / "sae_weights.safetensors").exists(),
           f"no SAELens export in {sae_dir}")
    planted = home / "planted"
    cli("make-planted", str(planted), "--rows", str(shape["eval_rows"]), "--d-in", str(shape["d_in"]),
        module="sae_dist", timeout=180)
    ev = json.loads(cli("evaluate", str(sae_dir), "--shards", str(planted), "--json", module="sae_dist",
                        timeout=240).stdout)
    print("evaluate:", json.dumps({k: ev.get(k) for k in ("fvu", "l0", "dead_fraction")}))
    expect(ev.get("fvu") is not None and math.isfinite(ev["fvu"]), f"evaluate gave FVU {ev.get('fvu')}")
    return ev["fvu"]


def check_samples(uuid: str, job_id: int, virtual: bool) -> int:
    """The daemon's samples of the device during the job name it, with every reading the device
    has (a virtual one has no temperature or power); and the device is idle again after."""
    samples = samples_during(uuid, job_id)
    expect(samples, f"no sample of {uuid} names job {job_id}")
    readings = {name: [getattr(s, name) for s in samples if getattr(s, name) is not None]
                for name in ("memory_used", "utilization_pct", "temperature_c", "power_w")}
    unknown = [name for name, values in readings.items() if not values]
    print(f"{len(samples)} samples name the job: memory up to {max(readings['memory_used'] or [0]) / GIB:.1f} GiB, "
          f"utilisation up to {max(readings['utilization_pct'] or [0]):.0f}%, "
          + ("temperature and power unknown" if virtual else f"temperature up to {max(readings['temperature_c']):.0f}"
             f" C, power up to {max(readings['power_w']):.0f} W"))
    if virtual:
        expect(unknown == ["temperature_c", "power_w"], f"a virtual device's unknown readings: {unknown}")
    else:
        expect(not unknown, f"the daemon's samples never read {', '.join(unknown)}")
        expect(max(readings["memory_used"]) > GIB, "the GPU's memory never showed the training")
    gpu_row = next(r for r in cli_json("info") if r["uuid"] == uuid)
    print(f"info after the job: {gpu_row['state']} ({gpu_row['reason']}), {gpu_row['name']}")
    expect(gpu_row["state"] == "idle", f"the device is {gpu_row['state']} ({gpu_row['reason']}) after the job")
    return len(samples)


def training_run(job_id: int):
    from sqlmodel import Session, select

    from sae_dist.db import TrainingRun, get_engine

    with Session(get_engine()) as s:
        run = s.exec(select(TrainingRun).where(TrainingRun.job_id == job_id)).first()
    if run is None:
        raise CheckFailed(f"job {job_id} left no training run in the database")
    return run


def samples_during(uuid: str, job_id: int) -> list:
    from sqlmodel import Session, select

    from sae_dist.db import GpuSample, get_engine

    with Session(get_engine()) as s:
        return list(s.exec(select(GpuSample).where(GpuSample.device_uuid == uuid, GpuSample.job_id == job_id)))


if __name__ == "__main__":
    run_step(main)
