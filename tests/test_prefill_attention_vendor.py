"""A prefill chunk's attention key segment by key segment (runtime/kernels/prefill_attention_vendor.py): the
segments' outputs merged by their log-sum-exps equal attention over every key at once. On the CPU each segment
runs through plain torch; on a GPU through cuDNN (the GPU test compares it with the paged kernel)."""

import pytest
import torch

from runtime.kernels import prefill_attention_vendor as vendor
from runtime.kernels.paged_attention import PAGE, paged_attention_reference
from runtime.kv.codecs import CODECS


def _case(codec_name, t, ctx, seed=0, hq=6, hkv=2, d=64, device="cpu"):
    c = CODECS[codec_name]
    g = torch.Generator().manual_seed(seed)
    lanes, per_lane = len(ctx), -(-max(ctx) // PAGE)
    total = lanes * per_lane + 2
    pool = c.encode(torch.randn(total, PAGE, hkv, d, generator=g), torch.randn(total, PAGE, hkv, d, generator=g))
    block_table = torch.randperm(total, generator=g)[: lanes * per_lane].view(lanes, per_lane).int()
    q = c.prepare_queries(torch.randn(lanes, t, hq, d, generator=g))
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    want = paged_attention_reference(q, pool, c, block_table, ctx_t, d ** -0.5)
    dev = {k: v.to(device) for k, v in pool.items()}
    return c, q.to(device), dev, block_table.to(device), ctx_t.to(device), want


@pytest.mark.parametrize("codec", ["bf16", "int8", "rk4v4-e8"])
@pytest.mark.parametrize("segment", [64, 100, 4096])  # several segments (one ending mid-page), or one
def test_segments_merge_to_attention_over_every_key(codec, segment):
    c, q, pool, bt, ctx, want = _case(codec, t=40, ctx=[300, 41])  # chunk start mid-page; a lane of one chunk
    got = vendor.prefill_attention_segments(q, pool, c, bt, [300, 41], 64 ** -0.5, segment_keys=segment)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("t, ctx", [(300, [1100, 300]), (256, [777, 513]), (40, [40, 41])])
def test_every_shape_the_kernel_sees_is_a_multiple_of_the_step(t, ctx, monkeypatch):
    """cuDNN builds a plan per shape: query rows and keys of every segment come in multiples of SHAPE_STEP (tail
    chunks and prefixes of any length: the prefix's remainder keys move into the causal block, padded at both ends),
    and the real rows' results stay attention over every key."""
    monkeypatch.setattr(vendor, "SHAPE_STEP", 64)  # small cases; 256 on a GPU
    shapes, real = [], vendor._segment_reference
    monkeypatch.setattr(vendor, "_segment_reference", lambda q, k, v, causal, scale:
                        shapes.append((q.shape[2], k.shape[2], causal)) or real(q, k, v, causal, scale))
    c, q, pool, bt, _, want = _case("bf16", t=t, ctx=ctx)
    got = vendor.prefill_attention_segments(q, pool, c, bt, ctx, 64 ** -0.5, segment_keys=512)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-5, rtol=1e-4)
    assert shapes and all(rows % 64 == 0 and keys % 64 == 0 for rows, keys, _ in shapes), shapes
    assert [causal for _, _, causal in shapes].count(True) == len(ctx)


def test_vendor_route_only_for_known_lengths_of_long_gpu_chunks(monkeypatch):
    q = torch.zeros(1, 512, 4, 64)
    assert not vendor.vendor_prefill(q, (512,), CODECS["bf16"], 2)  # the CPU runs the paged kernel's reference
    monkeypatch.setattr(vendor, "MODE", "triton")
    assert not vendor.vendor_prefill(q, (512,), CODECS["bf16"], 2)
    assert not vendor.route_wanted(8192, (131072,))
    monkeypatch.setattr(vendor, "MODE", "auto")  # deep chunks, and whole chunks from MIN_CONTEXT keys
    assert vendor.route_wanted(8192, (131072,)) and vendor.route_wanted(256, (vendor.DEEP_CONTEXT, 900))
    assert vendor.route_wanted(8192, (vendor.MIN_CONTEXT,)) and vendor.route_wanted(2048, (16384, 2048))
    assert not vendor.route_wanted(808, (9000,))  # an odd tail at shallow depth: a new cuDNN plan for a few percent
    assert not vendor.route_wanted(2048, (9000,))  # a whole chunk's rows at an odd start (a reused prefix)
    assert not vendor.route_wanted(4096, (vendor.MIN_CONTEXT - 1,)) and not vendor.route_wanted(255, (131072,))
    assert not vendor.route_wanted(8192, None)  # lengths unknown on the host (CUDA-graph pieces)
    monkeypatch.setattr(vendor, "MODE", "cudnn")
    assert vendor.route_wanted(256, (300,))


@pytest.mark.parametrize("fault", [None, "lse_base2", "causal_top_left_off", "gqa_interleaved", "strided_refused"])
def test_probe_turns_the_route_off_when_the_kernel_disagrees(fault, monkeypatch, capsys):
    def kernel(q, k, v, causal, scale):
        if vendor._OPERANDS["contiguous"]:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        if fault == "strided_refused" and not (q.is_contiguous() and k.is_contiguous()):
            raise RuntimeError("cuDNN: unsupported strides")
        if fault == "gqa_interleaved":  # heads grouped the other way round
            k = k.repeat(1, q.shape[1] // k.shape[1], 1, 1)
            v = v.repeat(1, q.shape[1] // v.shape[1], 1, 1)
        o, lse = vendor._segment_reference(q, k, v, causal and fault != "causal_top_left_off", scale)
        return o, lse * (1.4426950408889634 if fault == "lse_base2" else 1.0)

    monkeypatch.setattr(vendor, "_BROKEN", [])
    monkeypatch.setattr(vendor, "_OPERANDS", {"contiguous": False})
    monkeypatch.setattr(vendor, "_segment_cudnn", kernel)
    vendor._probe(torch.device("cpu"), 6, 2, 64, torch.float32)
    assert bool(vendor._BROKEN) == (fault not in (None, "strided_refused"))
    assert vendor._OPERANDS["contiguous"] == (fault is not None)  # every failure tries contiguous copies too
    if vendor._BROKEN:
        assert "paged kernel takes over" in capsys.readouterr().err


def test_memory_plan_counts_the_segments_the_kernel_gathers():
    from runtime import memory_plan

    assert memory_plan.ATTENTION_SEGMENT_KEYS == vendor.SEGMENT_KEYS
    assert memory_plan.ATTENTION_SEGMENT_MIN_ROWS == vendor.MIN_ROWS
    assert memory_plan.ATTENTION_SHAPE_STEP == vendor.SHAPE_STEP


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention needs a CUDA GPU")
@pytest.mark.parametrize("codec", ["bf16", "rk4v4-e8"])
def test_cudnn_segments_match_the_paged_kernel(codec, monkeypatch):
    from runtime.kernels.paged_attention import paged_attention

    monkeypatch.setattr(vendor, "MODE", "cudnn")  # at any depth

    c, q, pool, bt, ctx, want = _case(codec, t=512, ctx=[3000, 700], hq=24, hkv=4, d=256, device="cuda")
    q = q.to(torch.bfloat16)
    assert vendor.vendor_prefill(q, [3000, 700], c, 4), vendor._BROKEN  # the probe passes
    got = vendor.prefill_attention_segments(q, pool, c, bt, [3000, 700], 256 ** -0.5, segment_keys=1024)
    assert not vendor._BROKEN, vendor._BROKEN
    paged = paged_attention(q, pool, c, bt, ctx, 256 ** -0.5)
    torch.testing.assert_close(got.float().cpu(), paged.float().cpu(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float().cpu(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("codec", ["int8", "fp8", "nvfp4", "rk4v4-e8", "rk2v4-e8", "k8v4"])
@pytest.mark.parametrize("side", ["k", "v"])
def test_kv_decode_kernel_matches_the_codec_decoders(codec, side, kernel_device, monkeypatch):
    """The one-launch decode of a lane's positions out of the pages (the cuDNN route's compressed segments) against
    the codec's torch decoders, rows starting and ending mid-page."""
    from runtime.kernels.kv_decode import kv_decode, kv_decode_reference

    monkeypatch.setattr("runtime.kernels.CPU_KERNELS", "triton")
    c, _, pool, bt, _, _ = _case(codec, t=4, ctx=[300], hkv=2, d=256, device=kernel_device)
    want = kv_decode_reference({k: v.cpu() for k, v in pool.items()}, c, side, bt[0].cpu(), 37, 290)
    got = kv_decode(pool, c, side, bt[0], 37, 290, 256)
    assert got.shape == want.shape == (2, 253, 256) and got.dtype == torch.float16
    torch.testing.assert_close(got.cpu(), want, atol=0, rtol=0)
