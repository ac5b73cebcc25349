"""The launcher's torchrun command line, read back by torchrun's own parser: CPU ranks are forked
from the launcher (torchrun's --start-method fork --run-path), CUDA ranks start fresh."""

from __future__ import annotations

from torch.distributed.run import config_from_args, get_args_parser, run_script_path

from sae_dist.train.launch import FORKED_RANK, torchrun_argv


def parsed(fork: bool, port: str | None):
    return config_from_args(get_args_parser().parse_args(
        torchrun_argv(["--steps", "3"], 2, "train", fork=fork, port=port)))


def test_cpu_ranks_are_forked_from_the_launcher():
    config, entrypoint, args = parsed(fork=True, port=None)
    assert config.start_method == "fork" and entrypoint is run_script_path
    assert args == [str(FORKED_RANK), "train", "--steps", "3"] and FORKED_RANK.is_file()
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (1, 1, 2, 0)


def test_cuda_ranks_start_fresh_on_the_reserved_port():
    config, entrypoint, args = parsed(fork=False, port="29611")
    assert config.start_method == "spawn" and isinstance(entrypoint, str)
    assert args[-5:] == ["-m", "sae_dist", "train", "--steps", "3"]
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "127.0.0.1:29611"
