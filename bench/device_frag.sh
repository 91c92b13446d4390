#!/usr/bin/env bash
# One device call (< 600 s) for the fragment kernels (bench/RESULTS.md §2): their GPU tests, both kernels per
# product side by side with the other row kernels, and the 27B lanes / MTP3 with the default against
# NINFER_GEMV_FRAG=layout (the fragment-order planes) and =off.
#   run (carry .carry):  bash bench/device_frag.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh
timeout 150 python -m pytest -q -n 4 --tb=short tests/test_frag_kernel.py tests/test_engine.py \
  -k "frag or fragment or wide" > "$OUT/tests.log" 2>&1
grep -E "^E |passed|failed|FAILED" "$OUT/tests.log" | head -40
echo "t=$(el)"
timeout 200 python bench/gemv_compare.py "$OUT/frag.json" frag 2>&1 | grep "{" | cut -c1-900
echo "t=$(el)"
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
# auto: fragment kernel on the artifact's planes for row blocks; layout: the fragment-order kernel for every
# 1-16-row product (warps per block chosen per product); layout-k1: the same with K split across programs only
for mode in auto layout layout-k1; do
  tile=""; [ "$mode" = layout-k1 ] && tile="2,4,528,1"
  NINFER_GEMV_FRAG=${mode%-k1} NINFER_FRAGMENT_TILE=$tile timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 \
    --json-out "$OUT/lanes-$mode.json" 2>&1 | grep "│ bf16"
  echo "$mode t=$(el)"
done
NINFER_GEMV_FRAG=layout timeout 70 $B --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 \
  --decode-tokens 64 --json-out "$OUT/mtp-layout.json" 2>&1 | grep "│ bf16"
echo "t=$(el)"
