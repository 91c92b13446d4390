"""RMSNorm of the decode step at 27B width, graph-timed as the engine runs it: a product's 4 K-split
partials summed, the residual added, the normed row written and quantized for the next Q4 product;
one program per row vs rows spread over programs (several chunk sizes), T = 1 and 4. Also checks
the spread outputs against the one-program ones.

    PYTHONPATH=. python bench/norm_compare.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.attention_compare import graph_ms
from runtime.kernels import rmsnorm as rn
from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials

H, SPLITS = 5120, 4
NEXT = SimpleNamespace(fmt=SimpleNamespace(bits=4, group_size=64), k_pad=H, groups_per_row=H // 64)


def main(out_path: str) -> None:
    rows = []
    w = (torch.randn(H, device="cuda") * 0.1).to(torch.bfloat16)
    for t in (1, 4):
        parts = SplitPartials(torch.randn(SPLITS, t, H, device="cuda"), torch.empty(t, H, device="cuda",
                                                                                     dtype=torch.bfloat16))
        residual = torch.randn(t, H, device="cuda").to(torch.bfloat16)
        xq = QuantizedX.empty(t, NEXT, "cuda")
        row = {"t": t}
        outputs = {}
        for label, max_rows, chunk in (("one_program", 0, 512), ("spread256", 32, 256), ("spread512", 32, 512),
                                       ("spread1024", 32, 1024)):
            rn.SPREAD_MAX_ROWS, rn.SPREAD_CHUNK = max_rows, chunk
            y, res = rn.rmsnorm(parts, w, 1e-6, residual=residual.clone(), xq=xq)
            outputs[label] = (y.float(), res.clone(), xq.words.clone())
            scratch = residual.clone()  # one program per row adds into its residual in place, on every replay
            row[label + "_us"] = graph_ms(lambda: rn.rmsnorm(parts, w, 1e-6, residual=scratch, xq=xq), reps=50) * 1e3
        rn.SPREAD_MAX_ROWS, rn.SPREAD_CHUNK = 32, 256
        base = outputs["one_program"]
        for label, (y, res, words) in outputs.items():
            row[label + "_maxdiff"] = (y - base[0]).abs().max().item()
            row[label + "_same_residual"] = bool(torch.equal(res, base[1]))
            row[label + "_words_differ"] = int((words != base[2]).sum().item())
        rows.append(row)
        print(json.dumps(row), flush=True)
    Path(out_path).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
