#!/usr/bin/env bash
# run 27, call 1: the grouped MoE prefill (stop 16, untimed until now) on the H200: its GPU tests, the stage
# times and tile sweep of one 35B-A3B layer's experts at 8K tokens (the script's `sweep` mode today; call 1 ran
# it before the dense path existed, when the sweep was the script's only mode), then the 35B-A3B bench at 8K through the
# grouped path and through the old per-expert loop (NINFER_MOE_PREFILL=loop), side by side
set -u
R=/tmp/r27a; mkdir -p $R
. bench/device_env.sh
timeout 60 python -m pytest -q tests/test_kernels.py -k "expert_prefill or sort_pairs or expert_gemv" -p no:warnings > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 200 python bench/moe_compare.py $R/moe-8k.json 8192 sweep > $R/moe.log 2>&1; echo "moe_compare rc=$? t=$(el)"; grep -v "^{" $R/moe.log | tail -12
python - <<PY
import json; d = json.load(open("$R/moe-8k.json"))
ok = sorted((r for r in d["sweep"] if "ms" in r), key=lambda r: r["ms"])
for r in ok[:6]: print(r)
print("errors:", [r for r in d["sweep"] if "error" in r][:3])
PY
for mode in fused loop; do  # call 1 named the fused path "grouped" (then the only one; files bench-35b-grouped.*)
  NINFER_MOE_PREFILL=$mode timeout 130 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 16 --json-out $R/bench-35b-$mode.json > $R/bench-35b-$mode.log 2>&1; echo "bench $mode rc=$? t=$(el)"
  python -c "
import json; d = json.load(open('$R/bench-35b-$mode.json'))
for r in d['rows']: print('$mode', r['kv_dtype'], r['depth'], 'prefill', round(r.get('prefill_tok_s') or 0), 'decode', round(r['decode_tok_s'], 1))" 2>&1 | tail -2
done
tar -C $R -czf ${OUT:-/tmp}/run27a.tgz . 2>/dev/null
