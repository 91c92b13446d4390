"""H64 rotation of every 64-element group of the last dimension (specs/kv-codecs.md §2), one launch.

The rotated KV codecs rotate keys and values before encoding, queries before attention and the
attention output back; as torch ops each rotation was a float copy plus a small matmul, about a dozen
launches per attention layer per decode step. One program rotates one group in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kv.hadamard import hadamard_on_device, rotate_groups
from . import torch_path
from .launch import LAUNCH, pdl_wait


@triton.jit
def rotate_group64(x, h_ptr):
    """x [64] float32 -> x @ H64 (h_ptr: the row-major normalized matrix)."""
    i = tl.arange(0, 64)
    h = tl.load(h_ptr + i[:, None] * 64 + i[None, :])
    return tl.sum(x[:, None] * h, axis=0)  # y_j = sum_i x_i H_ij


@triton.jit
def _rotate64_kernel(x_ptr, h_ptr, y_ptr):
    pdl_wait()
    group = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, 64)
    y = rotate_group64(tl.load(x_ptr + group * 64 + i).to(tl.float32), h_ptr)
    tl.store(y_ptr + group * 64 + i, y.to(y_ptr.dtype.element_ty))


def rotate64(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., D] with D a multiple of 64 -> x with H64 applied per group (float32 math, out_dtype or x's)."""
    if x.shape[-1] % 64:
        raise ValueError(f"rotate64: last dimension {x.shape[-1]} is not a multiple of 64")
    if torch_path(x):
        return rotate64_reference(x, out_dtype)
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x.numel():
        _rotate64_kernel[(x.numel() // 64,)](x, hadamard_on_device(64, str(x.device)), y, num_warps=2, **LAUNCH)
    return y


def rotate64_reference(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return rotate_groups(x).to(out_dtype or x.dtype)
