"""Kernel launches of one decode step, counted on the CPU: the engine runs a tiny model of the real layer mix
(3 GDN layers, then an attention layer) with every op a Triton kernel under the interpreter, and each launch
is tallied by kernel and by layer type; the per-layer counts are then scaled to the full-size shapes (27B: 48
GDN + 16 attention layers, dense MLP; 35B-A3B: 30 + 10, MoE). A decode step's small kernels are latency-bound,
so launches are a cost of their own (issue 21: ~1 ms of a 6.5 ms 27B step outside the products). The tiny
model's products may split differently from the full-size ones (a K-split's finishing launch), so the totals
are estimates; differences between two trees are exact.

    PYTHONPATH=. python bench/launch_count.py [--json]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("NINFER_CPU_KERNELS", "triton")

SHAPES = {"qwen3.6-27b": (48, 16, False), "qwen3.6-35b-a3b": (30, 10, True)}  # GDN layers, attention layers, MoE


def count(moe: bool, kv: str) -> dict:
    """Launches of one decode step of a tiny 4-layer model (layers 0-2 GDN, layer 3 attention)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from format.convert import ConvertOptions, convert_checkpoint
    from format.tiny import write_tiny_checkpoint
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    with tempfile.TemporaryDirectory() as tmp:
        src = write_tiny_checkpoint(Path(tmp) / "hf", moe=moe, seed=1, mtp_layers=0, hidden=512, intermediate=1024,
                                    shared_intermediate=32)  # wide enough for the full-size kernel choices
        path = convert_checkpoint(src, Path(tmp) / "m.nfer", ConvertOptions(recipe="q4")).output
        engine = Engine(path, PlanOptions(max_context=256, kv_dtype=kv, prefill_chunk=128), device="cpu")
        engine.prefill(0, [3, 17, 99, 150, 42])
        launches: list[str] = []
        original = InterpretedFunction.run

        def run(self, *args, **kwargs):
            launches.append(self.fn.__name__)
            return original(self, *args, **kwargs)

        layer_of = []
        InterpretedFunction.run = run
        try:
            import runtime.engine as engine_module

            marks = {}
            for name in ("_attention", "_gdn", "_ffn"):
                method = getattr(engine_module.Engine, name)

                def wrapped(self, *a, _method=method, _name=name, **k):
                    start = len(launches)
                    out = _method(self, *a, **k)
                    layer_of.append((_name, start, len(launches)))
                    return out

                marks[name] = method
                setattr(engine_module.Engine, name, wrapped)
            with torch.no_grad():
                engine.decode_step([0], [7])
        finally:
            InterpretedFunction.run = original
            for name, method in marks.items():
                setattr(engine_module.Engine, name, method)
        engine.close()
    total = len(launches)
    mixer = {name: end - start for name, start, end in layer_of if name != "_ffn"}
    ffn = [end - start for name, start, end in layer_of if name == "_ffn"]
    # the norms after each block are outside these spans: per layer = total of the step less the head and embed
    return {"total": total, "kernels": dict(Counter(launches)), "gdn_mixer": mixer.get("_gdn"),
            "attention_mixer": mixer.get("_attention"), "ffn": ffn[0] if ffn else None, "layers": 4}


def main() -> dict:
    out = {}
    for model, (gdn, attn, moe) in SHAPES.items():
        for kv in ("bf16", "rk4v4-e8"):
            c = count(moe, kv)
            outside = c["total"] - 3 * (c["gdn_mixer"] + c["ffn"]) - (c["attention_mixer"] + c["ffn"])
            norms = 2 * 4  # two rmsnorms per layer (inside `outside`)
            per_step = gdn * (c["gdn_mixer"] + c["ffn"]) + attn * (c["attention_mixer"] + c["ffn"]) + \
                (gdn + attn) * 2 + (outside - norms)
            out[f"{model} {kv}"] = {**c, "per_gdn_layer": c["gdn_mixer"] + c["ffn"] + 2,
                                    "per_attention_layer": c["attention_mixer"] + c["ffn"] + 2,
                                    "full_size_step": per_step}
    return out


if __name__ == "__main__":
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        for name, r in result.items():
            print(f"{name}: {r['full_size_step']} launches per decode step (per GDN layer {r['per_gdn_layer']}, per "
                  f"attention layer {r['per_attention_layer']}; tiny model's step {r['total']})")
