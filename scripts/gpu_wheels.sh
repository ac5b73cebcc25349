#!/usr/bin/env bash
# The Python packages the GPU check needs that the lent GPU machine lacks, as CPython 3.12
# manylinux wheels in .whl/ (ignored by git), ready to travel with the working tree: that machine
# reaches no package registry. Prints their total size and fails above the budget (48 MiB of the
# 64 MiB that may travel), or when a wheel cannot be had.
#
#   scripts/gpu_wheels.sh            # download what is missing (idempotent), then check the budget
#
# The versions are the ones this checkout's own environment (.venv) runs, where it has them, so
# the GPU machine runs what the tests here ran; the rest at their newest.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.whl}
BUDGET_MIB=48

# What the machine's image lacks (it has torch, numpy, pandas, pyarrow, nvidia-ml-py, safetensors,
# filelock, triton, transformers, pytest, anyio, click, protobuf, jinja2, narwhals ... : see the
# device tool's KINDS.md), by what needs it:
PROJECT="sqlmodel sqlalchemy pydantic pydantic-core annotated-types typing-inspection typing-extensions alembic mako"
# sparsify's GPU kernels (its fused encoder and Triton decoder) are timed beside our step; its
# trainer (datasets, schedulefree) is never imported, so its wheels stay behind.
SPARSIFY="eai-sparsify simple-parsing docstring-parser natsort"
# Streamlit's AppTest of Overview and Monitor. pydeck (11 MiB: maps) and GitPython are not
# imported by any page and stay behind.
APP="streamlit altair starlette uvicorn websockets python-multipart itsdangerous watchdog tornado blinker cachetools
tenacity toml jsonschema jsonschema-specifications referencing rpds-py"

pinned() {  # NAMES -> NAME==VERSION as .venv has it, else NAME, a line each (one interpreter for all)
    if [ -x .venv/bin/python ]; then
        .venv/bin/python - "$@" <<'EOF'
import sys
from importlib import metadata
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        print(name)
EOF
    else
        printf '%s\n' "$@"
    fi
}

mkdir -p "$DEST"
mapfile -t specs < <(pinned $PROJECT $SPARSIFY $APP)
# pip skips a wheel already in DEST (it reports "File was already downloaded").
if ! python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
        -d "$DEST" "${specs[@]}" 2> >(grep -v "^WARNING: Location" >&2); then
    echo "gpu_wheels: could not download: ${specs[*]}" >&2
    exit 1
fi

# Two versions of one package stop the whole install there: keep the one asked for.
python3 - "$DEST" "${specs[@]}" <<'EOF'
import re, sys
from pathlib import Path
dest, specs = Path(sys.argv[1]), sys.argv[2:]
def norm(n): return re.sub(r"[-_.]+", "_", n).lower()
wanted = {norm(s.split("==")[0]): (s.split("==") + [None])[1] for s in specs}
for wheel in sorted(dest.glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    if norm(name) not in wanted:
        print(f"gpu_wheels: {wheel.name} is not on the list any more; removed")
        wheel.unlink()
    elif wanted[norm(name)] not in (None, version):
        print(f"gpu_wheels: {wheel.name} is not the version wanted ({wanted[norm(name)]}); removed")
        wheel.unlink()
EOF

total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
count=$(ls "$DEST"/*.whl | wc -l)
mib=$(python3 -c "print(f'{$total / 2**20:.1f}')")
echo "gpu_wheels: $count wheels in $DEST/, $mib MiB (budget $BUDGET_MIB MiB)"
if [ "$total" -gt $((BUDGET_MIB * 1024 * 1024)) ]; then
    echo "gpu_wheels: $mib MiB is over the budget of $BUDGET_MIB MiB" >&2
    exit 1
fi
