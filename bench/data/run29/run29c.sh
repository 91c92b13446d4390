#!/usr/bin/env bash
# Run 29 call 3: bf16 row kernel with x tiles and scales prefetched by hand beside the pipelined weight bytes (tile
# sweep vs the int8 kernel and T = 1); ncu stall reasons of one product; lanes and MTP3 with the default paths
# (Q5 row blocks on the bf16 kernel).  run (carry .carry): bash bench/data/run29/run29c.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 120 python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py -k "rows_bf16 or test_qlinear or verify_rows" 2>&1 | tail -1
echo "tests done $(el) s"
timeout 240 python bench/gemv_compare.py "$OUT/gemv_rows.json" rows 2>&1 | grep -E "^\{|failed" | cut -c1-1000
echo "gemv done $(el) s"
if command -v ncu >/dev/null; then
  timeout 90 ncu --clock-control none -k regex:qgemm_rows_bf16 -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section LaunchStats python bench/data/run29/ncu_rows.py > "$OUT/ncu_rows.txt" 2>&1
  grep -E "Duration|Memory Throughput|DRAM Throughput|Stall|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued" "$OUT/ncu_rows.txt" | head -30
fi
echo "ncu done $(el) s"
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/lanes-default.json" 2>&1 | grep -E "lane\(|rror" | tail -5
echo "lanes done $(el) s"
