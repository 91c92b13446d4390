"""Allocates a MemoryPlan: one device buffer per arena, typed views per region."""

from __future__ import annotations

import numpy as np
import torch

from format.container import Artifact

from .memory_plan import MemoryPlan


class DeviceMemory:
    def __init__(self, plan: MemoryPlan, device: torch.device | str):
        self.plan = plan
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = {}
        self.regions = {}
        for name, arena in plan.arenas.items():
            self.buffers[name] = torch.empty(arena.allocated_bytes, dtype=torch.uint8, device=self.device)
            for r in arena.regions:
                self.regions[(name, r.name)] = r

    def view(self, arena: str, region: str, dtype: torch.dtype, shape) -> torch.Tensor:
        r = self.regions[(arena, region)]
        item = torch.empty((), dtype=dtype).element_size()
        count = int(np.prod(shape)) if len(shape) else 1
        if count * item > r.nbytes:
            raise ValueError(f"view {arena}/{region} of {count * item} bytes exceeds its {r.nbytes}-byte region")
        return self.buffers[arena][r.offset : r.offset + count * item].view(dtype).view(*shape)

    def raw(self, arena: str, region: str) -> torch.Tensor:
        r = self.regions[(arena, region)]
        return self.buffers[arena][r.offset : r.offset + r.nbytes]

    def load_weights(self, art: Artifact) -> None:
        """Copy every resident object's bytes (packed formats stay packed) into the weights arena."""
        for r in self.plan.arenas["weights"].regions:
            host = torch.from_numpy(np.frombuffer(art.raw(r.name), dtype=np.uint8).copy())
            self.raw("weights", r.name).copy_(host)
