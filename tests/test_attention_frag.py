"""The fragment decode attention over int4 keys and values (runtime/kernels/paged_attention_frag.py). On a CPU
Triton's interpreter runs the whole kernel with its PTX emulated warp by warp (tests/ptx_warp.py), so pages,
splits, short last tiles, causal masks of several query rows and the combine are held to the reference
attention; on a GPU the kernel itself runs."""

import pytest
import torch

from runtime.kernels import paged_attention_frag as fa
from runtime.kernels.paged_attention import PAGE, paged_attention_reference
from runtime.kv.codecs import CODECS


def _case(codec, lanes, t, hq, hkv, ctx, per_lane, seed, device):
    c = CODECS[codec]
    g = torch.Generator().manual_seed(seed)
    total = lanes * per_lane + 1
    pool = c.encode(torch.randn(total, PAGE, hkv, 256, generator=g), torch.randn(total, PAGE, hkv, 256, generator=g))
    block_table = torch.randperm(total, generator=g)[: lanes * per_lane].view(lanes, per_lane).int()
    ctx = torch.tensor(ctx, dtype=torch.int32)
    q = c.prepare_queries(torch.randn(lanes, t, hq, 256, generator=g) * 2)
    want = paged_attention_reference(q.float(), pool, c, block_table, ctx, 256 ** -0.5)
    dev = {k: v.to(device) for k, v in pool.items()}
    return c, q.to(device), dev, block_table.to(device), ctx.to(device), want


@pytest.mark.parametrize("codec,t,hq,hkv,split_tokens,warps", [
    ("rk4v4-e8", 1, 12, 2, 64, 2),  # the 27B's 6-head groups, one page per split, a short last tile
    ("rk4v4-e8", 1, 24, 4, 64, 2),  # the 27B's 4 kv heads: a program's warps are two heads of one split
    ("rk4v4", 1, 16, 2, 128, 4),  # the 35B-A3B's 8-head groups (every column), two tiles per split, empty warps
    ("rk4v4-e8", 2, 8, 2, 0, 2),  # two query rows per head: causal masks inside the last tile; splits by capacity
    ("int8", 1, 12, 2, 64, 2),  # int8 keys and values
    ("rk8v4", 2, 8, 2, 128, 4),  # int8 keys, int4 values
    ("rk4v4-e8", 4, 12, 2, 64, 4),  # a 24-row verify block (MTP3 on a 6-head group): 3 column tiles of 8 rows
    ("rk2v4-e8", 1, 12, 2, 64, 2),  # e8cube keys: 8-vectors decoded bit by bit into int4's nibble order
    ("rk2v4-e8", 2, 8, 2, 128, 4),
])
def test_fragment_attention_matches_the_reference(kernel_device, codec, t, hq, hkv, split_tokens, warps):
    c, q, pool, block_table, ctx, want = _case(codec, 2, t, hq, hkv, [70, 150], 3, 7 + t + hq, kernel_device)
    out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=kernel_device)
    got = fa.paged_attention_frag(q.float() if kernel_device == "cpu" else q, pool, c, block_table, ctx, 256 ** -0.5,
                                  out=out, warps=warps, target_splits=8, split_tokens=split_tokens)
    err = (got.cpu() - want).abs().max() / want.abs().max()
    assert err < 1e-3, err  # fp16 operands (4.5e-4 seen)


def test_fragment_attention_takes_int4_decode_shapes_only():
    for name in ("rk4v4", "rk4v4-e8"):
        assert fa.frag_attention_supported(CODECS[name], 256, 6) and fa.frag_attention_supported(CODECS[name], 256, 8)
        assert fa.frag_attention_supported(CODECS[name], 256, 24) and fa.frag_attention_supported(CODECS[name], 256, 64)
        assert not fa.frag_attention_supported(CODECS[name], 256, 65)
        assert not fa.frag_attention_supported(CODECS[name], 128, 6)
    for name in ("int8", "rk8v4", "rk2v4-e8"):
        assert fa.frag_attention_supported(CODECS[name], 256, 8)
    for name in ("bf16", "fp8", "nvfp4", "k8v4"):
        assert not fa.frag_attention_supported(CODECS[name], 256, 6)
    c, q, pool, block_table, ctx, _ = _case("rk4v4", 1, 5, 28, 2, [70], 2, 1, "cpu")
    with pytest.raises(ValueError, match="at most 64 rows"):
        fa.paged_attention_frag(q, pool, c, block_table, ctx, 0.1)


@pytest.mark.triton_kernels
def test_paged_attention_takes_the_fragment_kernel_when_on(kernel_device, monkeypatch):
    """NINFER_ATTENTION_FRAG=on routes int4 decode and verify rows (<= 64 per kv head) to the fragment kernel, and
    a prefill chunk (96 rows) to the tl.dot kernel; both match the reference."""
    from runtime.kernels import paged_attention as pa

    monkeypatch.setitem(fa.FRAG_ATTENTION, "mode", "on")
    calls, real = [], fa.paged_attention_frag
    monkeypatch.setattr(fa, "paged_attention_frag", lambda *a, **k: calls.append(1) or real(*a, **k))
    for t in (2, 16):
        c, q, pool, block_table, ctx, want = _case("rk4v4-e8", 1, t, 12, 2, [130], 3, 3 + t, kernel_device)
        got = pa.paged_attention(q.float() if kernel_device == "cpu" else q, pool, c, block_table, ctx, 256 ** -0.5)
        assert ((got.float().cpu() - want).abs().max() / want.abs().max()).item() < 1e-2
    assert len(calls) == 1  # T = 16 is 96 rows of a 6-head group: the tl.dot kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 27B-shaped context of thousands of keys: GPU only")
def test_fragment_attention_at_depth_on_the_gpu():
    """27B heads (24 / 4), three lanes of 4,000-9,000 keys over shuffled pages: the fragment kernel against the
    reference and the tl.dot kernel, with the engine's defaults (splits, hint)."""
    from runtime.kernels import paged_attention as pa

    c, q, pool, block_table, ctx, want = _case("rk4v4-e8", 3, 1, 24, 4, [4000, 9000, 6100], 150, 5, "cuda")
    got = fa.paged_attention_frag(q, pool, c, block_table, ctx, 256 ** -0.5).float().cpu()
    dot = pa.paged_attention(q, pool, c, block_table, ctx, 256 ** -0.5).float().cpu()
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-2
    assert ((got - dot).abs().max() / dot.abs().max()).item() < 1e-2


@pytest.mark.triton_kernels
def test_engine_decodes_through_the_fragment_kernel_as_the_reference(kernel_device, tmp_path, monkeypatch):
    """A tiny model with the real head dim (256) and rk4v4-e8 KV, every op a Triton kernel (on a CPU interpreted,
    the fragment kernel's PTX emulated): greedy tokens equal the reference model's, each decode step's attention on
    the fragment kernel."""
    from format.container import Artifact
    from format.convert import ConvertOptions, convert_checkpoint
    from format.tiny import write_tiny_checkpoint
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from runtime.model import ReferenceModel

    src = write_tiny_checkpoint(tmp_path / "hf", seed=3, mtp_layers=0, head_dim=256)
    path = convert_checkpoint(src, tmp_path / "tiny.nfer", ConvertOptions(recipe="q4")).output
    monkeypatch.setitem(fa.FRAG_ATTENTION, "mode", "on")
    calls, real = [], fa.paged_attention_frag
    monkeypatch.setattr(fa, "paged_attention_frag", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt, new = [3, 17, 99, 150, 42, 7, 250, 11, 64, 300, 5, 128] * 6, 3  # 72 tokens: two pages
    engine = Engine(path, PlanOptions(max_context=256, kv_dtype="rk4v4-e8", prefill_chunk=128), device=kernel_device)
    if kernel_device == "cpu":  # the prompt through the ops' torch references (the interpreted prefill of 72 rows
        # took three quarters of the test; other engine tests hold those kernels to the reference), decode interpreted
        import runtime.kernels

        monkeypatch.setattr(runtime.kernels, "CPU_KERNELS", "torch")
        tokens = [int(engine.prefill(0, prompt).argmax())]
        monkeypatch.setattr(runtime.kernels, "CPU_KERNELS", "triton")
        for _ in range(new - 1):
            tokens.append(int(engine.decode_step([0], [tokens[-1]])[0].argmax()))
        assert tokens == ReferenceModel(Artifact(path)).generate(prompt, new)
    else:
        engine.generate(prompt, new)
    # every decode step's (one) attention layer (on a GPU, CUDA graphs replay the later steps without Python); the
    # prefill's 288 rows take tl.dot
    assert len(calls) == new - 1 if kernel_device == "cpu" else calls
