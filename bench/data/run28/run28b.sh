#!/usr/bin/env bash
# run 28, call 2: where a DFlash2 round goes (graph replay of the draft step, of the 8-row verify and of one
# decode step; kernel time per name of eager draft steps), this commit against .carry/base (3040b26: before
# the RoPE tables / one mask per block / SDPA attention in the drafter), same call; then bench K = 7 forced at
# 8K for both, and with the reduced lm-head draft (32,768 rows)
set -u
R=/tmp/r28b; mkdir -p $R
. bench/device_env.sh
timeout 120 python bench/profile_draft.py qwen3.6-27b $R/profile-new.json 7 bf16 > $R/profile-new.log 2>&1; echo "profile new rc=$? t=$(el)"
head -22 $R/profile-new.log | cut -c1-140
(cd .carry/base && timeout 120 python bench/profile_draft.py qwen3.6-27b $R/profile-base.json 7 bf16 > $R/profile-base.log 2>&1); echo "profile base rc=$? t=$(el)"
head -14 $R/profile-base.log | cut -c1-140
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 64 --depths 8k --kv-dtype bf16 --spec dflash2 --draft-tokens 7 --accepted-drafts 7"
timeout 80 $B --json-out $R/k7-new.json > $R/k7-new.log 2>&1; echo "k7 new rc=$? t=$(el)"
(cd .carry/base && timeout 80 $B --json-out $R/k7-base.json > $R/k7-base.log 2>&1); echo "k7 base rc=$? t=$(el)"
[ $(el) -lt 470 ] && { timeout 80 $B --lm-head-draft --json-out $R/k7-head.json > $R/k7-head.log 2>&1; echo "k7 head rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/k7-*.json")):
    for r in json.load(open(f))["rows"]:
        st = r.get("spec_stats") or {}
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "decode", round(r["decode_tok_s"], 1), "tpr", round(st.get("tokens_per_round", 0), 2), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run28b.tgz . 2>/dev/null
