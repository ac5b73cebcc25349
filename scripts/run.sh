#!/usr/bin/env bash
# Installs what is missing, then runs the main job: until the scheduler and the app land, a short
# DDP training run on synthetic data over 2 CPU ranks (or every GPU) that prints its metrics.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
devices=auto
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    devices=cpu:2
fi
exec .venv/bin/python -m sae_dist train --devices "$devices" --d-in 256 --synthetic-features 1024 \
    --expansion-factor 4 --k 16 --batch-size 1024 --steps 300 --log-every 25 --checkpoint-every 100 "$@"
