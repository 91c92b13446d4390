"""T = 1 nibble GEMV on the H200 at 27B shapes: the FMA "vec" kernel against the group-step kernel
over a small tuning grid; achieved bytes/s against the copy ceiling measured in the same run.

    PYTHONPATH=. python bench/gemv_group_sweep.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.gpu_check import bench_ms, copy_bandwidth, random_packed
from runtime.kernels import qlinear as q

SHAPES = [("mlp/gate_up", 34816, 5120, "Q4G64_F16S"), ("mlp/down", 5120, 17408, "Q5G64_F16S"),
          ("gdn/qkvz", 16384, 5120, "Q4G64_F16S"), ("attention/qgkv", 14336, 5120, "Q4G64_F16S"),
          ("output_head", 248320, 5120, "Q6G64_F16S")]


def main(out: str) -> None:
    peak = copy_bandwidth()
    rows = []
    for name, n, k, fmt in SHAPES:
        w, nbytes = random_packed(n, k, fmt)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        want = q.qlinear_reference(x, w).float()
        q.T1_NIBBLE_PATH = "vec"
        vec_ms = bench_ms(lambda: q.qlinear(x, w))
        best = None
        for block_n, unroll, warps, programs in itertools.product((32, 64, 128), (1, 2, 4), (4, 8), (512,)):
            q.T1_NIBBLE_PATH = "group"
            q.GROUP_TUNING.update(block_n=block_n, unroll=unroll, num_warps=warps)
            q.TARGET_PROGRAMS = programs
            try:
                got = q.qlinear(x, w).float()
            except Exception as exc:  # noqa: BLE001  (a tile that does not compile)
                print(f"{name} {block_n}/{unroll}/{warps}/{programs}: {type(exc).__name__}", flush=True)
                continue
            rel = ((got - want).norm() / want.norm()).item()
            ms = bench_ms(lambda: q.qlinear(x, w))
            row = {"shape": name, "n": n, "k": k, "fmt": fmt, "block_n": block_n, "unroll": unroll, "num_warps": warps,
                   "programs": programs, "us": ms * 1000, "of_copy": nbytes / (ms / 1000) / peak, "rel_err": rel}
            rows.append(row)
            if rel < 2e-2 and (best is None or ms < best["us"] / 1000):
                best = row
        q.TARGET_PROGRAMS = 512
        print(f"{name}: vec {vec_ms * 1000:.1f} us ({nbytes / (vec_ms / 1000) / peak:.2f} of copy); best group "
              f"{best['us']:.1f} us ({best['of_copy']:.2f}) at block_n {best['block_n']} unroll {best['unroll']} "
              f"warps {best['num_warps']} programs {best['programs']}", flush=True)
        rows.append({"shape": name, "vec_us": vec_ms * 1000, "vec_of_copy": nbytes / (vec_ms / 1000) / peak})
    # one setting for all shapes: the lowest total time
    combos = {}
    for r in rows:
        if "block_n" in r and r["rel_err"] < 2e-2:
            key = (r["block_n"], r["unroll"], r["num_warps"], r["programs"])
            combos.setdefault(key, []).append(r["us"])
    full = {k: sum(v) for k, v in combos.items() if len(v) == len(SHAPES)}
    best_key = min(full, key=full.get)
    vec_total = sum(r["vec_us"] for r in rows if "vec_us" in r)
    print(f"one setting for all shapes: {best_key} total {full[best_key]:.1f} us vs vec {vec_total:.1f} us", flush=True)
    json.dump({"copy_bytes_per_s": peak, "rows": rows, "best_overall": list(best_key),
               "best_total_us": full[best_key], "vec_total_us": vec_total}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
