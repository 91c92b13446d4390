"""Compile, on a CPU, every kernel launch a test selection makes, for the GPU (sm_90) — with whichever triton is on
the path, e.g. the device's version — so a kernel that only the GPU compiler rejects is caught before device time.

The interpreter runs a kernel's Python, not the GPU compiler: a branch the interpreter never takes, or a construct
one triton version compiles and another rejects, passes every CPU test and fails every launch on the device
(session 39: the rmsnorm launch with no router rows under triton 3.6). Two steps:

    # record each distinct launch (kernel, argument types, constexpr values, warps, stages) under the interpreter
    PYTHONPATH=. python bench/compile_check.py record OUT.json tests/test_kernels.py -k rmsnorm
    # compile every recorded launch for sm_90 (here with triton 3.6 from another environment, same Python)
    PYTHONPATH=/path/to/triton36/site-packages:. python bench/compile_check.py compile OUT.json

`compile` prints one line per failing launch and a count; exit status 1 if any failed; where COMPILE_CHECK_PTX names a
folder, each launch's PTX is written there. A launch whose kernel needs more shared memory than an sm_90 block may
take (232,448 bytes) fails too: the GPU refuses it at launch time (session 45: Q5 fields in the fused expert kernel at
triton's default 3 pipeline stages, 254 KB).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

_TORCH_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64", "int32": "i32",
                "int64": "i64", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1", "float8_e4m3fn": "fp8e4nv",
                "uint32": "u32"}


def _argument(value):
    """(signature type, constant) of one non-constexpr argument as triton's launcher would see it."""
    import torch

    if value is None:
        return "constexpr", None
    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TYPES[str(value.dtype).removeprefix("torch.")], None
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        return ("i32" if -2 ** 31 <= value < 2 ** 31 else "i64"), None
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"argument of type {type(value).__name__}")


def _constant(value):
    import triton.language as tl

    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, tl.constexpr):
        return _constant(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"constexpr of type {type(value).__name__}")


def launch_entry(fn, arg_names: list[str], args: tuple, kwargs: dict) -> dict:
    """One launch of the jit function `fn` (its Python function; `arg_names` in order) with these arguments as the
    `compile` step reads it: argument types, constexpr values, warps and stages. TypeError for an argument kind it
    does not know."""
    import inspect

    params = inspect.signature(fn).parameters
    bound = dict(zip(arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
    signature, constants = {}, {}
    for name in arg_names:
        value = bound.get(name, params[name].default)
        if value is inspect.Parameter.empty:
            raise TypeError(f"{name} not given")
        if "constexpr" in str(params[name].annotation):
            signature[name], constants[name] = "constexpr", _constant(value)
        else:
            kind, const = _argument(value)
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = const
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constants": constants,
            "num_warps": kwargs.get("num_warps", 4), "num_stages": kwargs.get("num_stages", 3)}


def record(out_path: str, pytest_args: list[str]) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["NINFER_CPU_KERNELS"] = "triton"
    import pytest
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    original = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            entry = launch_entry(self.fn, self.arg_names, args, kwargs)
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        except TypeError as exc:  # an argument kind this recorder does not know: say so, keep running
            print(f"compile_check: not recorded {self.fn.__name__}: {exc}", file=sys.stderr)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    status = pytest.main(["-q", "-o", "addopts=", "-p", "no:cacheprovider", *pytest_args])
    with open(out_path, "w") as f:
        json.dump(list(seen.values()), f, indent=1)
    print(f"{len(seen)} distinct launches recorded -> {out_path} (pytest status {status})", file=sys.stderr)
    return 0


SM90_MAX_SHARED = 232448  # bytes of shared memory one block may opt in to on sm_90 (H100, H200)


def compile_all(path: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    entries = json.load(open(path))
    ptx_dir = os.environ.get("COMPILE_CHECK_PTX")
    if ptx_dir:
        os.makedirs(ptx_dir, exist_ok=True)
    failed = 0
    for index, entry in enumerate(entries):
        fn = getattr(importlib.import_module(entry["module"]), entry["name"])
        constants = {k: getattr(tl, v["tl_dtype"]) if isinstance(v, dict) else v
                     for k, v in entry["constants"].items()}
        signature = entry["signature"]
        attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
        label = f"{entry['name']} warps={entry['num_warps']} " + " ".join(
            f"{k}={v}" for k, v in sorted(entry["constants"].items()) if k.isupper())
        try:
            kernel = triton.compile(ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()},
                                     attrs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})
            if ptx_dir:  # each launch's PTX, to read what the GPU runs
                with open(os.path.join(ptx_dir, f"{index}-{entry['name']}.ptx"), "w") as f:
                    f.write(kernel.asm["ptx"])
            if kernel.metadata.shared > SM90_MAX_SHARED:
                raise RuntimeError(f"needs {kernel.metadata.shared} bytes of shared memory, over sm_90's "
                                   f"{SM90_MAX_SHARED} a block")
        except Exception as exc:  # noqa: BLE001 - every failing launch is reported, the rest still compile
            failed += 1
            cause = exc.__cause__ or exc
            lines = [line for line in str(cause).strip().splitlines() if line.strip() not in ("", "^")]
            reason = f"{type(cause).__name__}: {lines[-1] if lines else ''}"
            print(f"FAIL {label[:300]}\n     {reason[:300]}")
    print(f"{len(entries) - failed} of {len(entries)} launches compile for sm_90 with triton {triton.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    mode, out, *rest = sys.argv[1:]
    sys.exit(record(out, rest) if mode == "record" else compile_all(out))
