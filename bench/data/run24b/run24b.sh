#!/usr/bin/env bash
# run 24, call 2: attention tiles at 200K (nvfp4 fp16 decode vs float32 one; one-warp programs), then the 27B
# bench with auto prefill chunks (bf16 + rk4v4-e8, 8K and 200K), the best rk4v4-e8 tile at 200K, MTP3 forced
set -u
R=/tmp/r24b; mkdir -p $R
. bench/device_env.sh
timeout 170 python bench/attention_compare.py $R/attn.json rk4v4-e8,nvfp4 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
python - > $R/tile.env <<'PY'
import json
for line in open("/tmp/r24b/attn.log"):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    if r.get("codec") == "rk4v4-e8" and r.get("t") == 1:
        tiles = {k: v for k, v in r.items() if k.startswith("new_") and k.endswith("_us") and k.count("_") == 2
                 and isinstance(v, float)}
        best = min(tiles, key=tiles.get)
        bn, nw = best.split("_")[1].split("x")
        if tiles[best] < 0.95 * tiles.get("new_64x4_us", 1e9):
            print(f"int4g64e8={bn}x{nw},int4g64={bn}x{nw}")
PY
TILE=$(cat $R/tile.env); echo "best rk4v4-e8 tile override: '$TILE'"
grep '"t": 1' $R/attn.log | python -c "
import json,sys
for l in sys.stdin:
    r=json.loads(l); print(r['codec'], {k: round(v,1) for k,v in r.items() if k.endswith('_us')})" | cut -c1-900
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 64"
timeout 170 $B --depths 8k,200k --kv-dtype bf16,rk4v4-e8 --json-out $R/bench-27b.json > $R/bench-27b.log 2>&1; echo "bench rc=$? t=$(el)"
if [ -n "$TILE" ] && [ $(el) -lt 380 ]; then
  NINFER_ATTENTION_TILES=$TILE timeout 80 $B --depths 200k --kv-dtype rk4v4-e8 --json-out $R/bench-27b-tile.json > $R/bench-27b-tile.log 2>&1; echo "tile rc=$? t=$(el)"
fi
[ $(el) -lt 440 ] && { timeout 90 $B --depths 8k,200k --kv-dtype rk4v4-e8 --spec mtp --draft-tokens 3 --accepted-drafts 3 --json-out $R/bench-27b-mtp3.json > $R/bench-27b-mtp3.log 2>&1; echo "mtp3 rc=$? t=$(el)"; }
python - <<'PY'
import json, glob
for f in sorted(glob.glob("/tmp/r24b/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
[ $(el) -lt 480 ] && { timeout $(( 515 - $(el) )) python -m pytest -q tests/test_engine.py -k "reuses or greedy" -rs > $R/gpu-pytest-engine.log 2>&1; echo "engine rc=$? t=$(el)"; tail -2 $R/gpu-pytest-engine.log; }
[ $(el) -lt 500 ] && { timeout $(( 555 - $(el) )) python bench/serve_smoke.py /tmp/smoke > $R/serve-smoke.log 2>&1; echo "smoke rc=$? t=$(el)"; tail -12 $R/serve-smoke.log | cut -c1-200; }
tar czf $OUT/run24b.tgz -C $R .
