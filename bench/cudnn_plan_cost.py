"""What a new shape costs cuDNN's fused attention (it builds an execution plan per shape): the first call of each
(query rows, keys, causal) shape against the same call again, 27B heads (24 query / 4 KV x 256, bf16). A server's
prefill tails and reused prefixes come in many lengths; prefill_attention_vendor pads them to SHAPE_STEP multiples.

    PYTHONPATH=. python bench/cudnn_plan_cost.py
"""

from __future__ import annotations

import json
import time

import torch

from runtime.kernels import prefill_attention_vendor as vendor

SHAPES = ((8192, 32768, False), (8192, 8192, True), (7936, 24576, False), (7936, 8192, True), (2048, 4096, False),
          (2304, 2560, True), (512, 16384, False), (768, 1024, True))


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    for rows, keys, causal in SHAPES:
        q = torch.randn(1, 24, rows, 256, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 4, keys, 256, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        call = lambda: vendor._segment_cudnn(q, k, v, causal, 256 ** -0.5)  # noqa: E731
        first = _timed(call)
        again = min(_timed(call) for _ in range(3))
        print(json.dumps({"rows": rows, "keys": keys, "causal": causal, "first_ms": round(first, 2),
                          "cached_ms": round(again, 2), "plan_ms": round(first - again, 2)}), flush=True)


if __name__ == "__main__":
    main()
