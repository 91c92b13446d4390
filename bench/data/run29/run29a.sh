#!/usr/bin/env bash
# Run 29 call 1: bf16 row-block products (issue 20) side by side with the int8 kernel and T = 1; lanes and
# MTP3 end to end with the previous (mma) and the new (bf16) row path.  run (carry .carry): bash bench/data/run29/run29a.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py -k "rows_bf16 or rows_mma or test_qlinear or verify_rows" 2>&1 | tail -3
echo "tests done $(el) s"
timeout 240 python bench/gemv_compare.py "$OUT/gemv_rows.json" rows 2>&1 | grep -E "^\{|failed" | cut -c1-900
echo "gemv done $(el) s"
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
for path in mma bf16; do
  NINFER_GEMV_ROWS=$path timeout 150 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16,rk4v4-e8 --json-out "$OUT/lanes-$path.json" 2>&1 | grep -E "lane|Error|error" | grep -v "^\s*$" | tail -10
  echo "lanes $path done $(el) s"
done
for path in mma bf16; do
  NINFER_GEMV_ROWS=$path timeout 100 $B --depths 8k --prefill-limit 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 --decode-tokens 64 --json-out "$OUT/mtp-$path.json" 2>&1 | grep -E "depth|rror" | tail -3
  echo "mtp $path done $(el) s"
done
