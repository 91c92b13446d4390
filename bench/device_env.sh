# Sourced by the device scripts (bench/device_checks.sh, bench/data/run*/run*.sh), from the repository root:
# the device has no network, so fastapi/uvicorn and flash-linear-attention come from the carried wheels in
# .carry/wheels (see device_checks.sh for how to fetch them); `el` prints seconds since sourcing.
export PYTHONPATH=.
python -m pip install -q --no-index --find-links .carry/wheels fastapi uvicorn einops llguidance 2>&1 | grep -v WARN
python -m pip install -q --no-index --no-deps .carry/wheels/fla_core*.whl .carry/wheels/flash_linear*.whl 2>&1 | grep -v WARN
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
