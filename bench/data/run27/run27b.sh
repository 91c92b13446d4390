#!/usr/bin/env bash
# run 27, call 2: the dense-experts MoE prefill (experts dequantized in chunks + torch's grouped GEMM) against
# the fused kernel timed in call 1, per chunk length; the 35B-A3B bench at 8K through each path; transformers'
# prefill/decode on the same shape in the same call
set -u
R=/tmp/r27b; mkdir -p $R
. bench/device_env.sh
timeout 60 python -m pytest -q tests/test_kernels.py -k "expert_prefill or expert_chunks" -p no:warnings > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 150 python bench/moe_compare.py $R/moe-8k.json 8192 > $R/moe.log 2>&1; echo "moe_compare rc=$? t=$(el)"; tail -12 $R/moe.log | cut -c1-400
for mode in auto fused; do
  NINFER_MOE_PREFILL=$mode timeout 130 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 16 --json-out $R/bench-35b-$mode.json > $R/bench-35b-$mode.log 2>&1; echo "bench $mode rc=$? t=$(el)"
  python -c "
import json; d = json.load(open('$R/bench-35b-$mode.json'))
for r in d['rows']: print('$mode', r['kv_dtype'], r['depth'], 'prefill', round(r.get('prefill_tok_s') or 0), 'decode', round(r['decode_tok_s'], 1), 'peak', r['peak_allocated_bytes'], 'planned', r['planned_bytes'])" 2>&1 | tail -2
done
[ $(el) -lt 400 ] && { timeout $(( 570 - $(el) )) python bench/hf_baseline.py qwen3.6-35b-a3b 8192 8 $R/hf-35b-8k.json > $R/hf.log 2>&1; echo "hf rc=$? t=$(el)"; tail -3 $R/hf.log | cut -c1-300; }
tar -C $R -czf ${OUT:-/tmp}/run27b.tgz . 2>/dev/null
