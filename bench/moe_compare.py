"""The MoE prefill experts of one 35B-A3B layer on the GPU (random Q4 gate/up and Q5 down experts, random
top-8 routing): expert_prefill's fused and dense paths side by side over chunk lengths (with their
relative difference, so a fast wrong path shows up), torch's bf16 grouped GEMM on the same pairs with the
weights already dense (what the dense path's products alone cost), and dequantizing every expert once.
`sweep` (run 27, call 1): the fused path's stages at TOKENS and its expert GEMM over tiles and pair-block
sizes, each checked against the default tile's output.

    PYTHONPATH=. python bench/moe_compare.py OUT.json [TOKENS] [sweep]
"""

from __future__ import annotations

import itertools
import json
import sys

import torch

from bench.gpu_check import bench_ms, random_packed
from runtime.kernels import moe
from runtime.kernels.swiglu import swiglu

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8


def _routing(t: int):
    logits = torch.randn(t, EXPERTS, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(TOP_K, -1)
    return ids.int(), (weights / weights.sum(-1, keepdim=True)).bfloat16()


def _fused(h, ids, weights, gate_up, down, shared, block_m):
    x_rows, block_experts, slot = moe.sort_pairs(ids, EXPERTS, block_m)
    act = swiglu(moe.expert_gemm(h, x_rows, block_experts, gate_up, 2 * INTER, block_m))
    own = torch.where(x_rows >= 0, torch.arange(x_rows.numel(), device=h.device, dtype=torch.int32), -1)
    return moe.combine_experts(moe.expert_gemm(act, own, block_experts, down, HIDDEN, block_m), weights, shared, slot)


def sweep_main(out_path: str, tokens: int) -> None:
    torch.manual_seed(0)
    gate_up, _ = random_packed(EXPERTS * 2 * INTER, HIDDEN, "Q4G64_F16S")
    down, _ = random_packed(EXPERTS * HIDDEN, INTER, "Q5G64_F16S")
    h = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    shared = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = _routing(tokens)
    flops = 2 * tokens * TOP_K * 3 * INTER * HIDDEN
    report = {"tokens": tokens, "gflop": flops / 1e9, "stages": {}, "sweep": []}
    bm = moe.EXPERT_BLOCK_M
    x_rows, block_experts, _ = moe.sort_pairs(ids, EXPERTS, bm)
    gu = moe.expert_gemm(h, x_rows, block_experts, gate_up, 2 * INTER, bm)
    act = swiglu(gu)
    own = torch.where(x_rows >= 0, torch.arange(x_rows.numel(), device="cuda", dtype=torch.int32), -1)
    stages = {"sort_pairs": lambda: moe.sort_pairs(ids, EXPERTS, bm),
              "gemm gate_up": lambda: moe.expert_gemm(h, x_rows, block_experts, gate_up, 2 * INTER, bm),
              "swiglu": lambda: swiglu(gu),
              "gemm down": lambda: moe.expert_gemm(act, own, block_experts, down, HIDDEN, bm),
              "whole fused path": lambda: _fused(h, ids, weights, gate_up, down, shared, bm)}
    for name, fn in stages.items():
        report["stages"][name] = bench_ms(fn)
        print(f"{name:>18}: {report['stages'][name]:.3f} ms", flush=True)
    expected = _fused(h, ids, weights, gate_up, down, shared, bm).float()
    default = dict(moe.EXPERT_GEMM_TILE)
    for block_m, block_n, block_k, warps in itertools.product((32, 64, 128), (64, 128), (128, 64), (4, 8)):
        moe.EXPERT_GEMM_TILE.update(block_n=block_n, block_k=block_k, num_warps=warps)
        row = {"block_m": block_m, "block_n": block_n, "block_k": block_k, "warps": warps}
        try:
            got = _fused(h, ids, weights, gate_up, down, shared, block_m).float()
            row["rel_err"] = ((got - expected).norm() / expected.norm()).item()
            row["ms"] = bench_ms(lambda: _fused(h, ids, weights, gate_up, down, shared, block_m))
            row["tflops"] = flops / (row["ms"] * 1e-3) / 1e12
        except Exception as e:  # out of shared memory / registers at this tile: record it, go on
            row["error"] = str(e).splitlines()[0][:160]
        report["sweep"].append(row)
        print(row, flush=True)
        with open(out_path, "w") as f:  # after every row: a timed-out call still leaves what it measured
            json.dump(report, f, indent=1)
    moe.EXPERT_GEMM_TILE.clear()
    moe.EXPERT_GEMM_TILE.update(default)


def _paths(report, gate_up, down, tokens_list):
    """expert_prefill through the fused and the dense path at each chunk length, and their difference."""
    for tokens in tokens_list:
        h = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        shared = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ids, weights = _routing(tokens)
        row = {"tokens": tokens, "gflop": 2 * tokens * TOP_K * 3 * INTER * HIDDEN / 1e9}
        outs = {}
        for path in ("fused", "dense"):
            fn = lambda: moe.expert_prefill(h, ids, weights, gate_up, down, INTER, EXPERTS, shared, swiglu, path=path)
            outs[path] = fn().float()
            row[path + "_ms"] = bench_ms(fn)
        row["rel_diff"] = ((outs["dense"] - outs["fused"]).norm() / outs["fused"].norm()).item()
        row["auto"] = "dense" if tokens * TOP_K >= moe.DENSE_EXPERTS_MIN_PAIRS * EXPERTS else "fused"
        report["paths"].append(row)
        print(row, flush=True)


def main(out_path: str, tokens: int) -> None:
    torch.manual_seed(0)
    gate_up, gu_bytes = random_packed(EXPERTS * 2 * INTER, HIDDEN, "Q4G64_F16S")
    down, dn_bytes = random_packed(EXPERTS * HIDDEN, INTER, "Q5G64_F16S")
    h = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    ids, weights = _routing(tokens)
    flops = 2 * tokens * TOP_K * (2 * INTER * HIDDEN + HIDDEN * INTER)
    report = {"tokens": tokens, "weight_bytes": gu_bytes + dn_bytes, "gflop": flops / 1e9, "paths": []}
    _paths(report, gate_up, down, (128, 256, 512, 1024, 2048, 4096, tokens))

    if hasattr(torch, "_grouped_mm"):  # bf16 weights, the same pairs, sorted: the vendor GEMM alone
        w_gu = torch.randn(EXPERTS, HIDDEN, 2 * INTER, device="cuda", dtype=torch.bfloat16)
        w_dn = torch.randn(EXPERTS, INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
        pairs = ids.reshape(-1).long()
        order = torch.argsort(pairs, stable=True)
        offs = torch.cumsum(torch.bincount(pairs, minlength=EXPERTS), 0).int()
        xs = h[order // TOP_K].contiguous()

        def dense():
            a = torch._grouped_mm(xs, w_gu, offs=offs)
            return torch._grouped_mm(swiglu(a), w_dn, offs=offs)
        report["torch_grouped_mm_bf16_ms"] = bench_ms(dense)
        print("torch._grouped_mm bf16, weights resident:", report["torch_grouped_mm_bf16_ms"], flush=True)
        del w_gu, w_dn
    # the dense path's parts at `tokens`: dequantizing every expert once, per matrix
    report["dequant_all_ms"] = {
        "gate_up": bench_ms(lambda: moe.dequantize_rows(gate_up, 0, gate_up.rows // 16, torch.bfloat16)) * 16,
        "down": bench_ms(lambda: moe.dequantize_rows(down, 0, down.rows // 16, torch.bfloat16)) * 16}
    print("dequantize every expert (ms):", report["dequant_all_ms"], flush=True)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    out, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8192
    (sweep_main if sys.argv[3:] == ["sweep"] else main)(out, n)
