#!/usr/bin/env bash
# run 27, call 3: where a 35B-A3B decode step goes (kernel time per name, eager steps); the MoE decode combine
# (one launch for weights, shared gate and sum) against the commit before it (.carry/base = 87cb2d5), same call;
# then issue 5's table for
# the shapes not yet run end to end: 35B-A3B Q4 and Q5 recipes, 27B Q5 recipe, bf16 / int8 / rk4v4-e8 KV at 8K
# and 200K (prefill through the dense-experts MoE path for the 35B)
set -u
R=/tmp/r27c; mkdir -p $R
. bench/device_env.sh
timeout 90 python bench/profile_decode.py qwen3.6-35b-a3b $R/profile-35b-decode.json decode bf16 > $R/profile.log 2>&1; echo "profile rc=$? t=$(el)"
grep -v "^\[" $R/profile.log | head -27 | cut -c1-150
S="python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --prefill-limit 8k --decode-tokens 64 --depths 8k --kv-dtype bf16"
timeout 70 $S --json-out $R/side-new.json > $R/side-new.log 2>&1; echo "side new rc=$? t=$(el)"
(cd .carry/base && timeout 70 $S --json-out $R/side-base.json > $R/side-base.log 2>&1); echo "side base rc=$? t=$(el)"
B="python -m ninfer_cli.main bench --prefill-limit 8k --decode-tokens 32 --depths 8k,200k --kv-dtype bf16,int8,rk4v4-e8"
timeout 150 $B --random-weights qwen3.6-35b-a3b --recipe q4 --json-out $R/bench-35b-q4.json > $R/bench-35b-q4.log 2>&1; echo "35b q4 rc=$? t=$(el)"
[ $(el) -lt 330 ] && timeout $(( 560 - $(el) )) $B --random-weights qwen3.6-35b-a3b --recipe q5 --json-out $R/bench-35b-q5.json > $R/bench-35b-q5.log 2>&1; echo "35b q5 rc=$? t=$(el)"
[ $(el) -lt 420 ] && { timeout $(( 560 - $(el) )) $B --random-weights qwen3.6-27b --recipe q5 --json-out $R/bench-27b-q5.json > $R/bench-27b-q5.log 2>&1; echo "27b q5 rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/side-*.json") + glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run27c.tgz . 2>/dev/null
