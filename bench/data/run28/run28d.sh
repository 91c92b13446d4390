#!/usr/bin/env bash
# run 28, call 4: two lanes in one batched DFlash2 round on the GPU (graphs for a batch of 2; tiny model,
# each lane's output against its own plain greedy output), then the 27B at the drafter's native block of 16
# (K = 15, all forced accepted) and K = 7 in the same call, rk4v4-e8 at 8K and 200K, with the reduced lm-head draft
set -u
R=/tmp/r28d; mkdir -p $R
. bench/device_env.sh
timeout 120 python bench/dflash2_lanes_check.py $R/lanes > $R/lanes.log 2>&1; echo "lanes rc=$? t=$(el)"
tail -3 $R/lanes.log | cut -c1-400
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 96 --spec dflash2 --lm-head-draft --depths 8k,200k --kv-dtype rk4v4-e8"
timeout 120 $B --draft-tokens 15 --accepted-drafts 15 --json-out $R/k15.json > $R/k15.log 2>&1; echo "k15 rc=$? t=$(el)"
timeout 120 $B --draft-tokens 7 --accepted-drafts 7 --json-out $R/k7.json > $R/k7.log 2>&1; echo "k7 rc=$? t=$(el)"
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/k*.json")):
    for r in json.load(open(f))["rows"]:
        st = r.get("spec_stats") or {}
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "tpr", round(st.get("tokens_per_round", 0), 2), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
rm -f $R/lanes/*.safetensors $R/lanes/*.nfer $R/lanes/*/*.safetensors
tar -C $R -czf ${OUT:-/tmp}/run28d.tgz . 2>/dev/null
