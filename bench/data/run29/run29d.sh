#!/usr/bin/env bash
# Run 29 call 4: the bf16 row kernel as committed (x tiles and scales one group ahead, Q5/Q6 high planes as 8-byte
# loads) vs the int8 kernel and T = 1; lanes with the int8 kernel everywhere and with Q5 on the bf16 kernel; the
# server with 4 concurrent streaming clients.  run (carry .carry): bash bench/data/run29/run29d.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 240 python bench/gemv_compare.py "$OUT/gemv_rows.json" rows 2>&1 | grep -E "^\{|failed" | cut -c1-700
echo "gemv done $(el) s"
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
for path in mma auto; do
  NINFER_GEMV_ROWS=$path timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/lanes-$path.json" 2>&1 | grep -E "lane\(|rror" | tail -5
  echo "lanes $path done $(el) s"
done
NINFER_GEMV_ROWS=mma timeout 150 python bench/serve_lanes.py qwen3.6-27b --lanes 4 --tokens 128 --json "$OUT/serve-lanes.json" 2>&1 | tail -2
echo "serve done $(el) s"
