#!/usr/bin/env bash
# run 26, call 3: int4 operands through ldmatrix only for 32-row verify blocks (32-key tiles), the pure decode
# back for 16-row decode blocks; norm chunk 256. GPU tests, attention per layer against the session's first
# kernel, the 27B with MTP3 (forced acceptance) and plain rk4v4-e8 decode against .carry/base
set -u
R=/tmp/r26c; mkdir -p $R
. bench/device_env.sh
timeout 120 python -m pytest -q tests/test_kernels.py -k "rmsnorm or paged_attention" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -2 $R/gpu-pytest.log
timeout 150 python bench/attention_compare.py $R/attn.json rk4v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
python - <<PY
import json
for line in open("$R/attn.log"):
    if line.startswith("{") and '"t": ' in line:
        r = json.loads(line); print({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k in ("t", "default_graph_us", "old_graph_us", "old_us", "best", "best_us", "old_vs_new_maxdiff", "programs396_us")})
PY
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
M="--spec mtp --draft-tokens 3 --accepted-drafts 3"
[ $(el) -lt 300 ] && { timeout $(( 420 - $(el) )) $B --depths 8k,200k --kv-dtype rk4v4-e8 $M --json-out $R/bench-new-mtp3.json > $R/bench-new-mtp3.log 2>&1; echo "new mtp3 rc=$? t=$(el)"; }
[ $(el) -lt 400 ] && { (cd .carry/base && timeout $(( 500 - $(el) )) $B --depths 8k,200k --kv-dtype rk4v4-e8 $M --json-out $R/bench-base-mtp3.json > $R/bench-base-mtp3.log 2>&1); echo "base mtp3 rc=$? t=$(el)"; }
[ $(el) -lt 480 ] && { timeout $(( 575 - $(el) )) $B --depths 8k,200k --kv-dtype rk4v4-e8 --json-out $R/bench-new.json > $R/bench-new.log 2>&1; echo "new rc=$? t=$(el)"; }
python - <<PY
import json, glob
for f in sorted(glob.glob("$R/bench-*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1], r["kv_dtype"], r["depth"], r.get("spec"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "tok/round", r.get("tokens_per_round"), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
tar -C $R -czf ${OUT:-/tmp}/run26c.tgz . 2>/dev/null; ls $R
