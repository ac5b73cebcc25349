"""`python -m sae_dist ...`: train, estimate-memory. User mistakes are one line on stderr."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import typing
from typing import Any

from sae_dist.config import SYNTHETIC_D_IN, TrainConfig, build_config, config_fields, field_types, load_toml
from sae_dist.errors import USER_ERROR_EXIT, TrainingStopped, UserError


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, with the field's help; unset flags leave the TOML/default alone."""
    parser.add_argument("--config", help="TOML file with the same keys as the flags (flags win)")
    types = field_types()
    for f in config_fields():
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "") + (f" (default: {f.default})" if f.default is not None else "")
        annotation = types[f.name]
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        base = args[0] if args and typing.get_origin(annotation) is not typing.Literal else annotation
        if base is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_text)
        else:
            convert = {int: int, float: float}.get(base, str)
            parser.add_argument(flag, type=convert, default=argparse.SUPPRESS, help=help_text,
                                metavar=f.name.upper())


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    values: dict[str, Any] = load_toml(ns.config) if getattr(ns, "config", None) else {}
    names = {f.name for f in config_fields()}
    values.update({k: v for k, v in vars(ns).items() if k in names})
    return build_config(values)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sae_dist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train an SAE on N devices (DDP)",
                           description="Train a sparse autoencoder; N devices run as N DDP ranks.")
    _add_config_flags(train)
    est = sub.add_parser("estimate-memory", help="memory per device for a training config")
    _add_config_flags(est)
    return parser


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
    from sae_dist.launch import OUR_LAUNCHER_ENV, die_with_parent, in_worker, launch

    if not in_worker():
        return launch(_preflight(config_from_args(ns)), train_argv)
    # A rank started by torchrun (ours, or the user's on a cluster).
    import os

    from sae_dist.train import train

    die_with_parent()
    rank = os.environ.get("RANK", "0")
    if rank != "0":
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 speaks for the job
    try:
        train(config_from_args(ns))
    except TrainingStopped as e:
        if rank == "0" and not os.environ.get(OUR_LAUNCHER_ENV):  # under the user's torchrun
            print(f"training stopped by {e.signame}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + e.signum)  # as a process killed by the signal would report it
    except UserError as e:
        if rank == "0" or not e.shared:
            print(f"error: {e}" if os.environ.get("WORLD_SIZE") == "1" else f"error: [rank {rank}] {e}",
                  file=sys.stderr, flush=True)
        elif os.environ.get("WORLD_SIZE", "1") != "1":
            time.sleep(1.0)  # let rank 0 report the shared error before torchrun stops the job
        # Straight out: no interpreter teardown racing gloo's threads for a process group
        # whose peers are leaving too (it can abort with std::terminate).
        sys.stdout.flush()
        os._exit(USER_ERROR_EXIT)
    return 0


def _with_source_d_in(cfg: TrainConfig) -> TrainConfig:
    """The config with d_in from its source: the shards' width (headers only), or synthetic's."""
    if cfg.source == "shards":
        from sae_dist.sources.shards import open_shards

        return cfg.with_d_in(open_shards(cfg.shards_path).d_in)  # raises on a width mismatch
    return cfg.with_d_in(cfg.d_in or SYNTHETIC_D_IN)


def _preflight(cfg: TrainConfig) -> TrainConfig:
    """Checks that need the data or the disk, done once before any rank starts (one error, not N)."""
    from sae_dist.launch import resolve_devices
    from sae_dist.train import check_run_dir

    check_run_dir(_with_source_d_in(cfg), world_size=resolve_devices(cfg.devices)[1])
    return cfg


def _estimate(ns: argparse.Namespace) -> int:
    from sae_dist.launch import resolve_devices
    from sae_dist.memory import estimate_for_config

    cfg = _with_source_d_in(config_from_args(ns))
    print(estimate_for_config(cfg, resolve_devices(cfg.devices)[1]).describe())
    return 0
