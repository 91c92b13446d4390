#!/usr/bin/env bash
# run 24, call 1: GPU tests of the kernels changed in stop 13, 27B 8K bench new vs base (7677cd8), 8K chunks,
# nvfp4 / rk4v4-e8 attention at 200K vs the float32-nvfp4 kernel, decode profile
set -u
R=/tmp/r24a; mkdir -p $R
. bench/device_env.sh
timeout 110 python -m pytest -q -x tests/test_kernels.py -k "conv or gated_norm or attention_gate or paged_attention or launch or producers" -rs > $R/gpu-pytest-kernels.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest-kernels.log
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 64"
timeout 120 $B --json-out $R/bench-new-2k.json > $R/bench-new-2k.log 2>&1; echo "new2k rc=$? t=$(el)"
(cd .carry/base && timeout 100 $B --json-out $R/bench-base-2k.json > $R/bench-base-2k.log 2>&1; echo "base2k rc=$? t=$(el)")
timeout 50 $B --prefill-chunk 8192 --json-out $R/bench-new-8k.json > $R/bench-new-8k.log 2>&1; echo "new8k rc=$? t=$(el)"
python - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/r24a/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], "prefill", round(r["prefill_tok_s"]), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
[ $(el) -lt 400 ] && { timeout 100 python bench/attention_compare.py $R/attn.json nvfp4,rk4v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"; }
grep '"t": 1' $R/attn.log | cut -c1-400
[ $(el) -lt 490 ] && { NINFER_PDL=0 timeout 60 python bench/profile_decode.py qwen3.6-27b $R/profile-decode.json decode bf16 > $R/profile.log 2>&1; echo "prof rc=$? t=$(el)"; }
[ $(el) -lt 500 ] && { timeout $(( 560 - $(el) )) python -m pytest -q tests/test_engine.py -rs > $R/gpu-pytest-engine.log 2>&1; echo "engine rc=$? t=$(el)"; tail -2 $R/gpu-pytest-engine.log; }
tar czf $OUT/run24a.tgz -C $R .
