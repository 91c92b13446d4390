"""Triton kernels, one op per module, each with its plain-torch reference beside it.

On a GPU the kernels are the fast path. On a CPU each op runs its plain-torch reference (milliseconds
per token for a tiny model, where Triton's interpreter takes seconds), unless NINFER_CPU_KERNELS=triton
asks for the kernels under the interpreter (TRITON_INTERPRET=1): the kernel tests do, and so can any
run that wants the GPU's code paths checked on a CPU.
"""

import os

from ..switches import setting

CPU_KERNELS = setting("NINFER_CPU_KERNELS")


def torch_path(tensor) -> bool:
    """Whether an op on `tensor` runs its plain-torch reference: the tensor is on the CPU and
    NINFER_CPU_KERNELS (read here at call time, so tests may switch it) is not "triton"."""
    return tensor.device.type == "cpu" and CPU_KERNELS != "triton"


def interpreted() -> bool:
    """Kernels run under triton's CPU interpreter (TRITON_INTERPRET=1: tests, CI) rather than on a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _match_gpu_bf16_in_interpreter() -> None:
    """triton 3.6's interpreter stores bf16 as uint16 bit patterns: it hands them to np.matmul as
    integers and narrows float32 to bf16 by truncation. Widen bf16 dot operands (exact) and round
    float32 -> bf16 to nearest even, as the GPU does, so interpreted kernels compute what GPU ones do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_ninfer_bf16_fixed", False):
        return
    create_dot, cast_impl = builder.create_dot, builder.cast_impl

    def widen(h):
        if h.dtype.scalar == tl.bfloat16:
            return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
            rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
            rounded = np.where(np.isnan(src.data), np.uint16(0x7FC0), rounded)
            return interpreter.TensorHandle(rounded, tl.bfloat16)
        return cast_impl(self, src, dst_type)

    builder.create_dot, builder.cast_impl, builder._ninfer_bf16_fixed = dot, cast, True


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches the language modules (an inspect.getmembers walk over tl, tl.core,
    tl.tensor and tl.math) on every call of a @triton.jit helper, although the launch around it has patched
    them already and the helper sees the same modules: a fifth to a third of an interpreted engine test went
    there. Inside a launch, a helper whose modules the launch patched skips it; anything else (the launch's
    own patching, a helper seeing another module the first time, an interpreter without these internals) goes
    through."""
    import triton.language as tl
    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if real is None or executor is None or getattr(real, "_ninfer_once", False):
        return
    launches: list[set[int]] = []  # per launch in progress: the ids of the language modules patched so far

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        seen = languages(fn)
        if launches and seen and seen <= launches[-1]:
            return None  # a helper inside a launch (the interpreter ignores what this returns there)
        # the launch's own patching, or a helper seeing another module (triton's standard library sees
        # tl.core): a helper's patches are never undone, so these modules stay patched for the launch
        scope = real(fn)
        if launches:
            launches[-1] |= seen
        return scope

    grid_call = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(set())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang._ninfer_once = True
    interpreter._patch_lang, executor.__call__ = patch_lang, launch


if interpreted():
    _match_gpu_bf16_in_interpreter()
    _patch_language_once_per_launch()


def tuning_from_env(name: str, keys: tuple[str, ...], into: dict) -> dict:
    """Side-by-side runs set kernel tunings as comma-separated integers in environment variable `name`, in the
    order of `keys` (a prefix of them may be given); they update `into`. A malformed value stops with a one-line
    error naming the variable and the expected form, not a traceback."""
    text = os.environ.get(name, "")
    if not text:
        return into
    parts = [p.strip() for p in text.split(",")]
    if len(parts) > len(keys) or not all(p.lstrip("-").isdigit() for p in parts):
        raise SystemExit(f"ninfer: {name}={text!r} is not up to {len(keys)} comma-separated integers "
                         f"({','.join(keys)}); unset it for the defaults")
    into.update(zip(keys, map(int, parts)))
    return into

