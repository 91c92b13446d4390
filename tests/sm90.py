"""Kernel launches compiled for sm_90 (H100, H200) on the CPU, by bench/compile_check.py in a subprocess without the
interpreter: for launches the interpreter cannot show wrong (shared memory over a block's limit, a construct only the
GPU compiler rejects, a kernel whose programs wait for each other and so cannot run one after another)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _no_ptxas() -> str | None:
    """Why this machine cannot compile for sm_90 (triton's ptxas missing), or None."""
    try:
        from triton import knobs

        path = knobs.nvidia.ptxas.path
    except Exception as exc:  # noqa: BLE001 - no NVIDIA backend in this triton
        return f"triton has no ptxas here ({type(exc).__name__})"
    return None if path and os.access(path, os.X_OK) else f"no ptxas at {path}"


def assert_compiles_for_sm90(launches: list[dict], tmp_path) -> None:
    """Every launch entry (bench.compile_check.launch_entry's form) compiles for sm_90 within a block's shared memory;
    skipped where this machine has no sm_90 toolchain (any failure where it has one fails the test)."""
    missing = _no_ptxas()
    if missing:
        pytest.skip(f"no sm_90 toolchain: {missing}")
    recorded = tmp_path / "launches.json"
    recorded.write_text(json.dumps(launches))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the GPU compiler, not the interpreter
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "bench/compile_check.py", "compile", str(recorded)], capture_output=True,
                         text=True, env=env, timeout=600)
    report = run.stdout + run.stderr
    assert run.returncode == 0 and f"{len(launches)} of {len(launches)} launches compile" in report, report[-2000:]
