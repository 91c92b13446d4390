"""Allocates a MemoryPlan: one device buffer per resident arena, typed views per region (the activation
workspace stays headroom for run-time tensors, see memory_plan.HEADROOM_ARENAS)."""

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
        for name, arena in plan.resident_arenas.items():  # the workspace is headroom, not a buffer
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

    def fill_random(self, art: Artifact, seed: int = 0) -> None:
        """Random weights of plausible scale, generated on the device (benchmarks of full-size shapes
        without real weights): random codes with scales giving ~1/sqrt(cols) weights, random bf16
        matrices, unit norms, GDN decay controls in their trained range; integer tensors are read."""
        from format.layouts import RowSplitGeometry
        from format.numeric import FloatCodeFormat, GroupedFormat, get_format

        gen = torch.Generator(self.device).manual_seed(seed)
        for r in self.plan.arenas["weights"].regions:
            e = art.objects[r.name]
            raw = self.raw("weights", r.name)
            fmt = get_format(e.format)
            if isinstance(fmt, GroupedFormat):
                geo = RowSplitGeometry(e.shape[0], e.shape[1], fmt)
                base, high, scale = geo.split(raw)
                for plane in (base, high):
                    if plane is not None and plane.numel():
                        plane.view(torch.uint8).copy_(torch.randint(0, 256, plane.view(torch.uint8).shape, generator=gen,
                                                                    device=self.device, dtype=torch.uint8))
                code_std = 2 ** fmt.bits / 12 ** 0.5
                scale.view(torch.float16).fill_(1.0 / (e.shape[1] ** 0.5 * code_std))
            elif isinstance(fmt, FloatCodeFormat):  # random codes, scales giving ~1/sqrt(cols)
                from format.float_codes import geometry

                geo = geometry(e.format, e.shape[0], e.shape[1])
                planes = geo.split(raw.view(torch.uint8))
                codes = torch.randint(0, 256, planes[0].shape, generator=gen, device=self.device, dtype=torch.uint8)
                if e.format == "NVFP4":
                    planes[0].copy_(codes)
                    planes[1].fill_(0x38)  # E4M3FN 1.0
                    planes[2].view(torch.float32).fill_(3.0 * e.shape[1] ** 0.5)
                else:
                    planes[0].copy_(codes & 0xDF)  # exponent <= 11: no NaN, |code| <= 30
                    planes[1].view(torch.bfloat16).fill_(0.1 * e.shape[1] ** -0.5)
            elif e.format == "BF16":
                t = raw.view(torch.bfloat16)
                if len(e.shape) == 2:
                    t.copy_(torch.randn(t.shape, generator=gen, device=self.device) * e.shape[1] ** -0.5)
                elif e.component == "dflash2":
                    t.fill_(1.0)  # the drafter's norms are plain w; its conv base kernels pass rows through
                else:
                    t.zero_()  # norms are (1 + w)
            elif e.format == "FP32":
                t = raw.view(torch.float32)
                if r.name.endswith("a_log"):
                    t.copy_(torch.empty(t.shape, device=self.device).uniform_(1.0, 16.0, generator=gen).log())
                else:
                    t.zero_()
            else:
                host = torch.from_numpy(np.frombuffer(art.raw(r.name), dtype=np.uint8).copy())
                raw.copy_(host)
