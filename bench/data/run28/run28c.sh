#!/usr/bin/env bash
# run 28, call 3: the drafter's W8 products through the int8 tensor-core row kernel (NINFER_GEMV_ROWS=mma;
# Q4-Q6 products take it already, so only W8 changes) against the float tensor-core kernel (default), same
# call: draft-step profile and K = 7 bench at 8K; then the 27B with the reduced lm-head draft at 8K / 200K
# (bf16, rk4v4-e8) and the 35B-A3B with its DFlash2-shaped drafter (5 layers, hidden 2048, MLP 6144)
set -u
R=/tmp/r28c; mkdir -p $R
. bench/device_env.sh
NINFER_GEMV_ROWS=mma timeout 110 python bench/profile_draft.py qwen3.6-27b $R/profile-mma.json 7 bf16 > $R/profile-mma.log 2>&1; echo "profile mma rc=$? t=$(el)"
head -12 $R/profile-mma.log | cut -c1-140
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 64 --spec dflash2 --draft-tokens 7 --accepted-drafts 7"
timeout 80 $B --depths 8k --kv-dtype bf16 --json-out $R/k7-tensor.json > $R/k7-tensor.log 2>&1; echo "k7 tensor rc=$? t=$(el)"
NINFER_GEMV_ROWS=mma timeout 80 $B --depths 8k --kv-dtype bf16 --json-out $R/k7-mma.json > $R/k7-mma.log 2>&1; echo "k7 mma rc=$? t=$(el)"
timeout 130 $B --lm-head-draft --depths 8k,200k --kv-dtype bf16,rk4v4-e8 --json-out $R/k7-head.json > $R/k7-head.log 2>&1; echo "k7 head rc=$? t=$(el)"
[ $(el) -lt 420 ] && { timeout $(( 540 - $(el) )) python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --prefill-limit 8k --decode-tokens 64 --spec dflash2 --draft-tokens 7 --accepted-drafts 7 --depths 8k,200k --kv-dtype bf16,rk4v4-e8 --json-out $R/35b-k7.json > $R/35b-k7.log 2>&1; echo "35b k7 rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/*k7*.json")):
    for r in json.load(open(f))["rows"]:
        st = r.get("spec_stats") or {}
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "tpr", round(st.get("tokens_per_round", 0), 2), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run28c.tgz . 2>/dev/null
