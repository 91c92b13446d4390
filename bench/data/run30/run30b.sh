#!/usr/bin/env bash
# Run 30 call 2: as call 1 (32K prefill beside 3 decoding lanes, 27B Q4, bf16 KV at 8K), the riding chunks
# now replayed as CUDA graphs (call 1: eager, ~140 ms per chunk of any size up to 1,024 -- launch-bound);
# shared chunks 512/1024/2048 against the old schedule; then the engine tests on the GPU.
# run (carry .carry): bash bench/data/run30/run30b.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 240 python -m ninfer_cli.main bench --random-weights qwen3.6-27b --lanes 1,4 \
  --depths 8k --kv-dtype bf16 --concurrent-prefill 32k --json-out "$OUT/prefill-ride-graphs.json" 2>&1 \
  | grep -E "prefills|rror|Traceback|without a CUDA graph" | tail -8
echo "t=$(el)"
timeout 300 python -m pytest -q -n0 -p no:cacheprovider tests/test_engine.py 2>&1 | grep -E "passed|failed|^E " | tail -6
echo "t=$(el)"
