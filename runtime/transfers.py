"""Host <-> device transfers that leave the stream running: a decode step is queued behind the one in flight
(chained decode), so nothing on its way may wait for the GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# False: every host-to-device copy of device_ints blocks as torch.tensor(..., device=...) does (the behaviour before
# session 46), for side-by-side timing (bench/engine_ab.py runtime.transfers.QUEUED_COPIES:False); read at call time
QUEUED_COPIES = True


@dataclass
class HostCopy:
    """A device tensor's copy on its way to the host, so a chained step's tokens reach the host while the GPU runs
    the next step: pinned memory behind a CUDA event on a GPU (None on the CPU: the copy is done)."""
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @classmethod
    def start(cls, tensor: torch.Tensor) -> "HostCopy":
        cuda = tensor.is_cuda
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=cuda)
        host.copy_(tensor, non_blocking=cuda)
        ready = torch.cuda.Event() if cuda else None
        if ready is not None:
            ready.record()
        return cls(host, ready)

    def tolist(self) -> list:
        """The values, once the copy has landed (waits for nothing queued after it)."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def device_ints(values: list, device: torch.device | str) -> torch.Tensor:
    """Host ints (a list, or lists of one length) as an int64 tensor on `device`, queued behind the work
    already on the stream. torch.tensor(..., device="cuda") copies through a blocking cudaMemcpy, which
    waits for every kernel queued before it: a decode step chained behind the one in flight would wait
    for it to finish, and the GPU would idle while the host launched the next (~0.1-0.2 ms a step). The
    pinned staging block is not reused before the copy has run (torch's pinned allocator records it)."""
    return to_device(staged_ints(values, device), device)


def staged_ints(values: list, device: torch.device | str) -> torch.Tensor:
    """device_ints without the copy: the ints in pinned host memory when `device` is a GPU, for a caller that copies
    them straight into a buffer of its own (a CUDA graph's static input: one copy instead of two), else the tensor
    device_ints would return (on the CPU; with QUEUED_COPIES off, already on the device by a blocking copy)."""
    if not QUEUED_COPIES:
        return torch.tensor(values, dtype=torch.long, device=device)
    host = torch.tensor(values, dtype=torch.long)
    return host.pin_memory() if torch.device(device).type == "cuda" else host


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`'s kind; a host tensor on its way to a GPU is pinned (staged_ints), so the copy is queued
    behind the stream's work and nothing waits."""
    return tensor if tensor.device.type == torch.device(device).type else tensor.to(device, non_blocking=True)
