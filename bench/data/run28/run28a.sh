#!/usr/bin/env bash
# run 28, call 1: DFlash2 on the H200 for the first time. GPU tests of the drafter and of the speculation
# refactor (MTP through the shared Speculator), then the 27B shape with its DFlash2 drafter (5 layers, window
# 2048, 16 selector candidates; random weights, so acceptance is forced): K = 7 (block 8) all accepted and
# K = 3, against plain decode and MTP3 forced in the same call, bf16 and rk4v4-e8 KV at 8K and 200K
set -u
R=/tmp/r28a; mkdir -p $R
. bench/device_env.sh
timeout 200 python -m pytest -q -p no:cacheprovider -n 0 tests/test_dflash2.py tests/test_speculative.py > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"
tail -5 $R/gpu-pytest.log
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 64 --depths 8k,200k --kv-dtype bf16,rk4v4-e8"
timeout 150 $B --spec dflash2 --draft-tokens 7 --accepted-drafts 7 --json-out $R/dflash2-k7.json > $R/dflash2-k7.log 2>&1; echo "dflash2 k7 rc=$? t=$(el)"
tail -3 $R/dflash2-k7.log
[ $(el) -lt 380 ] && { timeout 100 $B --spec mtp --draft-tokens 3 --accepted-drafts 3 --json-out $R/mtp3.json > $R/mtp3.log 2>&1; echo "mtp3 rc=$? t=$(el)"; }
[ $(el) -lt 450 ] && { timeout 90 $B --spec dflash2 --draft-tokens 3 --accepted-drafts 3 --json-out $R/dflash2-k3.json > $R/dflash2-k3.log 2>&1; echo "dflash2 k3 rc=$? t=$(el)"; }
[ $(el) -lt 510 ] && { timeout 70 $B --json-out $R/plain.json > $R/plain.log 2>&1; echo "plain rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/*.json")):
    for r in json.load(open(f))["rows"]:
        st = r.get("spec_stats") or {}
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "tpr", round(st.get("tokens_per_round", 0), 2), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run28a.tgz . 2>/dev/null
