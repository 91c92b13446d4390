#!/usr/bin/env bash
# run 25, call 3: e8cube keys (rk2v4-e8, bit-operation decode) on the H200 -- GPU tests, attention per layer at
# 200K over the tile sweep, the 27B bench with rk2v4-e8 (default tile and the int4 keys' 64x2@512)
set -u
R=/tmp/r25c; mkdir -p $R
. bench/device_env.sh
timeout 150 python -m pytest -q tests/test_kv_codecs.py tests/test_kernels.py -k "kv_append or paged_attention or e8cube" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 110 python bench/attention_compare.py $R/attn.json rk2v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
python -c "
import json,sys
for l in open('$R/attn.log'):
    if l.startswith('{'):
        r=json.loads(l); print(r.get('codec'), r.get('t'), {k: (round(v,1) if isinstance(v,float) else v) for k,v in r.items() if k.endswith('_us') or k=='best'})" | cut -c1-800
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
timeout 170 $B --depths 8k,200k --kv-dtype rk2v4-e8 --json-out $R/bench-27b.json > $R/bench-27b.log 2>&1; echo "bench rc=$? t=$(el)"
[ $(el) -lt 400 ] && { NINFER_ATTENTION_TILES=e8cube=64x2@512 timeout $(( 540 - $(el) )) $B --depths 200k --kv-dtype rk2v4-e8 --json-out $R/bench-27b-64x2.json > $R/bench-27b-64x2.log 2>&1; echo "tile rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tail -3 $R/bench-27b.log | cut -c1-300
tar -C $R -czf ${OUT:-/tmp}/run25c.tgz . 2>/dev/null; ls $R
