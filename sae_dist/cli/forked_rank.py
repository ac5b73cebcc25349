"""A CPU rank forked by our launcher (torchrun `--start-method fork --run-path` this file).

It starts as a copy of the launcher, so first it becomes what a fresh `python -u -m sae_dist`
rank would be: the launcher's signal handlers (torchrun's, which raise in the agent) dropped,
its output line-buffered so a log follows the run, and named for the scheduler (its environ in
/proc is the launcher's). Then the same command line as a spawned rank.
"""

import os
import signal
import sys

from sae_dist.contract import FORKED_RANK_ENV, RANK_PROCESS_NAME

signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
for stream in (sys.stdout, sys.stderr):
    stream.reconfigure(line_buffering=True)
os.environ[FORKED_RANK_ENV] = "1"


def name_this_rank() -> None:
    """This process's name (its comm): sae-rank-<LOCAL_RANK>. Forked from the launcher, its /proc
    environ is the launcher's, so the scheduler tells its device by this name (Linux only)."""
    local_rank = os.environ.get("LOCAL_RANK")
    if local_rank is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_NAME = 15
    name = RANK_PROCESS_NAME.format(local_rank=local_rank).encode()[:15]
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    except OSError:
        pass


name_this_rank()

from sae_dist.cli import main  # noqa: E402  (after the signals: a stop must not hit torchrun's handler)

sys.exit(main(sys.argv[1:]))
