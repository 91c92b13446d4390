#!/usr/bin/env bash
# Run 29 call 5: GPU tests of the row kernels; the server smoke on cuda (hardened server, thinking budget, tool_choice);
# decoding lanes while another lane prefills 32K (issue 20 item 5).  run (carry .carry): bash bench/data/run29/run29e.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 120 python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py -k "rows_bf16 or rows_mma or test_qlinear or verify_rows" 2>&1 | tail -1
echo "tests done $(el) s"
timeout 150 python bench/serve_smoke.py /tmp/smoke > "$OUT/smoke.log" 2>&1; grep -E "PASS|FAIL|HTTP|Error" "$OUT/smoke.log" | cut -c1-300
echo "smoke done $(el) s"
timeout 200 python -m ninfer_cli.main bench --random-weights qwen3.6-27b --lanes 1,4 --depths 8k --kv-dtype bf16 \
  --concurrent-prefill 32k --json-out "$OUT/concurrent-prefill.json" 2>&1 | grep -E "lane|prefills|rror" | tail -4
echo "concurrent prefill done $(el) s"
