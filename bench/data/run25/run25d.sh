#!/usr/bin/env bash
# run 25, call 4: a lane's context spread over the capacity's splits + the e8cube one-warp tile, side by side with
# the code before them (.carry/base = the call-3 commit) on the 27B at 8K; rk2v4-e8 at 8K and 200K with the
# cheaper e8cube decode (attention per layer at 200K); GPU tests
set -u
R=/tmp/r25d; mkdir -p $R
. bench/device_env.sh
timeout 100 python -m pytest -q tests/test_kernels.py -k "paged_attention" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 100 python bench/attention_compare.py $R/attn.json rk2v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
grep '"t": 1,' $R/attn.log | cut -c1-400
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
timeout 170 $B --depths 8k,200k --kv-dtype bf16,rk2v4-e8 --json-out $R/bench-new.json > $R/bench-new.log 2>&1; echo "new rc=$? t=$(el)"
[ $(el) -lt 330 ] && { (cd .carry/base && timeout $(( 440 - $(el) )) $B --depths 8k,200k --kv-dtype bf16 --json-out $R/bench-base.json > $R/bench-base.log 2>&1); echo "base rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run25d.tgz . 2>/dev/null; ls $R
