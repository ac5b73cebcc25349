#!/usr/bin/env bash
# Installs what is missing (the project, test tools, and sae-lens in its own venv for the export
# compatibility test), then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
exec .venv/bin/python -m pytest "$@"
