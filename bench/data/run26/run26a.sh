#!/usr/bin/env bash
# run 26, call 1: decode rmsnorm spread over programs, int4 attention decode kept out of Triton's byte-wise
# operand hoisting (nibble decode marked impure); GPU tests, micro-benchmarks with the previous kernels side
# by side, then the 27B at 8K (bf16) against the session's starting commit (.carry/base)
set -u
R=/tmp/r26a; mkdir -p $R
. bench/device_env.sh
timeout 150 python -m pytest -q tests/test_kernels.py -k "rmsnorm or paged_attention" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 60 python bench/norm_compare.py $R/norm.json > $R/norm.log 2>&1; echo "norm rc=$? t=$(el)"; cat $R/norm.log | cut -c1-600
timeout 150 python bench/attention_compare.py $R/attn.json rk4v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
grep '"t": ' $R/attn.log | cut -c1-900
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
[ $(el) -lt 400 ] && { timeout $(( 560 - $(el) )) $B --depths 8k --kv-dtype bf16 --json-out $R/bench-new.json > $R/bench-new.log 2>&1; echo "new rc=$? t=$(el)"; }
[ $(el) -lt 470 ] && { (cd .carry/base && timeout $(( 575 - $(el) )) $B --depths 8k --kv-dtype bf16 --json-out $R/bench-base.json > $R/bench-base.log 2>&1); echo "base rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run26a.tgz . 2>/dev/null; ls $R
