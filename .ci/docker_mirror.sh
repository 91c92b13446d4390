#!/usr/bin/env bash
# The Dockerfile's steps without a docker daemon, as far as a CPU machine can take them:
#   bash .ci/docker_mirror.sh
# 1. copies exactly the paths the Dockerfile COPYs into an empty directory (a file the image lacks fails
#    the install or the run below, as it would in the image);
# 2. a fresh venv, torch (the CPU build here; the image takes the cu128 one), then a non-editable
#    `pip install '.[gpu,bench]'` of that copy, as the image's RUN does;
# 3. as an unprivileged user with the image's TRITON_CACHE_DIR: `ninfer --help` (the ENTRYPOINT's default),
#    `ninfer demo`, and `ninfer serve` on the demo's artifact checked the way the HEALTHCHECK checks it
#    (curl /health), plus one chat request.
# Not covered here: the CUDA base image and its driver, the cu128 torch wheel, Triton compiling kernels on a
# GPU (the GPU paths are covered by bench/device_checks.sh on a GPU host).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/ninfer-docker-XXXX)
chmod 755 "$work"
cleanup() { [ -n "${server:-}" ] && kill "$server" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
python3 - "$root/Dockerfile" "$root" "$work/src" <<'PY'
import shlex, shutil, sys, pathlib
dockerfile, root, dest = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])
dest.mkdir()
for line in dockerfile.read_text().splitlines():
    if not line.startswith("COPY "):
        continue
    *sources, target = shlex.split(line[5:])
    for s in sources:
        src, out = root / s, dest / (s if target.endswith("/") else target)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, out)
        print(f"COPY {s} -> {out.relative_to(dest)}", file=sys.stderr)
PY
# the image's interpreter is the system python3; a python under a private home (pyenv in /root) would not
# run for the unprivileged user
py=$( [ -x /usr/bin/python3 ] && echo /usr/bin/python3 || command -v python3 )
"$py" -m venv "$work/venv"
. "$work/venv/bin/activate"
pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
pip install -q "torch==2.13.0" || pip install -q "torch>=2.4,<2.15" --index-url https://download.pytorch.org/whl/cpu
pip install -q "$work/src[gpu,bench]" 2>&1 | grep -v "^WARNING: Location" || true
python -c "import ninfer_cli" 2>/dev/null || { echo "install of the copied sources failed" >&2; exit 1; }
echo "install: ok ($(python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
user=ninfer-mirror
id "$user" >/dev/null 2>&1 || useradd --create-home "$user" 2>/dev/null || user=$(id -un)
as_user() { if [ "$user" = "$(id -un)" ]; then "$@"; else su "$user" -s /bin/bash -c "$(printf '%q ' "$@")"; fi; }
home=$(eval echo "~$user")
env_line=(env "PATH=$work/venv/bin:/usr/bin:/bin" "HOME=$home" "TRITON_CACHE_DIR=$home/.triton")
as_user "${env_line[@]}" ninfer --help | head -3
mkdir "$work/demo" && chown "$user" "$work/demo"  # the user's own, like the image's home
as_user "${env_line[@]}" ninfer demo --workdir "$work/demo" | tail -2
chmod -R a+rX "$work/demo"
artifact=$(ls "$work"/demo/*.nfer | head -1)
port=18437
as_user "${env_line[@]}" ninfer serve "$artifact" --device cpu --port "$port" --max-context 256 >"$work/serve.log" 2>&1 &
server=$!
for _ in $(seq 120); do curl -fsS "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.5; done
curl -fsS "http://127.0.0.1:$port/health" && echo " <- HEALTHCHECK: ok"
curl -fsS "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":8}' | python -c \
  'import json,sys; r=json.load(sys.stdin); print("chat: ok,", r["usage"]["completion_tokens"], "tokens")'
echo "docker mirror: every step passed"
