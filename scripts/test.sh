#!/usr/bin/env bash
# Installs what is missing (the project, test tools, and sae-lens in its own venv for the export
# compatibility test), then runs the whole test suite. Extra arguments go to pytest.
# Two workers, a test file each at a time (--dist loadfile keeps a module's shared runs in one
# process): on two cores one worker left half the machine idle while its tests waited on their
# processes. `-n 0` runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
