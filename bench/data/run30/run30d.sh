#!/usr/bin/env bash
# Run 30 call 4: the engine tests on the GPU with their verdicts (call 3's `-q` doubled the addopts' -q, which
# hides the summary line).  run (carry .carry): bash bench/data/run30/run30d.sh
set -u
. bench/device_env.sh
timeout 200 python -m pytest -p no:cacheprovider tests/test_engine.py tests/test_speculative.py -rA 2>&1 \
  | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|^E |passed|failed" | tail -40
echo "rc=${PIPESTATUS[0]} t=$(el)"
