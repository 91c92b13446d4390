#!/usr/bin/env bash
# run 27, call 5: the bench's peak memory per KV dtype after collecting the previous engine (call 4: the second
# dtype of a 35B-A3B MTP3 run peaked 1.6 GiB over its plan; the first engine was still alive); same command
set -u
R=/tmp/r27e; mkdir -p $R
. bench/device_env.sh
M="python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --prefill-limit 8k --decode-tokens 16 --depths 8k --kv-dtype bf16,rk4v4-e8 --spec mtp --draft-tokens 3 --accepted-drafts 3"
timeout 150 $M --json-out $R/bench-35b-mtp3.json > $R/bench-35b-mtp3.log 2>&1; echo "35b mtp3 rc=$? t=$(el)"
python - <<PY
import json
for r in json.load(open("$R/bench-35b-mtp3.json"))["rows"]:
    print(r["kv_dtype"], r["depth"], "decode", round(r["decode_tok_s"], 1), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 3), "planGiB", round(r["planned_bytes"] / 2**30, 3), "before", r.get("resident_before_bytes"))
PY
tar -C $R -czf ${OUT:-/tmp}/run27e.tgz . 2>/dev/null
