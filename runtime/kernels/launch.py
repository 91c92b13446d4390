"""Programmatic dependent launch (PDL, Hopper and later): every kernel of this package is launched
with `**LAUNCH` and calls `pdl_wait()` before it touches activations.

Why: a decode step is ~700 small dependent kernels; between two of them the GPU drains one grid, then
launches and ramps up the next (about a microsecond each, even inside a CUDA graph). Under PDL the
next kernel is launched while the current one still runs and waits in `griddepcontrol.wait` until
the current grid has finished and its writes are visible. Before that wait a kernel may only read
what no kernel writes during inference (weights): the quantized GEMV fetches its first weight tile
there, so weight streaming overlaps the tail of the kernel before it.

Where the next kernel is released matters (run 23, 27B Q4, 8K, CUDA-graph decode, one device call):
releasing it right after the wait, so at most one kernel runs ahead of the working one, is 3.5 %
faster than no PDL (137.2 / 136.2 vs 131.9 / 132.1 tok/s); releasing it at each kernel's first
instruction was 5 % slower (125.3; run 22: 127.6 vs 134.0): then a whole chain of later kernels
became resident, held SM slots and prefetched while the current one still ran.

The rule that keeps this correct: a kernel launched with LAUNCH calls `pdl_wait()` before it reads
anything another kernel wrote and before it writes anything (another kernel may still read it).
`tests/test_kernels.py::test_every_launch_waits` checks that every launch site and kernel follows it.
On by default on sm_90 and later; NINFER_PDL=0 turns it off. Never on under the interpreter or on
older GPUs (no such PTX there).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..switches import setting
from . import interpreted


def _pdl_supported() -> bool:
    if interpreted() or setting("NINFER_PDL") == "0":
        return False
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


PDL_ENABLED = _pdl_supported()
LAUNCH = {"launch_pdl": True} if PDL_ENABLED else {}  # keyword arguments of every kernel launch
_PDL = tl.constexpr(PDL_ENABLED)


@triton.jit
def pdl_wait():
    """Wait until the previous kernel in the stream has finished and its writes are visible, then let
    the next kernel launch (released only now, so at most one kernel runs ahead of the working one)."""
    if _PDL:
        gdc_wait()
        gdc_launch_dependents()
