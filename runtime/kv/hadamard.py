"""Sylvester-Hadamard rotations used by the rotated KV codecs (specs/kv-codecs.md §2)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix H_n / sqrt(n) (symmetric, orthogonal, its own inverse)."""
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


@functools.lru_cache(maxsize=16)
def hadamard_on_device(n: int, device: str) -> torch.Tensor:
    # cached per device so CUDA-graph capture never copies from the host
    return hadamard_matrix(n).to(device)


def rotate_groups(x: torch.Tensor, group: int = 64) -> torch.Tensor:
    """Apply H_group inside each consecutive group of the last dimension (H64 in the spec)."""
    shape = x.shape
    h = hadamard_on_device(group, str(x.device))
    y = x.float().reshape(*shape[:-1], shape[-1] // group, group) @ h
    return y.reshape(shape)
