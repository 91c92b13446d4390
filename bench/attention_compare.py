"""Paged decode attention at 27B shapes (24 Q / 4 KV heads x 256) per codec and depth, side by side:
this tree's kernel over a small tile sweep, and (when `.carry/old_paged_attention.py` holds an earlier
version of the module) the earlier kernel; also the KV append (encode + write) per layer, kernel vs torch.

    PYTHONPATH=. python bench/attention_compare.py OUT.json [CODEC,...] [DEPTH,...]
    PYTHONPATH=. python bench/attention_compare.py OUT.json frag      # int4/int8 KV: tl.dot kernel vs fragment kernel
    PYTHONPATH=. python bench/attention_compare.py OUT.json prefill   # a prefill chunk's attention at depth: tiles
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import sys
from pathlib import Path

import torch

from bench.gpu_check import bench_ms, copy_bandwidth
from runtime.kernels import paged_attention as pa
from runtime.kernels.kv_append import SUPPORTED, kv_append
from runtime.kv.codecs import CODECS
from runtime.kernels.hadamard import rotate64

HQ, HKV, D = 24, 4, 256
CODEC_NAMES = ("bf16", "int8", "rk8v4", "rk4v4-e8", "fp8", "nvfp4", "rk2v4-e8")
DEPTHS = (8192, 32768, 131072, 204800)
TILES = [(16, 4), (32, 4), (32, 8), (64, 4), (64, 8), (16, 1), (32, 1), (32, 2), (64, 2)]


def graph_ms(fn, reps=50):
    """Time `fn` replayed from a CUDA graph, as the engine's decode step runs it (no launch gaps)."""
    from runtime.bench import graph_us

    return graph_us(fn, reps) / 1e3


def _old_module():
    path = Path(".carry/old_paged_attention.py")
    if not path.exists():
        return None
    # loaded as a sibling of the current module, so its relative imports (launch, interpreted) resolve
    spec = importlib.util.spec_from_file_location("runtime.kernels.old_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "runtime.kernels"
    spec.loader.exec_module(module)
    return module


def _pool(codec, pages):
    """Pool planes holding real encodings of random vectors (scales and codes in their true ranges)."""
    planes = {}
    chunk = 4096
    for p in codec.planes(D):
        planes[p.name] = torch.empty((pages, 64, HKV, p.width), dtype=p.dtype, device="cuda")
    for first in range(0, pages, chunk // 64):
        n = min(chunk // 64, pages - first)
        k = torch.randn(n, 64, HKV, D, device="cuda")
        v = torch.randn(n, 64, HKV, D, device="cuda")
        for name, value in codec.encode(k, v).items():
            planes[name][first:first + n] = value
    return planes


def main(out_path: str, codecs=CODEC_NAMES, depths=DEPTHS) -> None:
    peak = copy_bandwidth()
    old = _old_module()
    rows = []
    for name in codecs:
        codec = CODECS[name]
        pool = _pool(codec, max(depths) // 64)
        for depth, t in itertools.product(depths, (1, 4)):
            bt = torch.arange(depth // 64, dtype=torch.int32, device="cuda")[None]
            ctx = torch.tensor([depth], dtype=torch.int32, device="cuda")
            q = torch.randn(1, t, HQ, D, device="cuda", dtype=torch.bfloat16)
            kv_bytes = codec.bytes_per_token_head(D) * HKV * depth
            row = {"codec": name, "depth": depth, "t": t, "kv_bytes": kv_bytes}
            ref = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
            for bn, nw in TILES:  # as many warps in flight for every tile: 4,096 / warps programs
                pa.ATTENTION_TUNING.update(block_n=bn, num_warps=nw, programs=4096 // nw)
                try:
                    out = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
                    ms = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                    row[f"new_{bn}x{nw}"] = type(exc).__name__
                    continue
                row[f"new_{bn}x{nw}_us"] = ms * 1e3
                if (bn, nw) == (16, 4):
                    row["new_16x4_graph_us"] = graph_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5)) * 1e3
                row[f"new_{bn}x{nw}_maxdiff"] = (out - ref).abs().max().item()
                if nw <= 2 and depth >= 131072:  # small programs also at a quarter of that (two warps: one wave)
                    pa.ATTENTION_TUNING["programs"] = 1024 // nw
                    row[f"new_{bn}x{nw}_quarter_us"] = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20) * 1e3
            pa.ATTENTION_TUNING.clear()
            if depth >= 131072:  # the default tile at other program counts (396 = 3 per SM x 132 SMs: one wave)
                for target in (396, 528, 1024, 2048, 4096):
                    pa.ATTENTION_TUNING["programs"] = target
                    row[f"programs{target}_us"] = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20) * 1e3
                pa.ATTENTION_TUNING.clear()
            row["default_graph_us"] = graph_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5)) * 1e3
            if t > 1:  # one 32-row query block (default for a 24-row verify block) vs two of 16
                pa.ATTENTION_TUNING["block_m"] = 16
                row["block_m16_graph_us"] = graph_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5)) * 1e3
                pa.ATTENTION_TUNING.clear()
            if old is not None:
                old_out = old.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
                row["old_us"] = bench_ms(lambda: old.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20) * 1e3
                row["old_graph_us"] = graph_ms(lambda: old.paged_attention(q, pool, codec, bt, ctx, D ** -0.5)) * 1e3
                row["old_vs_new_maxdiff"] = (old_out - ref).abs().max().item()
            best = min((v, k) for k, v in row.items() if k.startswith("new_") and k.endswith("_us") and "graph" not in k)
            row["best"], row["best_us"] = best[1], best[0]
            row["best_frac_of_copy"] = kv_bytes / (best[0] * 1e-6) / peak
            rows.append(row)
            print(json.dumps(row), flush=True)
        # a 2,048-token prefill chunk ending at 8K: 64-row blocks (default) vs 16-row blocks
        bt = torch.arange(8192 // 64, dtype=torch.int32, device="cuda")[None]
        ctx = torch.tensor([8192], dtype=torch.int32, device="cuda")
        q = torch.randn(1, 2048, HQ, D, device="cuda", dtype=torch.bfloat16)
        prefill = {"codec": name, "prefill_chunk": 2048, "depth": 8192}
        out64 = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
        prefill["block_m64_us"] = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20) * 1e3
        pa.PREFILL_MIN_ROWS = 1 << 30
        out16 = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
        prefill["block_m16_us"] = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=20) * 1e3
        pa.PREFILL_MIN_ROWS = 256
        prefill["maxdiff_64_vs_16"] = (out64 - out16).abs().max().item()
        rows.append(prefill)
        print(json.dumps(prefill), flush=True)
        # KV append for one decode token of one layer
        k = torch.randn(1, HKV, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, HKV, D, device="cuda", dtype=torch.bfloat16)
        page = torch.zeros(1, dtype=torch.int32, device="cuda")
        slot = torch.zeros(1, dtype=torch.int32, device="cuda")

        def torch_append():
            for plane, value in codec.encode(k.float(), v.float()).items():
                pool[plane][page.long(), slot.long()] = value

        append = {"codec": name, "append_torch_us": graph_ms(torch_append) * 1e3}
        if codec.key in SUPPORTED and codec.value in SUPPORTED:
            def kernel_append():
                for side, kind, x, rot in (("k", codec.key, k, codec.rotate_keys), ("v", codec.value, v, codec.rotate_values)):
                    x = rotate64(x, torch.float32) if rot else x
                    kv_append(x, kind, [pool[p.name] for p in codec.planes(D) if p.name.startswith(side + "_")], page, slot)
            append["append_kernel_us"] = graph_ms(kernel_append) * 1e3
        rows.append(append)
        print(json.dumps(append), flush=True)
        del pool
        torch.cuda.empty_cache()
    Path(out_path).write_text(json.dumps({"peak_GBps": peak / 1e9, "rows": rows}, indent=1))


FRAG_SWEEP = [(4, 1024, 2), (4, 1024, 0), (2, 1024, 2), (8, 1024, 2), (4, 2048, 2)]  # (warps, splits, hint)


def frag_main(out_path: str, codecs=("rk4v4-e8", "int8", "rk2v4-e8"), depths=(8192, 131072, 204800)) -> None:
    """int4 / int8 / e8cube-key KV decode attention (T = 1, T = 1 x 4 lanes and a 4-row verify block at 27B shapes):
    the tl.dot kernel against the fragment kernel (paged_attention_frag) over its (warps, splits, hint) sweep,
    CUDA-graph replays, L2 flushed by the pool's size; max difference against the tl.dot kernel's output and
    fraction of copy."""
    from runtime.kernels import paged_attention_frag as fa

    peak = copy_bandwidth()
    rows = []
    for name in codecs:
        codec = CODECS[name]
        pool = _pool(codec, max(depths) // 64)
        for depth, (lanes, t) in itertools.product(depths, ((1, 1), (4, 1), (1, 4))):  # T = 4: MTP3's verify block
            pages = depth // 64
            if lanes * pages > max(depths) // 64:
                pages = max(depths) // 64 // lanes
            bt = torch.arange(lanes * pages, dtype=torch.int32, device="cuda").view(lanes, pages)
            ctx = torch.full((lanes,), pages * 64, dtype=torch.int32, device="cuda")
            q = torch.randn(lanes, t, HQ, D, device="cuda", dtype=torch.bfloat16)
            kv_bytes = codec.bytes_per_token_head(D) * HKV * pages * 64 * lanes
            row = {"codec": name, "depth": pages * 64, "lanes": lanes, "t": t, "kv_bytes": kv_bytes}
            ref = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
            row["dot_graph_us"] = graph_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5)) * 1e3
            for warps, splits, hint in FRAG_SWEEP:
                key = f"frag_{warps}w_{splits}s_h{hint}"
                run = lambda: fa.paged_attention_frag(q, pool, codec, bt, ctx, D ** -0.5, warps=warps,  # noqa: E731
                                                      target_splits=splits, hint=hint)
                try:
                    out = run().float()
                    row[key + "_graph_us"] = graph_ms(run) * 1e3
                except Exception as exc:  # noqa: BLE001 - reported, not fatal
                    row[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    continue
                row[key + "_maxdiff"] = (out - ref).abs().max().item()
            times = {k: v for k, v in row.items() if k.startswith("frag_") and k.endswith("_graph_us")}
            if times:
                best = min(times, key=times.get)
                row["best"], row["best_us"] = best, times[best]
                row["best_frac_of_copy"] = kv_bytes / (times[best] * 1e-6) / peak
                row["dot_frac_of_copy"] = kv_bytes / (row["dot_graph_us"] * 1e-6) / peak
                row["speedup"] = row["dot_graph_us"] / times[best]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del pool
        torch.cuda.empty_cache()
    Path(out_path).write_text(json.dumps({"peak_GBps": peak / 1e9, "rows": rows}, indent=1))


PREFILL_SWEEP = [  # (block_m, block_n, warps, stages); (64, 32, 4, None) is bf16's default tile
    (64, 32, 4, None), (64, 32, 4, 1), (64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (64, 64, 8, 3),
    (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 8, 2)]


def matmul_tflops() -> float:
    """bf16 tensor-core rate measured now (8192^3 GEMM), the ceiling a prefill chunk's attention is held to."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b, reps=10)
    return 2 * 8192 ** 3 / (ms * 1e-3) / 1e12


def _vendor_rows(row: dict, q, pool, depth: int, chunk: int, flop: float, ref) -> None:
    """The same chunk through torch's attention kernels over keys gathered from the bf16 pool: the ceiling a
    vendor kernel sets. `gather`: pool pages -> [1, HKV, depth, D] (K and V); `flash_aten`: one FA2 call with
    GQA and causal taken bottom-right (its convention for seqlen_q != seqlen_k); `<backend>_split`: the keys
    before the chunk unmasked plus the chunk's square causal block (the two calls a runtime would merge by
    their log-sum-exps), each backend forced, GQA by enable_gqa."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pages = depth // 64

    def gather():
        k = pool["k_data"][:pages].reshape(depth, HKV, D).transpose(0, 1)[None]
        v = pool["v_data"][:pages].reshape(depth, HKV, D).transpose(0, 1)[None]
        return k.contiguous(), v.contiguous()

    row["gather_us"] = bench_ms(gather, reps=5) * 1e3
    k, v = gather()
    qt = q.transpose(1, 2).contiguous()  # [1, HQ, chunk, D]
    scale = D ** -0.5

    def flash_aten():
        return torch.ops.aten._scaled_dot_product_flash_attention(qt, k, v, 0.0, True, False, scale=scale)[0]

    def split(backend):
        prefix = depth - chunk
        with sdpa_kernel(backend):
            a = F.scaled_dot_product_attention(qt, k[:, :, :prefix], v[:, :, :prefix], scale=scale, enable_gqa=True)
            b = F.scaled_dot_product_attention(qt, k[:, :, prefix:], v[:, :, prefix:], is_causal=True, scale=scale,
                                               enable_gqa=True)
        return a, b

    candidates = [("flash_aten", flash_aten)] + [
        (f"{b.name.lower()}_split", lambda b=b: split(b))
        for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)]
    for key, fn in candidates:
        try:
            out = fn()
            us = bench_ms(fn, reps=5) * 1e3
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the shape is reported
            row[key] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        row[key + "_us"] = us
        row[key + "_tflops"] = flop / (us * 1e-6) / 1e12
        if key == "flash_aten":
            row[key + "_maxdiff"] = (out.transpose(1, 2).float() - ref).abs().max().item()


def prefill_main(out_path: str, codecs=("bf16", "rk4v4-e8"), depths=(8192, 131072, 204800), chunk=2048) -> None:
    """A prefill chunk's attention (chunk rows ending at each depth, 27B heads) over the tile sweep: µs, TFLOP/s
    (2 x 2 x visible keys x D per query head) and the fraction of the bf16 GEMM rate measured in the same run."""
    peak = matmul_tflops()
    rows = []
    for name in codecs:
        codec = CODECS[name]
        pool = _pool(codec, max(depths) // 64)
        for depth in depths:
            bt = torch.arange(depth // 64, dtype=torch.int32, device="cuda")[None]
            ctx = torch.tensor([depth], dtype=torch.int32, device="cuda")
            q = torch.randn(1, chunk, HQ, D, device="cuda", dtype=torch.bfloat16)
            visible = sum(depth - chunk + j + 1 for j in range(chunk))
            flop = 4 * visible * D * HQ
            row = {"codec": name, "depth": depth, "chunk": chunk, "gflop": flop / 1e9, "peak_tflops": peak}
            ref = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
            for bm, bn, nw, stages in PREFILL_SWEEP:
                key = f"m{bm}_n{bn}_w{nw}_s{stages or 'default'}"
                pa.ATTENTION_TUNING.clear()
                pa.ATTENTION_TUNING.update(block_m=bm, block_n=bn, num_warps=nw)
                if stages:
                    pa.ATTENTION_TUNING["num_stages"] = stages
                try:
                    out = pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5).float()
                    us = bench_ms(lambda: pa.paged_attention(q, pool, codec, bt, ctx, D ** -0.5), reps=5) * 1e3
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile or fit is reported
                    row[key] = f"{type(exc).__name__}: {str(exc)[:120]}"
                    continue
                row[key + "_us"] = us
                row[key + "_tflops"] = flop / (us * 1e-6) / 1e12
                row[key + "_maxdiff"] = (out - ref).abs().max().item()
            pa.ATTENTION_TUNING.clear()
            if name == "bf16":
                _vendor_rows(row, q, pool, depth, chunk, flop, ref)
            times = {k: v for k, v in row.items() if k.endswith("_us")}
            if times:
                best = min(times, key=times.get)
                row["best"], row["best_of_peak"] = best, flop / (times[best] * 1e-6) / 1e12 / peak
            rows.append(row)
            print(json.dumps(row), flush=True)
        del pool
        torch.cuda.empty_cache()
    Path(out_path).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) > 1 and args[1] in ("frag", "prefill"):
        (frag_main if args[1] == "frag" else prefill_main)(args[0])
        sys.exit()
    main(args[0], *([args[1].split(",")] if len(args) > 1 else []),
         *([[int(x) for x in args[2].split(",")]] if len(args) > 2 else []))
