"""transformers' own speed on the same full-size shape (bf16, random weights), for issue 5's
side-by-side table: prefill tok/s at a depth (after one warm-up prefill of the same length), then
greedy decode tok/s at that depth.

    PYTHONPATH=. python bench/hf_baseline.py qwen3.6-27b 8192 16 OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch


def main(shape: str, depth: int, decode: int, out: str) -> None:
    import transformers

    from format.shapes import shape_config

    text = shape_config(shape)
    model_type = text.pop("model_type")
    cfg = transformers.AutoConfig.for_model(model_type, **text)
    cls = transformers.Qwen3_5MoeForCausalLM if "moe" in model_type else transformers.Qwen3_5ForCausalLM
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = cls._from_config(cfg, dtype=torch.bfloat16).eval()
    build_s = time.perf_counter() - t0
    ids = torch.randint(0, cfg.vocab_size, (1, depth), device="cuda")
    with torch.no_grad():
        # warm-up: the same call twice (fla's kernels compile and autotune per variant on first use,
        # and a prefill that returns its cache runs other variants than one that does not)
        for _ in range(2):
            model(ids, use_cache=True)
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = model(ids, use_cache=True)
        torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        cache, nxt = res.past_key_values, res.logits[:, -1:].argmax(-1)
        del res
        # one warm-up step, then timed greedy steps
        res = model(nxt, past_key_values=cache, use_cache=True)
        nxt = res.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(decode):
            res = model(nxt, past_key_values=res.past_key_values, use_cache=True)
            nxt = res.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        decode_s = time.perf_counter() - t0
    row = {"engine": f"transformers {transformers.__version__} bf16", "shape": shape, "depth": depth,
           "build_s": build_s, "prefill_tok_s": depth / prefill_s, "decode_tok_s": decode / decode_s,
           "decode_tokens": decode, "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
           "fla": _has_fla()}
    print(json.dumps(row))
    with open(out, "w") as f:
        json.dump(row, f, indent=1)


def _has_fla() -> bool:
    try:
        import fla  # noqa: F401

        return True
    except ImportError:
        return False


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
