#!/usr/bin/env bash
# Run 30 call 3: the ride graphs with a smaller dequant scratch (16 and 32 MiB: L2-resident, costly only in
# launches, which a graph removes), against call 2's 64 MiB; then the engine tests on the GPU (call 2's -n0
# needed xdist, absent there).  run (carry .carry): bash bench/data/run30/run30c.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_engine.py -rs 2>&1 | tail -3
echo "t=$(el)"
for mb in 16 32; do
  NINFER_GEMM_DEQUANT_MB=$mb timeout 190 python -m ninfer_cli.main bench --random-weights qwen3.6-27b --lanes 1,4 \
    --depths 8k --kv-dtype bf16 --concurrent-prefill 32k --json-out "$OUT/prefill-ride-graphs-$mb.json" 2>&1 \
    | grep -E "prefills|rror|Traceback|without a CUDA graph" | sed "s/^/[scratch $mb MiB] /" | tail -5
  echo "t=$(el)"
done
