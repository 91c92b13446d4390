"""Programmatic dependent launch (PDL, Hopper and later): every kernel of this package is launched
with `**LAUNCH` and starts with `pdl_release()` + `pdl_wait()`.

Why: a decode step is ~1,200 small dependent kernels; between two of them the GPU drains one grid,
then launches and ramps up the next (about a microsecond each, even inside a CUDA graph). Under PDL
the next kernel is launched as soon as every program of the current one has started
(`pdl_release`), and waits in `griddepcontrol.wait` (`pdl_wait`) until the current grid has
finished and its writes are visible. Before that wait a kernel may only read what no kernel writes
during inference (weights): the quantized GEMV fetches its first weight tile there, so weight
streaming overlaps the tail of the kernel before it.

The rule that keeps this correct: a kernel launched with LAUNCH calls `pdl_wait()` before it reads
anything another kernel wrote and before it writes anything (another kernel may still read it).
`tests/test_kernels.py::test_every_launch_waits` checks that every launch site and kernel follows it.
Opt-in: on the H200 (run 22, 27B Q4, 8K, CUDA-graph decode) releasing the next kernel at the start of
each one (NINFER_PDL=1) made decode 5 % slower (127.6 vs 134.0 tok/s): every kernel released its
successor before waiting itself, so a whole chain of later kernels could become resident, hold SM
slots and prefetch while the current one still ran. NINFER_PDL=2 releases right after the wait
instead, so at most one kernel runs ahead of the one working. Never on under the interpreter or on
GPUs before sm_90 (no such PTX there).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import interpreted


def _pdl_supported() -> bool:
    if interpreted() or PDL_MODE not in ("1", "2"):
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL_MODE = os.environ.get("NINFER_PDL", "0")  # 0 off, 1 release at kernel start, 2 release after the wait
PDL_ENABLED = _pdl_supported()
LAUNCH = {"launch_pdl": True} if PDL_ENABLED else {}  # keyword arguments of every kernel launch
_PDL = tl.constexpr(PDL_ENABLED)
_RELEASE_AT_START = tl.constexpr(PDL_MODE == "1")


@triton.jit
def pdl_release():
    """Let the next kernel in the stream launch (it still waits for this grid before reading)."""
    if _PDL:
        if _RELEASE_AT_START:
            gdc_launch_dependents()


@triton.jit
def pdl_wait():
    """Wait until the previous kernel in the stream has finished and its writes are visible."""
    if _PDL:
        gdc_wait()
        if not _RELEASE_AT_START:  # this grid's predecessor is done: one kernel may now run ahead
            gdc_launch_dependents()
