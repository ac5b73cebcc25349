#!/usr/bin/env bash
# Installs what is missing (the project, test tools, and sae-lens in its own venv for the export
# compatibility test), runs the linter, then the whole test suite. Extra arguments go to pytest.
# Two workers, a test file each at a time (--dist loadfile keeps a module's shared runs in one
# process): on two cores one worker left half the machine idle while its tests waited on their
# processes. `-n 0` runs everything in this one process.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
# The linter first (a second): pyflakes, pycodestyle and import order, as pyproject.toml sets them.
.venv/bin/ruff check --quiet . || { echo "test.sh: ruff found the above; fix them (ruff check --fix for most)" >&2; exit 1; }
exec .venv/bin/python -m pytest -n 2 --dist loadfile "$@"
