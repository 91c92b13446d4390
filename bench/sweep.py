"""Tile-size sweep for the GEMV and attention kernels on the device (prints the best per shape)."""

import itertools
import json
import sys

import torch

from bench.gpu_check import bench_ms, copy_bandwidth, random_packed
from runtime.kernels import paged_attention as pa
from runtime.kernels import qlinear as ql
from runtime.kv.codecs import CODECS


def main():
    peak = copy_bandwidth()
    out = {"peak_GBps": peak / 1e9, "gemv": [], "attention": []}
    for label, n, k, fmt in [("gate_up Q4", 34816, 5120, "Q4G64_F16S"), ("down Q5", 5120, 17408, "Q5G64_F16S"),
                             ("head Q6", 248320, 5120, "Q6G64_F16S")]:
        w, nbytes = random_packed(n, k, fmt)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        best = None
        for bn, bk, nw in itertools.product((8, 16, 32), (256, 512, 1024), (4, 8)):
            ql.VEC_TUNING.update(block_n=bn, block_k=bk, num_warps=nw)
            try:
                ms = bench_ms(lambda: ql.qlinear(x, w), reps=20)
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is just skipped
                print("skip", label, bn, bk, nw, type(exc).__name__, flush=True)
                continue
            frac = nbytes / (ms * 1e-3) / peak
            out["gemv"].append({"op": label, "block_n": bn, "block_k": bk, "num_warps": nw, "us": ms * 1e3, "frac": frac})
            if best is None or frac > best[0]:
                best = (frac, bn, bk, nw, ms * 1e3)
        print("GEMV", label, "best", best, flush=True)
    with open(sys.argv[1] + "/sweep.json", "w") as f:
        json.dump(out, f, indent=1)
    if len(sys.argv) > 2 and sys.argv[2] == "gemv-only":
        return
    hq, hkv, d, ctx = 24, 4, 256, 65536
    pages = ctx // 64
    for name in ("int8", "rk4v4-e8", "rk2v4-e8", "nvfp4"):
        c = CODECS[name]
        pool = {}
        for p in c.planes(d):
            shape = (pages, 64, hkv, p.width)
            pool[p.name] = ((torch.randn(shape, device="cuda") * 0.01).to(p.dtype) if p.dtype == torch.float16
                            else torch.randint(0, 120, shape, device="cuda").to(p.dtype))
        bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
        cl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
        best = None
        for bn, nw in itertools.product((16, 32, 64), (4, 8)):
            pa.ATTENTION_TUNING.update(block_n=bn, num_warps=nw)
            try:
                ms = bench_ms(lambda: pa.paged_attention(q, pool, c, bt, cl, d ** -0.5), reps=20)
            except Exception as exc:  # noqa: BLE001
                print("skip", name, bn, nw, type(exc).__name__, flush=True)
                continue
            frac = c.bytes_per_token_head(d) * hkv * ctx / (ms * 1e-3) / peak
            out["attention"].append({"codec": name, "block_n": bn, "num_warps": nw, "us": ms * 1e3, "frac": frac})
            if best is None or frac > best[0]:
                best = (frac, bn, nw, ms * 1e3)
        print("ATTN", name, "best", best, flush=True)
    with open(sys.argv[1] + "/sweep.json", "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
