#!/usr/bin/env bash
# For the first machine with NVIDIA GPUs: what no test on the GPU-less development machine can
# show (CUDA, NCCL, bf16, a real driver's NVML), run in one go, ending in one verdict table.
#
#   ./scripts/gpu_check.sh            # logs under test-artifacts/gpu-check/<time>/
#
# 1. the tests marked `cuda` (tests/test_cuda.py: NVML and CUDA agree on the GPUs in PCI bus
#    order and on free memory, the health probe's CUDA path, a CUDA and a bf16 step against the
#    CPU's, a 2-GPU training over NCCL), and the emulated-NVML tests (which must still pass
#    beside a real driver: LD_LIBRARY_PATH puts the emulated one first);
# 2. scripts/bench_step.py --device cuda, in fp32 and bf16;
# 3. a strong-scaling benchmark on 1, 2 and 4 GPUs (as many as there are), NCCL, no queue;
# 4. the daemon's CPU while it samples the real GPUs at 1 Hz (scripts/bench_nvml_sampler.py --real).
# A step that cannot run here (too few GPUs, no bf16) is SKIP, with why. Exit code 1 when a step FAILs.
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test >/dev/null
PY=.venv/bin/python
OUT=test-artifacts/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)
rows=()
failed=0

run_step() {  # run_step NAME COMMAND...: PASS/FAIL by exit code; the log's last line as detail
    local name=$1; shift
    local log="$OUT/${name// /_}.log" start=$SECONDS
    if "$@" >"$log" 2>&1; then verdict=PASS; else verdict=FAIL; failed=1; fi
    rows+=("$name|$verdict|$((SECONDS - start)) s|$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-90)")
}

skip_step() { rows+=("$1|SKIP|-|$2"); }

gpus=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
if [ "$gpus" = 0 ]; then
    seen=$(command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -1 || echo "no nvidia-smi")
    echo "gpu_check: torch sees no CUDA GPU here ($seen); nothing to check"
    exit 2
fi
mkdir -p "$OUT"
{ nvidia-smi; "$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, \
'bf16', torch.cuda.is_bf16_supported())"; } >"$OUT/machine.txt" 2>&1
bf16=$("$PY" -c "import torch; print(int(torch.cuda.is_bf16_supported()))")

run_step "tests marked cuda" "$PY" -m pytest -p no:cacheprovider -m cuda -rs -q tests/test_cuda.py
run_step "emulated NVML tests" "$PY" -m pytest -p no:cacheprovider -q tests/test_nvml_emulated.py tests/test_nvml_scheduler.py
run_step "bench_step cuda fp32" "$PY" scripts/bench_step.py --device cuda --precision fp32
if [ "$bf16" = 1 ]; then
    run_step "bench_step cuda bf16" "$PY" scripts/bench_step.py --device cuda --precision bf16
else
    skip_step "bench_step cuda bf16" "this GPU has no bf16"
fi
counts=1; [ "$gpus" -ge 2 ] && counts=1,2; [ "$gpus" -ge 4 ] && counts=1,2,4
run_step "scaling $counts NCCL" env SAE_DIST_HOME="$OUT/home" "$PY" -m sae_dist bench --devices "$counts" \
    --device-kind cuda --no-queue --mode strong --steps 30 --repeats 3 \
    --d-in 768 --d-sae 24576 --k 32 --batch-size 4096 --synthetic-features 4096
[ "$gpus" -lt 4 ] && skip_step "scaling to 4 GPUs" "$gpus GPU(s) here"
run_step "daemon sampling real NVML" "$PY" scripts/bench_nvml_sampler.py --real --window 30

printf '\n%-28s %-7s %-8s %s\n' STEP VERDICT TIME DETAIL
for row in "${rows[@]}"; do
    IFS='|' read -r name verdict took detail <<<"$row"
    printf '%-28s %-7s %-8s %s\n' "$name" "$verdict" "$took" "$detail"
done
echo "logs and the machine's description: $OUT/"
exit $failed
