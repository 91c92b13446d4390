"""Cold prefill with a prefill chunk's attention on cuDNN and on the paged Triton kernel, alternated in one engine
(one model load: the comparison fits a short device call). Prints one JSON line per run.

    PYTHONPATH=. python bench/prefill_ab.py [SHAPE] [DEPTH,...] [KV] [MODE,...]
    # defaults: qwen3.6-27b 32768,131072 bf16 auto,triton,cudnn
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from format.shapes import write_shape_artifact
from runtime.engine import Engine
from runtime.kernels import prefill_attention_vendor as vendor
from runtime.memory_plan import PlanOptions


def main(shape: str = "qwen3.6-27b", depths: str = "32768,131072", kv: str = "bf16",
         modes: str = "auto,triton,cudnn") -> None:
    sizes = [int(d) for d in depths.split(",")]
    artifact = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4", mtp=True)
    engine = Engine(artifact, PlanOptions(max_context=max(sizes) + 128, kv_dtype=kv, prefill_chunk=0), device="cuda",
                    random_weights_seed=0)
    gen = torch.Generator().manual_seed(0)
    warm = torch.randint(0, engine.cfg.vocab_size, (engine.opts.prefill_chunk + 7,), generator=gen).tolist()
    for mode in ("cudnn", "triton"):  # compile / build both paths outside the timing
        vendor.MODE = mode
        engine.prefill(0, warm)
    for depth in sizes:
        prompt = torch.randint(0, engine.cfg.vocab_size, (depth,), generator=gen).tolist()
        for mode in modes.split(","):
            vendor.MODE = mode
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = engine.prefill(0, prompt)
            torch.cuda.synchronize()
            secs = time.perf_counter() - t0
            print(json.dumps({"shape": shape, "kv": kv, "depth": depth, "mode": mode,
                              "prefill_tok_s": round(depth / secs), "first_token": int(torch.argmax(logits)),
                              "cudnn_off": vendor._BROKEN[:1]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
