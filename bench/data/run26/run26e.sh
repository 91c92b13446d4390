#!/usr/bin/env bash
# run 26, call 5: the session's final code (norm spread for single rows only, ldmatrix verify tiles, Q5 unpack)
# against the session's starting commit (.carry/base = 1540c4e), same call: plain decode bf16 / rk4v4-e8 at 8K
# and 200K, MTP3 (3 of 3 forced) with rk4v4-e8; GPU tests of the changed kernels first
set -u
R=/tmp/r26e; mkdir -p $R
. bench/device_env.sh
timeout 70 python -m pytest -q tests/test_kernels.py -k "rmsnorm or int8 or producers or qlinear" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32 --depths 8k,200k"
M="--kv-dtype rk4v4-e8 --spec mtp --draft-tokens 3 --accepted-drafts 3"
timeout 130 $B --kv-dtype bf16,rk4v4-e8 --json-out $R/bench-new.json > $R/bench-new.log 2>&1; echo "new rc=$? t=$(el)"
(cd .carry/base && timeout 100 $B --kv-dtype bf16,rk4v4-e8 --json-out $R/bench-base.json > $R/bench-base.log 2>&1); echo "base rc=$? t=$(el)"
[ $(el) -lt 330 ] && { timeout 70 $B $M --json-out $R/bench-new-mtp3.json > $R/bench-new-mtp3.log 2>&1; echo "new mtp3 rc=$? t=$(el)"; }
[ $(el) -lt 390 ] && { (cd .carry/base && timeout 60 $B $M --json-out $R/bench-base-mtp3.json > $R/bench-base-mtp3.log 2>&1); echo "base mtp3 rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("spec"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run26e.tgz . 2>/dev/null; ls $R
