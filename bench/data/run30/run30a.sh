#!/usr/bin/env bash
# Run 30 call 1: decoding lanes while another lane prefills 32K -- the old schedule (full chunk, then a decode
# step) against decode rows riding inside --prefill-chunk-shared chunks (256/512/1024), with the dense scratch
# of the prefill GEMM at 64 MiB (default) and 16 MiB; then the engine tests on the GPU (riding lanes' tokens
# equal to the same lane decoded alone).  run (carry .carry): bash bench/data/run30/run30a.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
for mb in 64 16; do
  NINFER_GEMM_DEQUANT_MB=$mb timeout 200 python -m ninfer_cli.main bench --random-weights qwen3.6-27b --lanes 1,4 \
    --depths 8k --kv-dtype bf16 --concurrent-prefill 32k --json-out "$OUT/prefill-ride-$mb.json" 2>&1 \
    | grep -E "prefills|rror|Traceback" | sed "s/^/[scratch $mb MiB] /" | tail -8
  echo "t=$(el)"
done
timeout 240 python -m pytest -q -n0 -p no:cacheprovider tests/test_engine.py -k "ride or batched or reference" 2>&1 | tail -4
echo "t=$(el)"
