"""Decode GEMV side by side at 27B shapes, as a fraction of the copy bandwidth measured in the same
run. `sweep`: the float kernel vs the dp4a kernel over a tile sweep (T = 1), with the dp4a kernel's
error against the exact float product. `rows`: verify-sized blocks (T = 2, 4, 8, 16) through the
tensor-core kernel (float dequantization), the dp4a row-block kernel and the int8 tensor-core kernel,
and T = 1 for scale; CUDA-graph replays, so launch overhead is not in the times. `t1`: the decode
product as the model runs it (x already in dp4a words, K-split partials left for the next norm)
graph-replayed over a sweep of tiles and of the program target that sets the K-splits.

    PYTHONPATH=. python bench/gemv_compare.py OUT.json [sweep|rows|t1]
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.gpu_check import bench_ms, copy_bandwidth, random_packed
from runtime.kernels import qlinear as ql
from runtime.kernels.qgemv_int8 import QuantizedX, qgemv_int8

SHAPES = [("gdn qkvz Q4", 16384, 5120, "Q4G64_F16S"), ("mlp gate_up Q4", 34816, 5120, "Q4G64_F16S"),
          ("mlp down Q5", 5120, 17408, "Q5G64_F16S"), ("gdn out Q5", 5120, 6144, "Q5G64_F16S"),
          ("head Q6", 248320, 5120, "Q6G64_F16S"), ("shared W8", 1024, 2048, "W8G32_F16S")]


def _split(w, block_n, block_k):
    return ql.k_splits(-(-w.rows // block_n), w.k_pad // block_k, ql.TARGET_PROGRAMS)


def _xy(t: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """t rows of random x [t, k] and an output [t, n], bf16 on the GPU."""
    return torch.randn(t, k, device="cuda", dtype=torch.bfloat16), torch.empty(t, n, device="cuda", dtype=torch.bfloat16)


# the down product's shape in Q4: tells the Q5 format's cost apart from the shape's (few rows, long K)
T1_EXTRA = [("mlp down shape Q4", 5120, 17408, "Q4G64_F16S")]


def _matrices(extra=()):
    """Each 27B-shaped random packed weight with its byte count and the start of its result row."""
    for label, n, k, fmt in [*SHAPES, *extra]:
        w, nbytes = random_packed(n, k, fmt)
        yield w, nbytes, {"op": label, "N": n, "K": k, "bytes": nbytes}


def _save(out: str, peak: float, rows: list) -> None:
    with open(out, "w") as f:
        json.dump({"copy_GBps": peak / 1e9, "rows": rows}, f, indent=1)


def rows_main(out: str) -> None:
    from bench.attention_compare import graph_ms  # CUDA-graph replays: no launch overhead in the timing

    peak = copy_bandwidth()
    rows = []
    for w, nbytes, row in _matrices():
        n, k = w.rows, w.cols
        x1, y1 = _xy(1, k, n)
        t1 = graph_ms(lambda: ql.qlinear(x1, w, out=y1)) * 1e3
        row.update(t1_us=t1, t1_frac=nbytes / (t1 * 1e-6) / peak)
        for t in (2, 4, 8, 16):
            x, y = _xy(t, k, n)
            single = torch.cat([ql.qlinear(x[i : i + 1], w) for i in range(t)]).float()
            for path in ("tensor", "int8", "mma", "auto"):
                ql.ROWS_PATH = path
                us = graph_ms(lambda: ql.qlinear(x, w, out=y)) * 1e3
                row[f"t{t}_{path}_us"] = us
                row[f"t{t}_{path}_frac"] = nbytes / (us * 1e-6) / peak
                row[f"t{t}_{path}_vs_single"] = ((ql.qlinear(x, w).float() - single).abs().max() / single.abs().max()).item()
            if t == 4 and w.fmt.bits in (4, 5, 6):  # int8 tensor-core tiles: rows, warps, groups per step, stages
                ql.ROWS_PATH = "mma"
                default = dict(ql.ROWS_MMA_TUNING)
                for bn, nw, gs, st in ((64, 4, 1, 3), (128, 4, 2, 3), (128, 4, 1, 4), (128, 4, 2, 4), (128, 8, 2, 3),
                                       (256, 8, 1, 3), (64, 4, 2, 4)):
                    ql.ROWS_MMA_TUNING.update(block_n=bn, num_warps=nw, groups_per_step=gs, num_stages=st)
                    try:
                        row[f"t{t}_mma_{bn}x{nw}g{gs}s{st}_us"] = graph_ms(lambda: ql.qlinear(x, w, out=y)) * 1e3
                    except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
                        row[f"t{t}_mma_{bn}x{nw}g{gs}s{st}_us"] = -1.0
                        print("tile failed", bn, nw, gs, st, type(exc).__name__, str(exc)[:200], flush=True)
                ql.ROWS_MMA_TUNING.update(default)
        ql.ROWS_PATH = "auto"
        rows.append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    _save(out, peak, rows)


def t1_main(out: str) -> None:
    from bench.attention_compare import graph_ms

    peak = copy_bandwidth()
    rows = []
    for w, nbytes, row in _matrices(T1_EXTRA):
        x, y = _xy(1, w.cols, w.rows)
        bits = w.fmt.bits
        # as in the model: x arrives as dp4a words from its producer, K-split partials go to the next norm
        xq = QuantizedX.empty(1, w, x.device).fill(x)

        def product():
            ql.qlinear(x, w, out=y, xq=xq, defer_sum=True)

        row["default_tile"] = list(ql._int8_tiles(w))
        row["default_us"] = graph_ms(product) * 1e3
        row["default_frac"] = nbytes / (row["default_us"] * 1e-6) / peak
        saved, programs, wide = dict(ql.INT8_TUNING_BY_BITS), ql.INT8_TARGET_PROGRAMS, ql.INT8_WIDE_ROWS
        ql.INT8_WIDE_ROWS = 1 << 62  # the swept tile applies to every shape
        for (bn, nw), bk, target in itertools.product(((16, 4), (32, 4), (32, 8), (64, 4), (64, 8)), (256, 512, 1024),
                                                     (512, 1024, 2048)):
            if w.k_pad % bk:
                continue
            ql.INT8_TUNING_BY_BITS[bits] = {"block_n": bn, "block_k": bk, "num_warps": nw}
            ql.INT8_TARGET_PROGRAMS = target
            try:
                row[f"{bn}x{bk}w{nw}p{target}_us"] = graph_ms(product) * 1e3
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
                print("tile failed", row["op"], bn, bk, nw, type(exc).__name__, str(exc)[:200], flush=True)
        ql.INT8_TUNING_BY_BITS.clear()
        ql.INT8_TUNING_BY_BITS.update(saved)
        ql.INT8_TARGET_PROGRAMS, ql.INT8_WIDE_ROWS = programs, wide
        tiles = {key: v for key, v in row.items() if key[0].isdigit()}
        best = min(tiles, key=tiles.get)
        row.update(best_tile=best, best_us=tiles[best], best_frac=nbytes / (tiles[best] * 1e-6) / peak)
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    _save(out, peak, rows)


def main(out: str, mode: str = "sweep") -> None:
    if mode == "rows":
        return rows_main(out)
    if mode == "t1":
        return t1_main(out)
    peak = copy_bandwidth()
    rows = []
    for w, nbytes, row in _matrices():
        label, n, k = row["op"], w.rows, w.cols
        x, y = _xy(1, k, n)
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
        row.update(float_us=ms_float * 1e3, float_frac=nbytes / (ms_float * 1e-3) / peak, int8_us=ms * 1e3,
                   int8_frac=nbytes / (ms * 1e-3) / peak, speedup=ms_float / ms, best_tile=[bn, bk, nw, split, pre],
                   int8_rel_err_vs_exact=err)
        x4, y4 = _xy(4, k, n)  # an MTP3 verify block
        ql.ROWS_PATH = "tensor"
        ms_t4 = bench_ms(lambda: ql.qlinear(x4, w, out=y4))
        ql.ROWS_PATH = "auto"
        row.update(t4_tensor_us=ms_t4 * 1e3, t4_tensor_frac=nbytes / (ms_t4 * 1e-3) / peak)
        rows.append(row)
        print(json.dumps(row), flush=True)
    _save(out, peak, rows)


if __name__ == "__main__":
    main(*sys.argv[1:3])
