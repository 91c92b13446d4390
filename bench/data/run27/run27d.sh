#!/usr/bin/env bash
# run 27, call 4: the session's new MoE kernels under the GPU tests (combine with shared gate and slots, expert
# GEMV rows by pair index, both prefill paths, the MoE engine and speculative tests); 35B-A3B with MTP3 (3 of 3
# drafts forced: random weights) at 8K and 200K; where a 35B-A3B decode step goes (profile, for the next session)
set -u
R=/tmp/r27d; mkdir -p $R
. bench/device_env.sh
timeout 150 python -m pytest -q tests/test_kernels.py tests/test_engine.py tests/test_speculative.py -k "expert or combine_experts or sort_pairs or moe" -rs -p no:warnings > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"; tail -3 $R/gpu-pytest.log
M="python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --prefill-limit 8k --decode-tokens 32 --depths 8k,200k --kv-dtype bf16,rk4v4-e8 --spec mtp --draft-tokens 3 --accepted-drafts 3"
timeout 120 $M --json-out $R/bench-35b-mtp3.json > $R/bench-35b-mtp3.log 2>&1; echo "35b mtp3 rc=$? t=$(el)"
python - <<PY
import json
for r in json.load(open("$R/bench-35b-mtp3.json"))["rows"]:
    print(r["kv_dtype"], r["depth"], r.get("spec"), "decode", round(r["decode_tok_s"], 1), "of_roof", round(r["of_roofline"], 3), "peakGiB", round(r["peak_allocated_bytes"] / 2**30, 2), "planGiB", round(r["planned_bytes"] / 2**30, 2))
PY
[ $(el) -lt 300 ] && { timeout $(( 440 - $(el) )) python bench/profile_decode.py qwen3.6-35b-a3b $R/profile-35b-decode.json decode bf16 > $R/profile.log 2>&1; echo "profile rc=$? t=$(el)"; grep -v "^\[" $R/profile.log | head -24 | cut -c1-150; }
tar -C $R -czf ${OUT:-/tmp}/run27d.tgz . 2>/dev/null
