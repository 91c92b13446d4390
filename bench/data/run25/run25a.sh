#!/usr/bin/env bash
# run 25, call 1: the e8p key codec (rk2v4-e8) on the H200 -- kernel tests, attention and KV append per layer at
# 200K, the 27B bench with rk2v4-e8 beside bf16, and transformers+fla on the same shape in the same call
set -u
R=/tmp/r25a; mkdir -p $R
. bench/device_env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader > $R/gpu.txt
timeout 200 python -m pytest -q tests/test_kv_codecs.py tests/test_kernels.py -k "kv_append or paged_attention or e8p or quality" -rs > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -3 $R/gpu-pytest.log
timeout 120 python bench/attention_compare.py $R/attn.json rk2v4-e8,rk4v4-e8 204800 > $R/attn.log 2>&1; echo "attn rc=$? t=$(el)"
grep -v '"depth": 8192, "prefill' $R/attn.log | python -c "
import json,sys
for l in sys.stdin:
    if l.startswith('{'):
        r=json.loads(l); print(r.get('codec'), r.get('t'), {k: (round(v,1) if isinstance(v,float) else v) for k,v in r.items() if k.endswith('_us') or k=='best'})" | cut -c1-700
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b --prefill-limit 8k --decode-tokens 32"
timeout 200 $B --depths 8k,200k --kv-dtype bf16,rk2v4-e8 --json-out $R/bench-27b.json > $R/bench-27b.log 2>&1; echo "bench rc=$? t=$(el)"
python - <<PY
import json
for r in json.load(open("$R/bench-27b.json"))["rows"]:
    print(r["kv_dtype"], r["depth"], r.get("prefill_chunk"), "prefill", round(r.get("prefill_tok_s") or 0), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2))
PY
[ $(el) -lt 430 ] && { timeout $(( 560 - $(el) )) python bench/hf_baseline.py qwen3.6-27b 8192 8 $R/hf-27b-8k.json > $R/hf.log 2>&1; echo "hf rc=$? t=$(el)"; tail -3 $R/hf.log | cut -c1-300; }
tar -C $R -czf ${OUT:-/tmp}/run25a.tgz . 2>/dev/null; ls $R
