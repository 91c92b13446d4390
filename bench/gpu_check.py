"""GPU checks for issue 3: plan bytes == allocated bytes, and kernel bandwidth at 27B shapes.

Run on the device: PYTHONPATH=. python bench/gpu_check.py OUT_DIR
Writes OUT_DIR/gpu_check.json; every number comes from this one run.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

from format.numeric import FORMATS
from runtime.kernels.paged_attention import PAGE, paged_attention
from runtime.kernels.qlinear import PackedLinear, qlinear
from runtime.kv.codecs import CODECS


def bench_ms(fn, reps=50):
    return triton.testing.do_bench(fn, warmup=10, rep=reps)


def copy_bandwidth() -> float:
    n = 2 << 30
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


def random_packed(n, k, fmt_name):
    f = FORMATS[fmt_name]
    k_pad = -(-k // 128) * 128
    g = k_pad // f.group_size
    base = torch.randint(0, 256, (n * g * f.base_bytes_per_group,), dtype=torch.uint8, device="cuda")
    high = torch.randint(0, 256, (n * g * f.high_bytes_per_group,), dtype=torch.uint8, device="cuda") if f.high_bytes_per_group else None
    scale = (torch.rand(n * g, device="cuda") * 1e-3).half().view(torch.uint8)
    return PackedLinear(base, high, scale, n, k, f), base.numel() + (high.numel() if high is not None else 0) + scale.numel()


def qlinear_rows(peak):
    shapes = [("mlp/gate_up Q4", 34816, 5120, "Q4G64_F16S"), ("mlp/down Q5", 5120, 17408, "Q5G64_F16S"),
              ("attn qgkv Q4", 14336, 5120, "Q4G64_F16S"), ("gdn qkvz Q4", 16384, 5120, "Q4G64_F16S"),
              ("output_head Q6", 248320, 5120, "Q6G64_F16S"), ("embedding-size W8", 248320, 5120, "W8G32_F16S")]
    rows = []
    for label, n, k, fmt in shapes:
        w, nbytes = random_packed(n, k, fmt)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for t in (1, 4, 16, 512):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            ms = bench_ms(lambda: qlinear(x, w))
            ms_bf16 = bench_ms(lambda: x @ dense.t())
            rows.append({"op": label, "T": t, "N": n, "K": k, "weight_bytes": nbytes, "ms": ms,
                         "GBps": nbytes / (ms * 1e-3) / 1e9, "frac_of_copy": nbytes / (ms * 1e-3) / peak,
                         "torch_bf16_ms": ms_bf16, "tflops": 2 * t * n * k / (ms * 1e-3) / 1e12})
        del dense
    return rows


def attention_rows(peak):
    rows = []
    hq, hkv, d = 24, 4, 256
    for ctx in (8192, 32768, 131072):
        pages = ctx // PAGE
        for name in ("bf16", "int8", "fp8", "nvfp4", "rk4v4-e8", "rk2v4-e8"):
            c = CODECS[name]
            pool = {}
            for p in c.planes(d):
                shape = (pages, PAGE, hkv, p.width)
                if p.dtype in (torch.bfloat16, torch.float16):
                    pool[p.name] = (torch.randn(shape, device="cuda") * (0.01 if "scales" in p.name else 1)).to(p.dtype)
                else:
                    pool[p.name] = torch.randint(0, 120, shape, device="cuda").to(p.dtype)
            bt = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
            ctx_len = torch.tensor([ctx], dtype=torch.int32, device="cuda")
            q = torch.randn(1, 1, hq, d, device="cuda", dtype=torch.bfloat16)
            ms = bench_ms(lambda: paged_attention(q, pool, c, bt, ctx_len, d ** -0.5), reps=30)
            kv_bytes = c.bytes_per_token_head(d) * hkv * ctx
            rows.append({"codec": name, "context": ctx, "kv_bytes_per_layer": kv_bytes, "ms_per_layer": ms,
                         "GBps": kv_bytes / (ms * 1e-3) / 1e9, "frac_of_copy": kv_bytes / (ms * 1e-3) / peak})
            del pool
    return rows


def plan_vs_allocated():
    """Engine arenas on a mid-size random artifact: torch's allocated bytes vs the plan's prediction."""
    from format.convert import ConvertOptions, convert_checkpoint
    from format.tiny import write_tiny_checkpoint
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    d = Path(tempfile.mkdtemp())
    write_tiny_checkpoint(d / "ck", moe=False, layers=8)
    art = convert_checkpoint(d / "ck", d / "m.nfer", ConvertOptions(recipe="q4")).output
    results = []
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    for kv, lanes, ctx, spec in [("bf16", 1, 8192, "none"), ("int8", 4, 30000, "none"), ("rk4v4-e8", 8, 65536, "mtp"),
                                 ("rk2v4-e8", 2, 262144, "none"), ("nvfp4", 3, 5000, "mtp")]:
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        e = Engine(art, PlanOptions(max_context=ctx, max_concurrency=lanes, kv_dtype=kv, spec=spec), device="cuda",
                   cuda_graphs=False)
        torch.cuda.synchronize()
        arenas = sum(a.allocated_bytes for a in e.plan.resident_arenas.values())  # the workspace is headroom
        measured = torch.cuda.memory_allocated() - before
        # cached small device tables (Hadamard, E8) may be created lazily later, not here
        results.append({"kv": kv, "lanes": lanes, "context": ctx, "spec": spec, "planned_arena_bytes": arenas,
                        "allocated_bytes": measured, "equal": arenas == measured})
        t0 = time.time()
        toks = e.generate(list(range(1, 200)), 16)
        results[-1]["tokens"] = len(toks)
        results[-1]["generate_s"] = round(time.time() - t0, 3)
        peak_before = torch.cuda.max_memory_allocated()
        results[-1]["peak_transient_bytes"] = peak_before - before - arenas
        results[-1]["planned_workspace_bytes"] = e.plan.arenas["workspace"].allocated_bytes
        e.close()
        del e
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return results


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    peak = copy_bandwidth()
    info["copy_bandwidth_GBps"] = peak / 1e9
    print(json.dumps(info), flush=True)
    result = {"info": info, "plan_vs_allocated": plan_vs_allocated()}
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result["plan_vs_allocated"], indent=1), flush=True)
    result["qlinear"] = qlinear_rows(peak)
    for r in result["qlinear"]:
        print(f"{r['op']:<20} T={r['T']:<4} {r['ms']*1e3:8.1f} us  {r['GBps']:7.0f} GB/s  {r['frac_of_copy']:.2f} of copy  "
              f"bf16 torch {r['torch_bf16_ms']*1e3:8.1f} us", flush=True)
    result["attention"] = attention_rows(peak)
    for r in result["attention"]:
        print(f"{r['codec']:<9} ctx={r['context']:<7} {r['ms_per_layer']*1e3:8.1f} us/layer  {r['GBps']:7.0f} GB/s  "
              f"{r['frac_of_copy']:.2f} of copy", flush=True)
    result["engine"] = []
    engine_decode(result["engine"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))


def engine_decode(out_rows: list) -> None:
    """Decode speed of the engine on a mid-size random model, graphs on and off."""
    from format.convert import ConvertOptions, convert_checkpoint
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    d = Path(tempfile.mkdtemp())
    src = d / "ck"
    _mid_checkpoint(src)
    art = convert_checkpoint(src, d / "m.nfer", ConvertOptions(recipe="q4")).output
    for graphs in (False, True):
        for kv in ("bf16", "rk4v4-e8"):
            e = Engine(art, PlanOptions(max_context=4096, kv_dtype=kv, prefill_chunk=1024), device="cuda", cuda_graphs=graphs)
            prompt = list(range(1, 1025))
            torch.cuda.synchronize()
            t0 = time.time()
            logits = e.prefill(0, prompt)
            torch.cuda.synchronize()
            t1 = time.time()
            tok = int(logits.argmax())
            for _ in range(3):  # warm-up (and capture)
                tok = int(e.decode_step([0], [tok])[0].argmax())
            torch.cuda.synchronize()
            t2 = time.time()
            n = 32
            for _ in range(n):
                tok = int(e.decode_step([0], [tok])[0].argmax())
            torch.cuda.synchronize()
            t3 = time.time()
            out_rows.append({"graphs": graphs, "kv": kv, "prefill_tok_s": len(prompt) / (t1 - t0),
                             "decode_tok_s": n / (t3 - t2)})
            print(json.dumps(out_rows[-1]), flush=True)
            e.close()


def _mid_checkpoint(out: Path) -> None:
    """hidden 2048, 8 layers (2 full attention), vocab 32768: small enough to build in seconds."""
    from safetensors.torch import save_file

    from format.tiny import _layer_tensors, write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, 384)
    text = {"model_type": "qwen3_5_text", "vocab_size": 32768, "hidden_size": 2048, "num_hidden_layers": 8,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4, "intermediate_size": 6144, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}, "eos_token_id": 2,
            "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]}
    (out / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    g = torch.Generator().manual_seed(0)
    t = {"model.language_model.embed_tokens.weight": torch.randn(32768, 2048, generator=g),
         "lm_head.weight": torch.randn(32768, 2048, generator=g) * 0.02,
         "model.language_model.norm.weight": torch.zeros(2048)}
    for i in range(8):
        t.update(_layer_tensors(g, text, f"model.language_model.layers.{i}.", text["layer_types"][i] == "full_attention", False))
    save_file({k: v.bfloat16().contiguous() for k, v in t.items()}, str(out / "model.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "out")
