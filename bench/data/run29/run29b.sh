#!/usr/bin/env bash
# Run 29 call 2: bf16 row kernel with triton's pipeliner or a hand prefetch (tile sweep) vs the int8 kernel and T = 1;
# then lanes and MTP3 end to end with the best bf16 tile of the sweep.  run (carry .carry): bash bench/data/run29/run29b.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. bench/device_env.sh
timeout 150 python -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py -k "rows_bf16 or rows_mma or test_qlinear or verify_rows" 2>&1 | tail -2
echo "tests done $(el) s"
timeout 300 python bench/gemv_compare.py "$OUT/gemv_rows.json" rows 2>&1 | grep -E "^\{|failed" | cut -c1-1200
echo "gemv done $(el) s"
TILE=$(OUT_DIR="$OUT" python - <<'PY'
import json, collections
rows = json.load(open(__import__("os").environ["OUT_DIR"] + "/gemv_rows.json"))["rows"]
score = collections.Counter()
for r in rows:
    if r["op"].endswith("W8") or r["op"].startswith("head"):
        continue
    for k, v in r.items():
        if "_bf16_" in k and k.endswith("_us") and "best" not in k and k.startswith(("t4_", "t8_")):
            score[k.split("_bf16_")[1][:-3]] += v / r["t1_us"]
tile = min(score, key=score.get)
bn, rest = tile.split("x"); nw, rest = rest.split("s"); st, rest = rest.split("p")
print(f"{bn},{nw},{st},{rest.rstrip('f')},{1 if rest.endswith('f') else 0}")
PY
)
echo "best bf16 tile: $TILE"
export NINFER_ROWS_BF16_TILE=$TILE
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
NINFER_GEMV_ROWS=bf16 timeout 120 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16,rk4v4-e8 --json-out "$OUT/lanes-bf16.json" 2>&1 | grep -E "lane|rror" | tail -10
echo "lanes done $(el) s"
for path in mma bf16; do
  NINFER_GEMV_ROWS=$path timeout 100 $B --depths 8k --prefill-limit 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 --decode-tokens 64 --json-out "$OUT/mtp-$path.json" 2>&1 | grep -E "depth|rror" | tail -3
  echo "mtp $path done $(el) s"
done
