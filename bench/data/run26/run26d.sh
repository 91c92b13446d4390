#!/usr/bin/env bash
# run 26, call 4: bisect call 3's MTP3 slowdown (8K, 3 of 3 drafts forced): the session's starting commit, this
# code, this code with the norm spread only for single rows, this code without the ldmatrix verify tiles
set -u
R=/tmp/r26d; mkdir -p $R
. bench/device_env.sh
A="--random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32 --depths 8k --kv-dtype rk4v4-e8 --spec mtp --draft-tokens 3 --accepted-drafts 3"
run() {  # label, python prelude (module patches), then the CLI
  timeout 150 python -c "$2
import sys
from ninfer_cli.main import app
sys.argv = ['ninfer', 'bench'] + '$A --json-out $R/bench-$1.json'.split()
app()" > $R/bench-$1.log 2>&1; echo "$1 rc=$? t=$(el)"
}
(cd .carry/base && timeout 150 python -m ninfer_cli.main bench $A --json-out $R/bench-base.json > $R/bench-base.log 2>&1); echo "base rc=$? t=$(el)"
run new "pass"
run norm1 "import runtime.kernels.rmsnorm as m; m.SPREAD_MAX_ROWS = 1"
run noverify "import runtime.kernels.paged_attention as m; m.VERIFY_TILES.clear()"
[ $(el) -lt 420 ] && run both "import runtime.kernels.rmsnorm as m; m.SPREAD_MAX_ROWS = 1
import runtime.kernels.paged_attention as p; p.VERIFY_TILES.clear()"
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("spec"), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), r.get("spec_stats", {}).get("tokens_per_round"))
PY
tar -C $R -czf ${OUT:-/tmp}/run26d.tgz . 2>/dev/null; ls $R
