#!/usr/bin/env bash
# run 26, call 2: the norm micro-benchmark again (call 1's timed the spread variants on a residual the
# one-program variant had already added into), rk4v4-e8 attention per layer at 200K against the previous
# kernel (.carry/old_paged_attention.py), and the 27B with rk4v4-e8 KV at 8K and 200K against .carry/base
set -u
R=/tmp/r26b; mkdir -p $R
. bench/device_env.sh
timeout 60 python bench/norm_compare.py $R/norm.json > $R/norm.log 2>&1; echo "norm rc=$? t=$(el)"; cat $R/norm.log | cut -c1-700
timeout 200 python bench/attention_compare.py $R/attn.json rk4v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
grep '"t": ' $R/attn.log | cut -c1-1500; tail -3 $R/attn.log | cut -c1-300
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
[ $(el) -lt 330 ] && { timeout $(( 500 - $(el) )) $B --depths 8k,200k --kv-dtype rk4v4-e8 --json-out $R/bench-new.json > $R/bench-new.log 2>&1; echo "new rc=$? t=$(el)"; }
[ $(el) -lt 460 ] && { (cd .carry/base && timeout $(( 580 - $(el) )) $B --depths 8k,200k --kv-dtype rk4v4-e8 --json-out $R/bench-base.json > $R/bench-base.log 2>&1); echo "base rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run26b.tgz . 2>/dev/null; ls $R
