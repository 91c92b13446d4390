"""Decode GEMV side by side at 27B shapes, as a fraction of the copy bandwidth measured in the same
run. `sweep`: the float kernel vs the dp4a kernel over a tile sweep (T = 1), with the dp4a kernel's
error against the exact float product. `rows`: row blocks (T = 2, 4, 8, 16: lanes, verify blocks)
through the int8 tensor-core kernel and the bf16 tensor-core kernel (tile sweep), next to T = 1; `lanes`:
the lanes kernel against the int8 tensor-core one at T = 2, 3, 4, 8; `float_codes`: the NVFP4 / FP8-row
products (upstream's nvfp4 profile, dequantized in-kernel) over a tile sweep at T = 1 and 4, next to the Q4 product;
CUDA-graph replays, so launch overhead is not in the times. `frag`: the fragment kernels (Q4/Q5, T = 1..16;
over the artifact's planes and over planes in fragment order) over a tile sweep next to the runtime's other
products. `shapes`: the fragment-order kernel at T = 1..16 over its shape options (1, 2 or 4 warps sharing K,
the loop's shape, the engine's measured choice, x loaded ahead), called as the engine calls it. `fields`: that
kernel as the engine runs it over the Q5 products in pair order and as 5-bit fields (NINFER_Q5_FIELDS), x ahead
by the rule and as pair order takes it, and with the registers capped (NINFER_FIELDS_REGS). `head`: the Q6
output head's row blocks on the runtime's path against the fragment-order kernel over a copy. `w8`: W8 products
(DFlash2 drafter, MTP input projection, shared expert) on the runtime's path against the int8 fragment kernel. `t1`: the decode
product as the model runs it (x already in dp4a words, K-split partials left for the next norm)
graph-replayed over a sweep of tiles and of the program target that sets the K-splits.

    PYTHONPATH=. python bench/gemv_compare.py OUT.json [sweep|rows|lanes|t1|float_codes|frag|shapes|head|fields]

NINFER_BENCH_SHAPES=35b takes the 35B-A3B's dense layer products instead of the 27B's.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import sys

import torch

from bench.gpu_check import bench_ms, copy_bandwidth, random_packed
from runtime.kernels import qlinear as ql
from runtime.kernels.qgemv_int8 import QuantizedX, qgemv_int8

SHAPES = [("gdn qkvz Q4", 16384, 5120, "Q4G64_F16S"), ("mlp gate_up Q4", 34816, 5120, "Q4G64_F16S"),
          ("mlp down Q5", 5120, 17408, "Q5G64_F16S"), ("gdn out Q5", 5120, 6144, "Q5G64_F16S"),
          ("head Q6", 248320, 5120, "Q6G64_F16S"), ("shared W8", 1024, 2048, "W8G32_F16S")]
# NINFER_BENCH_SHAPES=35b: the 35B-A3B's dense layer products instead, in the same slots (hidden 2,048: its Q5
# output projections, 2,048 x 4,096, ran at ~0.32 of copy in a one-lane step, session 41)
if os.environ.get("NINFER_BENCH_SHAPES") == "35b":
    SHAPES = [("gdn qkvz Q4", 12288, 2048, "Q4G64_F16S"), ("attention qgkv Q4", 9216, 2048, "Q4G64_F16S"),
              ("gdn out Q5", 2048, 4096, "Q5G64_F16S"), ("attention out Q5", 2048, 4096, "Q5G64_F16S"),
              ("head Q6", 248320, 2048, "Q6G64_F16S"), ("shared W8", 1024, 2048, "W8G32_F16S")]


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


ROWS_SHAPES = [*SHAPES[:5], ("mlp gate_up W8", 34816, 5120, "W8G32_F16S"), ("mlp gate_up Q6", 34816, 5120, "Q6G64_F16S")]
# bf16 row kernel tiles: rows per program, warps, pipeline stages, target programs (sets the K splits),
# prefetch by hand (else triton's pipeliner)
BF16_TILES = [(128, 4, 3, 512, False), (128, 4, 4, 512, False), (64, 4, 3, 1024, False), (64, 4, 4, 1024, False),
              (256, 8, 3, 512, False), (128, 8, 3, 1024, False), (128, 4, 1, 512, True)]


def _rotating(label: str, n: int, k: int, fmt: str):
    """A random weight, its bytes, the start of its result row, and a timer (µs per call, CUDA-graph replays)
    that cycles a call through copies of the weight: >= 256 MB, so no replay reads them from L2."""
    from bench.attention_compare import graph_ms

    w, nbytes = random_packed(n, k, fmt)
    ws = [w] + [random_packed(n, k, fmt)[0] for _ in range(-(-(256 << 20) // nbytes) - 1)]

    def rotating(fn):
        cycle = itertools.cycle(ws)
        return graph_ms(lambda: fn(next(cycle))) * 1e3

    rotating.weights = ws  # for layouts made before a graph is captured
    return w, nbytes, {"op": label, "N": n, "K": k, "bytes": nbytes, "copies": len(ws)}, rotating


def _one_row(rotating, row: dict, peak: float) -> float:
    """The one-row product's µs (the reference the row blocks are compared with), recorded in `row`."""
    x1, y1 = _xy(1, row["K"], row["N"])
    t1 = rotating(lambda w: ql.qlinear(x1, w, out=y1))
    row.update(t1_us=t1, t1_frac=row["bytes"] / (t1 * 1e-6) / peak)
    return t1


def rows_main(out: str) -> None:
    """Row blocks T = 2, 4, 8, 16 side by side with the one-row product: the int8 tensor-core kernel
    (the previous default) and the bf16 tensor-core kernel over a tile sweep; fractions of the copy
    bandwidth, and the bf16 kernel's error against the exact float product."""
    from runtime.kernels.qgemm_rows_bf16 import qgemm_rows_bf16

    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in ROWS_SHAPES:
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        t1 = _one_row(rotating, row, peak)
        for t in (2, 4, 8, 16):
            x, y = _xy(t, k, n)
            if w.fmt.bits != 8:
                ql.ROWS_PATH = "mma"
                us = rotating(lambda w: ql.qlinear(x, w, out=y))
                row[f"t{t}_mma_us"], row[f"t{t}_mma_frac"] = us, nbytes / (us * 1e-6) / peak
            ql.ROWS_PATH = "auto"
            best = None
            for bn, nw, st, programs, pre in BF16_TILES:
                split = ql.k_splits(-(-n // bn), w.groups_per_row, programs)
                tile = f"{bn}x{nw}s{st}p{programs}{'f' if pre else ''}"
                try:
                    us = rotating(lambda w: qgemm_rows_bf16(x, w, y, bn, split, nw, st, pre))
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported
                    print("tile failed", label, tile, type(exc).__name__, str(exc)[-600:], flush=True)
                    continue
                row[f"t{t}_bf16_{tile}_us"] = us
                if best is None or us < best[0]:
                    best = (us, tile)
            if best:
                row[f"t{t}_bf16_best_us"], row[f"t{t}_bf16_best_tile"] = best
                row[f"t{t}_bf16_frac"] = nbytes / (best[0] * 1e-6) / peak
                row[f"t{t}_bf16_vs_t1"] = best[0] / t1
            if t == 8:
                exact = ql.qlinear_reference(x.float(), w)  # float32: not rounded to bf16
                got = qgemm_rows_bf16(x, w, torch.empty(t, n, device="cuda"), 128, 1, 4)
                row["t8_bf16_rel_err_vs_exact"] = ((got - exact).abs().max() / exact.abs().max()).item()
        rows.append(row)
        summary = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                   if not re.search(r"_bf16_\d+x", k)}
        print(json.dumps(summary), flush=True)
    _save(out, peak, rows)


def lanes_main(out: str) -> None:
    """Row blocks T = 2, 3, 4, 8 (and 16 on the tensor cores) side by side with the one-row product: the lanes
    kernel (the decode GEMV's arithmetic, each weight word unpacked once for every row) against the int8
    tensor-core kernel; fractions of the copy bandwidth, and whether each row equals its decode product."""
    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in ROWS_SHAPES:
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        t1 = _one_row(rotating, row, peak)
        for t in (2, 3, 4, 8, 16):
            x, y = _xy(t, k, n)
            for path in ("lanes", "mma") if w.fmt.bits != 8 else ("lanes", "tensor"):
                if path == "lanes" and t > 8:
                    continue
                ql.ROWS_PATH = path
                us = rotating(lambda w: ql.qlinear(x, w, out=y))
                row[f"t{t}_{path}_us"], row[f"t{t}_{path}_vs_t1"] = us, us / t1
                row[f"t{t}_{path}_frac"] = nbytes / (us * 1e-6) / peak
            ql.ROWS_PATH = "lanes"
            if t <= 8:
                block = ql.qlinear(x, w)
                single = torch.cat([ql.qlinear(x[i : i + 1], w) for i in range(t)])
                row[f"t{t}_lanes_equals_decode"] = bool(torch.equal(block, single))
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


def float_codes_main(out: str) -> None:
    from format.float_codes import geometry
    from runtime.kernels.float_gemv import TUNING, float_codes, launch_float_gemv

    peak = copy_bandwidth()
    rows = []
    for label, n, k, _ in [SHAPES[0], SHAPES[1], SHAPES[2]]:
        q4, q4_bytes = random_packed(n, k, "Q4G64_F16S")
        x1, y1 = _xy(1, k, n)
        q4_us = bench_ms(lambda: ql.qlinear(x1, q4, out=y1)) * 1e3
        for fmt in ("NVFP4", "FP8_E4M3FN_ROW_BF16S"):
            geo = geometry(fmt, n, k)
            raw = torch.randint(0, 0x70, (geo.total_bytes,), dtype=torch.uint8, device="cuda")
            w = float_codes(fmt, raw, n, k)
            if fmt == "NVFP4":
                w.divisors.fill_(64.0)
            for t in (1, 4):
                x, y = _xy(t, k, n)
                best = None
                for bn, bk, nw in itertools.product((32, 64, 128), (128, 256), (4, 8)):
                    if k % bk:
                        continue
                    ms = bench_ms(lambda: launch_float_gemv(x, w, y, bn, bk, nw))
                    if best is None or ms < best[0]:
                        best = (ms, bn, bk, nw)
                ms, bn, bk, nw = best
                row = {"op": label, "format": fmt, "T": t, "bytes": geo.total_bytes, "us": ms * 1e3,
                       "frac_of_copy": geo.total_bytes / (ms * 1e-3) / peak, "tile": [bn, bk, nw],
                       "q4_t1_us": q4_us, "q4_t1_frac": q4_bytes / (q4_us * 1e-6) / peak, "default_tile": dict(TUNING)}
                rows.append(row)
                print(json.dumps({k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()}), flush=True)

    _save(out, peak, rows)


FRAG_SHAPES = [*SHAPES[:4]] if os.environ.get("NINFER_BENCH_SHAPES") == "35b" else \
    [*SHAPES[:4], ("attention qgkv Q4", 14336, 5120, "Q4G64_F16S")]
FRAG_TILES = [(hint, warps, programs) for hint in (0, 2, 3) for warps, programs in ((4, 528), (4, 1056), (8, 528))]


def frag_main(out: str) -> None:
    """The fragment kernels (Q4/Q5 code words straight into tensor-core fragments) at T = 1, 2, 4, 8, 16: over
    the artifact's planes (`frag`, qgemm_rows_frag) and over planes permuted into fragment order (`layout`,
    qgemm_fragment_layout); T = 1 and 8 over a sweep of (cache hint, warps, programs), the best of those at
    the other T; `lanes`: fragment order with the artifact's lane order inside code words (the kernel before pair
    order, at layout's best tile); `int8`: the int8 fragment kernel (qgemm_fragment_int8: planes in byte order, x
    as dp4a words written beforehand, as its producer would). Side by side with the products the runtime takes with the fragment kernels off (T = 1: the
    dp4a decode GEMV; T >= 2: the lanes / int8 tensor-core row path); CUDA-graph replays over weight copies
    that never hit L2; each kernel's error against the plain-torch group sums (frag_reference)."""
    import copy

    from runtime.kernels.qgemm_fragment_int8 import qgemm_fragment_int8
    from runtime.kernels.qgemm_fragment_layout import fragment_planes, qgemm_fragment_layout
    from runtime.kernels.qgemm_rows_frag import HINTS, frag_reference, qgemm_rows_frag
    from runtime.kernels.qgemv_int8 import QuantizedX

    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in FRAG_SHAPES:
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        ql.FRAG_MODE = "off"
        t1 = _one_row(rotating, row, peak)
        planes = {}

        def layout_of(w, order="pairs"):
            if (id(w), order) not in planes:
                planes[id(w), order] = fragment_planes(w, order)
            return planes[id(w), order]

        def bytes_of(w):  # a PackedLinear whose planes are in byte order (the int8 kernel's)
            if (id(w), "int8") not in planes:
                laid = copy.copy(w)
                laid.fragment = layout_of(w, "bytes")
                planes[id(w), "int8"] = laid
            return planes[id(w), "int8"]

        for copy_ in rotating.weights:  # every copy's layouts before any capture (a capture would replay them)
            layout_of(copy_), layout_of(copy_, "lanes"), bytes_of(copy_)
        words = {}

        def words_of(x, w):  # x's dp4a words, as the kernel producing x writes them (outside the timing)
            if id(x) not in words:
                words[id(x)] = (x, QuantizedX.empty(x.shape[0], w, x.device).fill(x))
            return words[id(x)][1]

        kernels = {"frag": lambda x, w, y, tile: qgemm_rows_frag(x, w, y, tile[1], tile[2], hint=tile[0]),
                   "layout": lambda x, w, y, tile: qgemm_fragment_layout(x, layout_of(w), y, tile[1], tile[2], tile[0],
                                                                         ksplit=tile[3], xahead=tile[4]),
                   "lanes": lambda x, w, y, tile: qgemm_fragment_layout(x, layout_of(w, "lanes"), y, tile[1], tile[2],
                                                                        tile[0], ksplit=tile[3], xahead=tile[4]),
                   "int8": lambda x, w, y, tile: qgemm_fragment_int8(x, bytes_of(w), y, words_of(x, w), tile[1], tile[2],
                                                                     tile[0], ksplit=tile[3])}
        # layout: warps per block chosen per product (k0), K split across programs only (k1), x a chunk ahead (x1)
        sweeps = {"frag": FRAG_TILES, "layout": [(*tile, 0, 0) for tile in FRAG_TILES]
                  + [(2, 4, 528, 1, 0), (2, 4, 1056, 1, 0), (2, 4, 528, 0, 1), (2, 4, 528, 4, 1)],
                  "int8": [(*tile, 0, 0) for tile in FRAG_TILES] + [(2, 4, 528, 1, 0), (2, 4, 1056, 1, 0)]}

        def label(tile):
            return "h{}w{}p{}".format(*tile) + ("k{}x{}".format(*tile[3:]) if len(tile) > 3 else "")

        best_of = {}
        for t in (1, 8, 2, 4, 16):
            x, y = _xy(t, k, n)
            words_of(x, w)
            if t > 1:
                us = rotating(lambda w: ql.qlinear(x, w, out=y))
                row[f"t{t}_off_us"], row[f"t{t}_off_vs_t1"] = us, us / t1
            for name, kernel in kernels.items():
                if name == "lanes":
                    tiles = [best_of["layout", t]]
                else:
                    tiles = sweeps[name] if t in (1, 8) else [best_of[name, 1 if t < 8 else 8]]
                best = None
                for tile in tiles:
                    us = rotating(lambda w: kernel(x, w, y, tile))
                    row[f"t{t}_{name}_{label(tile)}_us"] = us
                    if best is None or us < best[0]:
                        best = (us, tile)
                best_of[name, t] = best[1]
                row[f"t{t}_{name}_us"], row[f"t{t}_{name}_tile"] = best[0], label(best[1])
                row[f"t{t}_{name}_frac"], row[f"t{t}_{name}_vs_t1"] = nbytes / (best[0] * 1e-6) / peak, best[0] / t1
                got = kernel(x, w, torch.empty(t, n, device="cuda", dtype=torch.float32), best[1])
                want = frag_reference(x, w)
                row[f"t{t}_{name}_err_vs_reference"] = ((got - want).abs().max() / want.abs().max()).item()
        ql.FRAG_MODE = "auto"
        planes.clear()
        words.clear()
        rows.append(row)
        print(json.dumps({k2: (round(v, 4) if isinstance(v, float) else v) for k2, v in row.items()
                          if not re.search(r"_h\d+w\d+p\d+(k\d+x\d+)?_us", k2)}), flush=True)
    print("hints:", HINTS, flush=True)
    _save(out, peak, rows)


def shapes_main(out: str) -> None:
    """The fragment-order kernel at T = 1..16 (one or two mma column tiles) per 27B product, called as the engine
    calls it (MLP down and GDN out leave their K-split partials to the next norm: defer_sum): fragment_shape's loop
    alone ("loop": NINFER_FRAGMENT_KS_RULE=off), 1, 2 or 4 warps sharing each block's K, the shape the engine
    picks ("chosen": the measured rule, x in place), and that shape with x loaded a chunk ahead ("xahead", T <= 8;
    "xwide", 9-16 rows: the first column tile's x; "xwide4": that with 4 warps sharing K; "split" / "splitx": 9-16
    rows' two column tiles on twice the warps, x in place / ahead), and every measured rule ("engine"; at half / twice
    the program target: "p264" / "p1056"); µs and fraction of copy.
    The "chosen" columns keep x in place; the engine's own rule is loads_x_ahead."""
    from runtime.kernels import qgemm_fragment_layout as fl

    peak = copy_bandwidth()
    rows = []
    setting = fl.FRAGMENT_KS_RULE
    one = {"tiles": 1}  # 9-16 rows: both column tiles in each warp
    variants = {"loop": {"xahead": 0, **one}, "ks1": {"ksplit": 1, "xahead": 0, **one},
                "ks2": {"ksplit": 2, "xahead": 0, **one}, "ks4": {"ksplit": 4, "xahead": 0, **one},
                "chosen": {"xahead": 0, **one},
                "xahead": {"xahead": 1},  # the chosen shape, x loaded a chunk ahead (T <= 8; the engine's: a rule)
                "xwide": one,  # 9-16 rows: the chosen shape with the first column tile's x a chunk ahead (xwide)
                "xwide4": {"ksplit": 4, **one},  # the same with 4 warps sharing K (gate_up's shape, where xwide gained)
                "split": {"tiles": 2, "xahead": 0},  # 9-16 rows: the column tiles on twice the warps, x in place
                "splitx": {"tiles": 2, "xahead": 1},  # the same, x a chunk ahead
                "engine": {},  # every measured rule (x ahead, xwide, split tiles): what the engine runs
                "p264": {"programs": 264}, "p1056": {"programs": 1056}}  # the rules at half / twice the programs
    for label, n, k, fmt in FRAG_SHAPES:
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        planes = {id(c): fl.fragment_planes(c) for c in rotating.weights}
        defer = label.startswith(("mlp down", "gdn out"))  # summed by the next rmsnorm in the engine
        for t in (1, 2, 4, 8, 12, 16):
            x, y = _xy(t, k, n)
            for name, kwargs in variants.items():
                if name == "xahead" and t > 8 or name.startswith(("xwide", "split")) and t <= 8:
                    continue
                fl.FRAGMENT_KS_RULE = name != "loop"  # (the ks variants name their warps sharing K themselves)
                wide = fl.FRAGMENT_TUNING["xwide"]
                rules = name == "engine" or name.startswith("p")
                fl.FRAGMENT_TUNING["xwide"] = 1 if name.startswith("xwide") else wide if rules else 0
                us = rotating(lambda w: fl.qgemm_fragment_layout(x, planes[id(w)], y, defer_sum=defer, **kwargs))
                fl.FRAGMENT_TUNING["xwide"] = wide
                row[f"t{t}_{name}_us"], row[f"t{t}_{name}_frac"] = us, nbytes / (us * 1e-6) / peak
            fl.FRAGMENT_KS_RULE = True
            row[f"t{t}_chosen_shape"] = fl.layout_shape(planes[id(w)], t, defer_sum=defer)
            fl.FRAGMENT_KS_RULE = setting
        rows.append(row)
        print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()}), flush=True)
    _save(out, peak, rows)


def _variants_side_by_side(row: dict, y: torch.Tensor, rotating, nbytes: int, peak: float, variants: dict,
                           reference: str) -> None:
    """Time each variant (name -> product(w, out, timed) over weight w into out: as the engine runs it when timed,
    whole float32 sums otherwise) twice, alternated, into y [t, n] and `row` (µs and fraction of copy), then each
    one's largest difference against `reference`'s relative to its largest value."""
    t = y.shape[0]
    for rep in range(2):
        for name, product in variants.items():
            us = rotating(lambda w: product(w, y, True))
            row[f"t{t}_{name}{rep}_us"] = us
            row[f"t{t}_{name}{rep}_frac"] = nbytes / (us * 1e-6) / peak
    outputs = {}
    for name, product in variants.items():
        outputs[name] = torch.zeros(y.shape, device=y.device, dtype=torch.float32)
        product(rotating.weights[0], outputs[name], False)
    for name in outputs:
        if name != reference:
            row[f"t{t}_{name}_err"] = ((outputs[name] - outputs[reference]).abs().max()
                                       / outputs[reference].abs().max()).item()


def _print_row(row: dict) -> None:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) and not k.endswith("err") else v)
                      for k, v in row.items()}), flush=True)


def fields_main(out: str) -> None:
    """The fragment-order kernel as the engine runs it over each Q5 product at T = 1..16: planes in pair order
    ("pairs"), as 5-bit fields with x loaded ahead by the measured rule ("fields", the default), with x loaded ahead
    from 2 to 8 rows as pair order takes it ("fields_x") and so with the registers capped at 128 ("fields_x128",
    NINFER_FIELDS_REGS=128), each variant twice, alternated; µs, fraction of copy, and each variant's largest
    difference against "pairs" relative to the product's largest value (fields are exact: 0)."""
    from runtime.kernels import qgemm_fragment_layout as fl

    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in FRAG_SHAPES:
        if not fmt.startswith("Q5"):
            continue
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        planes = {order: {id(c): fl.fragment_planes(c, order) for c in rotating.weights}
                  for order in ("pairs", "fields")}
        defer = label.startswith(("mlp down", "gdn out"))  # summed by the next rmsnorm in the engine
        for t in (1, 2, 4, 6, 8, 12, 16):
            x, y = _xy(t, k, n)

            def variant(order: str, xahead: int | None, regs: int | None):
                return lambda w, out, timed: fl.qgemm_fragment_layout(x, planes[order][id(w)], out,
                                                                      defer_sum=defer and timed, xahead=xahead,
                                                                      maxnreg=regs)

            _variants_side_by_side(row, y, rotating, nbytes, peak,
                                   {"pairs": variant("pairs", None, None), "fields": variant("fields", None, None),
                                    "fields_x": variant("fields", 2, 0), "fields_x128": variant("fields", 2, 128)},
                                   "pairs")
        rows.append(row)
        _print_row(row)
    _save(out, peak, rows)


def head_main(out: str) -> None:
    """The output head (Q6 248320x5120) at T = 1, 2, 4, 8, 12, 16: the runtime's path on the artifact's planes (T = 1
    the dp4a GEMV, row blocks the int8 tensor-core kernel: "planes") against the fragment-order kernel over a copy of
    the head in fragment order (NINFER_HEAD_FRAGMENT): fragment_shape's loop with x in place ("frag"), x a chunk
    ahead ("xahead", T <= 8; 156 registers against 96), 4 warps sharing K ("ks4"), 9-16 rows' column tiles split
    across warps ("split"); µs and fraction of copy."""
    from runtime.kernels import qgemm_fragment_layout as fl

    peak = copy_bandwidth()
    label, n, k, fmt = SHAPES[4]
    w, nbytes, row, rotating = _rotating(label, n, k, fmt)
    copies = {id(c): fl.fragment_copy(c) for c in rotating.weights}
    variants = {"frag": {"xahead": 0}, "xahead": {"xahead": 1}, "ks4": {"xahead": 0, "ksplit": 4},
                "split": {"xahead": 0, "tiles": 2}}  # 9-16 rows: the column tiles on twice the warps
    for t in (1, 2, 4, 8, 12, 16):
        x, y = _xy(t, k, n)
        us = rotating(lambda w: ql.qlinear(x, w, out=y))
        row[f"t{t}_planes_us"], row[f"t{t}_planes_frac"] = us, nbytes / (us * 1e-6) / peak
        for name, kwargs in variants.items():
            if name == "xahead" and t > 8 or name == "split" and t <= 8:
                continue
            us = rotating(lambda w: fl.qgemm_fragment_layout(x, copies[id(w)], y, **kwargs))
            row[f"t{t}_{name}_us"], row[f"t{t}_{name}_frac"] = us, nbytes / (us * 1e-6) / peak
        print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()
                          if k2.startswith(f"t{t}_")}), flush=True)
    _save(out, peak, [row])


W8_SHAPES = [("dflash2 gate_up W8", 34816, 5120, "W8G32_F16S"), ("dflash2 down W8", 5120, 17408, "W8G32_F16S"),
             ("mtp fc W8", 5120, 10240, "W8G32_F16S"), ("shared gate_up W8", 1024, 2048, "W8G32_F16S")]


def w8_main(out: str) -> None:
    """W8 products (the DFlash2 drafter's, the MTP input projection, the 35B-A3B shared expert) at T = 1, 2, 4, 8,
    12, 16: the runtime's path on the artifact's planes ("planes": the dp4a GEMV, the lanes kernel to 4 rows, the
    dequantizing tensor-core kernel beyond) against the int8 fragment kernel over the planes in byte order
    (NINFER_FRAGMENT_W8), x's dp4a words written beforehand as its producer would ("int8") or quantized in the
    call's own launch ("int8_quantize"), 4 warps sharing K ("ks4", since session 36 W8's default: "int8" the
    same); µs, fraction of copy, relative error against the plain-torch group sums."""
    import copy

    from runtime.kernels.qgemm_fragment_int8 import fragment_int8_reference, qgemm_fragment_int8
    from runtime.kernels.qgemm_fragment_layout import fragment_planes

    peak = copy_bandwidth()
    rows = []
    for label, n, k, fmt in W8_SHAPES:
        w, nbytes, row, rotating = _rotating(label, n, k, fmt)
        laid = {}
        for c in rotating.weights:
            laid[id(c)] = copy.copy(c)
            laid[id(c)].fragment = fragment_planes(c, "bytes")
        for t in (1, 2, 4, 8, 12, 16):
            x, y = _xy(t, k, n)
            words = QuantizedX.empty(t, w, x.device).fill(x)
            want = fragment_int8_reference(x, w)
            got = qgemm_fragment_int8(x, laid[id(w)], torch.empty(t, n, device="cuda", dtype=torch.float32), words)
            row[f"t{t}_int8_err"] = ((got.float() - want).abs().max() / want.abs().max()).item()
            for name, fn in {"planes": lambda w: ql.qlinear(x, w, out=y),
                             "int8": lambda w: qgemm_fragment_int8(x, laid[id(w)], y, words),
                             "int8_quantize": lambda w: qgemm_fragment_int8(x, laid[id(w)], y),
                             "ks4": lambda w: qgemm_fragment_int8(x, laid[id(w)], y, words, ksplit=4)}.items():
                us = rotating(fn)
                row[f"t{t}_{name}_us"], row[f"t{t}_{name}_frac"] = us, nbytes / (us * 1e-6) / peak
            print(json.dumps({k2: (round(v, 3) if isinstance(v, float) else v) for k2, v in row.items()
                              if k2.startswith(f"t{t}_") or k2 == "op"}), flush=True)
        rows.append(row)
    _save(out, peak, rows)


def main(out: str, mode: str = "sweep") -> None:
    if mode == "shapes":
        return shapes_main(out)
    if mode == "head":
        return head_main(out)
    if mode == "fields":
        return fields_main(out)
    if mode == "w8":
        return w8_main(out)
    if mode == "frag":
        return frag_main(out)
    if mode == "float_codes":
        return float_codes_main(out)
    if mode == "rows":
        return rows_main(out)
    if mode == "lanes":
        return lanes_main(out)
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
