#!/usr/bin/env bash
# The GPU check, for the machine this workplace lends (one H100 or H200, Python 3.12 with its own
# torch, no package registry): what no test on a GPU-less machine can show, in one go, each step
# under its own time limit, ending in one verdict table.
#
#   scripts/gpu_wheels.sh                 # here, first: the wheels that travel (.whl/, ~21 MiB)
#   scripts/gpu_check.sh                  # there, as one `device` run: carry [".whl"], timeout_s 540
#   scripts/gpu_check.sh --rehearse       # here: every step that needs no CUDA, the device's way
#   scripts/gpu_check.sh --only 3,7       # some steps again (numbers from the table)
#
# There: the machine's own python3 and torch; the carried wheels installed with pip --no-index
# --target (nothing is fetched, nothing is built). The rehearsal installs the same wheels the same
# way for the device's platform (the set must be complete, one version of each), runs the steps
# with this checkout's .venv (Python 3.11 cannot load cp312 wheels), and checks that what would
# travel and what would come back fit the device tool's limits. The verdict (verdict.md,
# verdict.json) and the logs (logs.tar.gz) go to $OUT there, else test-artifacts/gpu-check/<time>/.
# Exit status 1 when a step fails or runs out of time; a SKIP says why and fails nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
rehearse=0
if [ "${1:-}" = "--rehearse" ]; then rehearse=1; shift; fi
out=${OUT:-test-artifacts/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)}
site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
platform=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --only-binary=:all:)
install() {  # the carried wheels into $site, as the GPU machine installs them
    rm -rf "$site"
    python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps \
        --no-compile --no-cache-dir --upgrade --target "$site" "$@" .whl/*.whl 2> >(grep -v "^WARNING: Location" >&2)
}

if [ $rehearse = 1 ]; then
    py=${PYTHON:-.venv/bin/python}
    [ -x "$py" ] || { echo "gpu_check: no $py: run scripts/setup.sh --test first" >&2; exit 2; }
    scripts/gpu_wheels.sh || exit 1
    install "${platform[@]}" || { echo "gpu_check: the carried wheels do not install for Python 3.12" >&2; exit 1; }
    echo "gpu_check: the carried wheels install for CPython 3.12 manylinux ($(ls "$site" | grep -c dist-info) packages)"
    "$py" scripts/gpu_check/run.py --out "$out" --rehearse "$@"
    status=$?
    "$py" scripts/gpu_check/travel.py --carry .whl --out "$out" || status=1
    exit $status
fi

[ -d .whl ] || { echo "gpu_check: no .whl/ here: run scripts/gpu_wheels.sh and carry .whl" >&2; exit 2; }
install || { echo "gpu_check: the carried wheels did not install" >&2; exit 1; }
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}"
# The compiled CPU top-k kernel is not what this checks, and its first build (g++, tens of
# seconds) would come out of the lease: the CPU sides of the comparisons use stock torch.topk.
export SAE_DIST_NO_KERNELS=1
exec python3 scripts/gpu_check/run.py --out "$out" "$@"
