"""The GDN decode/verify recurrence (runtime/kernels/gdn_fused.py) of one 27B layer over its tile options: value
columns per program x warps per program, at the row shapes a decode step and the speculative rounds give it (lanes
x tokens: 1 x 1 plain decode, 8 x 1 eight lanes, 1 x 4 MTP3 verify, 4 x 4 four lanes of MTP3, 1 x 8 DFlash2 K = 7
verify), alpha/beta projected in the kernel as the engine calls it, snapshots on for verify blocks; µs per call
(CUDA-graph replays) and the output's largest difference from the first tile's; then the default rule's.

    PYTHONPATH=. python bench/gdn_compare.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from bench.attention_compare import graph_ms
from runtime.kernels import gdn_fused as gf

HK, HV, DK, DV, K = 16, 48, 128, 128, 5120  # 27B GDN heads and hidden width
SHAPES = [(1, 1), (8, 1), (1, 4), (4, 4), (1, 8)]  # (lanes, tokens per lane)
TILES = [(32, 4), (32, 2), (32, 1), (16, 1), (16, 2), (64, 4), (64, 2), (128, 4)]  # (block_v, warps); first: every
# launch's tile before session 36 (the default now is the rule, gdn_block_v, timed last as "rule")


def main(out: str) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for lanes, t in SHAPES:
        snapshot = t > 1
        x = torch.randn(lanes, t, 2 * HK * DK + HV * DV, device="cuda", generator=g).to(torch.bfloat16)
        h = torch.randn(lanes * t, K, device="cuda", generator=g).to(torch.bfloat16)
        wa, wb = (torch.randn(HV, K, device="cuda", generator=g).to(torch.bfloat16) * 0.02 for _ in range(2))
        a_log, dt_bias = torch.randn(HV, device="cuda", generator=g), torch.randn(HV, device="cuda", generator=g)
        state = torch.randn(lanes, t + 1, HV, DK, DV, device="cuda", generator=g) * 0.1
        idx = torch.arange(lanes, dtype=torch.int32, device="cuda")
        o = torch.empty(lanes, t, HV, DV, device="cuda")
        row, want = {"lanes": lanes, "tokens": t}, None
        for block_v, warps in TILES:
            gf.GDN_TUNING.update(block_v=block_v, warps=warps)
            s = state.clone()
            got = gf.gdn_fused(x, None, None, a_log, dt_bias, s, idx, HK, snapshot, out=o.clone(),
                               projections=(h, wa, wb))
            want = got if want is None else want
            us = graph_ms(lambda: gf.gdn_fused(x, None, None, a_log, dt_bias, s, idx, HK, snapshot, out=o,
                                               projections=(h, wa, wb))) * 1e3
            row[f"{block_v}x{warps}_us"] = round(us, 2)
            row[f"{block_v}x{warps}_maxdiff"] = float((got - want).abs().max())
        gf.GDN_TUNING.update(block_v=0, warps=4)  # the rule (gdn_block_v), the default
        row["rule_block_v"] = gf.gdn_block_v(lanes, t, HV, DV)
        row["rule_us"] = round(graph_ms(lambda: gf.gdn_fused(x, None, None, a_log, dt_bias, s, idx, HK, snapshot, out=o,
                                                             projections=(h, wa, wb))) * 1e3, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
