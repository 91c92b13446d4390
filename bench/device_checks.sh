#!/usr/bin/env bash
# One device call that re-verifies the GPU paths and refreshes the headline numbers.
#   run (carry .carry):  bash bench/device_checks.sh
# .carry/wheels holds fastapi/uvicorn and flash-linear-attention wheels (the device has no network):
#   pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any \
#     -d .carry/wheels fastapi uvicorn einops && pip download --no-deps -d .carry/wheels fla-core flash-linear-attention
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh
timeout 120 python bench/attention_compare.py "$OUT/attention.json" bf16,rk4v4-e8 8192,204800 2>&1 | grep -c "{"
timeout 170 python bench/gemv_compare.py "$OUT/gemv_rows.json" rows 2>&1 | grep "{" | cut -c1-400
timeout 150 python bench/serve_smoke.py /tmp/smoke > "$OUT/smoke.log" 2>&1
grep -E "PASS|FAIL|HTTP" "$OUT/smoke.log"
timeout 200 python -m pytest -q tests/test_kernels.py tests/test_frag_kernel.py tests/test_engine.py tests/test_vision.py \
  -rs 2>&1 | tail -4
B="python -m ninfer_cli.main bench --random-weights"
timeout 200 $B qwen3.6-27b --depths 8k,200k --prefill-limit 8k --kv-dtype bf16,rk4v4-e8 --decode-tokens 64 \
  --json-out "$OUT/27b.json" 2>&1 | tail -7
timeout 100 $B qwen3.6-27b --depths 8k,200k --prefill-limit 8k --kv-dtype rk4v4-e8 --spec mtp --draft-tokens 3 \
  --accepted-drafts 3 --decode-tokens 64 --json-out "$OUT/27b-mtp.json" 2>&1 | tail -3
