#!/usr/bin/env bash
# Device calls (< 600 s each) for the fragment kernels (bench/RESULTS.md §2).
#   run (carry .carry):  bash bench/device_frag.sh first     # everything built since the last device call: GPU tests,
#                                                            # then each new default or option against the old path
#                        bash bench/device_frag.sh kernels   # GPU tests, per product, bf16 lanes
#                        bash bench/device_frag.sh attention # int4/int8 KV decode attention: tl.dot vs fragment kernel
#                        bash bench/device_frag.sh s26       # session 26: SwiGLU in the gate/up launch, int8 fragment
#                                                            # kernel, pair order (one lane, side by side)
#                        bash bench/device_frag.sh next      # session 27 first: RMSNorm spread, profile, MoE ties
#                        bash bench/device_frag.sh s27       # MoE fused + weight cache GPU tests, ride with the cache
#                                                            # on/off, 4-client server, 35B-A3B lanes
#                        bash bench/device_frag.sh s28b      # MoE GPU tests, 1 vs 4 lanes by kernel, server chain off/on
#                        bash bench/device_frag.sh pieces    # padded prompt-piece graphs: GPU test, 4-client server off/on
#                        bash bench/device_frag.sh s29       # ride tests, 35B-A3B 1 vs 8 lanes by kernel, server 512 tok
#                        bash bench/device_frag.sh s29c      # 35B-A3B lanes old vs new expert tiles; 35B server
#                        bash bench/device_frag.sh s29f      # 35B server: MoE prompts from CUDA graphs off / on
#                        bash bench/device_frag.sh s33       # the measured warps-sharing-K rule: per product, lanes, MTP3
#                        bash bench/device_frag.sh s34       # SwiGLU in the gate/up launch; x loaded a chunk ahead (T <= 8)
#                        bash bench/device_frag.sh s35       # x ahead by default: tests, lanes, SwiGLU launch, MTP3 lanes
#                        bash bench/device_frag.sh s36       # one plain lane in fragment order (auto vs layout), profiles
#                        bash bench/device_frag.sh s37       # x ahead at 9-16 rows (first column tile): shapes, MTP3 lanes
#                        bash bench/device_frag.sh s38       # the Q6 head in fragment order, 9-16-row tiles split (opt-ins)
#                        bash bench/device_frag.sh s42       # W8 products on the int8 fragment kernel (opt-in) vs planes
#                        bash bench/device_frag.sh s45       # DFlash2's drafter convolutions, norms + RoPE fused vs torch
#                        bash bench/device_frag.sh s53       # next: cuDNN prefill end to end, MoE down launch split, s50
#                        bash bench/device_frag.sh s51       # prefill attention at depth (tiles, torch's kernels), then s50
#                        bash bench/device_frag.sh s50       # 35B prefill + one lane with fragment experts, server
#                        bash bench/device_frag.sh s49       # expert-major fragment launches: tests, 35B lanes
#                        bash bench/device_frag.sh s48       # the fragment expert launches taken apart, lanes off / on
#                        bash bench/device_frag.sh next36    # session 36's one call: W8, sliced rows, lanes; depths on an H200
#                        bash bench/device_frag.sh s58       # session 41: conv / GDN-norm epilogues, 35B one-lane profile
#                        bash bench/device_frag.sh s59       # session 43: the combine 16 rows a program (ride profile);
#                                                            # the 35B's Q5 output projections (fragment / dp4a / int8)
#                        bash bench/device_frag.sh s65       # a graph step's wall time from the GPU timeline
#                                                            # (27B 1 and 8 lanes, 35B-A3B), decode beside GEMMs
#                                                            # (streams, priority, green contexts)
#                        bash bench/device_frag.sh s67       # settings side by side in one engine (fields'
#                                                            # register cap; 35B router on the dense kernel)
#                        bash bench/device_frag.sh s69       # next: one lane's norm launch shapes in one engine
#                        bash bench/device_frag.sh s70       # next first: s68, and queued vs blocking host copies
#                        bash bench/device_frag.sh s71       # next: one lane and lanes end to end, 27B norm shapes
#                        bash bench/device_frag.sh s74       # after s70: 2-16-row bf16 products on the dense kernel,
#                                                            # 35B-A3B / 27B lanes; 27B norm launch shapes
#                        bash bench/device_frag.sh s77       # 35B-A3B one lane: norm shapes, one-token expert tiles
#                        bash bench/device_frag.sh s78       # the server, 4 streaming clients against one (35B, 27B)
#                        bash bench/device_frag.sh s81       # 35B-A3B one lane: Q5 output projections' K sharing
#                        bash bench/device_frag.sh s83       # the norm barrier's options: GPU test, 27B 1 / 8 lanes, 35B
#                        bash bench/device_frag.sh s86       # session 48: s80 + s83 in one engine a shape (~440 s)
#                        bash bench/device_frag.sh s85       # (~560 s): s83, the 4-client server, then s81
#                        bash bench/device_frag.sh s88       # next first (~560 s): where the 35B-A3B server's 4-row
#                                                            # step lost its speed (server with graphs on first use and
#                                                            # host / GPU profiles, server warmed up, timeline, engine
#                                                            # A/B, lanes); s89: the two servers in ~300 s
# Side by side: NINFER_GEMV_FRAG=rows (row blocks on the fragment kernel over the artifact's planes, T = 1 on the
# dp4a GEMV) against auto (an engine of several lanes or with speculation: every 1-16-row layer product in
# fragment order), layout-k1 (fragment order with K split across programs only, no warps sharing K) and auto-lanes
# (NINFER_FRAGMENT_PAIRS=0: code words in the artifact's lane order, x paired by byte permutes, as before session 26).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
. bench/device_env.sh
# the RMSNorm's spread-launch shapes beside its default (engine_ab settings): columns a program, lanes a sum step, warps
N=runtime.kernels.rmsnorm
NORM_SHAPES="chunk512=$N.SPREAD_CHUNK:512 chunk128=$N.SPREAD_CHUNK:128 sum2048=$N.SUM_BLOCK:2048 \
sum512=$N.SUM_BLOCK:512 warps8=$N.SPREAD_WARPS:8 warps2=$N.SPREAD_WARPS:2"
B="python -m ninfer_cli.main bench --random-weights qwen3.6-27b"
lanes() {  # mode kv (mode: rows, auto, layout-k1, or auto-lanes: fragment order without pair order)
  local tile="" pairs=1
  [ "$1" = layout-k1 ] && tile="2,4,528,1"
  [ "$1" = auto-lanes ] && pairs=0
  NINFER_GEMV_FRAG=$(echo "$1" | sed 's/-k1$//; s/-lanes$//') NINFER_FRAGMENT_TILE=$tile NINFER_FRAGMENT_PAIRS=$pairs \
    timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype "$2" \
    --json-out "$OUT/lanes-$1-$2.json" 2>&1 | grep "│ $2"
  echo "$1 $2 t=$(el)"
}
one() {  # label, env...: 27B one lane, bf16 KV, 8K, DECODE tokens (64), results in $OUT/$SECTION-label.json
  local label=$1; shift
  env "$@" timeout "${ONE_TIMEOUT:-90}" $B --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens "${DECODE:-64}" \
    --json-out "$OUT/$SECTION-$label.json" 2>&1 | grep "│ bf16"
  echo "$label t=$(el)"
}
SECTION=${1:-kernels}
case "${1:-kernels}" in
first)  # session 25's CPU-built changes (fragment attention: opt-in; MoE routing and combine folded in, attention
  # launches fused: default), session 24's (warps sharing K, MoE fusions: default): correctness first, then each
  # against the path it replaces (~450 s)
  timeout 200 python -m pytest -q -n 4 --tb=short tests/test_attention_frag.py tests/test_frag_kernel.py \
    tests/test_kernels.py tests/test_engine.py \
    -k "frag or fragment or attention or wide or moe or expert or route or combine or rmsnorm or rides or router \
        or inputs or gate or launches" \
    > "$OUT/first-tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/first-tests.log" | head -30
  echo "t=$(el)"
  for mode in off on; do  # 27B rk4v4-e8 decode at 8K and 200K: tl.dot vs fragment attention
    NINFER_ATTENTION_FRAG=$mode timeout 70 $B --depths 8k,200k --prefill-limit 8k --kv-dtype rk4v4-e8 \
      --decode-tokens 64 --json-out "$OUT/first-attn-$mode.json" 2>&1 | grep "│ rk4v4"
    echo "attention $mode t=$(el)"
  done
  for mode in fused separate; do  # 27B one lane, rk4v4-e8: the attention block's launches fused (5 fewer) or not
    NINFER_ATTENTION_LAUNCHES=$mode timeout 60 $B --depths 8k --prefill-limit 8k --kv-dtype rk4v4-e8 \
      --decode-tokens 64 --json-out "$OUT/first-attn-launches-$mode.json" 2>&1 | grep "│ rk4v4"
    echo "attention launches $mode t=$(el)"
  done
  M="python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b"
  for mode in fused separate; do  # 35B-A3B one lane: 3 MoE launches per layer vs 10
    NINFER_MOE_DECODE=$mode timeout 70 $M --depths 8k --kv-dtype bf16 --decode-tokens 64 \
      --json-out "$OUT/first-moe-$mode.json" 2>&1 | grep "│ bf16"
    echo "moe $mode t=$(el)"
  done  # (lanes rows vs auto: `kernels`)
  ;;
kernels)
  timeout 180 python -m pytest -q -n 4 --tb=short tests/test_frag_kernel.py tests/test_engine.py tests/test_kernels.py \
    -k "frag or fragment or wide or moe or rides or router or expert or routing or combine" > "$OUT/tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/tests.log" | head -40
  echo "t=$(el)"
  timeout 200 python bench/gemv_compare.py "$OUT/frag.json" frag 2>&1 | grep "{" | cut -c1-900
  echo "t=$(el)"
  for mode in rows auto auto-lanes layout-k1; do lanes $mode bf16; done  # auto-lanes: before pair order
  ;;
attention)  # int4/int8 decode attention: GPU tests, per-layer sweep, then the 27B decode at depth, off vs on
  timeout 120 python -m pytest -q -n 4 --tb=short tests/test_attention_frag.py tests/test_kernels.py -k "attention" \
    > "$OUT/attn-tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/attn-tests.log" | head -20
  echo "t=$(el)"
  PYTHONPATH=. timeout 300 python bench/attention_compare.py "$OUT/attn-frag.json" frag 2>&1 | grep "{" | \
    python -c "import json,sys; [print({k: v for k, v in json.loads(l).items() if not k.endswith('maxdiff') or v > 1e-2 or 'frag_4w_1024s_h2' in k}) for l in sys.stdin]"
  echo "t=$(el)"
  for mode in off on; do  # (rk4v4-e8 at 8K and 200K: `first`)
    NINFER_ATTENTION_FRAG=$mode timeout 80 $B --depths 200k --prefill-limit 8k --kv-dtype int8,rk2v4-e8 \
      --decode-tokens 64 --json-out "$OUT/depth-attn-int8-e8-$mode.json" 2>&1 | grep -E "│ (int8|rk2v4)"
    echo "attention $mode t=$(el)"
  done
  ;;
s26)  # session 26's CPU-built changes, GPU tests then one lane against the path each replaces (~450 s): SwiGLU in
  # the gate/up launch (64 launches fewer), the int8 fragment kernel for the Q5 products / every layer product,
  # pair order (one lane with every product in fragment order, pairs vs lane order)
  timeout 150 python -m pytest -q -n 4 --tb=short tests/test_frag_kernel.py tests/test_kernels.py tests/test_engine.py \
    -k "frag or fragment or swiglu or qgemv or every_launch or int8" > "$OUT/s26-tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/s26-tests.log" | head -30
  echo "t=$(el)"
  one swiglu-epilogue NINFER_SWIGLU_EPILOGUE=1
  one swiglu-launch NINFER_SWIGLU_EPILOGUE=0
  one int8-q5 NINFER_FRAGMENT_INT8=q5
  one int8-on NINFER_FRAGMENT_INT8=on  # (pair vs lane order per product: s26-kernels)
  ;;
next)  # session 27's first call (~500 s): the RMSNorm spread limit side by side and the step's profile, the MoE
  # fused path's routing against the separate one (near tie or bug), 35B-A3B fused vs separate
  DECODE=128
  one spread8-warmup NINFER_RMSNORM_SPREAD_SPLITS=8
  one spread4 NINFER_RMSNORM_SPREAD_SPLITS=4
  one spread8 NINFER_RMSNORM_SPREAD_SPLITS=8
  timeout 100 python bench/profile_decode.py qwen3.6-27b "$OUT/next-profile.json" decode bf16 2>&1 | grep -A9 "kernel time"
  echo "t=$(el)"
  timeout 120 python bench/moe_decode_check.py --ties 2>&1 | tail -12
  echo "t=$(el)"
  M="python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b"
  for mode in fused separate; do
    NINFER_MOE_DECODE=$mode timeout 80 $M --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 64 \
      --json-out "$OUT/next-moe-$mode.json" 2>&1 | grep "│ bf16"
    echo "moe $mode t=$(el)"
  done
  ;;
s27)  # session 27's second call (~540 s): GPU tests of the MoE fused default and the weight cache; a 32K prefill beside
  # 3 decoding lanes with the weight cache on and off; the 4-client server; 35B-A3B lanes
  timeout 70 python -m pytest -q -p no:cacheprovider tests/test_engine.py -k "moe or weight_cache" 2>&1 | \
    grep -iE "passed|failed|error|assert" | tail -5
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  for cache in auto off; do
    NINFER_WEIGHT_CACHE=$cache timeout 110 $B --lanes 1,4 --depths 8k --kv-dtype bf16 --concurrent-prefill 32k \
      --json-out "$OUT/s27-ride-$cache.json" 2>&1 | grep -E "│ bf16"
    echo "ride cache $cache t=$(el)"
  done
  timeout 150 python bench/serve_lanes.py qwen3.6-27b --lanes 4 --tokens 128 --json "$OUT/s27-serve4.json" 2>&1 | tail -3
  echo "serve t=$(el)"
  timeout 100 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 \
    --json-out "$OUT/s27-moe-lanes.json" 2>&1 | grep "│ bf16"
  echo "moe lanes t=$(el)"
  ;;
s28b)  # session 28's third call (~330 s)
  timeout 100 python -m pytest -q -rs -p no:cacheprovider tests/test_engine.py -k "moe" 2>&1 | \
    grep -iE "passed|failed|error|assert|skip" | tail -6
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  timeout 120 python bench/profile_decode.py qwen3.6-27b "$OUT/s28b-profile-lanes.json" decode bf16 1,4 2>&1 | \
    grep -A14 "lane(s): kernel time" | head -16
  echo "profile t=$(el)"
  timeout 200 python bench/serve_lanes.py qwen3.6-27b --lanes 4 --tokens 128 --chain both \
    --json "$OUT/s28b-serve4-128.json" 2>&1 | grep -v "^{" | tail -7
  echo "serve t=$(el)"
  ;;
pieces)  # session 29 first (~400 s): NINFER_PIECE_GRAPHS (short prompt pieces padded to a graph bucket) on the
  # GPU: its engine test, then the 4-client server without and with it (first text, aggregate)
  NINFER_PIECE_GRAPHS=on timeout 120 python -m pytest -q -rs -p no:cacheprovider tests/test_engine.py \
    -k "padded_prompt or ride" 2>&1 | grep -iE "passed|failed|error|assert|skip" | tail -6
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  for pieces in off on; do
    NINFER_PIECE_GRAPHS=$pieces timeout 150 python bench/serve_lanes.py qwen3.6-27b --lanes 4 --tokens 128 \
      --json "$OUT/pieces-$pieces.json" 2>&1 | grep -v "^{" | tail -5
    echo "serve pieces $pieces t=$(el)"
  done
  ;;
s29)  # session 29's second call (~450 s): GPU ride/padded tests with pieces on by default; the 35B-A3B decode step
  # kernel by kernel at 1 and 8 lanes (what each added lane costs); the 4-client server at 512 tokens
  timeout 120 python -m pytest -q -rs -p no:cacheprovider tests/test_engine.py -k "padded_prompt or ride" 2>&1 | \
    grep -iE "passed|failed|error|assert|skip" | tail -6
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  timeout 150 python bench/profile_decode.py qwen3.6-35b-a3b "$OUT/s29-profile-moe.json" decode bf16 1,8 2>&1 | \
    grep -A32 "lane(s): kernel time" | head -36
  echo "profile t=$(el)"
  timeout 200 python bench/serve_lanes.py qwen3.6-27b --lanes 4 --tokens 512 --json "$OUT/s29-serve4-512.json" 2>&1 | \
    grep -v "^{" | tail -5
  echo "serve t=$(el)"
  ;;
s29c)  # session 29's last call (~420 s): 35B-A3B lanes with the session-28 expert tiles and the new ones side by side;
  # expert GEMV GPU tests; the 35B-A3B server with 4 streaming clients
  old="NINFER_EXPERT_TILE_GATE_UP=16,512,4 NINFER_EXPERT_TILE_GATE_UP_ONE=16,512,4 NINFER_EXPERT_TILE_DOWN=16,512,4"
  old="$old NINFER_EXPERT_TILE_DOWN_ONE=16,512,4"
  for t in "$old" ""; do
    env $t timeout 100 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 \
      --depths 8k --kv-dtype bf16 --json-out "$OUT/s29c-moe-lanes-${t:+old}.json" 2>&1 | grep "│ bf16"
    echo "lanes tiles='$t' t=$(el)"
  done
  timeout 80 python -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py -k "expert" 2>&1 | \
    grep -iE "passed|failed|error|assert|skip" | tail -4
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  timeout 150 python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 256 --json "$OUT/s29c-serve-moe.json" 2>&1 | \
    grep -v "^{" | tail -5
  echo "serve t=$(el)"
  ;;
s29f)  # session 30 (~330 s): MoE prompts from CUDA graphs (NINFER_MOE_PREFILL_GRAPHS=on: padded pieces and riding
  # shared chunks) — the padded-piece GPU test, then the 35B-A3B server with 4 clients without and with it
  NINFER_MOE_PREFILL_GRAPHS=on timeout 90 python -m pytest -q -rs -p no:cacheprovider tests/test_engine.py \
    -k "padded_prompt or ride" 2>&1 | grep -iE "passed|failed|error|assert|skip" | tail -4
  echo "tests t=$(el) (pytest prints no summary line at -qq: no FAILED line = passed)"
  for g in off on; do
    NINFER_MOE_PREFILL_GRAPHS=$g timeout 110 python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 256 \
      --json "$OUT/s29f-serve-moe-$g.json" 2>&1 | grep -v "^{" | tail -5
    echo "serve moe graphs $g t=$(el)"
  done
  ;;
s31)  # session 31's one call (~450 s): 35B-A3B lanes with both session-29 opt-ins against neither, the 27B lanes
  # with batched MTP3 rounds (drafts forced accepted), the shared-experts question, then the opt-ins' GPU tests
  moe_lanes s31 "off 0" "on 2"
  timeout 130 $B --lanes 1,2,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 \
    --json-out "$OUT/s31-spec-lanes.json" 2>&1 | grep "│ bf16"
  echo "spec lanes t=$(el)"
  shared_experts 100
  moe_opt_in_tests
  ;;
s33)  # session 33 (~450 s): the measured warps-sharing-K rule (default since session 33) — its GPU tests, every
  # fragment-order product at T = 1..16 over the shape options, then rule off / on end to end: 27B lanes (bf16,
  # rk4v4-e8), batched MTP3 rounds over 1-4 lanes, one plain lane with every product in fragment order, 35B-A3B lanes
  timeout 120 python -m pytest -q -n 4 --tb=short -p no:cacheprovider tests/test_frag_kernel.py > "$OUT/s33-tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/s33-tests.log" | head -12
  echo "tests t=$(el)"
  PYTHONPATH=. timeout 150 python bench/gemv_compare.py "$OUT/s33-shapes.json" shapes 2>&1 | grep "{" | cut -c1-3500
  echo "per product t=$(el)"
  for r in off on; do
    NINFER_FRAGMENT_KS_RULE=$r timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16,rk4v4-e8 \
      --json-out "$OUT/s33-lanes-rule-$r.json" 2>&1 | grep -E "│ (bf16|rk4v4)"
    echo "lanes rule $r t=$(el)"
    NINFER_FRAGMENT_KS_RULE=$r timeout 100 $B --lanes 1,2,3,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 \
      --accepted-drafts 3 --decode-tokens 32 --json-out "$OUT/s33-spec-rule-$r.json" 2>&1 | grep "│ bf16"
    echo "spec lanes rule $r t=$(el)"
  done
  for mode in auto layout auto; do  # one plain lane: Q4 on the dp4a GEMV or in fragment order (gate_up 4 warps / K)
    NINFER_GEMV_FRAG=$mode timeout 60 $B --depths 8k --kv-dtype bf16 --decode-tokens 64 \
      --json-out "$OUT/s33-one-lane-$mode.json" 2>&1 | grep "│ bf16"
    echo "one lane $mode t=$(el)"
  done
  timeout 90 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --lanes 1,8 --depths 8k --kv-dtype bf16 \
    --json-out "$OUT/s33-moe-lanes.json" 2>&1 | grep "│ bf16"
  echo "moe lanes t=$(el)"
  ;;
s34)  # next (~500 s): session 33's CPU-built options — GPU tests of the fragment kernels (incl. SwiGLU in the gate/up
  # launch), every product's shapes incl. x loaded a chunk ahead (NINFER_FRAGMENT_TILE=2,4,528,0,1, T <= 8; 104
  # registers against 91 for Q4), 27B lanes with NINFER_SWIGLU_FRAGMENT off / 2 / 4, then lanes and batched MTP3
  # rounds without / with x ahead
  timeout 150 python -m pytest -q -n 4 --tb=short -p no:cacheprovider tests/test_frag_kernel.py tests/test_engine.py \
    -k "frag or swiglu" > "$OUT/s34-tests.log" 2>&1
  grep -E "^E |passed|failed|FAILED" "$OUT/s34-tests.log" | head -12
  echo "tests t=$(el) (no FAILED line = passed)"
  PYTHONPATH=. timeout 150 python bench/gemv_compare.py "$OUT/s34-shapes.json" shapes 2>&1 | grep "{" | cut -c1-3500
  echo "per product t=$(el)"
  for sw in off 2 4; do  # SwiGLU in the gate/up launch (opt-in) against the swiglu kernel after it
    NINFER_SWIGLU_FRAGMENT=$sw timeout 100 $B --lanes 1,4,8 --depths 8k --kv-dtype bf16 \
      --json-out "$OUT/s34-lanes-swiglu-$sw.json" 2>&1 | grep "│ bf16"
    echo "lanes NINFER_SWIGLU_FRAGMENT=$sw t=$(el)"
  done
  for tile in "" "2,4,528,0,1"; do
    NINFER_FRAGMENT_TILE=$tile timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 \
      --json-out "$OUT/s34-lanes-xahead${tile:+-on}.json" 2>&1 | grep "│ bf16"
    echo "lanes NINFER_FRAGMENT_TILE='$tile' t=$(el)"
    NINFER_FRAGMENT_TILE=$tile timeout 100 $B --lanes 1,2 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 \
      --accepted-drafts 3 --decode-tokens 32 --json-out "$OUT/s34-spec-xahead${tile:+-on}.json" 2>&1 | grep "│ bf16"
    echo "spec lanes NINFER_FRAGMENT_TILE='$tile' t=$(el)"
  done
  ;;
s35)  # session 34 (~420 s): x a chunk ahead by default at 2-8 rows — GPU tests, 27B lanes bf16 and rk4v4-e8, SwiGLU in
  # the gate/up launch off / 2 (now with x ahead), batched MTP3 rounds over 1-4 lanes, MTP3 drafts from the whole
  # head / its first 32K token ids
  timeout 150 python -m pytest -q -n 4 --tb=line -p no:cacheprovider tests/test_frag_kernel.py tests/test_engine.py \
    -k "frag or swiglu" 2>&1 | tail -4
  echo "tests t=$(el)"
  for kv in bf16 rk4v4-e8; do
    timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype $kv --json-out "$OUT/s35-lanes-$kv.json" 2>&1 | grep "│ $kv"
    echo "lanes $kv t=$(el)"
  done
  for sw in off 2; do
    NINFER_SWIGLU_FRAGMENT=$sw timeout 100 $B --lanes 1,4,8 --depths 8k --kv-dtype bf16 \
      --json-out "$OUT/s35-lanes-swiglu-$sw.json" 2>&1 | grep "│ bf16"
    echo "lanes NINFER_SWIGLU_FRAGMENT=$sw t=$(el)"
  done
  timeout 100 $B --lanes 1,2,3,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 \
    --decode-tokens 32 --json-out "$OUT/s35-spec-lanes.json" 2>&1 | grep "│ bf16"
  echo "spec lanes t=$(el)"
  for dv in 0 32768; do
    timeout 100 $B --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 --decode-tokens 64 \
      --draft-vocab $dv --json-out "$OUT/s35-mtp3-draft-vocab-$dv.json" 2>&1 | grep "│ bf16"
    echo "mtp3 draft vocab $dv t=$(el)"
  done
  ;;
s36)  # session 34, second (~300 s): one plain lane with every product in fragment order now that x a chunk ahead
  # makes its T = 1 Q4 products 0.87-0.91 of copy — bench auto / layout / layout + SwiGLU in the gate/up launch, the
  # kernel profile of auto and layout, lanes with the rule's one-row x ahead
  DECODE=64
  one auto NINFER_GEMV_FRAG=auto
  one layout NINFER_GEMV_FRAG=layout
  one layout-swiglu4 NINFER_GEMV_FRAG=layout NINFER_SWIGLU_FRAGMENT=4
  one auto-again NINFER_GEMV_FRAG=auto
  for mode in auto layout; do
    NINFER_GEMV_FRAG=$mode timeout 100 python bench/profile_decode.py qwen3.6-27b "$OUT/s36-profile-$mode.json" decode \
      bf16 2>&1 | grep -A16 "kernel time" | cut -c1-150
    echo "profile $mode t=$(el)"
  done
  timeout 100 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/s36-lanes-bf16.json" 2>&1 | grep "│ bf16"
  echo "lanes t=$(el)"
  ;;
s37)  # session 34, third (~280 s): the first column tile's x a chunk ahead at 9-16 rows (xwide, opt-in) — its GPU
  # test, every product's shapes (variant xwide at T = 12, 16), batched MTP3 rounds over 1-4 lanes without / with it
  timeout 100 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_frag_kernel.py \
    -k "nine_to_sixteen or every_k_share" 2>&1 | tail -2
  echo "tests t=$(el)"
  PYTHONPATH=. timeout 150 python bench/gemv_compare.py "$OUT/s37-shapes.json" shapes 2>&1 | grep "{" | \
    python -c "import json,sys; [print(r['op'], {k: v for k, v in r.items() if k.startswith(('t12', 't16')) and ('chosen_us' in k or 'xwide' in k)}) for r in map(json.loads, sys.stdin)]"
  echo "per product t=$(el)"
  for xw in 0 1; do
    NINFER_FRAGMENT_TILE=2,4,528,0,-1,$xw timeout 100 $B --lanes 1,2,3,4 --depths 8k --kv-dtype bf16 --spec mtp \
      --draft-tokens 3 --accepted-drafts 3 --decode-tokens 32 --json-out "$OUT/s37-spec-xwide-$xw.json" 2>&1 | grep "│ bf16"
    echo "spec lanes xwide=$xw t=$(el)"
  done
  ;;
s38)  # next session (~400 s): session 34's CPU-built options — GPU tests (Q6 kernel, the head's copy in the engine,
  # 9-16 rows' column tiles split across warps), the Q6 head's row blocks on the runtime's path vs the fragment-order
  # copy, every product's 9-16-row variants (xwide with 4 warps sharing K, split tiles), batched MTP3 rounds over 1,
  # 3, 4 lanes with the tiles in each warp / split (the measured x-ahead rule's end-to-end run too)
  timeout 150 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_frag_kernel.py \
    tests/test_engine.py -k "q6 or fragment_kernels_in_the_engine or nine_to_sixteen or column_tiles" 2>&1 | tail -2
  echo "tests t=$(el)"
  PYTHONPATH=. timeout 120 python bench/gemv_compare.py "$OUT/s38-head.json" head 2>&1 | grep "{"
  echo "head t=$(el)"
  PYTHONPATH=. timeout 150 python bench/gemv_compare.py "$OUT/s38-shapes.json" shapes 2>&1 | grep "{" | \
    python -c "import json,sys; [print(r['op'], {k: v for k, v in r.items() if k.startswith(('t12', 't16')) and k.endswith('_us')}) for r in map(json.loads, sys.stdin)]"
  echo "per product (9-16 rows: xwide with 4 warps sharing K, column tiles split across warps) t=$(el)"
  for tiles in 1 2; do  # 9-16 rows' column tiles in each warp / split across twice the warps
    NINFER_FRAGMENT_TILE=2,4,528,0,-1,-1,$tiles timeout 100 $B --lanes 1,3,4 --depths 8k --kv-dtype bf16 --spec mtp \
      --draft-tokens 3 --accepted-drafts 3 --decode-tokens 32 --json-out "$OUT/s38-spec-tiles-$tiles.json" 2>&1 | \
      grep "│ bf16"
    echo "spec lanes tiles=$tiles t=$(el)"
  done
  ;;
s42)  # next session (~330 s): W8 products in byte order on the int8 fragment kernel (NINFER_FRAGMENT_W8=on: the MTP
  # input projection, the DFlash2 drafter's whole products) — GPU tests, per product against the runtime's W8 path,
  # then batched MTP3 rounds over 1-4 lanes and DFlash2 K = 7 (with --draft-vocab 32768) off / on; 35B-A3B lanes
  # routed apart (--distinct-lane-tokens)
  timeout 120 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_frag_kernel.py \
    tests/test_speculative.py -k "int8_fragment or w8" 2>&1 | tail -2
  echo "tests t=$(el)"
  PYTHONPATH=. timeout 150 python bench/gemv_compare.py "$OUT/s42-w8.json" w8 2>&1 | grep "{"
  echo "w8 products t=$(el)"
  for w8 in off on; do
    NINFER_FRAGMENT_W8=$w8 timeout 100 $B --lanes 1,2,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 \
      --accepted-drafts 3 --decode-tokens 32 --draft-vocab 32768 --json-out "$OUT/s42-spec-w8-$w8.json" 2>&1 | \
      grep "│ bf16"
    echo "spec lanes w8 $w8 t=$(el)"
    NINFER_FRAGMENT_W8=$w8 timeout 100 $B --depths 8k --kv-dtype bf16 --spec dflash2 --draft-tokens 7 \
      --accepted-drafts 7 --decode-tokens 64 --draft-vocab 32768 --json-out "$OUT/s42-dflash2-w8-$w8.json" 2>&1 | \
      grep "│ bf16"
    echo "dflash2 w8 $w8 t=$(el)"
  done
  timeout 100 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k \
    --kv-dtype bf16 --distinct-lane-tokens --json-out "$OUT/s42-moe-lanes-distinct.json" 2>&1 | grep "│ bf16"
  echo "35B-A3B lanes, each its own token (experts apart) t=$(el)"
  ;;
s45)  # session 36 (~150 s; S45_LANES=1 ~90 s): the DFlash2 drafter's convolutions, query / key norm + RoPE and
  # selector walk in one launch each (NINFER_DFLASH2_KERNELS=fused) against the torch ops, GPU tests, then DFlash2 K = 7 alternated twice
  timeout 60 python -m pytest -o addopts="" -q --tb=line -p no:cacheprovider tests/test_kernels.py \
    -k "block_conv or head_norm_rope or selector_walk" 2>&1 | tail -1
  echo "tests t=$(el)"
  for kernels in torch fused torch fused; do
    NINFER_DFLASH2_KERNELS=$kernels timeout 110 $B --lanes ${S45_LANES:-1,2} --depths 8k --kv-dtype bf16 --spec dflash2 \
      --draft-tokens 7 --accepted-drafts 7 --decode-tokens 32 --draft-vocab 32768 \
      --json-out "$OUT/s45-dflash2-$kernels-$(el).json" 2>&1 | grep "│ bf16" | tail -2
    echo "dflash2 drafter kernels $kernels t=$(el)"
  done
  ;;
s65)  # ~300 s, any GPU: where a CUDA-graph step's wall time goes beyond its products (issue 21 items 1 and 3), from
  # the GPU timeline: 27B one lane and 8 lanes, 35B-A3B one lane (bench/step_timeline.py, 8 chained steps each); then
  # whether decode steps can run beside a prefill's GEMMs instead of riding in its chunks (bench/overlap_probe.py)
  nvidia-smi --query-gpu=name --format=csv,noheader
  for lanes in 1 8; do  # engines of their own: one plain lane keeps its Q4 products on the dp4a GEMV
    timeout 120 python bench/step_timeline.py qwen3.6-27b "$OUT/s65-timeline-27b-$lanes.json" bf16 $lanes 8 2>&1 | \
      grep -v "^ninfer:" | head -40
    echo "27B $lanes lane(s) timeline t=$(el)"
  done
  timeout 120 python bench/step_timeline.py qwen3.6-35b-a3b "$OUT/s65-timeline-35b.json" bf16 1 8 2>&1 | \
    grep -v "^ninfer:" | head -40
  echo "35B-A3B timeline t=$(el)"
  # decode steps beside a prefill chunk's GEMMs in streams / priority / green contexts instead of riding (issue 20.4)
  timeout 120 python bench/overlap_probe.py "$OUT/s65-overlap.json" 2>&1 | grep -E '^\{|Error' | head -12
  echo "overlap probe t=$(el)"
  ;;
s67)  # ~300 s, any GPU: settings side by side in one process (bench/engine_ab.py: one engine, each setting's steps
  # captured anew and timed in turn, 3 rounds), which the separate bench processes' 5-8 % spread hid
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 90 python -m pytest -o addopts="" -q -p no:cacheprovider tests/test_frag_kernel.py -k "fields or \
    measured_rule" 2>&1 | grep -E "passed|failed|Error|assert" | tail -4
  echo "tests t=$(el)"
  FL=runtime.kernels.qgemm_fragment_layout
  timeout 150 python bench/engine_ab.py qwen3.6-27b "$OUT/s67-27b.json" 1,2,8 base= regs=$FL.FIELDS_REGS:128 2>&1 | \
    grep -E "median|Error"
  echo "27B t=$(el)"
  timeout 150 python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s67-35b.json" 1,8 base= regs=$FL.FIELDS_REGS:128 \
    dense=runtime.engine.DENSE_ROWS_MIN_T:1 2>&1 | grep -E "median|Error"
  echo "35B-A3B t=$(el)"
  # one lane's decode timed as the server chains it, beside the host reading every token (session 45's bench)
  for shape in qwen3.6-27b qwen3.6-35b-a3b; do
    timeout 90 python -m ninfer_cli.main bench --random-weights $shape --depths 8k --prefill-limit 8k --kv-dtype bf16 \
      --decode-tokens 256 --json-out "$OUT/s67-chained-$shape.json" 2>&1 | grep -E "depth 8192|Error"
    echo "$shape chained t=$(el)"
  done
  ;;
s70)  # ~540 s, any GPU: s68's GPU tests (the fused expert kernel's fields fix and session 46's queued host-to-device
  # copies never ran on a GPU), then in one engine each: decode steps queued behind the one in flight (session 46's
  # default) against blocking copies (a stream sync a step, as before), 27B and 35B-A3B at 1 and 8 lanes, with the
  # 35B-A3B's router in the norm's launch (8 rows a program) and on the PDL dense kernel beside them; then, with the
  # time left, one lane of the 35B-A3B end to end (bench: chained and host-synced)
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 200 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_moe_fragment.py \
    tests/test_engine.py tests/test_kernels.py tests/test_frag_kernel.py tests/test_attention_frag.py 2>&1 | \
    grep -E "passed|failed|Error|assert" | tail -8
  echo "tests t=$(el)"
  timeout 120 python bench/engine_ab.py qwen3.6-27b "$OUT/s70-27b.json" 1,8 base= \
    blocking=runtime.transfers.QUEUED_COPIES:False 2>&1 | grep -E "median|Error"
  echo "27B t=$(el)"
  [ $(( ${DEADLINE:-570} - $(el) )) -gt 60 ] && timeout $(( ${DEADLINE:-570} - $(el) )) python bench/engine_ab.py \
    qwen3.6-35b-a3b "$OUT/s70-35b.json" 1,8 base= blocking=runtime.transfers.QUEUED_COPIES:False \
    "router8=runtime.engine.ROUTER_IN_NORM_ROWS:8;runtime.kernels.rmsnorm.ROUTER_IN_NORM_ROWS:8" \
    dense=runtime.engine.DENSE_ROWS_MIN_T:1 2>&1 | grep -E "median|Error"
  echo "35B-A3B t=$(el)"
  [ $(( ${DEADLINE:-570} - $(el) )) -gt 70 ] && timeout $(( ${DEADLINE:-570} - $(el) )) python -m ninfer_cli.main \
    bench --random-weights qwen3.6-35b-a3b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 256 \
    --json-out "$OUT/s70-35b-bench.json" 2>&1 | grep -E "│ bf16|decode .* tok/s"
  echo "35B-A3B one lane t=$(el)"
  ;;
s74)  # ~400 s, any GPU: after s70 (router on the dense kernel 3 % faster at 8 lanes of the 35B-A3B, 2 % slower at
  # one; default from 8 rows since): 2-16 rows on the dense kernel (NINFER_DENSE_ROWS=on), the default, and none,
  # 35B-A3B at 2, 4, 8 lanes and 27B at 2, 8 lanes (any small bf16 product), in one engine each; the GPU
  # test s70 failed (prefill chunks' host lengths, now eager); then s69's norm launch shapes, 27B one lane
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 60 python -m pytest -o addopts="" -q --tb=line -p no:cacheprovider tests/test_engine.py \
    -k segment_route 2>&1 | grep -E "passed|failed|Error|assert" | tail -4
  echo "test t=$(el)"
  timeout 200 python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s74-35b.json" 2,4,8 base= \
    dense2=runtime.engine.DENSE_ROWS_MIN_T:2 off=runtime.engine.DENSE_ROWS_MIN_T:17 2>&1 | grep -E "median|Error"
  echo "35B-A3B t=$(el)"
  timeout 90 python bench/engine_ab.py qwen3.6-27b "$OUT/s74-27b.json" 2,8 base= \
    dense2=runtime.engine.DENSE_ROWS_MIN_T:2 2>&1 | grep -E "median|Error"
  echo "27B t=$(el)"
  [ $(( ${DEADLINE:-360} - $(el) )) -gt 60 ] && timeout $(( ${DEADLINE:-360} - $(el) )) python bench/engine_ab.py \
    qwen3.6-27b "$OUT/s74-norms.json" 1 base= $NORM_SHAPES 2>&1 | grep -E "median|Error"
  echo "27B norms t=$(el)"
  ;;
s77)  # ~200 s, any GPU: the 35B-A3B's one-lane step under launch settings in one engine (issue 21: 0.346 of the H100's
  # roofline, 0.35 needs ~1.3 % more): the norms' spread shape (111 launches, ~390 µs a step) and the one-token expert
  # tiles (80 launches, ~612 µs; picked from isolated L2-cold launches in session 29, never inside the step's graph)
  nvidia-smi --query-gpu=name --format=csv,noheader
  E=runtime.kernels.moe.EXPERT_TUNING
  timeout $(( ${DEADLINE:-200} - $(el) )) python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s77-35b.json" 1 base= \
    chunk128=$N.SPREAD_CHUNK:128 chunk512=$N.SPREAD_CHUNK:512 warps2=$N.SPREAD_WARPS:2 warps8=$N.SPREAD_WARPS:8 \
    sum512=$N.SUM_BLOCK:512 "gu16=$E[gate_up/one]:{'block_n':16,'block_k':1024,'num_warps':4}" \
    "gu64=$E[gate_up/one]:{'block_n':64,'block_k':1024,'num_warps':4}" \
    "gu_w8=$E[gate_up/one]:{'block_n':32,'block_k':1024,'num_warps':8}" \
    "dn64=$E[down/one]:{'block_n':64,'block_k':512,'num_warps':8}" \
    "dn16=$E[down/one]:{'block_n':16,'block_k':512,'num_warps':8}" \
    "dn_w4=$E[down/one]:{'block_n':32,'block_k':512,'num_warps':4}" 2>&1 | grep -E "median|Error"
  echo "35B-A3B t=$(el)"
  ;;
s78)  # ~250 s, any GPU: the server with 4 streaming clients against one, after the queued host copies (session 46) and
  # the step inputs in the graph (47): issue 20's 35B-A3B row (2.91x, session 40), then the 27B (3.42x, session 34)
  nvidia-smi --query-gpu=name --format=csv,noheader
  # (session 48: the 35B-A3B's run had not finished at 152 s: load, warm-ups, then 1 and 4 clients)
  timeout 230 python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 256 2>&1 | tail -6
  echo "35B-A3B server 4 clients t=$(el)"
  [ $(( ${DEADLINE:-250} - $(el) )) -gt 200 ] && timeout $(( ${DEADLINE:-250} - $(el) )) python bench/serve_lanes.py \
    qwen3.6-27b --lanes 4 --tokens 256 2>&1 | tail -6
  echo "27B server 4 clients t=$(el)"
  ;;
s81)  # ~150 s, any GPU: the 35B-A3B's one-lane Q5 output projections (2,048 x 4,096, 40 launches of ~5.2 µs at 0.34 of
  # copy, latency-bound) with K shared by 2 or 4 warps of a program instead of split across programs, and 8 warps a
  # program for every fragment-order product, in one engine
  nvidia-smi --query-gpu=name --format=csv,noheader
  F=runtime.kernels.qgemm_fragment_layout
  timeout $(( ${DEADLINE:-150} - $(el) )) python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s81-35b.json" 1 base= \
    "ks2=$F.WARPS_SHARING_K:{(2048,4096):[(1,1,2)]}" "ks4=$F.WARPS_SHARING_K:{(2048,4096):[(1,1,4)]}" \
    "warps8=$F.FRAGMENT_TUNING[warps]:8" 2>&1 | grep -E "median|Error"
  echo "35B-A3B t=$(el)"
  ;;
s89)  # ~300 s, any GPU: s88 for a short budget — the 35B-A3B server as session 49 ran it (graphs on first use; host
  # time in the step call, graphs captured during the timed runs, median and slowest step), then with the start-up
  # warm-up (session 51: is a capture mid-run the regression?), then the GPU timeline of a 4-row step
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout $(( ${DEADLINE:-300} / 2 - $(el) )) python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 128 \
    --no-warm-up --profile-host 2>&1 | grep -v "^ninfer:" | tail -40
  echo "35B server, graphs on first use t=$(el)"
  timeout $(( ${DEADLINE:-300} - 60 - $(el) )) python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 128 \
    2>&1 | grep -v "^ninfer:" | tail -12
  echo "35B server, warmed up t=$(el)"
  [ $(( ${DEADLINE:-300} - $(el) )) -gt 90 ] && timeout $(( ${DEADLINE:-300} - $(el) )) python bench/step_timeline.py \
    qwen3.6-35b-a3b "$OUT/s89-timeline-35b.json" bf16 4 8 2>&1 | grep -v "^ninfer:" | head -40
  echo "s89 t=$(el)"
  ;;
s88)  # ~560 s, any GPU, first thing next session: the 35B-A3B server with 4 clients ran at 0.63x one client in
  # session 49 (engine 12.78 ms a 4-row step against 1.96 at one row; 2.91x in session 40), while the 27B's 8-lane
  # step was as before. Where: the server again, now with the host's time inside each step call, the graphs
  # captured during the timed runs, the GPU's kernels over 16 of its 4-row steps and the same engine's steps timed
  # without the server (host or GPU? which kernels?), the median and slowest step (one capture inside the timed
  # run?); then the server warmed up at start as it is since session 51; with the time left the GPU timeline of a 1-
  # and a 4-row step in one engine (which kernels?), one engine at 1 and 4 lanes with session 48's defaults taken
  # back one at a time, the lanes bench
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 220 python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 256 --no-warm-up --profile-host \
    --gpu-profile 2>&1 | grep -v "^ninfer:" | tail -56
  echo "35B server, graphs on first use t=$(el)"
  # session 51: the server now captures its graphs before it listens (a capture inside a timed run, with the kernels
  # it compiles, would count seconds into one step of the mean)
  timeout 200 python bench/serve_lanes.py qwen3.6-35b-a3b --lanes 4 --tokens 256 2>&1 | grep -v "^ninfer:" | tail -12
  echo "35B server, warmed up t=$(el)"
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 90 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python bench/step_timeline.py \
    qwen3.6-35b-a3b "$OUT/s88-timeline-35b.json" bf16 1,4 8 2>&1 | grep -v "^ninfer:" | head -70
  echo "35B timeline t=$(el)"
  R=runtime.kernels.rmsnorm
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 80 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python bench/engine_ab.py \
    qwen3.6-35b-a3b "$OUT/s88-35b.json" 1,4 base= nobarrier=$R.SPREAD_BARRIER:False \
    "cublas_one=runtime.engine.DENSE_ROWS_ONE_ROW:False" 2>&1 | grep -E "median|Error|round"
  echo "35B engine t=$(el)"
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 60 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python -m ninfer_cli.main bench \
    --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --distinct-lane-tokens 2>&1 | \
    grep -E "│ bf16|Error|error"
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 50 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python -m pytest -o addopts="" \
    -q -n 4 --tb=line -p no:cacheprovider tests/test_engine.py tests/test_server.py -k "warm_up" 2>&1 | \
    grep -E "passed|failed|Error|assert" | tail -4
  echo "s88 t=$(el)"
  ;;
s87)  # ~580 s, session 49's call: on an H200, issue 20 / 21's H200 tables with today's defaults (s61; the last ones
  # are session 27's), then s78's 35B-A3B server with the time left; on an H100, s85
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    DEADLINE=480 bash bench/device_frag.sh s61
    [ $(( ${DEADLINE:-580} - $(el) )) -gt 90 ] && DEADLINE=$(( ${DEADLINE:-580} - $(el) )) bash bench/device_frag.sh s78
  else
    DEADLINE=$(( ${DEADLINE:-580} - $(el) )) bash bench/device_frag.sh s85
  fi
  echo "s87 t=$(el)"
  ;;
s86)  # ~440 s, any GPU (ran in session 48): s80 and s83 for a short budget, one engine a shape: the GPU tests of
  # session 47's kernels and engine and session 48's barrier, then one lane of the 35B-A3B (embedding / K/V slots back on torch, the few-rows router,
  # the barrier) and the 27B (both back on torch, the barrier), each against the defaults
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 150 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_engine.py \
    tests/test_kernels.py -k "engine or kv_slots or embedding_rows or dense_rows or greedy or lanes or barrier" 2>&1 | \
    grep -E "passed|failed|Error|assert" | tail -6
  echo "tests t=$(el)"
  K=runtime.kernels
  timeout $(( (${DEADLINE:-440} - $(el)) / 2 )) python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s86-35b.json" 1 base= \
    torch_embed=$K.embed_rows.ONE_LAUNCH:False torch_slots=$K.kv_slots.ONE_LAUNCH:False \
    few_router=runtime.engine.DENSE_ROWS_MIN_T:1 barrier=$K.rmsnorm.SPREAD_BARRIER:True 2>&1 | grep -E "median|Error|round"
  echo "35B-A3B t=$(el)"
  timeout $(( ${DEADLINE:-440} - $(el) )) python bench/engine_ab.py qwen3.6-27b "$OUT/s86-27b.json" 1 base= \
    "torch_both=$K.embed_rows.ONE_LAUNCH:False;$K.kv_slots.ONE_LAUNCH:False" barrier=$K.rmsnorm.SPREAD_BARRIER:True \
    2>&1 | grep -E "median|Error|round"
  echo "27B t=$(el)"
  ;;
s85)  # ~560 s, any GPU: what issue 20/21 still lack after session 48's call: the spread-norm barrier's options (s83),
  # the server with 4 clients against one (s78: the 35B-A3B was 2.91x in session 40, before the queued host copies;
  # issue 20 asks 3x), then the 35B-A3B's Q5 output projections (s81) with the time left
  DEADLINE=${DEADLINE:-560}
  DEADLINE=250 bash bench/device_frag.sh s83
  DEADLINE=$(( DEADLINE - $(el) )) bash bench/device_frag.sh s78
  [ $(( DEADLINE - $(el) )) -gt 90 ] && DEADLINE=$(( DEADLINE - $(el) )) bash bench/device_frag.sh s81
  echo "s85 t=$(el)"
  ;;
s83)  # ~250 s, any GPU: session 48's spread-norm barrier (a row's programs share their chunks' sums of squares and wait
  # for each other instead of each re-reading the whole row's K-split partials; default for rows of <= 8 chunks, the
  # 35B-A3B's): its GPU tests, then the 27B (20 chunks: 0.8 % slower with it in session 48) at 1 and 8 lanes with the
  # barrier, counting out after the stores (BARRIER_LEAVE_LAST), spreading 8 rows, 128 / 512 lanes a program; one lane of
  # the 35B-A3B (base = the barrier) without it, counting out last, 128 lanes a program
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 60 python -m pytest -o addopts="" -q --tb=line -p no:cacheprovider tests/test_kernels.py -k barrier \
    2>&1 | grep -E "passed|failed|Error|assert" | tail -4
  R=runtime.kernels.rmsnorm
  timeout $(( (${DEADLINE:-250} - $(el)) * 5 / 8 )) python bench/engine_ab.py qwen3.6-27b "$OUT/s83-27b.json" 1,8 base= \
    barrier=$R.SPREAD_BARRIER:True "leave_last=$R.SPREAD_BARRIER:True;$R.BARRIER_LEAVE_LAST:True" \
    "rows8=$R.SPREAD_BARRIER:True;$R.BARRIER_SPREAD_ROWS:8" "b_c128=$R.SPREAD_BARRIER:True;$R.SPREAD_CHUNK:128" \
    "b_c512=$R.SPREAD_BARRIER:True;$R.SPREAD_CHUNK:512" 2>&1 | grep -E "median|Error|round"
  echo "27B t=$(el)"
  timeout $(( ${DEADLINE:-250} - $(el) )) python bench/engine_ab.py qwen3.6-35b-a3b "$OUT/s83-35b.json" 1 base= \
    nobarrier=$R.SPREAD_BARRIER:False leave_last=$R.BARRIER_LEAVE_LAST:True \
    "b_c128=$R.SPREAD_BARRIER:True;$R.SPREAD_CHUNK:128" 2>&1 | \
    grep -E "median|Error|round"
  echo "35B-A3B t=$(el)"
  ;;
s71)  # ~480 s, any GPU: end to end with the queued copies (session 46): one lane of the 27B and the 35B-A3B (bench, the
  # chained decode and the host-synced loop in one run), the 27B's lanes 1-8 (its steps no longer wait for the host);
  # then s69's norm launch shapes for the 27B
  nvidia-smi --query-gpu=name --format=csv,noheader
  for shape in qwen3.6-27b qwen3.6-35b-a3b; do
    timeout 100 python -m ninfer_cli.main bench --random-weights $shape --depths 8k --prefill-limit 8k --kv-dtype bf16 \
      --decode-tokens 256 --json-out "$OUT/s71-$shape.json" 2>&1 | grep "│ bf16"
    python - "$OUT/s71-$shape.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))["rows"][0]
print({k: r.get(k) for k in ("decode_tok_s", "decode_tok_s_host_synced", "of_roofline")})
PY
    echo "$shape one lane t=$(el)"
  done
  timeout 110 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/s71-lanes.json" 2>&1 | grep "│ bf16"
  echo "27B lanes t=$(el)"
  [ $(( ${DEADLINE:-580} - $(el) )) -gt 80 ] && timeout $(( ${DEADLINE:-580} - $(el) )) python bench/engine_ab.py \
    qwen3.6-27b "$OUT/s71-norms.json" 1 base= $NORM_SHAPES 2>&1 | grep -E "median|Error"
  echo "27B norms t=$(el)"
  ;;
s69)  # ~200 s, any GPU: the one-lane norms' launch shape in one engine (issue 21 item 1: 177 RMSNorms of 4-5 µs a
  # 27B step, 111 a 35B-A3B step, session 45's timelines): lanes a program, lanes a sum step, warps
  nvidia-smi --query-gpu=name --format=csv,noheader
  for shape in qwen3.6-27b qwen3.6-35b-a3b; do
    timeout 100 python bench/engine_ab.py $shape "$OUT/s69-$shape.json" 1 base= $NORM_SHAPES \
      2>&1 | grep -E "median|Error"
    echo "$shape t=$(el)"
  done
  ;;
s61)  # ~470 s on an H200: issue 20 / 21's H200 tables with session 41-43's defaults, most needed first: 27B lanes
  # 1-8 (bf16), the 27B depth table (real prefill, bf16 and rk4v4-e8), 35B-A3B lanes (each lane its own token; its
  # one-lane row is issue 21's 8K number), then a 32K prefill beside 3 decoding lanes
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 120 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/s61-lanes.json" 2>&1 | grep "│ bf16"
  echo "27B lanes t=$(el)"
  timeout 240 $B --depths 8k,32k,128k,200k --kv-dtype bf16,rk4v4-e8 --decode-tokens 64 \
    --json-out "$OUT/s61-depths.json" 2>&1 | grep -E "│ (bf16|rk4v4)"
  echo "27B depths t=$(el)"
  [ $(( ${DEADLINE:-470} - $(el) )) -gt 50 ] && timeout 80 python -m ninfer_cli.main bench --random-weights \
    qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --distinct-lane-tokens \
    --json-out "$OUT/s61-moe-lanes.json" 2>&1 | grep "│ bf16"
  echo "35B-A3B lanes t=$(el)"
  [ $(( ${DEADLINE:-470} - $(el) )) -gt 50 ] && timeout $(( ${DEADLINE:-470} - $(el) )) $B --lanes 1,4 --depths 8k \
    --kv-dtype bf16 --concurrent-prefill 32k --json-out "$OUT/s61-beside.json" 2>&1 | grep -E "│" | tail -6
  echo "32K prefill beside 3 lanes t=$(el)"
  ;;
s59)  # session 43 (~580 s): GPU tests; a prefill chunk's combine with 16 rows a program (NINFER_COMBINE_ROWS, opt-in)
  # in the riding-chunk profile, off / on; the MoE routing's top-k keyed (opt-in) or not, the expert launches alone;
  # 35B-A3B one lane with its narrow Q5 output projections (2,048 x 4,096, ~0.32 of copy, session 41) in fragment order
  # (default), on the dp4a GEMV (NINFER_GEMV_FRAG=rows) and on the int8 fragment kernel, and the router + shared gate
  # on the PDL dense kernel (NINFER_DENSE_ROWS=all) instead of cuBLAS, twice each; then, with the time left, those Q5
  # products per product on the 35B's shapes (fragment kernels vs the dp4a GEMV)
  nvidia-smi --query-gpu=name --format=csv,noheader
  # GPU tests of session 41's work: the defaults never run on a GPU yet (the prefill conv's sections and its window
  # replaced in-kernel, the riders' GDN norm in place) and the opt-ins
  timeout 150 python -m pytest -o addopts="" -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py -k \
    "combine_rows or test_paged_attention or output_gate or conv1d or gdn_chunked or routing or dense_rows or \
    gdn_norm_in or ride or greedy_tokens_equal or chunked_prefill" 2>&1 | tail -3
  echo "tests t=$(el)"
  for rows in 0 16; do  # (the prefill conv's sections apart, default since session 41: no q/k/v copies left)
    [ $(( ${DEADLINE:-580} - $(el) )) -gt 60 ] || break
    NINFER_COMBINE_ROWS=$rows timeout 90 python bench/profile_decode.py qwen3.6-27b "$OUT/s59-ride-$rows-$(el).json" \
      ride bf16 2>&1 | grep -E "kernel time|_combine|_paged_attention_kernel|direct_copy|_conv4"
    echo "ride profile, combine rows $rows t=$(el)"
  done
  for keyed in 0 1; do  # the MoE routing's top-k, two reductions a pick (0, default) or one over int64 keys (1)
    [ $(( ${DEADLINE:-580} - $(el) )) -gt 40 ] || break
    NINFER_TOPK_KEYED=$keyed timeout 60 python bench/moe_decode_tiles.py "$OUT/s59-topk-$keyed-$(el).json" 1 shared \
      2>&1 | tail -4 | cut -c1-300
    echo "35B expert launches at one token, top-k keyed $keyed t=$(el)"
  done
  for mode in auto dense rows q5 auto dense rows q5; do  # dense: the router on the PDL dense kernel (NINFER_DENSE_ROWS=all)
    [ $(( ${DEADLINE:-580} - $(el) )) -gt 120 ] || break
    frag=auto; int8=off; dense=off
    [ $mode = rows ] && frag=rows
    [ $mode = q5 ] && int8=q5
    [ $mode = dense ] && dense=all
    NINFER_GEMV_FRAG=$frag NINFER_FRAGMENT_INT8=$int8 NINFER_DENSE_ROWS=$dense timeout 90 python -m ninfer_cli.main \
      bench --random-weights \
      qwen3.6-35b-a3b --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 512 \
      --json-out "$OUT/s59-35b-$mode-$(el).json" 2>&1 | grep "│ bf16"  # 512 steps: 128 spread ~8 % (session 41)
    echo "35B-A3B one lane, Q5 products $mode t=$(el)"
  done
  [ $(( ${DEADLINE:-580} - $(el) )) -gt 40 ] && NINFER_BENCH_SHAPES=35b timeout $(( ${DEADLINE:-580} - $(el) )) \
    python bench/gemv_compare.py "$OUT/s59-frag-35b.json" frag 2>&1 | grep "^{" | cut -c1-400
  echo "35B shapes per product t=$(el)"
  ;;
s58)  # session 41 (~420 s): the GPU tests of the two epilogues, then one lane (27B and 35B-A3B, 8K) with the GDN conv
  # in the qkvz launch (NINFER_CONV_EPILOGUE) and the GDN output norm in the recurrence's launch
  # (NINFER_GDN_NORM_EPILOGUE) off / conv / both, twice; then where a 35B-A3B one-lane step goes, kernel by kernel
  # (issue 21 item 3: ~390 launches a step, 0.23 of roofline), both epilogues off and on
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 90 python -m pytest -o addopts="" -q -p no:cacheprovider tests/test_kernels.py tests/test_engine.py \
    -k "conv_in_its_launch or conv_in_the_qkvz or gdn_norm_in or gdn_fused" 2>&1 | tail -2
  echo "tests t=$(el)"
  for mode in off conv both off conv both; do
    [ $(( ${DEADLINE:-300} - $(el) )) -gt 30 ] || break
    conv=off; norm=off
    [ $mode != off ] && conv=on
    [ $mode = both ] && norm=on
    for shape in qwen3.6-27b qwen3.6-35b-a3b; do
      NINFER_CONV_EPILOGUE=$conv NINFER_GDN_NORM_EPILOGUE=$norm timeout 60 python -m ninfer_cli.main bench \
        --random-weights $shape --depths 8k --prefill-limit 8k --kv-dtype bf16 --decode-tokens 128 \
        --json-out "$OUT/s58-$shape-$mode-$(el).json" 2>&1 | grep "│ bf16"
      echo "$shape one lane, epilogues $mode t=$(el)"
    done
  done
  timeout 120 python bench/profile_decode.py qwen3.6-35b-a3b "$OUT/s58-35b-one-lane.json" decode bf16 2>&1 | tail -30
  echo "35B-A3B one-lane profile t=$(el)"
  NINFER_CONV_EPILOGUE=on NINFER_GDN_NORM_EPILOGUE=on timeout 120 python bench/profile_decode.py qwen3.6-35b-a3b \
    "$OUT/s58-35b-one-lane-both.json" decode bf16 2>&1 | tail -30
  echo "35B-A3B one-lane profile, both epilogues on t=$(el)"
  ;;
s55)  # session 40 (~300 s): riding chunks with the riders' rows taken out of the prompt piece (NINFER_RIDE_ALIGN):
  # the bf16 GEMM at row counts around whole tiles, then lane 0's 32K prefill beside 3 decoding lanes, off / on
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 60 python bench/gemm_rows.py 2>&1 | cut -c1-100
  echo "gemm rows t=$(el)"
  for align in off on; do
    [ $(( ${DEADLINE:-300} - $(el) )) -gt 60 ] || break
    NINFER_RIDE_ALIGN=$align timeout $(( ${DEADLINE:-300} - $(el) )) $B --lanes 1,4 --depths 8k --kv-dtype bf16 \
      --concurrent-prefill 32k --json-out "$OUT/s55-ride-align-$align.json" 2>&1 | grep -E "ride|alternate"
    echo "ride align $align t=$(el)"
  done
  ;;
s54)  # session 40 on an H200 (~560 s): GPU tests of the cuDNN route and the rmsnorm fix, cold prefill to 128K with the
  # chunk's attention on cuDNN / paged / auto alternated in one engine, then issue 21's depth table (real prefill, the
  # cuDNN route by default) and the 35B-A3B lanes (each lane its own token)
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 60 python -m pytest -o addopts="" -q -p no:cacheprovider tests/test_prefill_attention_vendor.py \
    tests/test_kernels.py -k "cudnn or vendor or rmsnorm" 2>&1 | tail -3
  echo "tests t=$(el)"
  timeout 120 python bench/prefill_ab.py qwen3.6-27b 131072 bf16 2>&1 | grep -E "^\{|cuDNN|Error"
  echo "prefill a/b t=$(el)"
  timeout 250 $B --depths 8k,32k,128k,200k --kv-dtype bf16,rk4v4-e8 --decode-tokens 64 \
    --json-out "$OUT/s54-depths.json" 2>&1 | grep -E "│ (bf16|rk4v4)"
  echo "27B depths t=$(el)"
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 50 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python -m ninfer_cli.main \
    bench --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --distinct-lane-tokens \
    --json-out "$OUT/s54-moe-lanes.json" 2>&1 | grep "│ bf16"
  echo "35B-A3B lanes, distinct tokens t=$(el)"
  ;;
s53)  # next session (~560 s): what session 39 built and could not time. The cuDNN prefill route end to end (27B
  # bf16 and rk4v4-e8, one engine each, cuDNN / paged alternated), the down launch pair by pair after routing first
  # (35B-A3B lanes, each lane its own token, down_major 2 vs 0 alternated), then s50's 35B one lane and router runs
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 60 python -m pytest -o addopts="" -q -p no:cacheprovider tests/test_prefill_attention_vendor.py \
    tests/test_kernels.py -k "cudnn or vendor or rmsnorm" 2>&1 | tail -3
  for kv in bf16 rk4v4-e8; do
    timeout 150 python bench/prefill_ab.py qwen3.6-27b 32768,131072 $kv 2>&1 | grep -E "^\{|cuDNN|Error"
    echo "prefill a/b $kv t=$(el)"
  done
  for down in 2 0 2 0; do
    [ $(( ${DEADLINE:-560} - $(el) )) -gt 60 ] || break
    NINFER_MOE_FRAGMENT_TILE=2,4,2,2,$down timeout 90 python -m ninfer_cli.main bench --random-weights \
      qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --distinct-lane-tokens \
      --json-out "$OUT/s53-down-major-$down-$(el).json" 2>&1 | grep "│ bf16"
    echo "35B-A3B lanes, distinct tokens, down_major $down t=$(el)"
  done
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 120 ] && DEADLINE=$(( ${DEADLINE:-560} - $(el) )) bash bench/device_frag.sh s50
  ;;
s51)  # session 39 (~560 s): a prefill chunk's attention at depth (tiles, stages, torch's kernels on gathered keys), then
  # s50 in the time left
  nvidia-smi --query-gpu=name --format=csv,noheader
  PYTHONPATH=. timeout 220 python bench/attention_compare.py "$OUT/s51-prefill-attn.json" prefill 2>&1 | grep "{" | \
    python -c "import json,sys; [print({k: (round(v) if isinstance(v, float) and v > 20 else round(v, 2) if isinstance(v, float) else v) for k, v in json.loads(l).items() if not k.endswith('_us') and (not k.endswith('maxdiff') or v > 5e-2)}) for l in sys.stdin]"
  echo "prefill attention t=$(el)"
  DEADLINE=$(( ${DEADLINE:-560} - $(el) )) bash bench/device_frag.sh s50
  ;;
s50)  # next session (~480 s), what session 38 left unmeasured: the 35B-A3B one lane with real prefill (its prefill
  # through the grouped expert kernel over experts in fragment order) and decode, experts off / on pair by pair / on
  # routed first at one token too, alternated; the router in the norm's launch (0 / 8 / 16 rows a program);
  # then the 35B-A3B server with 4 streaming clients (expert-major by default). First: both expert launches of one
  # layer pair by pair vs expert-major at 1 and 8 tokens, random / shared routing (us, of copy)
  nvidia-smi --query-gpu=name --format=csv,noheader
  PYTHONPATH=. timeout 120 python bench/moe_decode_tiles.py "$OUT/s50-fragment-launches.json" 1,8 fragment 2>&1 | \
    grep "{" | cut -c1-220
  echo "fragment launches t=$(el)"
  for run in 1 2; do
    for mode in "off 2" "on 2" "on 1"; do
      set -- $mode
      [ $(( ${DEADLINE:-560} - $(el) )) -gt 120 ] || break
      NINFER_MOE_FRAGMENT=$1 NINFER_MOE_FRAGMENT_TILE=2,4,2,$2 timeout 150 python -m ninfer_cli.main bench \
        --random-weights qwen3.6-35b-a3b --depths 8k,32k --kv-dtype bf16 \
        --json-out "$OUT/s50-moe-one-$1-$2-$run.json" 2>&1 | grep "│ bf16"
      echo "35B-A3B one lane, prefill + decode, fragment $1 expert_major $2 t=$(el)"
    done
  done
  for rows in 0 8 16 0 8; do  # the router in the norm's launch (decode rows, lanes 1-8), opt-in
    [ $(( ${DEADLINE:-560} - $(el) )) -gt 130 ] || break
    NINFER_ROUTER_IN_NORM=$rows timeout 100 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b \
      --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/s50-router-$rows-$(el).json" 2>&1 | grep "│ bf16"
    echo "35B-A3B lanes, router in the norm: $rows rows a program t=$(el)"
  done
  [ $(( ${DEADLINE:-560} - $(el) )) -gt 100 ] && timeout $(( ${DEADLINE:-560} - $(el) )) python bench/serve_lanes.py \
    qwen3.6-35b-a3b --lanes 4 --tokens 256 2>&1 | tail -6
  echo "35B-A3B server 4 clients t=$(el)"
  ;;
s49)  # session 38 (~400 s): the expert-major fragment launches (an expert read once for every token that picked it):
  # GPU tests, then 35B-A3B lanes with the routed experts off / fragment pair by pair / fragment expert-major, the
  # lanes feeding the same token (every lane routes alike) and distinct tokens, alternated
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 150 python -m pytest -o addopts="" -q -n 4 --tb=short -p no:cacheprovider tests/test_moe_fragment.py 2>&1 | \
    grep -v Warn | tail -12
  echo "tests t=$(el)"
  for run in 1 2; do
    for mode in "off 2" "on 0" "on 2"; do
      set -- $mode
      for tokens in "" --distinct-lane-tokens; do
        [ $(( ${DEADLINE:-560} - $(el) )) -gt 40 ] || break
        NINFER_MOE_FRAGMENT=$1 NINFER_MOE_FRAGMENT_TILE=2,4,2,$2 timeout 130 python -m ninfer_cli.main bench \
          --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 $tokens \
          --json-out "$OUT/s49-moe-lanes-$1-$2${tokens:+-distinct}-$run.json" 2>&1 | grep "│ bf16"
        echo "35B-A3B lanes fragment $1 expert_major $2 '$tokens' t=$(el)"
      done
    done
  done
  ;;
s48)  # next session (~450 s): the fragment expert launches taken apart (bench/moe_fragment_check.py: per pair, routing
  # and the shared expert on / off, beside the known-good fragment SwiGLU launch), their GPU tests, then 35B-A3B lanes
  # off / on alternated (the first run compiles: a long timeout) and the one-lane profile with them on
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 150 python bench/moe_fragment_check.py 2>&1 | tail -14
  timeout 100 python bench/moe_fragment_check.py pure 2>&1 | tail -8
  echo "check t=$(el)"
  timeout 120 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_moe_fragment.py 2>&1 | tail -5
  echo "tests t=$(el)"
  for frag in on off on off; do
    [ $(( ${DEADLINE:-560} - $(el) )) -gt 50 ] || break
    NINFER_MOE_FRAGMENT=$frag timeout 130 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b \
      --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/s48-moe-lanes-$frag-$(el).json" 2>&1 | grep "│ bf16"
    echo "35B-A3B lanes moe fragment $frag t=$(el)"
  done
  ;;
next36)  # session 36's one call (~540 s on either card): W8 GPU tests; 17-64 rows as 16-row blocks against the
  # dequantizing GEMM (8 lanes of MTP3 rounds); DFlash2 lanes 1-2 with W8 off / on; 27B lanes, MTP3 lanes, 35B-A3B lanes
  # with every default; then on an H200 the depth table (issue 21), on an H100 the GDN verify-tile rule off / on
  nvidia-smi --query-gpu=name --format=csv,noheader
  timeout 100 python -m pytest -o addopts="" -q -n 4 --tb=line -p no:cacheprovider tests/test_frag_kernel.py \
    tests/test_speculative.py tests/test_dflash2.py -k "int8_fragment or w8 or W8" 2>&1 | tail -2
  echo "tests t=$(el)"
  for sliced in 0 1; do  # 8 lanes of MTP3 rounds (32-row verify blocks): dequantizing GEMM / 16-row blocks
    NINFER_SLICED_ROWS=$sliced timeout 90 $B --lanes 8 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 \
      --accepted-drafts 3 --decode-tokens 16 --json-out "$OUT/n36-spec8-sliced-$sliced.json" 2>&1 | grep "│ bf16"
    echo "8 lanes MTP3 sliced rows $sliced t=$(el)"
  done
  for w8 in off on; do
    NINFER_FRAGMENT_W8=$w8 timeout 80 $B --lanes 1,2 --depths 8k --kv-dtype bf16 --spec dflash2 --draft-tokens 7 \
      --accepted-drafts 7 --decode-tokens 32 --draft-vocab 32768 --json-out "$OUT/n36-dflash2-w8-$w8.json" 2>&1 | \
      grep "│ bf16"
    echo "dflash2 lanes w8 $w8 t=$(el)"
  done
  timeout 80 $B --lanes 1,2,4,8 --depths 8k --kv-dtype bf16 --json-out "$OUT/n36-lanes.json" 2>&1 | grep "│ bf16"
  echo "27B lanes t=$(el)"
  timeout 80 $B --lanes 1,2,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 --accepted-drafts 3 \
    --decode-tokens 32 --draft-vocab 32768 --json-out "$OUT/n36-mtp3-lanes.json" 2>&1 | grep "│ bf16"
  echo "MTP3 lanes t=$(el)"
  timeout 80 python -m ninfer_cli.main bench --random-weights qwen3.6-35b-a3b --lanes 1,2,4,8 --depths 8k \
    --kv-dtype bf16 --json-out "$OUT/n36-moe-lanes.json" 2>&1 | grep "│ bf16"
  echo "35B-A3B lanes t=$(el)"
  if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
    for kv in rk4v4-e8 bf16; do  # apart, so one finishes if the time runs short
      timeout $((${DEADLINE:-575} - $(el))) $B --depths 8k,32k,128k,200k --kv-dtype $kv --decode-tokens 64 \
        --json-out "$OUT/n36-depths-$kv.json" 2>&1 | grep -E "│ $kv"
      echo "27B depths $kv t=$(el)"
    done
  elif [ $(( ${DEADLINE:-575} - $(el) )) -gt 120 ]; then
    for tile in "" 0; do  # GDN verify blocks: 32 value columns always (default) / widened by rule (opt-in)
      NINFER_GDN_TILE=$tile timeout 60 $B --lanes 2,4 --depths 8k --kv-dtype bf16 --spec mtp --draft-tokens 3 \
        --accepted-drafts 3 --decode-tokens 32 --json-out "$OUT/n36-spec-gdn${tile:+-rule}.json" 2>&1 | grep "│ bf16"
      echo "MTP3 lanes GDN tile '$tile' t=$(el)"
    done
  fi
  ;;
esac
