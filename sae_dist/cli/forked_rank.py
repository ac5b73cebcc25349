"""A CPU rank forked by our launcher (torchrun `--start-method fork --run-path` this file).

It starts as a copy of the launcher, so first it becomes what a fresh `python -u -m sae_dist`
rank would be: the launcher's signal handlers (torchrun's, which raise in the agent) dropped,
its output line-buffered so a log follows the run. Then the same command line as a spawned rank.
"""

import os
import signal
import sys

from sae_dist.contract import FORKED_RANK_ENV

signal.signal(signal.SIGTERM, signal.SIG_DFL)
signal.signal(signal.SIGINT, signal.default_int_handler)
for stream in (sys.stdout, sys.stderr):
    stream.reconfigure(line_buffering=True)
os.environ[FORKED_RANK_ENV] = "1"

from sae_dist.cli import main  # noqa: E402  (after the signals: a stop must not hit torchrun's handler)

sys.exit(main(sys.argv[1:]))
