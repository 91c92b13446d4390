"""Every Triton kernel against its torch reference: fresh random inputs, NaN-poisoned outputs, odd
shapes, and a relative-error tolerance named per dtype. On CPU they run under TRITON_INTERPRET=1."""

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.triton_kernels  # the kernels themselves, never their torch references

from format.numeric import FORMATS, GroupedFormat  # noqa: E402
from format.quantize import encode_rows  # noqa: E402
from runtime.kv.codecs import CODECS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# max |kernel - reference| / max |reference|; on a GPU, float32 tl.dot runs as TF32 (10-bit mantissa)
REL_TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _check(got, want, dtype=DTYPE):
    assert not torch.isnan(got).any(), "kernel left NaN-poisoned output unwritten"
    err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12)).item()
    assert err <= REL_TOL[dtype], f"relative error {err:.2e} > {REL_TOL[dtype]:.0e}"


def _poison(shape, dtype=DTYPE):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def _packed(n, k, fmt, seed):
    from runtime.kernels.qlinear import PackedLinear

    g = torch.Generator().manual_seed(seed)
    base, high, scale = encode_rows(torch.randn(n, k, generator=g), fmt)
    u8 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).to(DEVICE) if b else None  # noqa: E731
    return PackedLinear(u8(base), u8(high), u8(scale), n, k, fmt)


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if isinstance(f, GroupedFormat)], ids=lambda f: f.name)
@pytest.mark.parametrize("t,n,k", [(1, 70, 200), (3, 33, 128), (16, 64, 130), (19, 65, 257), (1, 40, 2048), (40, 33, 300)])
def test_qlinear(fmt, t, n, k):
    from runtime.kernels.qlinear import qlinear, qlinear_reference

    from runtime.kernels.qgemv_int8 import INT8_BITS, qgemv_int8_reference
    from runtime.kernels.qlinear import GEMV_MAX_T, GEMV_PATH, rows_path

    w = _packed(n, k, fmt, seed=t * 1000 + n)
    x = torch.randn(t, k, device=DEVICE).to(DTYPE)
    # the integer paths (one row: dp4a; row blocks: dp4a or int8 tensor cores) round x to 14 bits: their own reference
    int8 = fmt.bits in INT8_BITS and GEMV_PATH == "int8" and (t == 1 or (t <= GEMV_MAX_T and rows_path(fmt.bits, t) in
                                                                          ("int8", "mma", "lanes")))
    _check(qlinear(x, w, out=_poison((t, n))), (qgemv_int8_reference if int8 else qlinear_reference)(x, w))


def test_prefill_gemm_takes_resident_dense_copies(monkeypatch):
    """keep_dense_copies keeps matrices in order while the budget lasts (one too large is passed over, a later
    one that fits is kept); a kept matrix's prefill GEMM multiplies its copy, not a fresh dequantization, and
    gives the same rows; decode rows (T <= GEMV_MAX_T) never read it."""
    import runtime.kernels.qlinear as ql

    fmt = FORMATS["Q4G64_F16S"]
    small, large, last = _packed(40, 256, fmt, 1), _packed(96, 512, fmt, 2), _packed(24, 256, fmt, 3)
    item = torch.empty((), dtype=DTYPE).element_size()
    budget = (40 * 256 + 24 * 256) * item + 100  # not the large one
    x = torch.randn(ql.GEMV_MAX_T + 9, 256, device=DEVICE).to(DTYPE)
    before = ql.qlinear(x, small, out=_poison((x.shape[0], 40)))
    kept = ql.keep_dense_copies([small, large, last], budget, DTYPE)
    assert kept == [small, last] and large.resident_dense is None
    assert small.resident_dense.shape == (40, 256) and small.resident_dense.dtype == DTYPE
    monkeypatch.setattr(ql, "dequantize_rows", lambda *a: pytest.fail("a kept matrix was dequantized again"))
    got = ql.qlinear(x, small, out=_poison((x.shape[0], 40)))
    assert torch.equal(got, before)
    _check(got, ql.qlinear_reference(x, small))
    assert ql.keep_dense_copies([_packed(8, 128, fmt, 4)], 0, DTYPE) == []


@pytest.mark.parametrize("prequant", [True, False])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("n,k", [(70, 200), (33, 1024), (5, 128)])
def test_qgemv_int8(bits, n, k, prequant):
    """The dp4a GEMV (emulated under the interpreter) == its integer reference to float rounding,
    and within the 14-bit activation rounding of the exact float product."""
    from runtime.kernels.qgemv_int8 import qgemv_int8, qgemv_int8_reference
    from runtime.kernels.qlinear import qlinear_reference

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(n, k, fmt, seed=n + k + bits)
    x = torch.randn(1, k, device=DEVICE) * torch.rand(1, k, device=DEVICE) * 4  # uneven magnitudes per group
    x[0, :7] = 0.0  # an all-but-zero stretch
    x[0, 64:128] *= 1e-33  # a group too small to scale: it counts as zero in kernel and reference
    got = qgemv_int8(x.float(), w, _poison((1, n), torch.float32), block_n=16, block_k=128,
                     split=1 if k <= 128 else 2, num_warps=4, prequant=prequant)
    assert not torch.isnan(got).any()
    want = qgemv_int8_reference(x.float(), w)
    # same integers; float32 group sums in another order on the GPU
    assert ((got - want).abs().max() / want.abs().max()).item() < (1e-5 if DEVICE == "cpu" else 1e-4)
    exact = qlinear_reference(x.float(), w)
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 5e-4


@pytest.mark.parametrize("bits", [4, 5])
@pytest.mark.parametrize("channels,extra,k", [(96, 40, 256), (70, 0, 512)])
def test_qkvz_product_applies_the_conv_in_its_launch(bits, channels, extra, k, monkeypatch):
    """One row times a GDN qkvz matrix with the width-4 causal conv + SiLU on its first `channels` columns in the
    dp4a GEMV's epilogue (NINFER_CONV_EPILOGUE): the product's numbers then conv1d's lanes kernel (bit for bit on the
    CPU), the lane's window moved on a step and no other lane's touched; the z columns are the plain product's."""
    import runtime.kernels.qlinear as ql
    from runtime.kernels.conv1d import causal_conv1d_lanes

    monkeypatch.setattr(ql, "CONV_EPILOGUE", True)
    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(channels + extra, k, fmt, seed=channels + k + bits)
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(1, k, generator=g).to(DEVICE, DTYPE)
    stack = torch.randn(3, 2, 3, channels, generator=g).to(DEVICE, torch.bfloat16)  # [lanes, slots, window, C]
    weight = torch.randn(channels, 4, generator=g).to(DEVICE)
    lane = torch.tensor([1], dtype=torch.int32, device=DEVICE)
    want_stack = stack.clone()
    got = ql.qlinear_conv(x, w, stack, lane, weight)
    assert got is not None and got.shape == (1, channels + extra)
    plain = ql.qlinear(x, w)
    conv = causal_conv1d_lanes(plain[:, :channels].reshape(1, 1, channels).to(torch.bfloat16), want_stack, lane,
                               weight).reshape(1, channels).to(DTYPE)
    want = torch.cat([conv, plain[:, channels:]], dim=1)
    if DEVICE == "cpu":
        assert torch.equal(got, want) and torch.equal(stack, want_stack)
    else:  # the same roundings; fused multiply-adds may differ between the two kernels
        _check(got, want)
        _check(stack.float(), want_stack.float(), torch.bfloat16)
    assert ql.qlinear_conv(torch.cat([x, x]), w, stack, lane, weight) is None  # row blocks: two launches
    monkeypatch.setattr(ql, "CONV_EPILOGUE", False)
    assert ql.qlinear_conv(x, w, stack, lane, weight) is None


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("inter,k", [(100, 256), (35, 512)])
def test_gate_up_product_applies_swiglu_in_its_launch(bits, inter, k):
    """One row times a gate/up pair with SwiGLU in the dp4a GEMV's epilogue (a program's even rows gate rows, odd
    rows the matching up rows; the last program's rows past I masked): the numbers of the product and then the
    swiglu kernel (bit for bit on the CPU), in one launch; row blocks are left to the caller's two launches."""
    from runtime.kernels.qlinear import qlinear, qlinear_swiglu
    from runtime.kernels.swiglu import swiglu

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(2 * inter, k, fmt, seed=inter + k + bits)
    x = torch.randn(1, k, device=DEVICE).to(DTYPE)
    got = qlinear_swiglu(x, w)
    assert got is not None and got.shape == (1, inter)
    want = swiglu(qlinear(x, w))
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # the same roundings; the sigmoid's instructions may differ between the two kernels
        _check(got, want)
    assert qlinear_swiglu(torch.cat([x, x]), w) is None


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("t,n,k", [(3, 70, 200), (5, 33, 1024)])
def test_qgemm_rows_int8(bits, t, n, k):
    """The dp4a kernel for a few rows of x: each row == the one-row integer reference; rows past T
    (a partial row block) are neither read nor written."""
    from runtime.kernels.qgemv_int8 import qgemm_rows_int8, qgemv_int8_reference

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(n, k, fmt, seed=n + k + bits + t)
    x = torch.randn(t, k, device=DEVICE) * torch.rand(t, k, device=DEVICE) * 4
    x[1, 64:128] = 0.0
    got = qgemm_rows_int8(x, w, _poison((t, n), torch.float32), block_t=4, block_n=16, block_k=128,
                          split=1 if k <= 256 else 2, num_warps=4)
    assert not torch.isnan(got).any()
    want = qgemv_int8_reference(x, w)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if DEVICE == "cpu" else 1e-4), f"relative error {err:.2e}"


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("t,n,k,split", [(2, 70, 200, 1), (3, 33, 1024, 2), (11, 40, 512, 4)])
def test_qgemv_lanes(bits, t, n, k, split):
    """The lanes kernel (rows of x unrolled over one unpacked tile) == the integer reference row by row;
    a partial last block of rows (t = 3 of 4, 11 = 8 + 3) neither reads nor writes past T."""
    from runtime.kernels.qgemv_lanes import qgemv_lanes, qgemv_lanes_reference

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(n, k, fmt, seed=n + k + bits + t)
    x = torch.randn(t, k, device=DEVICE) * torch.rand(t, k, device=DEVICE) * 4
    x[1, 64:128] = 0.0
    y = _poison((t + 1, n), torch.float32)
    got = qgemv_lanes(x, w, y[:t], block_n=16, block_k=128, split=split if k > 256 else 1, num_warps=4)
    assert not torch.isnan(got).any() and torch.isnan(y[t]).all()
    want = qgemv_lanes_reference(x, w)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if DEVICE == "cpu" else 1e-4), f"relative error {err:.2e}"


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("t,n,k,split", [(3, 70, 200, 1), (16, 33, 1024, 2), (5, 130, 512, 4)])
def test_qgemm_rows_mma(bits, t, n, k, split):
    """The int8 tensor-core kernel for row blocks == the integer reference row by row."""
    from runtime.kernels.qgemv_int8 import qgemm_rows_mma, qgemv_int8_reference

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(n, k, fmt, seed=n + k + bits + t)
    x = torch.randn(t, k, device=DEVICE) * torch.rand(t, k, device=DEVICE) * 4
    x[1, 64:128] = 0.0
    got = qgemm_rows_mma(x, w, _poison((t, n), torch.float32), block_n=64, split=split if k > 256 else 1, num_warps=4)
    assert not torch.isnan(got).any()
    want = qgemv_int8_reference(x, w)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < (1e-5 if DEVICE == "cpu" else 1e-4), f"relative error {err:.2e}"


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("t,n,k,split", [(3, 70, 200, 1), (16, 33, 1024, 2), (5, 130, 512, 4)])
def test_qgemm_rows_bf16(bits, t, n, k, split, prefetch):
    """The bf16 tensor-core row kernel == the exact float product (codes exact in bf16, scales applied
    to each group's float32 dot), every row and column written."""
    from runtime.kernels.qgemm_rows_bf16 import qgemm_rows_bf16, qgemm_rows_bf16_reference

    fmt = next(f for f in FORMATS.values() if isinstance(f, GroupedFormat) and f.bits == bits)
    w = _packed(n, k, fmt, seed=n + k + bits + t)
    x = (torch.randn(t, k, device=DEVICE) * torch.rand(t, k, device=DEVICE) * 4).to(DTYPE)
    x[1, 64:128] = 0.0
    got = qgemm_rows_bf16(x, w, _poison((t, n), torch.float32), block_n=64, split=split if k > 256 else 1,
                          num_warps=4, prefetch=prefetch)
    assert not torch.isnan(got).any(), "kernel left NaN-poisoned output unwritten"
    want = qgemm_rows_bf16_reference(x.float(), w)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-5, f"relative error {err:.2e}"


def test_rows_path_names_a_bad_override(monkeypatch):
    from runtime.kernels import qlinear as ql

    monkeypatch.setattr(ql, "ROWS_PATH", "fast")
    with pytest.raises(ValueError, match="NINFER_GEMV_ROWS='fast' is not one of"):
        ql.rows_path(4)
    monkeypatch.setattr(ql, "ROWS_PATH", "auto")
    assert [ql.rows_path(b) for b in (4, 5, 6, 8)] == ["mma", "mma", "mma", "tensor"]
    assert [ql.rows_path(b, 2) for b in (4, 5, 6, 8)] == ["mma", "lanes", "lanes", "lanes"]
    assert [ql.rows_path(b, 4) for b in (4, 5, 6, 8)] == ["mma", "mma", "mma", "lanes"]


@pytest.mark.parametrize("fmt,path", [("Q4G64_F16S", "mma"), ("Q5G64_F16S", "mma"), ("Q6G64_F16S", "mma"),
                                      ("Q4G64_F16S", "int8"), ("Q5G64_F16S", "int8"), ("Q5G64_F16S", "bf16"),
                                      ("W8G32_F16S", "bf16"), ("Q4G64_F16S", "lanes"), ("Q6G64_F16S", "lanes"),
                                      ("W8G32_F16S", "lanes"), ("Q4G64_F16S", "frag"), ("Q5G64_F16S", "frag")])
def test_verify_rows_score_as_decode_steps(fmt, path, monkeypatch):
    """qlinear on a 4-row verify block agrees with qlinear on each row alone: bit for bit on the dp4a
    row kernels (same tiles, splits and sum order), to float32 summation order on the int8 tensor cores,
    to the single row's 14-bit activation rounding on the bf16 tensor cores (exact products)."""
    from runtime.kernels import qlinear as ql

    if path == "frag":
        if DEVICE != "cuda":
            pytest.skip("the fragment kernel is inline PTX for NVIDIA GPUs; tests/test_frag_kernel.py emulates it")
        monkeypatch.setattr(ql, "FRAG_MODE", "rows")
    else:
        monkeypatch.setattr(ql, "ROWS_PATH", path)
    w = _packed(48, 1024, FORMATS[fmt], seed=11)
    x = torch.randn(4, 1024, device=DEVICE).to(DTYPE)
    block = ql.qlinear(x, w, out=_poison((4, 48))).float()
    rows = torch.cat([ql.qlinear(x[i : i + 1], w, out=_poison((1, 48))) for i in range(4)]).float()
    err = ((block - rows).abs().max() / rows.abs().max()).item()
    if path in ("int8", "lanes"):
        assert torch.equal(block, rows), f"max diff {(block - rows).abs().max().item():.3e}"
    elif path in ("bf16", "frag"):  # exact products against single rows rounded to 14 bits: within that rounding
        assert err < (5e-4 if DTYPE == torch.float32 else 1e-2), f"relative error {err:.2e}"
    else:
        assert err < (1e-6 if DTYPE == torch.float32 else 1e-2), f"relative error {err:.2e}"


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("t,h", [(1, 64), (5, 100)])
def test_rmsnorm(residual, t, h):
    from runtime.kernels.rmsnorm import rmsnorm, rmsnorm_reference

    x = torch.randn(t, h, device=DEVICE).to(DTYPE)
    w = (torch.randn(h, device=DEVICE) * 0.1).to(DTYPE)
    r = torch.randn(t, h, device=DEVICE).to(DTYPE) if residual else None
    want, want_res = rmsnorm_reference(x, w, 1e-6, r)
    got, got_res = rmsnorm(x, w, 1e-6, residual=r.clone() if r is not None else None, out=_poison((t, h)))
    _check(got, want)
    if residual:
        _check(got_res, want_res)


@pytest.mark.parametrize("t,inter", [(1, 96), (5, 1030)])
def test_swiglu(t, inter):
    from runtime.kernels.swiglu import swiglu, swiglu_reference

    gu = torch.randn(t, 2 * inter, device=DEVICE).to(DTYPE)
    _check(swiglu(gu, out=_poison((t, inter))), swiglu_reference(gu))


def test_gdn_value_tile_rule(monkeypatch):
    """The rule (default, NINFER_GDN_TILE unset or block_v 0): one-token steps keep 32 value columns a program;
    verify blocks of 4+ tokens widen the tile while 192+ programs still run (27B: 48 value heads of 128); a block_v
    given is taken as given."""
    from runtime.kernels import gdn_fused as gf

    assert gf.GDN_TUNING["block_v"] == 0 or "NINFER_GDN_TILE" in os.environ  # the rule by default
    monkeypatch.setitem(gf.GDN_TUNING, "block_v", 0)
    assert [gf.gdn_block_v(lanes, t, 48, 128) for lanes, t in ((1, 1), (8, 1), (1, 4), (1, 8))] == [32, 32, 32, 32]
    assert [gf.gdn_block_v(lanes, t, 48, 128) for lanes, t in ((2, 4), (3, 4), (4, 4), (8, 8))] == [64, 64, 128, 128]
    assert gf.gdn_block_v(4, 4, 48, 16) == 16  # narrow value heads: the head itself
    monkeypatch.setitem(gf.GDN_TUNING, "block_v", 32)
    assert gf.gdn_block_v(4, 4, 48, 128) == 32
    monkeypatch.setitem(gf.GDN_TUNING, "block_v", 64)
    assert gf.gdn_block_v(1, 1, 48, 128) == 64 and gf.gdn_block_v(4, 4, 48, 32) == 32


@pytest.mark.parametrize("tile", [None, (16, 1), (64, 2)])
@pytest.mark.parametrize("project", [False, True])
@pytest.mark.parametrize("b,t,hk,ratio,dk,dv", [(1, 1, 2, 2, 16, 32), (2, 3, 1, 3, 32, 64)])
def test_gdn_fused_matches_separate_ops(b, t, hk, ratio, dk, dv, project, tile, monkeypatch):
    """Preparation folded into the recurrence (l2 norm, key-head sharing, decay, beta, and with
    `project` the alpha/beta projections) == the separate torch ops + recurrent reference; snapshots
    into slots 1..T of a lane-indexed stack; on a GPU at other tiles too (NINFER_GDN_TILE: value columns per
    program, warps)."""
    from runtime.kernels import gdn_fused as gf
    from runtime.kernels.gdn_fused import gdn_fused, gdn_fused_reference

    if tile is not None:
        if DEVICE != "cuda":
            pytest.skip("GDN tiles choose a GPU launch's shape; the interpreter runs one tile")
        monkeypatch.setitem(gf.GDN_TUNING, "block_v", tile[0])
        monkeypatch.setitem(gf.GDN_TUNING, "warps", tile[1])

    hv = hk * ratio
    x = torch.randn(b, t, 2 * hk * dk + hv * dv, device=DEVICE).to(DTYPE)
    hidden = 1100  # two K blocks, the second partial
    h_in = torch.randn(b * t, hidden, device=DEVICE).to(DTYPE)
    wa, wb = (torch.randn(hv, hidden, device=DEVICE).to(DTYPE) / hidden ** 0.5 for _ in range(2))
    if project:
        alpha, beta = ((h_in.float() @ w.float().t()).to(DTYPE) for w in (wa, wb))  # the separate projections
    else:
        alpha, beta = torch.randn(b * t, hv, device=DEVICE).to(DTYPE), torch.randn(b * t, hv, device=DEVICE).to(DTYPE)
    a_log, dt_bias = torch.rand(hv, device=DEVICE) * 2, torch.randn(hv, device=DEVICE) * 0.5
    stack = torch.randn(b + 1, t + 2, hv, dk, dv, device=DEVICE)
    lanes = torch.arange(b, 0, -1, device=DEVICE, dtype=torch.int32)  # lanes b..1, lane 0 untouched
    before = stack.clone()
    want_o, want_steps = gdn_fused_reference(x.cpu(), alpha.cpu(), beta.cpu(), a_log.cpu(), dt_bias.cpu(),
                                             before[lanes.long(), 0].cpu(), hk)
    got = gdn_fused(x, None if project else alpha, None if project else beta, a_log, dt_bias, stack, lanes, hk,
                    snapshot=True, out=_poison((b, t, hv, dv), torch.float32),
                    projections=(h_in, wa, wb) if project else None)
    _check(got.cpu(), want_o, torch.float32)
    for j, lane in enumerate(lanes.tolist()):
        _check(stack[lane, 0].cpu(), want_steps[j, -1], torch.float32)
        for step in range(t):
            _check(stack[lane, step + 1].cpu(), want_steps[j, step], torch.float32)
    assert torch.equal(stack[0], before[0])
    assert torch.equal(stack[:, t + 1], before[:, t + 1])  # slots past the snapshots are left alone


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("b,t,snapshot", [(1, 1, False), (3, 1, False), (2, 3, True)])
def test_gdn_norm_in_the_recurrence_launch(b, t, snapshot, quantized, monkeypatch):
    """NINFER_GDN_NORM_EPILOGUE: the output norm done by the last of a head's value tiles to finish (a counter per
    head) gives the rows, the output product's dp4a words and the states of the recurrence and gated_norm's two
    launches — bit for bit on the CPU, where the interpreter splits each head over 2 programs — and leaves every
    counter zero for the next launch; a counter buffer too small for the launch falls back to the two launches."""
    from runtime.kernels import gdn_fused as gf
    from runtime.kernels.gated_norm import gated_norm
    from runtime.kernels.qgemv_int8 import QuantizedX

    hk, ratio, dk, dv = 2, 2, 16, 64
    hv = hk * ratio
    monkeypatch.setattr(gf, "INTERPRETER_BLOCK_V", dv // 2)  # two value tiles a head: the counter decides
    g = torch.Generator().manual_seed(b * 10 + t)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    x = rnd(b, t, 2 * hk * dk + hv * dv).to(DTYPE)
    alpha, beta = rnd(b * t, hv).to(DTYPE), rnd(b * t, hv).to(DTYPE)
    a_log, dt_bias = torch.rand(hv, generator=g).to(DEVICE) * 2, rnd(hv) * 0.5
    zs = rnd(b * t, hv * dv + 5).to(DTYPE)[:, 5:]  # a strided view, as the qkvz split gives
    weight = rnd(dv).to(DTYPE)
    stack = rnd(b + 1, t + 1, hv, dk, dv)
    lanes = torch.arange(b, 0, -1, device=DEVICE, dtype=torch.int32)
    w = _packed(8, hv * dv, FORMATS["Q4G64_F16S"], seed=3)

    def words():
        if not quantized:
            return None
        xq = QuantizedX.empty(b * t, w, DEVICE)
        xq.words.fill_(-1)  # poison: every word must be written
        return xq

    states, want_xq = stack.clone(), words()
    o = gf.gdn_fused(x, alpha, beta, a_log, dt_bias, states, lanes, hk, snapshot)
    want = gated_norm(o.reshape(b * t, hv, dv), zs, weight, 1e-6, DTYPE, xq=want_xq)
    for counts in (torch.zeros(b * hv, dtype=torch.int32, device=DEVICE), torch.zeros(1, dtype=torch.int32,
                                                                                        device=DEVICE)):
        got_states, got_xq = stack.clone(), words()
        gate = gf.GdnGate(zs, weight, 1e-6, _poison((b * t, hv * dv)), counts, got_xq)
        got = gf.gdn_fused(x, alpha, beta, a_log, dt_bias, got_states, lanes, hk, snapshot, gate=gate)
        assert got is gate.out
        if DEVICE == "cpu":
            assert torch.equal(got, want) and torch.equal(got_states, states)
        else:
            _check(got.float(), want.float())
        if quantized:
            assert torch.equal(got_xq.words, want_xq.words) if DEVICE == "cpu" else \
                (got_xq.words != want_xq.words).float().mean() < 0.01
        assert not counts.any()  # zero again: the next launch (or graph replay) counts from zero
    with pytest.raises(ValueError, match="do not fit"):
        gf.gdn_fused(x, alpha, beta, a_log, dt_bias, stack.clone(), lanes, hk,
                     gate=gf.GdnGate(zs[:, 1:], weight, 1e-6, _poison((b * t, hv * dv - 1)), counts))


@pytest.mark.parametrize("sections", [False, True])
@pytest.mark.parametrize("dk", [16, 128])
def test_gdn_chunked_matches_the_recurrence(dk, sections):
    """fla's chunked prefill kernel (raw gates and betas in, lane-indexed float32 state) == the torch
    recurrence, including the carried-in state and the state it leaves behind."""
    from runtime.kernels.gdn_chunked import fla_available, gdn_chunked
    from runtime.kernels.gdn_fused import gdn_fused_reference

    if not fla_available():
        pytest.skip("flash-linear-attention is installed with the gpu extra and runs on CUDA only")
    b, t, hk, ratio, dv = 2, 200, 2, 3, dk
    hv = hk * ratio
    x = torch.randn(b, t, 2 * hk * dk + hv * dv, device=DEVICE).to(DTYPE)
    alpha, beta = torch.randn(b * t, hv, device=DEVICE).to(DTYPE), torch.randn(b * t, hv, device=DEVICE).to(DTYPE)
    a_log, dt_bias = torch.rand(hv, device=DEVICE) * 2, torch.randn(hv, device=DEVICE) * 0.5
    stack = torch.randn(b + 1, 2, hv, dk, dv, device=DEVICE) * 0.1
    lanes = torch.arange(b, 0, -1, device=DEVICE, dtype=torch.int32)
    before = stack.clone()
    want_o, want_steps = gdn_fused_reference(x.cpu(), alpha.cpu(), beta.cpu(), a_log.cpu(), dt_bias.cpu(),
                                             before[lanes.long(), 0].cpu(), hk)
    parts = tuple(p.contiguous() for p in x.split([hk * dk, hk * dk, hv * dv], dim=-1)) if sections else x
    got = gdn_chunked(parts, alpha, beta, a_log, dt_bias, stack, lanes, hk)  # sections: as the prefill conv writes
    _check(got.float().cpu(), want_o, torch.bfloat16)
    for j, lane in enumerate(lanes.tolist()):
        _check(stack[lane, 0].cpu(), want_steps[j, -1], torch.bfloat16)
    assert torch.equal(stack[0], before[0]) and torch.equal(stack[:, 1], before[:, 1])


@pytest.mark.parametrize("tokens,hv,d", [(1, 3, 32), (5, 2, 128), (70, 15, 32)])  # 1,050 rows: 16 per program
def test_gated_norm(tokens, hv, d):
    from runtime.kernels.gated_norm import gated_norm, gated_norm_reference

    o = torch.randn(tokens, hv, d, device=DEVICE)
    z_wide = torch.randn(tokens, hv * d + 7, device=DEVICE).to(DTYPE)  # a strided view, as split() gives
    z = z_wide[:, 7:]
    w = torch.randn(d, device=DEVICE).to(DTYPE)
    _check(gated_norm(o, z, w, 1e-6, DTYPE, out=_poison((tokens, hv * d))), gated_norm_reference(o, z, w, 1e-6, DTYPE))


@pytest.mark.parametrize("t,chunk", [(5, 2), (11, 4), (9, 64)])
def test_causal_conv1d_lanes_time_chunks(t, chunk, monkeypatch):
    """A long block (prefill) runs in time chunks side by side, each starting from the window before
    it (partly carried state when the chunk starts within three steps of the block): the same outputs
    and final state as the reference, other lanes untouched."""
    from runtime.kernels import conv1d
    from runtime.kernels.conv1d import causal_conv1d_lanes, causal_conv1d_reference

    monkeypatch.setattr(conv1d, "CONV_TIME_CHUNK", chunk)
    b, c = 2, 300
    x = torch.randn(b, t, c + 9, device=DEVICE).to(DTYPE)[..., :c]
    stack = torch.randn(3, 2, 3, c, device=DEVICE).to(DTYPE)
    lanes = torch.tensor([2, 0], device=DEVICE, dtype=torch.int32)
    w = torch.randn(c, 4, device=DEVICE).to(DTYPE)
    before = stack.clone()
    got = causal_conv1d_lanes(x, stack, lanes, w, out=_poison((b, t, c)))
    for j, lane in enumerate(lanes.tolist()):
        want_y, want_s = causal_conv1d_reference(x[j : j + 1].cpu(), before[lane, 0][None].cpu(), w.cpu())
        _check(got[j : j + 1].cpu(), want_y)
        _check(stack[lane, 0].cpu(), want_s[0])
    assert torch.equal(stack[1], before[1]) and torch.equal(stack[:, 1], before[:, 1])


@pytest.mark.parametrize("t,chunk", [(5, 64), (70, 16)])
def test_causal_conv1d_lanes_writes_the_gdn_sections_apart(t, chunk, monkeypatch):
    """split_keys: the conv's q, k and v sections come out as three dense tensors (blocks straddling a section
    boundary included) holding exactly the whole output's columns, the state moved on alike; a split that does not
    fit the channels is refused."""
    from runtime.kernels import conv1d
    from runtime.kernels.conv1d import causal_conv1d_lanes

    monkeypatch.setattr(conv1d, "CONV_TIME_CHUNK", chunk)
    b, c, keys = 2, 300, 70  # 70 + 70 + 160: no section a whole number of blocks
    x = torch.randn(b, t, c, device=DEVICE).to(DTYPE)
    stack = torch.randn(3, 2, 3, c, device=DEVICE).to(DTYPE)
    lanes = torch.tensor([2, 0], device=DEVICE, dtype=torch.int32)
    w = torch.randn(c, 4, device=DEVICE).to(DTYPE)
    whole_stack, split_stack = stack.clone(), stack.clone()
    whole = causal_conv1d_lanes(x, whole_stack, lanes, w)
    q, k, v = causal_conv1d_lanes(x, split_stack, lanes, w, split_keys=keys)
    assert all(part.is_contiguous() for part in (q, k, v))
    assert torch.equal(torch.cat([q, k, v], dim=-1), whole) and torch.equal(split_stack, whole_stack)
    with pytest.raises(ValueError, match="do not split"):
        causal_conv1d_lanes(x, stack.clone(), lanes, w, split_keys=150)


@pytest.mark.parametrize("t", [1, 2, 5])
def test_causal_conv1d_lanes(t):
    """Lane-indexed width-4 conv on a slot stack: equals the reference per lane, snapshots hold each
    step's window, other lanes and slots stay untouched; x may be a strided column slice."""
    from runtime.kernels.conv1d import causal_conv1d_lanes, causal_conv1d_reference

    b, c = 2, 300
    wide = torch.randn(b * t, c + 9, device=DEVICE).to(DTYPE)
    x = wide[:, :c].reshape(b, t, c)  # as the engine's qkv (a column slice of qkvz): at t = 1 strides (c + 9, c, 1)
    stack = torch.randn(3, t + 2, 3, c, device=DEVICE).to(DTYPE)
    lanes = torch.tensor([2, 0], device=DEVICE, dtype=torch.int32)
    w = torch.randn(c, 4, device=DEVICE).to(DTYPE)
    before = stack.clone()
    got = causal_conv1d_lanes(x, stack, lanes, w, snapshot=True, out=_poison((b, t, c)))
    for j, lane in enumerate(lanes.tolist()):
        want_y, want_s = causal_conv1d_reference(x[j : j + 1].cpu(), before[lane, 0][None].cpu(), w.cpu())
        _check(got[j : j + 1].cpu(), want_y)
        _check(stack[lane, 0].cpu(), want_s[0])
        seq = torch.cat([before[lane, 0].cpu(), x[j].cpu()])
        for step in range(t):
            _check(stack[lane, step + 1].cpu(), seq[step + 1 : step + 4])
    assert torch.equal(stack[1], before[1]) and torch.equal(stack[:, t + 1], before[:, t + 1])


@pytest.mark.parametrize("b,t,c", [(1, 1, 40), (2, 2, 300), (1, 9, 64)])
def test_causal_conv1d(b, t, c):
    from runtime.kernels.conv1d import causal_conv1d, causal_conv1d_reference

    x = torch.randn(b, t, c, device=DEVICE).to(DTYPE)
    state = torch.randn(b, 3, c, device=DEVICE).to(DTYPE)
    w = torch.randn(c, 4, device=DEVICE).to(DTYPE)
    want_y, want_s = causal_conv1d_reference(x.cpu(), state.cpu(), w.cpu())
    s = state.clone()
    _check(causal_conv1d(x, s, w, out=_poison((b, t, c))).cpu(), want_y)
    _check(s.cpu(), want_s)


@pytest.mark.parametrize("codec", list(CODECS))
# 12 x 2 rows: a 32-row verify block; 66 x 2 rows: a 64-row prefill block; 256: one split holds every
# key, so the attention kernel writes finished rows itself (no combine launch)
@pytest.mark.parametrize("t,split_tokens", [(1, 0), (5, 0), (3, 64), (12, 64), (66, 0), (66, 256), (1, 256)])
def test_paged_attention(codec, t, split_tokens, monkeypatch):
    from runtime.kernels import paged_attention as module
    from runtime.kernels.paged_attention import PAGE, paged_attention, paged_attention_reference

    monkeypatch.setattr(module, "SPLIT_TOKENS", split_tokens)  # 64: several key splits per lane
    monkeypatch.setattr(module, "PREFILL_MIN_ROWS", 128)  # t = 66: 64-row blocks at test size

    c = CODECS[codec]
    lanes, hq, hkv, d, per_lane = 2, 4, 2, 64, 3
    g = torch.Generator().manual_seed(hash(codec) % 1000 + t)
    total = lanes * per_lane + 1
    pool = c.encode(torch.randn(total, PAGE, hkv, d, generator=g), torch.randn(total, PAGE, hkv, d, generator=g))
    block_table = torch.randperm(total, generator=g)[: lanes * per_lane].view(lanes, per_lane).int()
    ctx = torch.tensor([70, 150], dtype=torch.int32)
    q = c.prepare_queries(torch.randn(lanes, t, hq, d, generator=g))
    want = paged_attention_reference(q, pool, c, block_table, ctx, d ** -0.5)
    dev = {k: v.to(DEVICE) for k, v in pool.items()}
    got = paged_attention(q.to(DEVICE), dev, c, block_table.to(DEVICE), ctx.to(DEVICE), d ** -0.5,
                          out=_poison(q.shape, torch.float32))
    # tensor-core operands are 16-bit: bf16 for the bf16 cache, fp16 for compressed codecs
    _check(got.cpu(), want, torch.bfloat16 if c.key == "bf16" else torch.float16)


def _two_lane_attention(c, t, hq, hkv, d, seed):
    """Two lanes of 70 and 150 cached keys over 3 pages each (a shuffled block table) and their t query rows, on
    DEVICE: (the generator, to draw more from; pool, table, ctx, q)."""
    from runtime.kernels.paged_attention import PAGE

    lanes, per_lane = 2, 3
    g = torch.Generator().manual_seed(seed)
    total = lanes * per_lane
    pool = {k: v.to(DEVICE) for k, v in c.encode(torch.randn(total, PAGE, hkv, d, generator=g),
                                                  torch.randn(total, PAGE, hkv, d, generator=g)).items()}
    table = torch.randperm(total, generator=g).view(lanes, per_lane).int().to(DEVICE)
    ctx = torch.tensor([70, 150], dtype=torch.int32, device=DEVICE)
    q = c.prepare_queries(torch.randn(lanes, t, hq, d, generator=g)).to(DTYPE).to(DEVICE)
    return g, pool, table, ctx, q


@pytest.mark.parametrize("codec", ["bf16", "rk4v4-e8"])
def test_output_gate_rides_in_the_attention_combine(codec, monkeypatch):
    """paged_attention with an AttentionGate part: the combine launch gates its rows (rotated back when the codec
    rotates values) into the block's output rows from the part's first row on, and writes their dp4a words; the
    same bytes as paged_attention then attention_gate. A one-split call (no combine) gates its rows apart."""
    from runtime.kernels import paged_attention as module
    from runtime.kernels.attention_gate import AttentionGate, attention_gate
    from runtime.kernels.paged_attention import paged_attention
    from runtime.kernels.qgemv_int8 import QuantizedX

    monkeypatch.setattr(module, "SPLIT_TOKENS", 64)
    c = CODECS[codec]
    lanes, t, hq, hkv, d = 2, 1, 4, 2, 64
    g, pool, table, ctx, q = _two_lane_attention(c, t, hq, hkv, d, seed=21)
    n = 3 + lanes * t  # the gated block: 3 rows before these (another call's), then these rows
    qg = torch.randn(n, hq * 2 * d, generator=g).to(DTYPE).to(DEVICE)
    nxt = _packed(8, hq * d, FORMATS["Q4G64_F16S"], 2)
    want_xq, xq = QuantizedX.empty(lanes * t, nxt, DEVICE), QuantizedX.empty(n, nxt, DEVICE)
    o = paged_attention(q, pool, c, table, ctx, d ** -0.5)
    want = attention_gate(o.view(lanes * t, hq, d), qg[3:], c.rotate_values, want_xq)
    gate = AttentionGate(qg, c.rotate_values, hq, d, DTYPE, xq)
    got = paged_attention(q, pool, c, table, ctx, d ** -0.5, gate=gate.part(3))
    assert torch.equal(got, want) and torch.equal(gate.finish()[3:], want)
    assert torch.equal(xq.words[3:], want_xq.words)
    monkeypatch.setattr(module, "SPLIT_TOKENS", 256)  # one split: the rows are final, gated after
    o = paged_attention(q, pool, c, table, ctx, d ** -0.5)
    want = attention_gate(o.view(lanes * t, hq, d), qg[:2], c.rotate_values)
    gate = AttentionGate(qg[:2], c.rotate_values, hq, d, DTYPE, QuantizedX.empty(2, nxt, DEVICE))
    assert torch.equal(paged_attention(q, pool, c, table, ctx, d ** -0.5, gate=gate.part(0)), want)
    assert torch.equal(gate.finish(), want) and gate.words_missing


@pytest.mark.parametrize("codec", ["bf16", "rk4v4-e8"])
@pytest.mark.parametrize("t", [1, 66])
def test_combine_rows_kernel_matches_the_one_row_combine(codec, t, monkeypatch):
    """NINFER_COMBINE_ROWS: 16 rows of a (lane, kv head) merged side by side per program (ragged last block, each row
    stopping at its own last visible split) give the one-row combine's rows, plain and gated (rotated back where the
    codec rotates values); words for the next product keep the one-row kernel; a bad value is refused in one line."""
    from runtime.kernels import paged_attention as module
    from runtime.kernels.attention_gate import AttentionGate
    from runtime.kernels.paged_attention import paged_attention
    from runtime.kernels.qgemv_int8 import QuantizedX

    monkeypatch.setattr(module, "SPLIT_TOKENS", 32)  # several splits, rows of a prefill block ending in different ones
    monkeypatch.setattr(module, "PREFILL_MIN_ROWS", 128)
    monkeypatch.setattr(module, "COMBINE_MIN_ROWS", 1)
    c = CODECS[codec]
    lanes, hq, hkv, d = 2, 4, 2, 64
    g, pool, table, ctx, q = _two_lane_attention(c, t, hq, hkv, d, seed=31 + t)
    qg = torch.randn(lanes * t, hq * 2 * d, generator=g).to(DTYPE).to(DEVICE)
    got = {}
    for rows in (0, 16):
        monkeypatch.setattr(module, "COMBINE_ROWS", rows)
        plain = paged_attention(q, pool, c, table, ctx, d ** -0.5)
        gated = paged_attention(q, pool, c, table, ctx, d ** -0.5,
                                gate=AttentionGate(qg, c.rotate_values, hq, d, DTYPE).part(0))
        got[rows] = (plain.clone(), gated.clone())
    tol = torch.float32 if DEVICE == "cpu" else DTYPE
    for one, block in zip(got[0], got[16]):
        _check(block.float().cpu(), one.float().cpu(), tol)
    nxt = _packed(8, hq * d, FORMATS["Q4G64_F16S"], 2)
    xq = QuantizedX.empty(lanes * t, nxt, DEVICE)
    with_words = paged_attention(q, pool, c, table, ctx, d ** -0.5,
                                 gate=AttentionGate(qg, c.rotate_values, hq, d, DTYPE, xq).part(0))
    _check(with_words.float().cpu(), got[0][1].float().cpu(), tol)
    monkeypatch.setattr(module, "COMBINE_ROWS", 12)
    with pytest.raises(ValueError, match="NINFER_COMBINE_ROWS=12"):
        paged_attention(q, pool, c, table, ctx, d ** -0.5)


def test_attention_tiles_by_query_rows():
    """int4 keys take the ldmatrix verify tiles only for 17..32-row blocks (MTP3's 24 rows on the 27B):
    decode rows (16-row blocks) keep the pure decode and their tiles, prefill blocks the prefill tiles;
    codecs without verify tiles never use ldmatrix."""
    from runtime.kernels import paged_attention as pa

    int4 = CODECS["rk4v4-e8"]
    rows_27b = {1: 6, 4: 24, 512: 3072}  # T -> query rows of a 6-head GQA group
    blocks = {t: pa.query_block_rows(int4, rows) for t, rows in rows_27b.items()}
    assert blocks == {1: 16, 4: 32, 512: pa.PREFILL_BLOCK_M}
    assert pa.attention_tile(int4, blocks[1]) == (*pa.ATTENTION_TILES[int4.key], False)
    assert pa.attention_tile(int4, blocks[4]) == (*pa.VERIFY_TILES[int4.key], True)
    assert pa.attention_tile(int4, blocks[512]) == (*pa.PREFILL_TILES[int4.key], pa.PREFILL_PROGRAMS, False)
    for name in ("bf16", "int8", "nvfp4", "rk2v4-e8"):
        assert not pa.attention_tile(CODECS[name], 32)[3], name


@pytest.mark.parametrize("codec", ["bf16", "rk4v4-e8", "rk2v4-e8"])
@pytest.mark.parametrize("t", [1, 4])
def test_paged_attention_spreads_a_short_context_over_the_capacitys_splits(codec, t, monkeypatch):
    """The grid is sized for the block table's capacity (8 splits of 48 keys here); lanes holding 70 and
    150 keys spread them over all 8 splits (16 and 32 keys per split), in the kernel and in the combine."""
    from runtime.kernels import paged_attention as module
    from runtime.kernels.paged_attention import PAGE, paged_attention, paged_attention_reference

    monkeypatch.setattr(module, "MIN_SPLIT", 16)
    monkeypatch.setitem(module.ATTENTION_TUNING, "block_n", 16)
    monkeypatch.setitem(module.ATTENTION_TUNING, "programs", 2 * 2 * 8)  # lanes x kv heads x 8 splits
    c = CODECS[codec]
    lanes, hq, hkv, d, per_lane = 2, 4, 2, 64, 6
    g = torch.Generator().manual_seed(5 + t)
    total = lanes * per_lane
    pool = c.encode(torch.randn(total, PAGE, hkv, d, generator=g), torch.randn(total, PAGE, hkv, d, generator=g))
    block_table = torch.randperm(total, generator=g).view(lanes, per_lane).int()
    ctx = torch.tensor([70, 150], dtype=torch.int32)
    q = c.prepare_queries(torch.randn(lanes, t, hq, d, generator=g))
    assert module.split_size(per_lane * PAGE, lanes * hkv, 16, 2 * 2 * 8) == 48
    want = paged_attention_reference(q, pool, c, block_table, ctx, d ** -0.5)
    dev = {k: v.to(DEVICE) for k, v in pool.items()}
    got = paged_attention(q.to(DEVICE), dev, c, block_table.to(DEVICE), ctx.to(DEVICE), d ** -0.5,
                          out=_poison(q.shape, torch.float32))
    _check(got.cpu(), want, torch.bfloat16 if c.key == "bf16" else torch.float16)


@pytest.mark.parametrize("keyed", [True, False])
def test_moe_routing_breaks_ties_by_the_lowest_expert(keyed, monkeypatch):
    """Equal router logits (a bf16 router rounds many alike) pick the lowest expert ids first, in both the route
    launch and the expert GEMV's own routing (one reduction a pick over probability-then-index keys); experts past
    E are never picked, a probability of 0 (underflow) still is."""
    from runtime.kernels import moe
    from runtime.kernels.moe import route

    if keyed != bool(moe._TOPK_KEYED) and DEVICE == "cuda":
        pytest.skip("a compiled kernel keeps the global it was built with; the other order runs interpreted")
    import triton.language as tl

    monkeypatch.setattr(moe, "_TOPK_KEYED", tl.constexpr(keyed))  # NINFER_TOPK_KEYED=1: one reduction a pick
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0, 2.0, 0.5, -200.0, 0.5],
                           [-200.0, -200.0, 1.0, 1.0, -200.0, -200.0, -200.0, -200.0]], device=DEVICE)
    ids, w = route(logits, 4)
    assert ids.cpu().tolist() == [[1, 2, 4, 0], [2, 3, 0, 1]]
    _check(w.cpu(), torch.softmax(logits.cpu(), -1).gather(1, ids.cpu().long()) /
           torch.softmax(logits.cpu(), -1).gather(1, ids.cpu().long()).sum(-1, keepdim=True), torch.float32)
    ids, _ = route(logits[:, :7], 4)  # 7 experts in a block of 8: the padding lane never comes out
    assert ids.cpu().tolist() == [[1, 2, 4, 0], [2, 3, 0, 1]]


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (5, 37, 4), (3, 256, 8)])
def test_moe_routing(t, e, k):
    from runtime.kernels.moe import route, route_reference

    logits = torch.randn(t, e, device=DEVICE)
    ids, w = route(logits, k)
    want_ids, want_w = route_reference(logits.cpu(), k)
    assert torch.equal(ids.cpu(), want_ids)
    _check(w.cpu(), want_w, torch.float32)
    # the router's columns of a wider product (router and shared gate in one GEMM): rows read at their stride
    wide = torch.cat([logits, torch.full((t, 1), 1e9, device=DEVICE)], dim=1)
    ids, w = route(wide[:, :e], k)
    assert torch.equal(ids.cpu(), want_ids)
    _check(w.cpu(), want_w, torch.float32)


@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if isinstance(f, GroupedFormat)], ids=lambda f: f.name)
def test_expert_gemv(fmt):
    from runtime.kernels.moe import expert_gemv, expert_gemv_reference

    experts, rows_per_expert, k = 5, 24, 136
    w = _packed(experts * rows_per_expert, k, fmt, seed=11)
    x = torch.randn(3, k, device=DEVICE).to(DTYPE)
    x_rows = torch.tensor([0, 0, 1, 2, 2, 1], dtype=torch.int32, device=DEVICE)
    ex = torch.tensor([4, 0, 2, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    _check(expert_gemv(x, x_rows, ex, w, rows_per_expert).cpu(), expert_gemv_reference(x.cpu(), x_rows.cpu(), ex.cpu(), _to_cpu(w), rows_per_expert))
    # x rows by pair index (pair p reads row p // 2): a decode step's k = 2 pairs per token, no index tensor
    _check(expert_gemv(x, 2, ex, w, rows_per_expert).cpu(), expert_gemv_reference(x.cpu(), 2, ex.cpu(), _to_cpu(w), rows_per_expert))
    # the shared expert in the same launch: its rows after the routed pairs, over x rows shared_x0..
    other = FORMATS["W8G32_F16S"] if fmt.name != "W8G32_F16S" else FORMATS["Q4G64_F16S"]
    for x_rows_arg, x0, shared in ((2, 0, _packed(rows_per_expert, k, fmt, seed=12)),
                                   (x_rows, 1, _packed(rows_per_expert, k, other, seed=13))):  # another format
        got = expert_gemv(x, x_rows_arg, ex, w, rows_per_expert, shared=shared, shared_x0=x0).cpu()
        rows_arg = x_rows_arg if isinstance(x_rows_arg, int) else x_rows_arg.cpu()
        want = torch.cat([expert_gemv_reference(x.cpu(), rows_arg, ex.cpu(), _to_cpu(w), rows_per_expert),
                          expert_gemv_reference(x.cpu()[x0:], 1, torch.zeros(3 - x0, dtype=torch.int32),
                                                _to_cpu(shared), rows_per_expert)])
        assert got.shape == (6 + 3 - x0, rows_per_expert)
        _check(got, want)
    # SwiGLU of gate/up rows applied as the launch reads them: the same rows as a SwiGLU launch, then the product
    from runtime.kernels.swiglu import swiglu

    gu = torch.randn(6 + 3, 2 * k, device=DEVICE).to(DTYPE)
    fused = expert_gemv(gu, 1, ex, w, rows_per_expert, shared=shared, shared_x0=6, swiglu=True)
    assert torch.equal(fused, expert_gemv(swiglu(gu), 1, ex, w, rows_per_expert, shared=shared, shared_x0=6))
    # routing inside the launch (decode): each program routes its token from the router's logits (a strided view:
    # the router's columns of a wider product) and the launch writes the ids and weights route() would
    from runtime.kernels.moe import route

    logits = torch.cat([torch.randn(3, experts, device=DEVICE), torch.full((3, 1), 1e9, device=DEVICE)], dim=1)
    ids_want, weights_want = route(logits[:, :experts], 2)
    ids = torch.full((6,), -1, dtype=torch.int32, device=DEVICE)
    weights = torch.full((3, 2), float("nan"), device=DEVICE)
    got = expert_gemv(x, 2, ids, w, rows_per_expert, shared=shared, shared_x0=1, route_into=(logits[:, :experts],
                                                                                               weights))
    assert torch.equal(ids.view(3, 2), ids_want) and torch.equal(weights, weights_want)
    assert torch.equal(got, expert_gemv(x, 2, ids_want.reshape(-1), w, rows_per_expert, shared=shared, shared_x0=1))
    from runtime.kernels.moe import shared_fusable

    assert shared_fusable(w, shared, rows_per_expert) and not shared_fusable(w, shared, rows_per_expert + 1)
    assert not shared_fusable(w, torch.zeros(rows_per_expert, k), rows_per_expert)  # a dense (bf16) matrix
    assert not shared_fusable(w, _packed(rows_per_expert, k + 64, fmt, seed=1), rows_per_expert)
    with pytest.raises(ValueError, match="shared expert"):
        expert_gemv(x, 2, ex, w, rows_per_expert + 1, shared=shared)


def test_expert_gemv_tiles(monkeypatch):
    """Other expert GEMV tiles (EXPERT_TUNING, set by NINFER_EXPERT_TILE_<PRODUCT>) give the same products, routed
    and with SwiGLU in the launch; a malformed setting stops with a one-line error naming the variable."""
    from runtime.kernels import moe
    from runtime.kernels.swiglu import swiglu

    fmt = FORMATS["Q4G64_F16S"]
    experts, rows_per_expert, k = 5, 48, 256
    w = _packed(experts * rows_per_expert, k, fmt, seed=21)
    x = torch.randn(3, k, device=DEVICE).to(DTYPE)
    ex = torch.tensor([4, 0, 2, 2, 3, 1], dtype=torch.int32, device=DEVICE)
    gu = torch.randn(6, 2 * k, device=DEVICE).to(DTYPE)
    expert_want = moe.expert_gemv_reference(x.cpu(), 2, ex.cpu(), _to_cpu(w), rows_per_expert)
    want_down = moe.expert_gemv_reference(swiglu(gu).cpu(), 1, ex.cpu(), _to_cpu(w), rows_per_expert)
    monkeypatch.setattr(moe, "EXPERT_TUNING", {name: dict(tile) for name, tile in moe.EXPERT_TUNING.items()})
    before = {name: dict(tile) for name, tile in moe.EXPERT_TUNING.items()}
    for value, message in (("3,x", "not up to 3 comma-separated integers"), ("48,64,4", "not powers of two")):
        monkeypatch.setenv("NINFER_EXPERT_TILE_DOWN", value)
        with pytest.raises(SystemExit, match=f"NINFER_EXPERT_TILE_DOWN.*{message}"):
            moe.load_expert_tiles()
        monkeypatch.setattr(moe, "EXPERT_TUNING", {name: dict(tile) for name, tile in before.items()})
    monkeypatch.delenv("NINFER_EXPERT_TILE_DOWN")
    monkeypatch.setenv("NINFER_EXPERT_TILE_GATE_UP_ONE", "32,128,8")
    monkeypatch.setenv(moe.expert_tile_variable("down/one"), "64,64,4")
    moe.load_expert_tiles()
    assert moe.EXPERT_TUNING["gate_up/one"] == {"block_n": 32, "block_k": 128, "num_warps": 8}
    assert moe.EXPERT_TUNING["down/one"] == {"block_n": 64, "block_k": 64, "num_warps": 4}
    assert moe.EXPERT_TUNING["down"] == before["down"]
    _check(moe.expert_gemv(x, 2, ex, w, rows_per_expert).cpu(), expert_want)
    _check(moe.expert_gemv(gu, 1, ex, w, rows_per_expert, swiglu=True).cpu(), want_down)
    # more than one token's pairs take the other tiles (the defaults: wide ones)
    many = torch.arange(18, dtype=torch.int32, device=DEVICE) % experts
    x9, gu18 = torch.randn(9, k, device=DEVICE).to(DTYPE), torch.randn(18, 2 * k, device=DEVICE).to(DTYPE)
    _check(moe.expert_gemv(x9, 2, many, w, rows_per_expert).cpu(),
           moe.expert_gemv_reference(x9.cpu(), 2, many.cpu(), _to_cpu(w), rows_per_expert))
    _check(moe.expert_gemv(gu18, 1, many, w, rows_per_expert, swiglu=True).cpu(),
           moe.expert_gemv_reference(swiglu(gu18).cpu(), 1, many.cpu(), _to_cpu(w), rows_per_expert))


@pytest.mark.parametrize("slotted", [False, True], ids=["pair-order", "slots"])
@pytest.mark.parametrize("gated", [False, True], ids=["ungated", "gated"])
def test_combine_experts(slotted, gated):
    """out[t] = sum_j w[t, j] y[slot or t * k + j] + sigmoid(gate[t]) * shared[t], one launch, float32 sums."""
    from runtime.kernels.moe import combine_experts, combine_experts_reference

    t, k, hid = 5, 3, 200
    g = torch.Generator().manual_seed(4)
    y = torch.full((t * k + 4, hid), float("nan")).to(DTYPE)  # rows no slot names stay NaN: must not be read
    slot = torch.randperm(t * k, generator=g).view(t, k) if slotted else None
    y[slot.reshape(-1) if slotted else torch.arange(t * k)] = torch.randn(t * k, hid, generator=g).to(DTYPE)
    weights = torch.rand(t, k, generator=g)
    shared = torch.randn(t, hid, generator=g).to(DTYPE)
    gate = torch.randn(t, 1, generator=g).to(DTYPE) if gated else None
    dev = lambda a: None if a is None else a.to(DEVICE)
    got = combine_experts(dev(y), dev(weights), dev(shared), dev(slot), dev(gate))
    want = combine_experts_reference(y, weights, shared, slot, gate)
    _check(got.cpu(), want)
    if gated:  # the gate as a strided column (the last column of the router's product)
        logits = torch.cat([torch.randn(t, 7, generator=g).to(DTYPE), gate], dim=1)
        _check(combine_experts(dev(y), dev(weights), dev(shared), dev(slot), dev(logits)[:, 7]).cpu(), want)


def test_sort_pairs_groups_pairs_by_expert_in_whole_blocks():
    """Every block holds one expert's pairs (or only padding), runs keep token order, and each pair's
    slot points back at its token and expert; the row count is the fixed bound (no host sync)."""
    from runtime.kernels.moe import sort_pairs

    experts, block_m = 7, 4
    ids = torch.randint(0, experts - 1, (23, 3), generator=torch.Generator().manual_seed(5)).int()  # expert 6 unused
    x_rows, block_experts, slot = sort_pairs(ids.to(DEVICE), experts, block_m)
    x_rows, block_experts, slot = x_rows.cpu(), block_experts.cpu(), slot.cpu()
    assert x_rows.numel() == -(-(23 * 3 + experts * (block_m - 1)) // block_m) * block_m
    assert torch.equal(x_rows[slot], torch.arange(23)[:, None].expand(23, 3).int())
    assert torch.equal(block_experts[slot // block_m], ids)
    for b, e in enumerate(block_experts.tolist()):
        rows = x_rows[b * block_m:(b + 1) * block_m]
        if e < 0:
            assert (rows == -1).all()
        else:
            real = rows[rows >= 0]
            assert real.numel() > 0 and torch.equal(real, real.sort().values)
    assert (x_rows >= 0).sum() == 23 * 3


@pytest.mark.parametrize("path", ["fused", "dense", "dense-loop"])
@pytest.mark.parametrize("fmt", [f for f in FORMATS.values() if isinstance(f, GroupedFormat)], ids=lambda f: f.name)
def test_expert_prefill_matches_per_pair_products(fmt, path, monkeypatch):
    """Grouped prefill experts == each pair's gate_up, SwiGLU and down products with dequantized weights,
    through the fused path (sorted pairs, padded blocks, one launch per matrix) and the dense one (experts
    dequantized in chunks, torch's grouped GEMM; dense-loop: one matmul per expert, for a torch without
    it), both with the weighted combine with the shared expert. The chunk scratch is shrunk so the dense
    path runs several expert chunks."""
    import runtime.kernels.moe as moe
    from runtime.kernels.moe import expert_prefill, route
    from runtime.kernels.qlinear import qlinear_reference
    from runtime.kernels.swiglu import swiglu, swiglu_reference

    experts, top_k, t, hid, inter = 6, 2, 37, 96, 40
    gate_up = _packed(experts * 2 * inter, hid, fmt, seed=3)
    down = _packed(experts * hid, inter, fmt, seed=4)
    g = torch.Generator().manual_seed(9)
    h = torch.randn(t, hid, generator=g).to(DTYPE)
    shared = torch.randn(t, hid, generator=g).to(DTYPE)
    shared_gate = torch.randn(t, 1, generator=g).to(DTYPE)
    ids, weights = route(torch.randn(t, experts, generator=g).to(DEVICE), top_k)
    monkeypatch.setattr(moe, "GEMM_DEQUANT_BYTES", 2 * inter * hid * h.element_size() * 2)  # two experts a chunk
    if path == "dense-loop":
        monkeypatch.setattr(moe, "_vendor_grouped_mm", lambda: None)
    got = expert_prefill(h.to(DEVICE), ids, weights, gate_up, down, inter, experts, shared.to(DEVICE), swiglu,
                         path=path.removesuffix("-loop"), shared_gate=shared_gate.to(DEVICE))
    gu_all = qlinear_reference(h.float(), _to_cpu(gate_up)).float()
    want = shared.float() * torch.sigmoid(shared_gate.float())
    for i in range(t):
        for j in range(top_k):
            e = int(ids[i, j])
            act = swiglu_reference(gu_all[i : i + 1, e * 2 * inter:(e + 1) * 2 * inter])
            y = qlinear_reference(act, _to_cpu(down)).float()[0, e * hid:(e + 1) * hid]
            want[i] += float(weights[i, j]) * y
    _check(got.cpu(), want)


def test_grouped_matmul_falls_back_to_a_loop_when_the_vendor_kernel_refuses(monkeypatch):
    """A torch whose grouped GEMM raises for this device (older releases: Hopper only) gets the per-group
    loop, with the same result, and is not asked again."""
    import runtime.kernels.moe as moe

    g = torch.Generator().manual_seed(5)
    a, w = torch.randn(9, 16, generator=g), torch.randn(3, 8, 16, generator=g)
    bounds = [4, 6, 6, 13]  # the run starts at row 4 of the sorted pairs; the middle group is empty
    offs = torch.tensor(bounds[1:]) - bounds[0]
    want = torch.cat([a[0:2] @ w[0].t(), a[2:9] @ w[2].t()])
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("grouped gemm is not supported on this device")
    monkeypatch.setattr(moe, "_vendor_grouped_mm", lambda: refuse)
    monkeypatch.setattr(moe, "_VENDOR_REFUSED", set())
    for _ in range(2):
        torch.testing.assert_close(moe.grouped_matmul(a, w, offs, bounds), want)
    assert calls == [1]


def test_expert_chunks_cover_every_row_once_within_the_caps():
    """Expert runs for the dense prefill: consecutive, no empty run, at most per_chunk experts and row_cap
    rows unless one expert alone is bigger, and together every expert with rows exactly once."""
    from runtime.kernels.moe import expert_chunks

    counts = [3, 0, 0, 9, 1, 1, 1, 0, 2, 0]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    chunks = expert_chunks(bounds, per_chunk=3, row_cap=4)
    assert chunks == [(0, 3), (3, 4), (4, 7), (7, 10)]
    for e0, e1 in chunks:
        assert e1 - e0 <= 3 and bounds[e1] > bounds[e0]
        assert bounds[e1] - bounds[e0] <= 4 or e1 - e0 == 1
    assert expert_chunks([0, 0, 0], per_chunk=4, row_cap=8) == []


def _to_cpu(w):
    from runtime.kernels.qlinear import PackedLinear

    return PackedLinear(w.base.cpu(), None if w.high is None else w.high.cpu(), w.scale.view(torch.uint8).cpu(), w.rows, w.cols, w.fmt)


@pytest.mark.parametrize("params", [
    dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=5), dict(temperature=1.0, top_p=0.5),
    dict(temperature=0.9, min_p=0.2), dict(temperature=1.0, top_k=20, top_p=0.8, min_p=0.05),
    dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2),
    dict(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.3),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_sampling(params):
    from runtime.kernels.sampling import SamplingParams, sample, sample_reference

    sp = SamplingParams(**params)
    g = torch.Generator().manual_seed(7)
    b, v = 3, 1500
    logits = torch.randn(b, v, generator=g) * 3
    counts = torch.randint(0, 3, (b, v), generator=g, dtype=torch.int32)
    noise = torch.rand(b, v, generator=g).clamp(1e-20, 1 - 1e-7)
    want = sample_reference(logits, sp, counts, noise)
    got = sample(logits.to(DEVICE), sp, counts.to(DEVICE), noise=noise.to(DEVICE)).cpu()
    assert torch.equal(got, want)


def test_sampling_respects_top_k_statistically():
    from runtime.kernels.sampling import SamplingParams, sample

    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0] + [-9.0] * 59], device=DEVICE).repeat(200, 1)
    ids = sample(logits, SamplingParams(temperature=1.0, top_k=2), generator=None)
    assert set(ids.cpu().tolist()) <= {0, 1} and len(set(ids.cpu().tolist())) == 2


@pytest.mark.parametrize("kind", ["bf16", "int8g64", "int4g64", "int4g64e8"])
def test_kv_append_writes_the_reference_bytes(kind):
    from runtime.kernels.kv_append import KIND_IDS, kv_append, kv_append_reference
    from runtime.kv.codecs import sub_codec_planes

    assert set(KIND_IDS) == {"bf16", "int8g64", "int4g64", "int4g64e8", "e8cube"}
    n, hkv, d, pages = 7, 3, 128, 4
    g = torch.Generator().manual_seed(len(kind))
    x = torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 4
    x[0, 0, :64] = 0.0  # all-zero group: scale 0, codes 0
    x[1, 1, 64:] *= 1e-9  # tiny group: the 2^-24 scale rescue
    x[2, 2, :8] = torch.tensor([0.5, -1.5, 2.5, 0.5, 0.0, 0.0, 0.0, 7.0])  # exact halves: round half to even
    page = torch.randperm(pages, generator=g)[torch.arange(n) % pages].int()
    slot = torch.randperm(64, generator=g)[:n].int()
    want = [torch.randint(0, 100, (pages, 64, hkv, p.width), generator=g).to(p.dtype) for p in sub_codec_planes(kind, d)]
    got = [w.clone().to(DEVICE) for w in want]
    kv_append_reference(x, kind, want, page, slot)
    kv_append(x.to(DEVICE), kind, got, page.to(DEVICE), slot.to(DEVICE))
    for a, b in zip(got, want):
        assert torch.equal(a.cpu().view(torch.uint8), b.view(torch.uint8))


def test_kv_append_e8cube_matches_the_reference():
    """e8cube's group scale is a sum of squares (summation order differs from torch's), so a scale can move
    by one f16 step: nearly every code byte equals the reference's and the decoded vectors stay close."""
    from runtime.kernels.kv_append import kv_append, kv_append_reference
    from runtime.kv.codecs import decode_sub_codec, sub_codec_planes

    n, hkv, d, pages = 9, 4, 256, 3
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, hkv, d, generator=g) * torch.rand(n, hkv, 1, generator=g) * 4
    x[0, 0, :64] = 0.0  # all-zero group: scale 0
    x[1, 1, 64:128] *= 1e-9  # tiny group: the 2^-24 scale rescue
    x[2, 2, :8] = torch.tensor([0.5, -1.5, 2.5, 0.5, -0.5, 0.5, 0.5, 0.5])  # magnitude ties
    page = torch.randint(0, pages, (n,), generator=g).int()
    slot = torch.randperm(64, generator=g)[:n].int()
    planes = sub_codec_planes("e8cube", d)
    want = [torch.full((pages, 64, hkv, p.width), 7).to(p.dtype) for p in planes]
    got = [w.clone().to(DEVICE) for w in want]
    kv_append_reference(x, "e8cube", want, page, slot)
    kv_append(x.to(DEVICE), "e8cube", got, page.to(DEVICE), slot.to(DEVICE))
    got = [t.cpu() for t in got]
    at = (page.long(), slot.long())
    same = (got[0][at] == want[0][at]).float().mean().item()
    assert same >= 0.98, same
    assert torch.equal(got[1][at][0, 0, 0], torch.tensor(0.0, dtype=torch.float16))
    dec = lambda p: decode_sub_codec("e8cube", {"codes": p[0][at], "scales": p[1][at]})  # noqa: E731
    err = (dec(got) - dec(want)).norm() / dec(want).norm()
    assert err < 1e-2, err
    untouched = ~torch.isin(torch.arange(pages * 64), page.long() * 64 + slot.long()).reshape(pages, 64)
    assert (got[0][untouched] == 7).all() and (got[1][untouched] == 7).all()


@pytest.mark.parametrize("shape,out_dtype", [((3, 5, 128), None), ((2, 64), torch.float32)])
def test_rotate64(shape, out_dtype):
    from runtime.kernels.hadamard import rotate64, rotate64_reference

    x = torch.randn(*shape, device=DEVICE).to(DTYPE)
    got = rotate64(x, out_dtype)
    assert got.dtype == (out_dtype or x.dtype)
    _check(got.cpu(), rotate64_reference(x.cpu(), out_dtype), out_dtype or DTYPE)


@pytest.mark.parametrize("rotate,n", [(False, 3), (True, 3), (False, 261)])  # 261 x 2 x 2 groups: 16 per program
def test_attention_gate(rotate, n):
    from runtime.kernels.attention_gate import attention_gate, attention_gate_reference

    heads, d = 2, 128
    qgkv = torch.randn(n, heads * 2 * d + 40, device=DEVICE).to(DTYPE)  # gate rows sit inside a wider row
    qg = qgkv[:, : heads * 2 * d]
    o = torch.randn(n, heads, d, device=DEVICE).to(DTYPE)
    _check(attention_gate(o, qg, rotate).cpu(), attention_gate_reference(o.cpu(), qg.cpu(), rotate))


# calls a kernel may make before pdl_wait(): none of them reads what another kernel writes
# (the fragment kernels' _thread_ids reads %tid.x, _weight_addresses / _chunk_addresses are arithmetic,
# _load_group / _load_chunk load weights)
_BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.multiple_of", "tl.zeros", "tl.minimum", "_weight_tile", "_thread_ids",
                "_weight_addresses", "_load_group", "_chunk_addresses", "_load_chunk",
                "_program_start", "_preload_weights"}  # (ids, addresses and weight chunks only)


def _call_name(node) -> str:
    import ast

    return ast.unparse(node.func)


def test_every_launch_waits():
    """Programmatic dependent launch is only correct when every kernel launched with LAUNCH
    waits for the previous one before touching activations (runtime/kernels/launch.py): each kernel
    calls pdl_wait() at its top level, nothing but index arithmetic and weight loads before it, and
    every launch site passes **LAUNCH."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "runtime"
    kernels = launches = 0
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                kernels += 1
                body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) else node.body
                waits = [i for i, s in enumerate(body) if ast.unparse(s) == "pdl_wait()"]
                assert waits, f"{where}: {node.name} never calls pdl_wait() at its top level"
                for stmt in body[: waits[0]]:
                    for call in (c for c in ast.walk(stmt) if isinstance(c, ast.Call)):
                        assert _call_name(call) in _BEFORE_WAIT, (
                            f"{where}: {node.name} calls {_call_name(call)} before pdl_wait()")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and \
                    ast.unparse(node.func.value).endswith("_kernel"):
                launches += 1
                assert any(k.arg is None and ast.unparse(k.value) == "LAUNCH" for k in node.keywords), (
                    f"{where}: launch of {ast.unparse(node.func.value)} without **LAUNCH")
    assert kernels >= 20 and launches >= kernels


def _produce(kind, width, seed, xq):
    """Run producer `kind` on fresh inputs whose output rows have `width` lanes -> (rows, output)."""
    from runtime.kernels.attention_gate import attention_gate
    from runtime.kernels.gated_norm import gated_norm
    from runtime.kernels.rmsnorm import rmsnorm
    from runtime.kernels.swiglu import swiglu

    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    rows = 2
    if kind == "rmsnorm":
        return rmsnorm(rnd(rows, width).to(DTYPE), rnd(width).to(DTYPE), 1e-6, residual=rnd(rows, width).to(DTYPE), xq=xq)[0]
    if kind == "swiglu":
        return swiglu(rnd(rows, 2 * width).to(DTYPE), xq=xq)
    if kind == "gated_norm":
        d = 64
        return gated_norm(rnd(rows, width // d, d), rnd(rows, width).to(DTYPE), rnd(d).to(DTYPE), 1e-6, DTYPE, xq=xq)
    d = 64
    o, qg = rnd(rows, width // d, d).to(DTYPE), rnd(rows, width // d * 2 * d).to(DTYPE)
    return attention_gate(o, qg, False, xq=xq)


# widths where the producer fills the words itself, and where it falls back to a quantization launch
@pytest.mark.parametrize("kind,width", [("rmsnorm", 256), ("rmsnorm", 200), ("swiglu", 1100), ("swiglu", 1024),
                                        ("gated_norm", 256), ("gated_norm", 192), ("attention_gate", 128),
                                        ("attention_gate", 192)])
@pytest.mark.parametrize("fmt", ["Q4G64_F16S", "Q6G64_F16S", "W8G32_F16S"])
def test_producers_write_quantized_x(kind, width, fmt):
    """A kernel that writes its output also as the next product's dp4a words writes exactly the words
    the product's own quantization launch would, and the product reads them to the same result."""
    from runtime.kernels.qgemv_int8 import QuantizedX, quantize_x
    from runtime.kernels.qlinear import qlinear

    w = _packed(24, width, FORMATS[fmt], seed=width)
    xq = QuantizedX.empty(2, w, DEVICE)
    xq.words.fill_(-1)  # poison: every word must be written
    y = _produce(kind, width, seed=7, xq=xq)
    assert torch.equal(xq.words, quantize_x(y, w)), f"{kind}: fused words differ from quantize_x"
    for t in (1, 2):
        part = QuantizedX(xq.words[:t].contiguous(), xq.k_pad, xq.group, xq.bits)
        assert torch.equal(qlinear(y[:t], w, xq=part), qlinear(y[:t], w))


def test_quantized_x_is_checked_against_the_weight():
    from runtime.kernels.qgemv_int8 import QuantizedX
    from runtime.kernels.qlinear import qlinear

    w, other = _packed(8, 256, FORMATS["Q4G64_F16S"], 1), _packed(8, 384, FORMATS["Q4G64_F16S"], 2)
    x = torch.randn(1, 256, device=DEVICE).to(DTYPE)
    with pytest.raises(ValueError, match="does not fit"):
        qlinear(x, w, xq=QuantizedX.empty(1, other, DEVICE))


def test_rmsnorm_sums_deferred_split_partials():
    """A decode product split along K may hand its partials to the next rmsnorm instead of summing
    them in a launch of its own; the norm, the residual and the next product's words are unchanged."""
    from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials
    from runtime.kernels.qlinear import qlinear
    from runtime.kernels.rmsnorm import rmsnorm

    w = _packed(40, 2048, FORMATS["Q5G64_F16S"], 3)
    nxt = _packed(16, 40, FORMATS["Q4G64_F16S"], 4)
    x = torch.randn(1, 2048, device=DEVICE).to(DTYPE)
    residual, norm_w = torch.randn(1, 40, device=DEVICE).to(DTYPE), torch.randn(40, device=DEVICE).to(DTYPE)
    deferred = qlinear(x, w, defer_sum=True)
    assert isinstance(deferred, SplitPartials) and deferred.parts.shape[0] > 1
    xq_a, xq_b = QuantizedX.empty(1, nxt, DEVICE), QuantizedX.empty(1, nxt, DEVICE)
    want, want_res = rmsnorm(qlinear(x, w), norm_w, 1e-6, residual=residual.clone(), xq=xq_a)
    got, got_res = rmsnorm(deferred, norm_w, 1e-6, residual=residual.clone(), xq=xq_b)
    assert torch.equal(got, want) and torch.equal(got_res, want_res) and torch.equal(xq_a.words, xq_b.words)


@pytest.mark.parametrize("t,gated", [(1, True), (3, False), (2, True)])
def test_rmsnorm_combines_a_moe_blocks_expert_outputs(t, gated):
    """A MoE decode block hands its routed outputs, weights and (gated) shared output to the next rmsnorm, which
    combines them itself: the norm, the residual and the next product's words equal combine_experts, then the
    norm (one decode row spread over programs; several rows one program each; the gate a strided column)."""
    from runtime.kernels.moe import ExpertPartials, combine_experts
    from runtime.kernels.qgemv_int8 import QuantizedX
    from runtime.kernels.rmsnorm import rmsnorm

    k, hid = 4, 2048
    g = torch.Generator().manual_seed(9 + t)
    y = torch.randn(t * k + t, hid, generator=g).to(DTYPE).to(DEVICE)  # routed pairs, then the shared rows
    weights = torch.rand(t, k, generator=g).to(DEVICE)
    logits = torch.randn(t, 9, generator=g).to(DTYPE).to(DEVICE)
    gate = logits[:, -1:] if gated else None
    residual, norm_w = torch.randn(t, hid, device=DEVICE).to(DTYPE), (torch.randn(hid, device=DEVICE) * 0.1).to(DTYPE)
    nxt = _packed(16, hid, FORMATS["Q4G64_F16S"], 4)
    xq_a, xq_b = QuantizedX.empty(t, nxt, DEVICE), QuantizedX.empty(t, nxt, DEVICE)
    parts = ExpertPartials(y[: t * k], weights, y[t * k :], gate)
    assert parts.fits_one_stride()
    want, want_res = rmsnorm(combine_experts(y[: t * k], weights, y[t * k :], shared_gate=gate), norm_w, 1e-6,
                             residual=residual.clone(), xq=xq_a)
    got, got_res = rmsnorm(parts, norm_w, 1e-6, residual=residual.clone(), xq=xq_b)
    assert torch.equal(got, want) and torch.equal(got_res, want_res) and torch.equal(xq_a.words, xq_b.words)


@pytest.mark.parametrize("t,deferred", [(1, 4), (1, 6), (3, 0)])
def test_rmsnorm_spread_over_programs_matches_one_program_rows(monkeypatch, t, deferred):
    """Decode rows spread over several programs (each summing the whole row's squares, normalizing and
    quantizing its own chunk, writing a new residual) == one program per row: the residual sum and the
    next product's words exactly (against the words of its own stored output), the normed rows within
    a rounding step (the sum of squares is taken in another order); the input residual is not written. A row
    of 6 K-split partials (what the Q5 products in fragment order hand over) is spread too."""
    import runtime.kernels.rmsnorm as rn
    from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials, quantize_x

    h = 2 * rn.SPREAD_CHUNK + 200  # the last chunk part-filled; the next product's K_pad past h
    nxt = _packed(16, h, FORMATS["Q4G64_F16S"], 4)
    assert nxt.k_pad > h
    norm_w = (torch.randn(h, device=DEVICE) * 0.1).to(DTYPE)
    if deferred:  # a K-split product's float32 partials
        y_in = SplitPartials(torch.randn(deferred, t, h, device=DEVICE), torch.empty(t, h, device=DEVICE, dtype=DTYPE))
    else:
        y_in = torch.randn(t, h, device=DEVICE).to(DTYPE)
    residual = torch.randn(t, h, device=DEVICE).to(DTYPE)
    results = {}
    for spread in (True, False):
        monkeypatch.setattr(rn, "SPREAD_MAX_ROWS", 32 if spread else 0)
        xq = QuantizedX.empty(t, nxt, DEVICE)
        res_in = residual.clone()
        y, res = rn.rmsnorm(y_in, norm_w, 1e-6, residual=res_in, out=_poison((t, h)), xq=xq)
        assert spread == (res.data_ptr() != res_in.data_ptr())
        if spread:
            assert torch.equal(res_in, residual)
        assert torch.equal(xq.words, quantize_x(y, nxt))
        results[spread] = (y.float(), res)
    assert torch.equal(results[True][1], results[False][1])
    diff = (results[True][0] - results[False][0]).abs().max().item()
    assert diff <= (1e-5 if DTYPE == torch.float32 else 2e-2), diff


@pytest.mark.parametrize("setting,value", [("SPREAD_CHUNK", 128), ("SPREAD_CHUNK", 512), ("SUM_BLOCK", 512),
                                           ("SUM_BLOCK", 2048), ("SPREAD_WARPS", 2), ("SPREAD_WARPS", 8)])
def test_rmsnorm_spread_launch_shapes_keep_the_row(monkeypatch, setting, value):
    """The spread launch's shapes that bench/engine_ab.py compares (lanes a program, lanes a sum step, warps): the
    residual sum and the next product's words exactly as one program per row, the normed row within a rounding step."""
    import runtime.kernels.rmsnorm as rn
    from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials, quantize_x

    h = 1224  # over 2 x 512 lanes: spread at every chunk size here, the last chunk part-filled
    nxt = _packed(16, h, FORMATS["Q4G64_F16S"], 4)
    norm_w = (torch.randn(h, device=DEVICE) * 0.1).to(DTYPE)
    y_in = SplitPartials(torch.randn(4, 1, h, device=DEVICE), torch.empty(1, h, device=DEVICE, dtype=DTYPE))
    residual = torch.randn(1, h, device=DEVICE).to(DTYPE)
    results = {}
    for spread in (True, False):
        monkeypatch.setattr(rn, "SPREAD_MAX_ROWS", 1 if spread else 0)
        monkeypatch.setattr(rn, setting, value)
        xq = QuantizedX.empty(1, nxt, DEVICE)
        y, res = rn.rmsnorm(y_in, norm_w, 1e-6, residual=residual.clone(), out=_poison((1, h)), xq=xq)
        assert torch.equal(xq.words, quantize_x(y, nxt))
        results[spread] = (y.float(), res)
    assert torch.equal(results[True][1], results[False][1])
    diff = (results[True][0] - results[False][0]).abs().max().item()
    assert diff <= (1e-5 if DTYPE == torch.float32 else 2e-2), diff


@pytest.mark.parametrize("t,rows,deferred", [(1, 8, 0), (1, 16, 6), (1, 0, 0), (3, 8, 0), (3, 4, 6)])
def test_rmsnorm_multiplies_the_router_in_its_launch(monkeypatch, t, rows, deferred):
    """Decode rows (one spread over programs, or several of one program each) with the MoE router in the norm
    (NINFER_ROUTER_IN_NORM=rows): the norm's own outputs are those of the norm alone, and the logits are the stored
    normed rows times the router (21 router rows: the last program part-filled; rows 0: the product after the
    launch)."""
    import runtime.kernels.rmsnorm as rn
    from runtime.kernels.qgemv_int8 import SplitPartials

    monkeypatch.setattr(rn, "ROUTER_IN_NORM_ROWS", rows)
    monkeypatch.setattr(rn, "SPREAD_MAX_ROWS", 1)
    h, experts = 2 * rn.SPREAD_CHUNK + 200, 21
    norm_w = (torch.randn(h, device=DEVICE) * 0.1).to(DTYPE)
    router = (torch.randn(experts, h, device=DEVICE) * 0.05).to(DTYPE)
    if deferred:
        y_in = SplitPartials(torch.randn(deferred, t, h, device=DEVICE), torch.empty(t, h, device=DEVICE, dtype=DTYPE))
    else:
        y_in = torch.randn(t, h, device=DEVICE).to(DTYPE)
    residual = torch.randn(t, h, device=DEVICE).to(DTYPE)
    want_y, want_res = rn.rmsnorm(y_in, norm_w, 1e-6, residual=residual.clone())
    logits = _poison((t, experts))
    y, res = rn.rmsnorm(y_in, norm_w, 1e-6, residual=residual.clone(), router=router, router_out=logits)
    assert torch.equal(y, want_y) and torch.equal(res, want_res)
    _check(logits, (y.float() @ router.float().t()).to(DTYPE))


@pytest.mark.parametrize("n,heads,kv_heads,d,rot", [(1, 6, 2, 64, 16), (3, 4, 1, 32, 12), (2, 2, 2, 16, 16), (3, 3, 1, 256, 64)])
def test_qk_norm_rope(n, heads, kv_heads, d, rot):
    from runtime.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    row = heads * 2 * d + 2 * kv_heads * d
    qgkv = torch.randn(n, row + 24, device=DEVICE).to(DTYPE)[:, :row]  # a row inside a wider one
    qw, kw = torch.randn(d, device=DEVICE).to(DTYPE), torch.randn(d, device=DEVICE).to(DTYPE)
    pos = torch.tensor([5, 1000, 77][:n], device=DEVICE, dtype=torch.int32)
    q, k = qk_norm_rope(qgkv, heads, kv_heads, d, qw, kw, 1e-6, pos, rot, 1e6)
    want_q, want_k = qk_norm_rope_reference(qgkv.cpu(), heads, kv_heads, d, qw.cpu(), kw.cpu(), 1e-6, pos.cpu(), rot, 1e6)
    _check(q.cpu(), want_q)
    _check(k.cpu(), want_k)


@pytest.mark.parametrize("codec", ["bf16", "int8", "rk4v4-e8", "rk8v4", "rk2v4-e8"])
def test_attention_inputs_append_the_kv_and_rotate_the_queries_in_one_launch(codec):
    """attention_inputs == qk_norm_rope, then (rotated when the codec says) kv_append of K and V and the queries'
    rotation: the same queries and the same cache bytes (e8cube's scale may move one f16 step: close)."""
    from runtime.kernels.hadamard import rotate64
    from runtime.kernels.kv_append import kv_append
    from runtime.kernels.qk_norm_rope import attention_inputs, qk_norm_rope
    from runtime.kv.codecs import CODECS

    c = CODECS[codec]
    n, heads, kv_heads, d, rot = 3, 4, 2, 128, 32
    row = heads * 2 * d + 2 * kv_heads * d
    qgkv = torch.randn(n, row + 24, device=DEVICE).to(DTYPE)[:, :row]
    qw, kw = torch.randn(d, device=DEVICE).to(DTYPE), torch.randn(d, device=DEVICE).to(DTYPE)
    pos = torch.tensor([5, 1000, 77], device=DEVICE, dtype=torch.int32)
    page = torch.tensor([2, 0, 2], device=DEVICE, dtype=torch.int32)
    slot = torch.tensor([7, 63, 8], device=DEVICE, dtype=torch.int32)
    planes = {p.name: torch.zeros(3, 64, kv_heads, p.width, dtype=p.dtype, device=DEVICE) for p in c.planes(d)}
    want_planes = {name: t.clone() for name, t in planes.items()}
    side = lambda pl, s: [pl[p.name] for p in c.planes(d) if p.name.startswith(s + "_")]  # noqa: E731
    q, k = qk_norm_rope(qgkv, heads, kv_heads, d, qw, kw, 1e-6, pos, rot, 1e6)
    v = qgkv[:, heads * 2 * d + kv_heads * d :].reshape(n, kv_heads, d)
    for x, kind, rotate, s in ((k, c.key, c.rotate_keys, "k"), (v, c.value, c.rotate_values, "v")):
        kv_append(rotate64(x, torch.float32) if rotate else x, kind, side(want_planes, s), page, slot)
    want_q = rotate64(q) if c.rotate_keys else q
    got_q = attention_inputs(qgkv, heads, kv_heads, d, qw, kw, 1e-6, pos, rot, 1e6, c, side(planes, "k"),
                             side(planes, "v"), page, slot)
    assert torch.equal(got_q, want_q)
    for name in planes:
        if c.key == "e8cube" and name.startswith("k_"):
            decoded = c.decode_keys({n: t.cpu() for n, t in planes.items()})
            _check(decoded, c.decode_keys({n: t.cpu() for n, t in want_planes.items()}), torch.bfloat16)
        else:
            assert torch.equal(planes[name], want_planes[name]), name


def test_kernel_tunings_from_the_environment(monkeypatch):
    """NINFER_*_TILE side-by-side settings: a prefix of the keys updates the defaults; anything but integers
    stops with one line naming the variable and the form."""
    from runtime.kernels import tuning_from_env

    monkeypatch.setenv("NINFER_TEST_TILE", "4, 2048")
    assert tuning_from_env("NINFER_TEST_TILE", ("warps", "splits", "hint"), {"warps": 1, "hint": 2}) == \
        {"warps": 4, "splits": 2048, "hint": 2}
    for bad in ("4,x", "1,2,3,4", "4;2"):
        monkeypatch.setenv("NINFER_TEST_TILE", bad)
        with pytest.raises(SystemExit, match="NINFER_TEST_TILE=.* is not up to 3 comma-separated integers"):
            tuning_from_env("NINFER_TEST_TILE", ("warps", "splits", "hint"), {})
    monkeypatch.delenv("NINFER_TEST_TILE")
    assert tuning_from_env("NINFER_TEST_TILE", ("warps",), {"warps": 1}) == {"warps": 1}


def test_attention_tile_overrides():
    from runtime.kernels.paged_attention import _tile_overrides, split_size

    assert _tile_overrides("int4g64e8=32x1@2048, nvfp4=64x4") == {"int4g64e8": (32, 1, 2048), "nvfp4": (64, 4, 1024)}
    assert _tile_overrides("") == {}
    for bad in ("int4=32x1", "nvfp4=32", "bf16=ax4", "bf16=32x4@many"):
        with pytest.raises(ValueError, match="KIND=KEYSxWARPS"):
            _tile_overrides(bad)
    # the program target sets the split count: a quarter of the programs, four times the keys per split
    assert split_size(262144, 4, 64, 512) == 4 * split_size(262144, 4, 64, 2048) == 2048


@pytest.mark.parametrize("fmt", ["NVFP4", "FP8_E4M3FN_ROW_BF16S"])
@pytest.mark.parametrize("t", [1, 3, 20])
def test_float_code_products_match_the_reference(fmt, t):
    """NVFP4 / FP8-row products (in-kernel decode; 20 rows: decoded row blocks + GEMM) against the numpy
    decoder of format/float_codes.py, on random valid codes (NaN codes excluded)."""
    import numpy as np

    from format.float_codes import decode, geometry
    from runtime.kernels.float_gemv import float_codes, float_linear

    rows, cols = 96, 272  # not multiples of the kernel's blocks
    gen = np.random.default_rng(3)
    geo = geometry(fmt, rows, cols)
    raw = np.zeros(geo.total_bytes, np.uint8)
    if fmt == "NVFP4":
        raw[: geo.code_bytes] = gen.integers(0, 256, geo.code_bytes)
        raw[geo.scale_offset : geo.scale_offset + geo.scale_bytes] = gen.integers(0x20, 0x48, geo.scale_bytes)
        raw[geo.divisor_offset :] = np.float32(gen.uniform(0.5, 4, rows)).view(np.uint8)
    else:
        codes = gen.integers(0, 256, geo.code_bytes).astype(np.uint8)
        raw[: geo.code_bytes] = np.where((codes & 0x7F) == 0x7F, 0, codes)
        raw[geo.scale_offset :] = (np.float32(gen.uniform(0.01, 0.1, rows)).view(np.uint32) >> 16).astype("<u2").view(np.uint8)
    want_w = torch.from_numpy(decode(fmt, raw.tobytes(), rows, cols))
    w = float_codes(fmt, torch.from_numpy(raw).to(DEVICE), rows, cols)
    x = torch.randn(t, cols, generator=torch.Generator().manual_seed(t)).to(DEVICE)
    got = float_linear(x, w).float().cpu()
    want = x.float().cpu() @ want_w.t()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    from runtime.kernels.float_gemv import dense_reference

    assert torch.equal(dense_reference(w).cpu(), want_w)  # the torch reference decodes bit for bit


@pytest.mark.parametrize("lanes,t", [([2], 1), ([3, 0, 1], 1), ([1, 2], 5), ([0], 300)])
def test_kv_slots_in_one_launch(lanes, t, monkeypatch):
    """Each row's page and slot, the lanes' block tables and context lengths: the one launch gives torch's indexing
    (dtypes too), for decode rows of several lanes in any order, verify blocks and a prefill chunk longer than a
    program's block of rows, with a lane's table longer than a block of pages."""
    from runtime.kernels import kv_slots as module

    monkeypatch.setattr(module, "BLOCK_ROWS", 128)
    monkeypatch.setattr(module, "BLOCK_PAGES", 4)  # 7 pages a lane: two blocks, the second partial
    page_size, pages = 64, 7
    g = torch.Generator().manual_seed(t)
    table = torch.randperm(4 * pages, generator=g).to(torch.int32).view(4, pages).to(DEVICE)
    ctx = torch.tensor([5, 70, 400, 9], dtype=torch.int32, device=DEVICE)
    lanes_idx = torch.tensor(lanes, device=DEVICE)
    positions = torch.randint(0, pages * page_size, (len(lanes) * t,), generator=g).to(torch.int32).to(DEVICE)
    got = module.kv_slots(table, ctx, lanes_idx, t, positions, page_size)
    want = module.kv_slots_reference(table, ctx, lanes_idx, t, positions, page_size)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_embedding_rows_of_a_w8_table_in_one_launch(dtype):
    """The W8 embedding lookup's kernel gives the rows the torch decoder gives (gather_rows: code * scale in float32),
    rounded once to the activation dtype: tokens repeated, first and last rows, a width that is not a multiple of
    the planes' 128-column padding nor of the kernel's column block."""
    from runtime.kernels.embed_rows import BLOCK, embed_w8, takes
    from runtime.kernels.qlinear import gather_rows

    rows, cols = 37, BLOCK + 200
    w = _packed(rows, cols, FORMATS["W8G32_F16S"], seed=5)
    assert takes(w) and not takes(_packed(rows, cols, FORMATS["Q6G64_F16S"], seed=5))
    ids = torch.tensor([0, 36, 7, 7, 21], device=DEVICE)
    want = gather_rows(w, ids).to(dtype)
    got = embed_w8(w, ids, dtype)
    assert got.dtype == dtype and got.shape == (5, cols)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("t", [1, 2, 3, 4, 5, 16])
def test_dense_rows(t, monkeypatch):
    """The small bf16 product over 1-16 rows of x (the MoE router + shared gate of one or several lanes) against
    the plain-torch product, on a strided view with an odd row count and a K that is not a tile multiple (1-4 rows
    on the few-rows kernel, its K in several tiles, a weight tile loaded ahead)."""
    from runtime.kernels import dense_rows as module
    from runtime.kernels.dense_rows import MAX_ROWS, dense_rows, dense_rows_reference

    monkeypatch.setitem(module.ROW_TUNING, "block_k", 64)  # 200 = 3 whole tiles and a part

    torch.manual_seed(t)
    both = torch.randn(40, 200, device=DEVICE).to(DTYPE)
    w = both.as_strided((37, 200), (200, 1))  # 37 rows of a larger plane, as the router + gate view
    x = torch.randn(t, 200, device=DEVICE).to(DTYPE)
    got = dense_rows(x, w)
    assert got.shape == (t, 37) and got.dtype == x.dtype
    _check(got.cpu(), dense_rows_reference(x.cpu(), w.cpu()))
    with pytest.raises(ValueError, match="at most 16 rows"):
        dense_rows(torch.zeros(MAX_ROWS + 1, 200, device=DEVICE, dtype=DTYPE), w)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n,b,taps,h,group", [(1, 8, 4, 64, 16), (2, 5, 3, 96, 32), (3, 4, 4, 1100, 4)])
def test_block_conv_matches_reference(n, b, taps, h, group, residual):
    """The DFlash2 drafter's dynamic convolution in one launch == the plain-torch ops: every tap of every row,
    none reaching before its block, delta read through the strided view the drafter passes (one side of a
    [N, B, 2, taps, groups] projection), the residual added, the next product's dtype written."""
    from runtime.kernels.block_conv import block_conv, block_conv_reference

    g = torch.Generator().manual_seed(n * 100 + h)
    x = torch.randn(n, b, h, generator=g).to(DEVICE)
    both = torch.randn(n, b, 2, taps, h // group, generator=g).to(DEVICE)
    base = torch.randn(taps, h, generator=g).to(DEVICE)
    res = torch.randn(n, b, h, generator=g).to(DEVICE) if residual else None
    want = block_conv_reference(x, both[:, :, 1], base, group, res)
    _check(block_conv(x, both[:, :, 1], base, group, res), want, torch.float32)
    _check(block_conv(x, both[:, :, 1], base, group, res, out_dtype=DTYPE), want)
    with pytest.raises(ValueError, match="block_conv"):
        block_conv(x, both[:, :, 1, :-1], base, group)


@pytest.mark.parametrize("t,heads,d,r", [(8, 4, 64, 64), (5, 3, 96, 64), (3, 2, 40, 16)])
def test_head_norm_rope_matches_reference(t, heads, d, r):
    """Per-head RMSNorm then RoPE on the first R dims in one launch == rms_norm + apply_partial_rope, the heads
    read as a column range of a wider projection row (the drafter's query / key rows of its qkv)."""
    from runtime.kernels.head_norm_rope import head_norm_rope, head_norm_rope_reference
    from runtime.reference_ops import apply_partial_rope, rope_cos_sin

    g = torch.Generator().manual_seed(t * 10 + d)
    wide = torch.randn(t, 3 * heads * d, generator=g).to(DEVICE).to(DTYPE)
    x = wide[:, heads * d : 2 * heads * d]
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(DEVICE)
    cos, sin = rope_cos_sin(torch.arange(7, 7 + t, device=DEVICE), r, 1e6, torch.float32)
    want = apply_partial_rope(torch.nn.functional.rms_norm(x.float().view(t, heads, d), (d,), weight, 1e-6), cos, sin)
    _check(head_norm_rope_reference(x, heads, weight, 1e-6, cos, sin), want, torch.float32)
    _check(head_norm_rope(x, heads, weight, 1e-6, cos, sin), want, torch.float32)
    with pytest.raises(ValueError, match="head_norm_rope"):
        head_norm_rope(x, heads, weight[:-1], 1e-6, cos, sin)


@pytest.mark.parametrize("n,k,c,rank,vocab", [(1, 7, 8, 64, 300), (3, 4, 5, 48, 97)])
def test_selector_walk_matches_reference(n, k, c, rank, vocab):
    """The candidate selector's greedy walk in one launch picks the reference's drafts row after row (each row's
    pick becomes the next row's predecessor), over bf16 codebooks as the artifact stores them."""
    from runtime.kernels.selector_walk import selector_walk, selector_walk_reference

    g = torch.Generator().manual_seed(n * 10 + k)
    unary = torch.randn(n, k, c, generator=g).to(DEVICE)
    candidates = torch.stack([torch.randperm(vocab, generator=g)[:c] for _ in range(n * k)]).view(n, k, c).to(DEVICE)
    projected = torch.randn(n, k, rank, generator=g).to(DEVICE)
    predecessors = torch.randn(vocab, rank, generator=g).to(torch.bfloat16).to(DEVICE)
    successors = torch.randn(vocab, rank, generator=g).to(torch.bfloat16).to(DEVICE)
    anchors = torch.randint(0, vocab, (n,), generator=g).to(DEVICE)
    want = selector_walk_reference(unary, candidates, projected, predecessors, successors, anchors)
    got = selector_walk(unary, candidates, projected, predecessors, successors, anchors)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    with pytest.raises(ValueError, match="selector_walk"):
        selector_walk(unary, candidates[:, :, :-1], projected, predecessors, successors, anchors)


def _rmsnorm_launches_as_on_a_gpu(monkeypatch) -> list[tuple]:
    """rmsnorm's kernel launches taken, not run, as the launcher makes them off the interpreter (where a spread row may
    wait at the barrier): (grid, args, kwargs) each."""
    import runtime.kernels.rmsnorm as rn

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((grid, args, kwargs))

    monkeypatch.setattr(rn, "_rmsnorm_kernel", Recorder())
    monkeypatch.setattr(rn, "interpreted", lambda: False)
    return launches


@pytest.mark.parametrize("leave_last", [False, True])
def test_rmsnorm_spread_barrier_launch_compiles_for_sm90(monkeypatch, tmp_path, leave_last):
    """A spread row whose programs share their chunks' sums of squares and wait for each other (NINFER_RMSNORM_BARRIER)
    cannot run under the interpreter, which runs a launch's programs one after another: the launcher's barrier launch
    (scratch and constants as it makes them) is taken here and compiled for sm_90 by bench/compile_check.py, so a
    construct the GPU compiler rejects fails on the CPU. The GPU test below runs it against the re-reading spread."""
    import runtime.kernels.rmsnorm as rn
    from bench.compile_check import launch_entry
    from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials
    from tests.sm90 import assert_compiles_for_sm90

    kernel = rn._rmsnorm_kernel
    launches = _rmsnorm_launches_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(rn, "SPREAD_BARRIER", True)
    monkeypatch.setattr(rn, "BARRIER_LEAVE_LAST", leave_last)
    h = 5120
    nxt = _packed(16, h, FORMATS["Q4G64_F16S"], 4)
    parts = SplitPartials(torch.randn(6, 1, h), torch.empty(1, h, dtype=torch.bfloat16))
    rn.rmsnorm(parts, torch.zeros(h, dtype=torch.bfloat16), 1e-6, residual=torch.zeros(1, h, dtype=torch.bfloat16),
               xq=QuantizedX.empty(1, nxt, "cpu"))
    (grid, args, kwargs), = launches
    assert kwargs["BARRIER"] and kwargs["LEAVE_LAST"] == leave_last
    assert kwargs["CHUNKS"] == grid[1] == h // rn.SPREAD_CHUNK
    sums, arrivals = rn._barrier_scratch["cpu"]
    assert not arrivals.any()  # zeroed once; every launch leaves its counters at zero
    assert_compiles_for_sm90([launch_entry(kernel.fn, kernel.arg_names, args, kwargs)], tmp_path)


@pytest.mark.skipif(DEVICE != "cuda", reason="the spread barrier needs a launch's programs resident together (a GPU)")
@pytest.mark.parametrize("t,deferred,leave_last", [(1, 0, False), (1, 6, False), (4, 8, False), (1, 6, True),
                                                   (4, 8, True)])
def test_rmsnorm_spread_barrier_matches_the_rereading_spread(monkeypatch, t, deferred, leave_last):
    """Programs that share their chunks' sums of squares through the barrier == programs that each re-read the row:
    the residual sum and the next product's words exactly, the normed rows within a rounding step; launched many
    times over (the counters reset by each launch), inside a CUDA graph too; several rows (BARRIER_SPREAD_ROWS)."""
    import runtime.kernels.rmsnorm as rn
    from runtime.kernels.qgemv_int8 import QuantizedX, SplitPartials, quantize_x

    h = 5120 + 200
    nxt = _packed(16, h, FORMATS["Q4G64_F16S"], 4)
    norm_w = (torch.randn(h, device=DEVICE) * 0.1).to(DTYPE)
    if deferred:
        y_in = SplitPartials(torch.randn(deferred, t, h, device=DEVICE), torch.empty(t, h, device=DEVICE, dtype=DTYPE))
    else:
        y_in = torch.randn(t, h, device=DEVICE).to(DTYPE)
    residual = torch.randn(t, h, device=DEVICE).to(DTYPE)
    monkeypatch.setattr(rn, "SPREAD_MAX_ROWS", t)  # the re-reading spread for every row as the reference
    monkeypatch.setattr(rn, "SPREAD_MAX_SPLITS", 8)
    monkeypatch.setattr(rn, "BARRIER_SPREAD_ROWS", t)
    monkeypatch.setattr(rn, "BARRIER_LEAVE_LAST", leave_last)
    results = {}
    for barrier in (False, True):
        monkeypatch.setattr(rn, "SPREAD_BARRIER", barrier)
        for _ in range(50 if barrier else 1):
            xq = QuantizedX.empty(t, nxt, DEVICE)
            y, res = rn.rmsnorm(y_in, norm_w, 1e-6, residual=residual.clone(), out=_poison((t, h)), xq=xq)
        torch.cuda.synchronize()
        assert torch.equal(xq.words, quantize_x(y, nxt))
        results[barrier] = (y.float(), res)
    assert not rn._barrier_scratch[str(y.device)][1].any()
    assert torch.equal(results[True][1], results[False][1])
    assert (results[True][0] - results[False][0]).abs().max().item() <= 2e-2
    graph, static_res = torch.cuda.CUDAGraph(), residual.clone()
    with torch.cuda.graph(graph):
        y_graph, _ = rn.rmsnorm(y_in, norm_w, 1e-6, residual=static_res, out=_poison((t, h)))
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y_graph, results[True][0].to(DTYPE)) and not rn._barrier_scratch[str(y.device)][1].any()


@pytest.mark.parametrize("h,waits", [(2048, True), (5120, False)])
def test_rmsnorm_barrier_by_default_only_for_rows_of_few_chunks(monkeypatch, h, waits):
    """auto (the default): a spread row of at most BARRIER_AUTO_CHUNKS chunks waits at the barrier (the 35B-A3B's
    2,048 lanes: 0.9 % faster a step on the H100), a longer one re-reads (the 27B's 5,120: 0.8 % slower with it)."""
    import runtime.kernels.rmsnorm as rn

    launches = _rmsnorm_launches_as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(rn, "SPREAD_BARRIER", None)
    rn.rmsnorm(torch.zeros(1, h, dtype=torch.bfloat16), torch.zeros(h, dtype=torch.bfloat16), 1e-6,
               residual=torch.zeros(1, h, dtype=torch.bfloat16))
    (_, _, kwargs), = launches
    assert kwargs["SPREAD"] and kwargs["BARRIER"] == waits


def test_every_sampling_kernel_variant_is_compiled_by_the_warm_up(monkeypatch):
    """compile_every_variant (serve's warm-up) launches the sampling kernel in each of its 16 compiled variants."""
    import runtime.kernels.sampling as sampling

    if DEVICE == "cpu":  # the kernel itself, not the torch reference (CPU tensors take it unless told otherwise)
        monkeypatch.setattr(sampling, "torch_path", lambda tensor: False)
    seen, kernel = set(), sampling._sample_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.add((kw["GREEDY"], kw["HAS_PENALTY"], kw["HAS_TOPK"], kw["HAS_TOPP"]))
                return kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(sampling, "_sample_kernel", Recorder())
    assert sampling.compile_every_variant(64, DEVICE) == 16 and len(seen) == 16
