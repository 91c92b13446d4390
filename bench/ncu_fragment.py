"""One fragment-order product launched a few times (fresh weight copies, so none is read from L2), to run
under Nsight Compute and see where its time goes: stall reasons, issue slots, memory throughput.

    ncu --kernel-name regex:fragment_layout --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section SchedulerStats --section Occupancy \
        python bench/ncu_fragment.py "gdn qkvz Q4" 8 [KS]

PRODUCT is a label of gemv_compare's FRAG_SHAPES; KS (warps sharing K) defaults to the engine's choice."""

from __future__ import annotations

import sys

import torch

from bench.gemv_compare import FRAG_SHAPES, _xy, random_packed
from runtime.kernels import qgemm_fragment_layout as fl


def main(label: str, t: str, ks: str = "") -> None:
    n, k, fmt = next((n, k, fmt) for name, n, k, fmt in FRAG_SHAPES if name == label)
    defer = label.startswith(("mlp down", "gdn out"))
    planes = [fl.fragment_planes(random_packed(n, k, fmt)[0]) for _ in range(4)]
    x, y = _xy(int(t), k, n)
    ksplit = int(ks) if ks else None
    for fp in planes:
        fl.qgemm_fragment_layout(x, fp, y, defer_sum=defer, ksplit=ksplit)
    torch.cuda.synchronize()
    print(label, "T =", t, "shape", fl.layout_shape(planes[0], int(t), ksplit=ksplit, defer_sum=defer))


if __name__ == "__main__":
    main(*sys.argv[1:4])
