#!/usr/bin/env bash
# Run 29 call 6: decoding lanes while another lane prefills 32K, the prefill alone timed after a warm-up (call 5 timed
# its first, compiling run).  run (carry .carry): bash bench/data/run29/run29f.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 170 python -m ninfer_cli.main bench --random-weights qwen3.6-27b --lanes 1,4 --depths 8k --kv-dtype bf16 \
  --concurrent-prefill 32k --json-out "$OUT/concurrent-prefill.json" 2>&1 | grep -E "prefills|rror" | tail -3
