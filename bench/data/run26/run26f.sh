#!/usr/bin/env bash
# run 26, call 6 (the last ~250 s of device time): grouped MoE prefill on the H200: its kernel tests, then the
# 35B-A3B prefill at 8K (earlier runs: 2,901-3,103 tok/s with the per-expert loop; transformers 6,834)
set -u
R=/tmp/r26f; mkdir -p $R
. bench/device_env.sh  # flash-linear-attention for the chunked GDN prefill, as in the earlier 35B runs
timeout 35 python -m pytest -q tests/test_kernels.py -k "expert_prefill or sort_pairs" -p no:warnings > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 95 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 4 --json-out $R/bench-35b.json > $R/bench-35b.log 2>&1; echo "bench rc=$? t=$(el)"
grep -i "prefill\|tok/s\|│" $R/bench-35b.log | tail -6
python -c "
import json; d = json.load(open('$R/bench-35b.json'))
for r in d['rows']: print(r['kv_dtype'], r['depth'], r.get('prefill_chunk'), 'prefill', round(r.get('prefill_tok_s') or 0), 'decode', round(r['decode_tok_s'], 1))" 2>&1 | tail -3
tar -C $R -czf ${OUT:-/tmp}/run26f.tgz . 2>/dev/null
