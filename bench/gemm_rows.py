"""The vendor bf16 GEMM (x [M, K] @ W.T, the weight cache's products) at row counts around whole tiles: does a
riding chunk of 512 prompt rows + 3 riders (515) cost more than 512 rows? Prints one JSON line per (matrix, M).

    python bench/gemm_rows.py
"""

from __future__ import annotations

import json

import torch
import triton.testing

SHAPES = {"gate_up": (34816, 5120), "qkvz": (16384, 5120), "down": (5120, 17408)}  # the 27B's layer products
ROWS = (128, 131, 253, 256, 259, 384, 509, 512, 515, 1021, 1024, 1027)


def main() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ms = triton.testing.do_bench(lambda: x @ w.T, warmup=25, rep=100)
            print(json.dumps({"matrix": name, "rows": m, "us": round(ms * 1e3, 1),
                              "tflops": round(2 * m * n * k / (ms * 1e-3) / 1e12, 1)}), flush=True)


if __name__ == "__main__":
    main()
