"""Decode GEMV side by side at 27B shapes: the float kernel vs the dp4a kernel (tile sweep), as a
fraction of the copy bandwidth measured in the same run, plus the dp4a kernel's error against the
exact float product at full size.

    PYTHONPATH=. python bench/gemv_compare.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.gpu_check import bench_ms, copy_bandwidth, random_packed
from runtime.kernels import qlinear as ql
from runtime.kernels.qgemv_int8 import qgemv_int8

SHAPES = [("gdn qkvz Q4", 16384, 5120, "Q4G64_F16S"), ("mlp gate_up Q4", 34816, 5120, "Q4G64_F16S"),
          ("mlp down Q5", 5120, 17408, "Q5G64_F16S"), ("gdn out Q5", 5120, 6144, "Q5G64_F16S"),
          ("head Q6", 248320, 5120, "Q6G64_F16S"), ("shared W8", 1024, 2048, "W8G32_F16S")]


def _split(w, block_n, block_k):
    return ql.k_splits(-(-w.rows // block_n), w.k_pad // block_k, ql.TARGET_PROGRAMS)


def main(out: str) -> None:
    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in SHAPES:
        w, nbytes = random_packed(n, k, fmt)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ql.GEMV_PATH = "float"
        ms_float = bench_ms(lambda: ql.qlinear(x, w, out=y))
        exact = ql.qlinear_reference(x, w).float()
        best = None
        tiles = [(bn, bk, nw, True) for bn, bk, nw in itertools.product((16, 32, 64), (256, 512), (4, 8))]
        tiles += [(32, 512, 4, False), (64, 512, 4, False)]  # each program quantizes x itself
        for bn, bk, nw, pre in tiles:
            if w.k_pad % bk:
                continue
            split = _split(w, bn, bk)
            try:
                ms = bench_ms(lambda: qgemv_int8(x, w, y, bn, bk, split, nw, pre))
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is skipped
                print("skip", label, bn, bk, nw, type(exc).__name__, str(exc)[:200], flush=True)
                continue
            print(label, bn, bk, nw, pre, split, f"{ms * 1e3:.1f} us", flush=True)
            if best is None or ms < best[0]:
                best = (ms, bn, bk, nw, split, pre)
        ms, bn, bk, nw, split, pre = best
        got = qgemv_int8(x, w, torch.empty_like(y), bn, bk, split, nw, pre).float()
        err = ((got - exact).abs().max() / exact.abs().max()).item()
        row = {"op": label, "N": n, "K": k, "bytes": nbytes, "float_us": ms_float * 1e3,
               "float_frac": nbytes / (ms_float * 1e-3) / peak, "int8_us": ms * 1e3,
               "int8_frac": nbytes / (ms * 1e-3) / peak, "speedup": ms_float / ms, "best_tile": [bn, bk, nw, split, pre],
               "int8_rel_err_vs_exact": err}
        x4 = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)  # an MTP3 verify block
        y4 = torch.empty(4, n, device="cuda", dtype=torch.bfloat16)
        ms_t4 = bench_ms(lambda: ql.qlinear(x4, w, out=y4))
        row.update(t4_tensor_us=ms_t4 * 1e3, t4_tensor_frac=nbytes / (ms_t4 * 1e-3) / peak)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump({"copy_GBps": peak / 1e9, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
