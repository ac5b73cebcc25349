#!/usr/bin/env bash
# Installs what is missing, starts the scheduler daemon in the background (it keeps running the
# queue after the app stops; `python -m scheduler daemon --stop` ends it) and serves the app on
# 127.0.0.1 only, on the first free port from $SAE_DIST_PORT (default 8501). Ctrl-C stops the app.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
py=.venv/bin/python
"$py" -m scheduler daemon --detach
port=$("$py" - "${SAE_DIST_PORT:-8501}" <<'EOF'
import socket, sys
start = int(sys.argv[1])
for port in range(start, start + 100):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            continue
    print(port)
    break
else:
    sys.exit(f"no free port in {start}-{start + 99} on 127.0.0.1")
EOF
)
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    echo "sae-dist: no NVIDIA GPU here: the app shows virtual (CPU-backed) devices, labelled as such"
fi
echo "sae-dist: the app is at http://127.0.0.1:$port  (Ctrl-C stops it)"
exec "$py" -m streamlit run app.py --server.address 127.0.0.1 --server.port "$port" --server.headless true
