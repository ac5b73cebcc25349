"""`python -m sae_dist ...`: train, estimate-memory, bench, report, harvest, evaluate. User mistakes
are one line on stderr. `forked_rank` beside it is a CPU rank's entry when our launcher forks it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from sae_dist.config import SITES, SYNTHETIC_D_IN, TrainConfig, parse_transcode
from sae_dist.contract import (
    FORKED_RANK_ENV,
    OUR_LAUNCHER_ENV,
    add_config_flags,
    add_sweep_flag,
    config_from_args,
    sweep_from_args,
)
from sae_dist.data.harvest.sites import check_trainable
from sae_dist.errors import USER_ERROR_EXIT, TrainingStopped, UserError

PEER_LOSS_WAIT_S = 60.0  # a forked rank that lost a peer waits this long for its launcher to stop it


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sae_dist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_parsers(sub)
    _add_bench_parsers(sub)
    _add_harvest_parser(sub)
    _add_pair_parser(sub)
    _add_evaluate_parsers(sub)
    return parser


def _add_train_parsers(sub) -> None:
    train = sub.add_parser("train", help="train an SAE on N devices (DDP)",
                           description="Train a sparse autoencoder; N devices run as N DDP ranks.")
    add_config_flags(train)
    add_sweep_flag(train)
    est = sub.add_parser("estimate-memory", help="memory per device for a training config (or a sweep's placement)")
    add_config_flags(est)
    add_sweep_flag(est)


def _add_bench_parsers(sub) -> None:
    bench = sub.add_parser(
        "bench", help="measure how training scales with the device count",
        description="Measure throughput, speedup and efficiency on 1 and N devices (DDP), against "
                    "ideal and against N independent processes (the no-communication ceiling).")
    bench.add_argument("--devices", default="1,2", help="device counts, e.g. 1,2,4 (1 is always measured)")
    bench.add_argument("--mode", default="strong", choices=("strong", "weak"),
                       help="strong: the global batch (--batch-size) is split over the devices; "
                            "weak: each device keeps --batch-size")
    bench.add_argument("--steps", type=int, default=30, dest="timed_steps",
                       help="steps timed per point, after the warm-up (default 30)")
    bench.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    bench.add_argument("--repeats", type=int, default=3,
                       help="measure every point this often, interleaved across device counts "
                            "(1, 2, 4, 1, 2, 4, ...; default 3)")
    bench.add_argument("--start-within", type=float, default=3600.0, metavar="SECONDS",
                       help="queued: each point must get the machine alone (an exclusive job) within "
                            "this many seconds, else the benchmark stops naming the jobs that held it "
                            "(default 3600)")
    bench.add_argument("--no-queue", action="store_true",
                       help="run the points here, not as scheduler jobs (the devices must be free)")
    bench.add_argument("--device-kind", choices=("cuda", "cpu"), help="default: cuda where visible, else cpu")
    bench.add_argument("--name", dest="bench_name", help="a name for the benchmark (default from the config)")
    add_config_flags(bench, skip=("devices", "steps", "name"))
    point = sub.add_parser("bench-point", help=argparse.SUPPRESS)
    point.add_argument("spec")
    point.add_argument("result")
    report = sub.add_parser("report", help="write a benchmark's report (md, csv or html)")
    report.add_argument("bench_id", type=int, metavar="RUN_ID", help="the benchmark's id (bench prints it)")
    report.add_argument("--format", default="md", choices=("md", "csv", "html"))
    report.add_argument("-o", "--out", help="the file to write (default, or -: standard output)")
    report.add_argument("--link", default="pcie4",
                        help="link for the projection: pcie4, pcie5, nvlink3, nvlink4, here (the "
                             "all-reduce bandwidth the benchmark measured), or GB/s (e.g. 18.5)")


def _add_harvest_parser(sub) -> None:
    hv = sub.add_parser(
        "harvest", help="harvest a local transformer's activations into shards",
        description="Run a Hugging Face transformers model that is on disk (never downloaded) over text, "
                    "and write one site's activations (text tokens only) as the trainer's shards. "
                    "Run the same command again to continue an interrupted harvest.")
    hv.add_argument("--model", required=True, help="a model directory, or a name in the Hugging Face cache")
    hv.add_argument("--layer", type=int, required=True, help="the block, from 0")
    hv.add_argument("--site", default="resid", choices=SITES,
                    help="resid: the block's output; mlp_out / attn_out: what its MLP / attention adds; "
                         "mlp_in: what its MLP reads")
    hv.add_argument("--transcode", metavar="IN:OUT",
                    help="paired shards for a transcoder: each row the IN site and the OUT site side by side "
                         "(e.g. mlp_in:mlp_out, at --layer); --site is then unused")
    hv.add_argument("--text", nargs="+", required=True, help="text files or directories of them (.txt, .md, .rst)")
    hv.add_argument("--out", required=True, help="the shard directory to write")
    hv.add_argument("--max-tokens", type=int, help="stop after this many text tokens (default: all the text)")
    hv.add_argument("--context-length", type=int, default=128, help="tokens per context, special ones included")
    hv.add_argument("--batch-size", type=int, default=32, help="contexts per forward pass")
    hv.add_argument("--shard-rows", type=int, default=65536, help="about this many rows per shard")
    hv.add_argument("--devices", default="auto",
                    help="auto (every visible GPU, else one CPU process), cpu:N or cuda:N: one process per "
                         "device, each harvesting every N-th shard")
    hv.add_argument("--worker", help=argparse.SUPPRESS)  # "r/N": one of the processes above
    hv.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="how the activations are stored")


def _add_evaluate_parsers(sub) -> None:
    ev = sub.add_parser(
        "evaluate", help="evaluate an SAE on the last rows of a shard set",
        description="Evaluate an SAE folder in SAELens format (ours or SAELens' own standard, topk or "
                    "jumprelu) on the last N rows of a shard directory (the rows a run holds out): FVU "
                    "and explained variance, MSE, cosine, L0, dead and dense latents, the feature-density "
                    "histogram, and dictionary recovery when the shards are planted (make-planted). "
                    "Recorded in the state database, linked to the run when the SAE is a run's export.")
    ev.add_argument("sae_dir", metavar="SAE_DIR", help="the SAE folder (cfg.json + sae_weights.safetensors), "
                                                       "e.g. RUN_DIR/sae")
    ev.add_argument("--shards", required=True, metavar="DIR", help="the shard directory to evaluate on")
    ev.add_argument("--rows", type=int, metavar="N",
                    help="evaluate on the last N rows (default: the tail a run holds out, 16384 rows "
                         "or a tenth of the set if less)")
    ev.add_argument("--no-model-check", action="store_true",
                    help="skip splicing the SAE into the model the shards were harvested from")
    ev.add_argument("--json", action="store_true", help="print the evaluation as JSON only")
    ev.add_argument("--no-db", action="store_true", help="do not record it in the state database")
    mp = sub.add_parser(
        "make-planted", help="write synthetic shards with a known (planted) dictionary",
        description="Write N rows of the synthetic source (stream positions 0..N-1: what --source synthetic "
                    "with the same settings trains on) as shards, with the planted dictionary and feature "
                    "frequencies beside them, so evaluate can report how well an SAE recovers them. "
                    "Defaults are the trainer's synthetic_* defaults.")
    mp.add_argument("out", metavar="OUT", help="the shard directory to write (new, or empty)")
    mp.add_argument("--rows", type=int, required=True, metavar="N", help="rows to write")
    mp.add_argument("--d-in", type=int, metavar="D", help="activation width (default 512)")
    mp.add_argument("--features", type=int, metavar="F", help="planted dictionary size (default 4096)")
    mp.add_argument("--active", type=float, metavar="A", help="features active per row on average (default 4.0)")
    mp.add_argument("--power-law", type=float, metavar="P",
                    help="feature frequency ~ rank^-P (default 0.5; 0 = uniform)")
    mp.add_argument("--noise", type=float, metavar="S", help="Gaussian noise std per dimension (default 0.01)")
    mp.add_argument("--seed", type=int, metavar="X", help="the dictionary's and the data's seed (default 0)")
    mp.add_argument("--children", type=int, metavar="C",
                    help="children per parent feature: a hierarchy, a child firing only with its parent (default 0)")
    mp.add_argument("--child-prob", type=float, metavar="Q",
                    help="the chance that a firing parent brings one of its children (default 0.5)")
    mp.add_argument("--magnitude-sigma", type=float, metavar="S",
                    help="log-normal magnitudes exp(N(0, S)) (default 0: uniform in [0.5, 2])")
    mp.add_argument("--correlation", type=float, metavar="R",
                    help="correlated firing: features (parents) pair up, 0-1, 2-3..., and a firing one brings its "
                         "partner with chance R (default 0)")
    mp.add_argument("--rows-per-shard", type=int, default=65536, metavar="R",
                    help="rows per shard file (default 65536)")


def _add_pair_parser(sub) -> None:
    pp = sub.add_parser(
        "pair-shards", help="join an input shard set and a target shard set into a transcoder's paired shards",
        description="Write shards whose rows are an input row and its target row side by side, for training "
                    "a transcoder (--transcode IN:OUT with --source shards). The two sets must hold the same "
                    "rows in the same order (the same tokens at two sites) and the same width.")
    pp.add_argument("inputs", metavar="INPUT_DIR", help="the shards the transcoder reads")
    pp.add_argument("targets", metavar="TARGET_DIR", help="the shards it predicts, row for row")
    pp.add_argument("--out", required=True, metavar="OUT", help="the paired shard directory to write (new)")
    pp.add_argument("--names", metavar="IN:OUT",
                    help="the pair's names, given to --transcode later (default: each set's harvested site)")
    pp.add_argument("--rows-per-shard", type=int, default=65536, metavar="R", help="rows per shard file")


def _pair(ns: argparse.Namespace) -> int:
    from sae_dist.data.sources.paired import pair_shards

    if ns.rows_per_shard < 1:
        raise UserError(f"--rows-per-shard {ns.rows_per_shard}: must be positive")
    names = parse_transcode(ns.names, model_sites=False) if ns.names else None
    rows, names = pair_shards(ns.inputs, ns.targets, ns.out, names, ns.rows_per_shard)
    print(f"paired {rows:,} rows in {ns.out}; train a transcoder on them with --source shards --shards-path "
          f"{ns.out} --transcode {names[0]}:{names[1]}")
    return 0


def _harvest(ns: argparse.Namespace) -> int:
    from sae_dist.data.harvest.run import HarvestSpec, harvest, harvest_worker
    from sae_dist.train.launch import resolve_devices

    for flag in ("layer", "max_tokens", "context_length", "batch_size", "shard_rows"):
        value = getattr(ns, flag)
        if value is not None and (value < 0 or (value == 0 and flag != "layer")):
            raise UserError(f"--{flag.replace('_', '-')} {value}: "
                            f"must be {'0 or more' if flag == 'layer' else 'positive'}")
    kind, count = resolve_devices(ns.devices)  # the trainer's rules: auto, cpu:N, cuda:N
    spec = HarvestSpec(model=ns.model, layer=ns.layer, site=ns.site, texts=ns.text, out=ns.out,
                       max_tokens=ns.max_tokens, context_length=ns.context_length, batch_size=ns.batch_size,
                       shard_rows=ns.shard_rows, device=kind, dtype=ns.dtype,
                       transcode=parse_transcode(ns.transcode) if ns.transcode else None)
    if ns.worker:
        worker, workers = (int(v) for v in ns.worker.split("/"))
        print(f"worker harvested {harvest_worker(spec, worker, workers)} tokens")
        return 0
    result = harvest(spec, workers=count, device_kind=kind)
    print(f"harvested {result.tokens:,} tokens in {result.seconds:.1f} s ({result.tokens_per_s:,.0f} tokens/s; "
          f"{result.total_seconds:.1f} s with loading) on {count} {kind} process(es); "
          f"{result.total_rows:,} rows in {len(result.shards)} shard(s) in {result.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # a first-use migration is not news
    try:
        if ns.command == "train":
            return _train(ns, argv[argv.index("train") + 1:])
        if ns.command == "estimate-memory":
            return _estimate(ns)
        if ns.command == "bench":
            return _bench(ns)
        if ns.command == "harvest":
            return _harvest(ns)
        if ns.command == "pair-shards":
            return _pair(ns)
        if ns.command == "evaluate":
            from sae_dist.evaluate.cli import evaluate

            return evaluate(ns)
        if ns.command == "make-planted":
            from sae_dist.evaluate.cli import make_planted

            return make_planted(ns)
        if ns.command == "bench-point":
            from sae_dist.bench.measure import point

            return point(ns.spec, ns.result)
        if ns.command == "report":
            from sae_dist.analytics.bench_report import report_text, write_report

            if not ns.out or ns.out == "-":  # as a command's output: to a pipe, a pager, or a file by >
                sys.stdout.write(report_text(ns.bench_id, ns.format, ns.link))
                return 0
            print(f"wrote {write_report(ns.bench_id, ns.format, ns.out, ns.link)}")
            return 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except TrainingStopped as e:  # one process (one device); torchrun's ranks exit in _train
        print(f"training stopped by {e.signame}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


def _train(ns: argparse.Namespace, train_argv: list[str]) -> int:
    from sae_dist.train.launch import die_with_parent, exit_rank, in_worker, launch

    if not in_worker():
        sweep = sweep_from_args(ns)  # a bad sweep is said before the model or the shards are read
        # A model sweep's layers and sites, checked on the model's config read once for the sweep.
        model_config = check_trainable(sweep) if sweep is not None else None
        cfg = _preflight(config_from_args(ns), model_config)
        if sweep is None:
            return launch(cfg, train_argv)
        sweep = sweep.with_d_in(cfg.d_in)  # k > d_sae and twin points show only with the width
        _placement(sweep, cfg, model_config)  # a sweep that cannot fit stops here, before any rank starts
        return launch(cfg, train_argv, sweep=sweep)
    # A rank started by torchrun (ours, or the user's on a cluster).
    from sae_dist.train.loop import train

    die_with_parent()
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for the job
    try:
        train(config_from_args(ns), sweep_from_args(ns))
    except TrainingStopped as e:
        if rank == "0" and not os.environ.get(OUR_LAUNCHER_ENV):  # under the user's torchrun
            print(f"training stopped by {e.signame}", file=sys.stderr, flush=True)
        exit_rank(128 + e.signum)  # as a process killed by the signal would report it
    except UserError as e:
        if rank == "0" or not e.shared:
            print(f"error: {e}" if os.environ.get("WORLD_SIZE") == "1" else f"error: [rank {rank}] {e}",
                  file=sys.stderr, flush=True)
        elif os.environ.get("WORLD_SIZE", "1") != "1":
            time.sleep(1.0)  # let rank 0 report the shared error before torchrun stops the job
        # Straight out: no interpreter teardown racing gloo's threads for a process group
        # whose peers are leaving too (it can abort with std::terminate).
        exit_rank(USER_ERROR_EXIT)
    except Exception as e:
        from sae_dist.train.survive import DEVICE_ERROR_EXIT, is_device_error, is_peer_loss

        if is_peer_loss(e) and not is_device_error(e):
            # A peer went away (its own failure is reported by the launcher): one line, no traceback.
            print(f"error: [rank {rank}] lost a peer: {str(e).strip().splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
            if os.environ.get(FORKED_RANK_ENV):
                # Forked ranks are watched as one group that reports only the first rank to
                # exit, and the launcher must learn which rank died (to go on without its
                # device): it stops us once it has seen that; the wait is only a backstop.
                time.sleep(PEER_LOSS_WAIT_S)
            exit_rank(1)
        if not is_device_error(e):
            raise
        # The launcher restarts the job without this device (on_rank_loss = continue).
        print(f"error: [rank {rank}] device error: {e}", file=sys.stderr, flush=True)
        exit_rank(DEVICE_ERROR_EXIT)
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from sae_dist.bench.load import wait_scale
    from sae_dist.bench.run import parse_counts, run_benchmark

    wait_scale()  # a bad test knob is one error here, not a traceback in a point's process
    counts = parse_counts(ns.devices)
    ns.devices = "auto"  # the config's own device field: each point sets its own
    cfg = _with_source_d_in(config_from_args(ns))
    bench_id = run_benchmark(cfg, counts, mode=ns.mode, steps=ns.timed_steps, warmup=ns.warmup,
                             repeats=ns.repeats, queued=not ns.no_queue, name=ns.bench_name,
                             kind=ns.device_kind, start_within=ns.start_within)
    print(f"benchmark {bench_id} done: python -m sae_dist report {bench_id} --format md")
    return 0


def _with_source_d_in(cfg: TrainConfig, model_config=None) -> TrainConfig:
    """The config with d_in from its source: the shards' width (headers only), the model's hidden
    size (its config only, `model_config` where already read; the layer, site and text checked
    too), or synthetic's."""
    if cfg.source == "shards":
        from sae_dist.data.shard_format import input_width
        from sae_dist.data.sources.shards import open_shards

        # raises on a width mismatch, or shards that do not suit the config (pairs, or one site's rows)
        return cfg.with_d_in(input_width(open_shards(cfg.shards_path), cfg.transcode_sites))
    if cfg.source == "model":
        from sae_dist.data.sources.model import check_model_sites

        return cfg.with_d_in(check_model_sites(cfg.model_path, cfg.model_sites, cfg.text_path, model_config))
    return cfg.with_d_in(cfg.d_in or SYNTHETIC_D_IN)


def _preflight(cfg: TrainConfig, model_config=None) -> TrainConfig:
    """Checks that need the data or the disk, done once before any rank starts (one error, not N)."""
    from sae_dist.train.checkpoint import check_run_dir

    cfg = _with_source_d_in(cfg, model_config)  # the default run name needs d_sae
    check_run_dir(cfg)
    return cfg


def _estimate(ns: argparse.Namespace) -> int:
    from sae_dist.memory import estimate_for_config
    from sae_dist.train.launch import resolve_devices

    sweep = sweep_from_args(ns)  # as for train: a bad sweep first, the model's config read once
    model_config = check_trainable(sweep) if sweep is not None else None
    cfg = _with_source_d_in(config_from_args(ns), model_config)
    if sweep is not None:
        sweep = sweep.with_d_in(cfg.d_in)
        placement = _placement(sweep, cfg, model_config)
        print(f"{len(sweep)} SAEs: {', '.join(sweep.names)}")
        print("\n".join(placement.lines()))
        return 0
    kind, ranks = resolve_devices(cfg.devices)  # "auto" is a GPU only where one is visible
    print(estimate_for_config(cfg, ranks, kind).describe())
    return 0


def _placement(sweep, cfg: TrainConfig, model_config=None):
    """The sweep on the job's devices (sae_dist/sweeps/placement.py), each GPU's memory as its capacity;
    from the model source (`model_config`: its config), the model's memory on every device too."""
    from sae_dist.data.harvest.sites import model_sites
    from sae_dist.sweeps.placement import place_sweep
    from sae_dist.sweeps.setup import job_devices
    from sae_dist.train.launch import resolve_devices

    kind, ranks = resolve_devices(cfg.devices)
    source = None
    if model_config is not None:
        from sae_dist.data.sources.model import launcher_memory

        n_sites = 2 if cfg.transcode else len(model_sites(sweep))  # a transcoder's input and output
        source = launcher_memory(cfg, model_config, n_sites, cfg.batch_size * ranks * cfg.grad_accum)
    return place_sweep(sweep, kind, job_devices(kind, ranks), source)
