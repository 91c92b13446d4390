#!/usr/bin/env bash
# run 28, call 5: the GPU test files the speculation refactor touches (engine, speculative, DFlash2, memory plan)
# on the H200 at the session's last code commit
set -u
R=/tmp/r28e; mkdir -p $R
. bench/device_env.sh
timeout 420 python -m pytest -q -p no:cacheprovider -n 4 tests/test_engine.py tests/test_speculative.py tests/test_dflash2.py tests/test_memory_plan.py > $R/gpu-pytest.log 2>&1; echo "pytest rc=$? t=$(el)"
grep -E "passed|failed|error" $R/gpu-pytest.log | tail -5
tar -C $R -czf ${OUT:-/tmp}/run28e.tgz . 2>/dev/null
