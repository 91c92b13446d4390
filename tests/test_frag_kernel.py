"""The fragment row kernel (runtime/kernels/qgemm_rows_frag.py). Its thread-level work is inline PTX, which
Triton's interpreter cannot run, so on a CPU its load and group-product PTX runs in tests/ptx_warp.py's warp
emulator over real packed weights and is held to `frag_reference` (the same group sums in plain torch) and
to the exact product; on a GPU the kernel itself runs."""

import pytest
import torch

from format.numeric import FORMATS
from format.quantize import encode_rows
from runtime.kernels import qgemm_rows_frag as frag
from runtime.kernels.qlinear import PackedLinear, qlinear_reference
from tests.ptx_warp import Memory, bits_f32, f32_bits, run_warp

FMTS = ["Q4G64_F16S", "Q5G64_F16S"]


def _packed(n, k, fmt, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    base, high, scale = encode_rows(torch.randn(n, k, generator=g), FORMATS[fmt])
    u8 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device) if b else None  # noqa: E731
    return PackedLinear(u8(base), u8(high), u8(scale), n, k, FORMATS[fmt])


def _emulate(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """One warp per 16 rows walks every group with the kernel's own PTX; returns [T, N] float32."""
    t, k = x.shape
    nt = 1 if t <= 8 else 2
    mem = Memory()
    xb = x.to(torch.bfloat16).contiguous()
    x_addr = mem.place(xb.view(torch.uint8).numpy().tobytes())
    base_addr = mem.place(w.base.numpy().tobytes())
    high_addr = mem.place((w.high if w.high is not None else w.base).numpy().tobytes())
    scale_addr = mem.place(w.scale.view(torch.uint8).numpy().tobytes())
    gpr = w.groups_per_row
    out = torch.zeros(t, w.rows)
    for block in range(0, w.rows, 16):
        acc = [[f32_bits(0.0)] * 8 for _ in range(32)]
        for gi in range(k // 64):
            loads = []
            for lane in range(32):
                g, c = lane // 4, lane % 4
                r0, r1 = min(block + g, w.rows - 1), min(block + g + 8, w.rows - 1)
                loads.append([base_addr + r0 * gpr * 32 + gi * 32 + c * 8, base_addr + r1 * gpr * 32 + gi * 32 + c * 8,
                              scale_addr + (r0 * gpr + gi) * 2, scale_addr + (r1 * gpr + gi) * 2,
                              high_addr + r0 * gpr * 8 + gi * 8 + c * 2, high_addr + r1 * gpr * 8 + gi * 8 + c * 2, 1])
            slot = run_warp(frag._load_asm(w.fmt.bits), loads, 3, mem)
            args = []
            for lane in range(32):
                g, c = lane // 4, lane % 4
                xa = [x_addr + (min(r, t - 1) * k + gi * 64 + c * 16) * 2 for r in (g, g + 8)]
                args.append(acc[lane] + slot[lane] + xa)
            acc = run_warp(frag._compute_asm(w.fmt.bits, nt), args, 8, mem)
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for i in range(4 * nt):
                row, col = block + g + 8 * ((i % 4) // 2), 2 * c + i % 2 + 8 * (i // 4)
                if row < w.rows and col < t:
                    out[col, row] = bits_f32(acc[lane][i])
    return out


def _emulate_fragment_layout(x: torch.Tensor, fp) -> torch.Tensor:
    """qgemm_fragment_layout's PTX, one warp per 16-row block, over planes in fragment order -> [T, N]."""
    from runtime.kernels import qgemm_fragment_layout as fl

    t, k = x.shape
    nt = 1 if t <= 8 else 2
    mem = Memory()
    x_addr = mem.place(x.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    codes = mem.place(fp.codes.numpy().tobytes())
    scales = mem.place(fp.scales.view(torch.uint8).numpy().tobytes())
    high = mem.place((fp.high if fp.high is not None else fp.codes).numpy().tobytes())
    out = torch.zeros(t, fp.rows)
    chunks = fp.groups // fl.CHUNK
    for block in range(fp.blocks):
        acc = [[f32_bits(0.0)] * 8 for _ in range(32)]
        for ci in range(chunks):
            loads = [[codes + (block * fp.groups + ci * 4) * 512 + lane * 16,
                      scales + ((block * chunks + ci) * 8 + lane // 4) * 16,
                      high + (block * chunks + ci) * (1024 if fp.fmt.bits == 6 else 512) + lane * 16, 1]
                     for lane in range(32)]
            words = 20 if fp.fmt.bits == 4 else 24
            chunk = run_warp(fl._chunk_load_asm(fp.fmt.bits, ""), loads, words, mem)
            for j in range(4):
                gi = ci * 4 + j
                args = []
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    xa = [x_addr + (min(r, t - 1) * k + gi * 64 + c * 16) * 2 for r in (g, g + 8)]
                    high_bits = chunk[lane][20 + j] if fp.fmt.bits != 4 else 0
                    args.append(acc[lane] + chunk[lane][4 * j : 4 * j + 4] + [chunk[lane][16 + j], high_bits] + xa)
                acc = run_warp(frag._compute_asm(fp.fmt.bits, nt, words=True, pairs=fp.pairs,
                                                 fields=fp.fields), args, 8, mem)
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for i in range(4 * nt):
                row, col = block * 16 + g + 8 * ((i % 4) // 2), 2 * c + i % 2 + 8 * (i // 4)
                if row < fp.rows and col < t:
                    out[col, row] = bits_f32(acc[lane][i])
    return out


def _layout_case(kernel_device, fmt, t, seed, cpu_k, order=None):
    """A product for the fragment-order kernel's option tests: its planes (in `order`, else fragment_order's), t rows
    of x and the exact group sums (the GPU takes the MLP down's K and 320 rows; the CPU's interpreter a small K)."""
    from runtime.kernels.qgemm_fragment_layout import fragment_planes

    n, k = (320, 17408) if kernel_device == "cuda" else (40, cpu_k)
    w = _packed(n, k, fmt, seed=seed, device=kernel_device)
    x = torch.randn(t, k, device=kernel_device).to(torch.bfloat16)
    return fragment_planes(w, order), x, frag.frag_reference(x, w)


def _layout_error(x, fp, want, **options) -> float:
    """The fragment-order kernel's largest error against `want`, relative to its largest value, with `options`."""
    from runtime.kernels.qgemm_fragment_layout import qgemm_fragment_layout

    y = torch.full((x.shape[0], fp.rows), float("nan"), device=x.device, dtype=torch.float32)
    qgemm_fragment_layout(x, fp, y, **options)
    return ((y - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("order", ["pairs", "lanes", "bytes", "fields"])
@pytest.mark.parametrize("fmt", FMTS + ["Q6G64_F16S"])
@pytest.mark.parametrize("n", [16, 21])
def test_fragment_layout_round_trips(fmt, n, order):
    from runtime.kernels.qgemm_fragment_layout import fragment_planes, row_planes

    w = _packed(n, 1024, fmt, seed=n)
    if fmt == "Q6G64_F16S" and order == "bytes":  # the int8 kernel's order takes Q4/Q5 only
        with pytest.raises(ValueError, match="Q6 has no byte order"):
            fragment_planes(w, order)
        return
    if fmt != "Q5G64_F16S" and order == "fields":  # 5-bit fields: Q5 only
        with pytest.raises(ValueError, match="fields order is for Q5 only"):
            fragment_planes(w, order)
        return
    fp = fragment_planes(w, order)
    assert fp.codes.numel() == fp.blocks * 16 * 512 and fp.scales.numel() == fp.blocks * 16 * 16
    base, high, scale = row_planes(fp)
    assert torch.equal(base, w.base.view(n, -1)) and torch.equal(scale, w.scale.view(n, -1))
    assert (high is None) == (w.high is None) and (high is None or torch.equal(high, w.high.view(n, -1)))
    for row0, rows in [(r, m) for r, m in ((3, 5), (14, 5), (16, 5)) if r + m <= n]:  # in a block, across, padded
        base, high, scale = row_planes(fp, row0, rows)
        sl = slice(row0, row0 + rows)
        assert torch.equal(base, w.base.view(n, -1)[sl]) and torch.equal(scale, w.scale.view(n, -1)[sl])
        assert high is None or torch.equal(high, w.high.view(n, -1)[sl])


@pytest.mark.parametrize("order", ["pairs", "lanes", "fields"])
@pytest.mark.parametrize("fmt", FMTS + ["Q6G64_F16S"])
@pytest.mark.parametrize("t,n", [(1, 16), (6, 21), (12, 16)])
def test_fragment_layout_ptx_computes_the_group_sums(fmt, t, n, order):
    from runtime.kernels.qgemm_fragment_layout import fragment_planes

    if order == "fields" and fmt != "Q5G64_F16S":
        pytest.skip("fields order is Q5's (the round-trip test checks that others are refused)")
    w = _packed(n, 512, fmt, seed=t + n)
    x = torch.randn(t, 512, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    got = _emulate_fragment_layout(x, fragment_planes(w, order))
    want = frag.frag_reference(x, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t,n", [(1, 16), (5, 24), (11, 16)])
def test_fragment_ptx_computes_the_group_sums(fmt, t, n):
    w = _packed(n, 256, fmt, seed=t + n)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = _emulate(x, w)
    want = frag.frag_reference(x, w)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    exact = qlinear_reference(x.float(), w)
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 1e-5


def test_fragment_kernel_takes_whole_group_steps_only():
    q4 = _packed(16, 256, "Q4G64_F16S", 1)
    assert frag.frag_supported(q4, 1) and frag.frag_supported(q4, 16)
    assert not frag.frag_supported(q4, 17)
    assert not frag.frag_supported(_packed(16, 192, "Q4G64_F16S", 1), 1)  # 3 groups: not a whole loop step
    assert not frag.frag_supported(_packed(16, 256, "Q6G64_F16S", 1), 1)
    # splits divide the groups into whole loop steps of at least 8 groups
    for rows, groups in ((5120, 272), (34816, 80), (16384, 80), (5120, 96), (64, 8)):
        split = frag.frag_splits(rows, groups, 4, 528)
        assert groups % (4 * split) == 0 and (split == 1 or groups // split >= 8)


def test_fragment_kernel_is_chosen_by_rows_and_overrides(monkeypatch):
    """auto: Q4 blocks of 2..16 rows and Q5 of 3..16 (the dp4a GEMV keeps T = 1); a forced row path or GEMV
    path (side-by-side runs) is honoured; on / rows / off; never on a CPU or under the interpreter."""
    from types import SimpleNamespace

    from runtime.kernels import qlinear as ql

    def weight(fmt, cols=5120, device="cuda"):
        return SimpleNamespace(fmt=FORMATS[fmt], cols=cols, base=SimpleNamespace(device=torch.device(device)))

    monkeypatch.setattr(ql, "interpreted", lambda: False)
    monkeypatch.setattr(ql, "FRAG_MODE", "auto")
    q4, q5, q6 = weight("Q4G64_F16S"), weight("Q5G64_F16S"), weight("Q6G64_F16S")
    assert [ql.uses_frag(q4, t) for t in (1, 2, 16, 17)] == [False, True, True, False]
    assert [ql.uses_frag(q5, t) for t in (1, 2, 3, 8)] == [False, False, True, True]
    assert not ql.uses_frag(q6, 4) and not ql.uses_frag(weight("Q4G64_F16S", device="cpu"), 4)
    assert not ql.uses_frag(weight("Q4G64_F16S", cols=5000), 4)
    monkeypatch.setattr(ql, "ROWS_PATH", "int8")
    assert not ql.uses_frag(q4, 4)
    monkeypatch.setattr(ql, "ROWS_PATH", "auto")
    monkeypatch.setattr(ql, "FRAG_MODE", "on")
    assert ql.uses_frag(q4, 1) and ql.uses_frag(q5, 2)
    monkeypatch.setattr(ql, "FRAG_MODE", "rows")
    assert not ql.uses_frag(q4, 1) and ql.uses_frag(q4, 2)
    monkeypatch.setattr(ql, "FRAG_MODE", "off")
    assert not ql.uses_frag(q4, 4)
    monkeypatch.setattr(ql, "FRAG_MODE", "fast")
    with pytest.raises(ValueError, match="NINFER_GEMV_FRAG"):
        ql.uses_frag(q4, 4)
    monkeypatch.setattr(ql, "FRAG_MODE", "auto")
    monkeypatch.setattr(ql, "interpreted", lambda: True)
    assert not ql.uses_frag(q4, 4)
    # fragment order: always under layout; under auto for engines of several rows per step (lanes x verify rows)
    # and for Q5 products at any
    assert [ql.fragment_layout_enabled(rows, 4) for rows in (1, 2, 16)] == [False, True, True]
    assert [ql.fragment_layout_enabled(rows, 5) for rows in (1, 2)] == [True, True]
    for mode, want in (("layout", True), ("rows", False), ("on", False), ("off", False)):
        monkeypatch.setattr(ql, "FRAG_MODE", mode)
        assert all(ql.fragment_layout_enabled(rows, bits) == want for rows in (1, 8) for bits in (4, 5))
    monkeypatch.setattr(ql, "FRAG_MODE", "fast")
    with pytest.raises(ValueError, match="NINFER_GEMV_FRAG"):
        ql.fragment_layout_enabled(4, 4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fragment kernels are inline PTX for NVIDIA GPUs (sm_80+); "
                    "their PTX is checked on the CPU by the warp emulator tests above")
@pytest.mark.parametrize("kernel", ["artifact planes", "fragment order"])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("t,n,k", [(1, 64, 512), (2, 100, 1024), (8, 5120, 1024), (9, 70, 512), (16, 1000, 2048),
                                   (4, 5120, 17408)])
def test_fragment_kernels_on_the_gpu(kernel, fmt, t, n, k):
    from runtime.kernels.qgemm_fragment_layout import fragment_planes, qgemm_fragment_layout

    w = _packed(n, k, fmt, seed=n + k, device="cuda")
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    y = torch.full((t, n), float("nan"), device="cuda", dtype=torch.float32)
    if kernel == "artifact planes":
        frag.qgemm_rows_frag(x, w, y)
    else:
        qgemm_fragment_layout(x, fragment_planes(w), y)
    want = frag.frag_reference(x, w)
    assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5
    y16 = torch.full((t, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # a bf16 output: rounded once
    frag.qgemm_rows_frag(x, w, y16) if kernel == "artifact planes" else qgemm_fragment_layout(x, fragment_planes(w), y16)
    assert ((y16.float() - want).abs().max() / want.abs().max()).item() < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fragment kernels are inline PTX for NVIDIA GPUs (sm_80+); "
                    "their PTX is checked on the CPU by the warp emulator tests above")
@pytest.mark.parametrize("t,n,k", [(1, 64, 512), (4, 4096, 5120), (8, 5120, 1024), (13, 70, 512), (16, 1000, 2048)])
def test_q6_fragment_order_kernel_on_the_gpu(t, n, k):
    """Q6 (the output head's format) in fragment order: the group sums at 1-16 rows, x in place and ahead."""
    from runtime.kernels.qgemm_fragment_layout import fragment_planes, qgemm_fragment_layout

    w = _packed(n, k, "Q6G64_F16S", seed=n + k, device="cuda")
    fp = fragment_planes(w)
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    want = frag.frag_reference(x, w)
    for xahead in (0, 1):
        y = torch.full((t, n), float("nan"), device="cuda", dtype=torch.float32)
        qgemm_fragment_layout(x, fp, y, xahead=xahead)
        assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5, xahead


@pytest.mark.parametrize("fmt,t", [("Q4G64_F16S", 1), ("Q5G64_F16S", 11), ("Q4G64_F16S", 5), ("Q6G64_F16S", 6)])
def test_fragment_order_kernel_sums_every_k_share(kernel_device, fmt, t):
    """Warps sharing a block's K in a program (one share empty), K-splits across programs (the last one short)
    and both together give the same product as the group sums."""
    from runtime.kernels.qgemm_fragment_layout import fragment_shape

    fp, x, want = _layout_case(kernel_device, fmt, t, seed=11, cpu_k=2560)
    # (warps, programs, ksplit, x loaded a chunk ahead)
    configs = ((4, 528, 4, 0), (4, 3, 1, 1), (4, 6, 2, 1)) if kernel_device == "cpu" else \
        ((4, 528, 1, 0), (4, 528, 2, 1), (4, 528, 4, 1), (4, 4000, 4, 1), (8, 2000, 2, 1), (4, 528, 0, 1))
    shapes = set()
    for warps, programs, ksplit, xahead in configs:
        shapes.add(fragment_shape(fp.blocks, fp.groups // 4, warps, programs, ksplit))
        error = _layout_error(x, fp, want, warps=warps, programs=programs, ksplit=ksplit, xahead=xahead)
        assert error < 1e-5, (warps, programs, ksplit, xahead)
    chunks = fp.groups // 4
    last_share = [(splits - 1) * size + (ks - 1) * (size // ks) for _, ks, splits, size in shapes]
    assert max(last_share) >= chunks  # the last split's last warp share starts past K: it sums nothing
    assert any(splits > 1 and chunks % size for _, _, splits, size in shapes)  # a short last split


def test_x_loaded_ahead_by_the_measured_rule(monkeypatch):
    """The measured default (session 34): x a chunk ahead at 2-8 rows, at one row only for Q4 codes with two warps
    sharing K in one split, at 9-16 rows only for Q4 codes with four, for Q5 as fields at 2-8 rows with their registers
    capped (the default; never uncapped); an explicit first row count or 0 overrides."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_fragment_layout import loads_x_ahead

    loop, shared4, split = (2, 2, 1, 20), (1, 4, 1, 24), (4, 1, 6, 12)
    assert [t for t in range(1, 17) if loads_x_ahead(t, -1, 5, split)] == list(range(2, 9))
    assert [t for t in range(1, 17) if loads_x_ahead(t, -1, 4, loop)] == list(range(1, 9))
    assert [t for t in range(1, 17) if loads_x_ahead(t, -1, 4, shared4)] == list(range(2, 17))  # gate_up: 9-16 too
    assert [t for t in range(1, 17) if loads_x_ahead(t, -1, 5, shared4)] == list(range(2, 9))
    assert not loads_x_ahead(1, -1, 4, shared4) and not loads_x_ahead(1, -1, 5, loop)
    monkeypatch.setattr(fl, "FIELDS_REGS", 128)  # the default: ahead at 2-8 rows, 1-8 rows capped
    assert [t for t in range(1, 17) if loads_x_ahead(t, -1, 5, split, fields=True)] == list(range(2, 9))
    assert [t for t in range(1, 17) if fl.register_cap(t, True) == 128] == list(range(1, 9))
    assert not any(fl.register_cap(t, False) for t in range(1, 17))  # pair order and Q4 never
    monkeypatch.setattr(fl, "FIELDS_REGS", 0)  # NINFER_FIELDS_REGS=off: uncapped, 140 registers with x ahead
    assert not any(loads_x_ahead(t, -1, 5, split, fields=True) for t in range(1, 17))
    assert not any(fl.register_cap(t, True) or fl.register_cap(t, False) for t in range(1, 17))
    assert loads_x_ahead(4, 2, 5, split, fields=True)  # unless asked for
    assert [t for t in range(1, 17) if loads_x_ahead(t, 1, 5, split)] == list(range(1, 9))
    assert [t for t in range(1, 17) if loads_x_ahead(t, 3)] == list(range(3, 9))
    assert not any(loads_x_ahead(t, 0, 4, loop) for t in range(1, 17))


@pytest.mark.parametrize("fmt,t", [("Q4G64_F16S", 16), ("Q5G64_F16S", 9), ("Q6G64_F16S", 13)])
def test_first_column_tile_x_ahead_at_nine_to_sixteen_rows(kernel_device, monkeypatch, fmt, t):
    """xwide: 9-16 rows load the first column tile's x a chunk ahead and the second tile's in each group's product;
    the same sums as the group sums, with warps sharing K and with K split across programs."""
    from runtime.kernels import qgemm_fragment_layout as fl

    fp, x, want = _layout_case(kernel_device, fmt, t, seed=13, cpu_k=2048)
    monkeypatch.setitem(fl.FRAGMENT_TUNING, "xwide", 1)
    assert fl.loads_x_ahead(t) and not fl.loads_x_ahead(t, 0)
    for programs, ksplit in ((528, 2), (3, 1)):
        assert _layout_error(x, fp, want, warps=4, programs=programs, ksplit=ksplit) < 1e-5, (programs, ksplit)


@pytest.mark.parametrize("fmt,t", [("Q4G64_F16S", 16), ("Q5G64_F16S", 11), ("Q6G64_F16S", 9)])
def test_column_tiles_split_across_warps(kernel_device, fmt, t):
    """tiles = 2: 9-16 rows' two 8-column tiles of x on twice the warps (each warp one tile over the same chunks),
    with warps sharing K, K split across programs, x in place and ahead: the group sums."""
    fp, x, want = _layout_case(kernel_device, fmt, t, seed=17, cpu_k=2048)
    for programs, ksplit, xahead in ((528, 2, 0), (3, 1, 1), (528, 4, -1)):
        error = _layout_error(x, fp, want, warps=4, programs=programs, ksplit=ksplit, xahead=xahead, tiles=2)
        assert error < 1e-5, (programs, ksplit, xahead)


def test_the_column_tile_split_rule():
    """By default (tiles -1) only 9-16-row Q4 products with two warps sharing K in one split (GDN qkvz, attention
    qgkv) split their column tiles across warps; 1 never, 2 always at 9-16 rows; never at 8 rows or fewer."""
    from runtime.kernels import qgemm_fragment_layout as fl

    assert fl.splits_column_tiles(12, 4, (2, 2, 1, 0), -1) and fl.splits_column_tiles(16, 4, (2, 2, 1, 0), -1)
    assert not fl.splits_column_tiles(8, 4, (2, 2, 1, 0), -1)
    assert not fl.splits_column_tiles(16, 4, (1, 4, 1, 0), -1)  # gate_up: 4 warps share K
    assert not fl.splits_column_tiles(16, 5, (2, 2, 1, 0), -1) and not fl.splits_column_tiles(16, 4, (2, 2, 3, 0), -1)
    assert not fl.splits_column_tiles(16, 4, (2, 2, 1, 0), 1)
    assert fl.splits_column_tiles(9, 5, (1, 4, 4, 0), 2) and not fl.splits_column_tiles(8, 5, (1, 4, 4, 0), 2)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of a large negative gate
@pytest.mark.parametrize("fmt,t,ks", [("Q4G64_F16S", 1, 2), ("Q5G64_F16S", 5, 4), ("Q4G64_F16S", 11, 1)])
def test_swiglu_in_the_gate_up_launch_is_the_product_then_swiglu(kernel_device, fmt, t, ks):
    """qgemm_fragment_swiglu (a program per gate block and its up block, SwiGLU in the store) gives bit for bit
    what the fragment-order product at the same warps sharing K and the swiglu kernel give; a pair whose halves
    do not split at a block boundary is refused."""
    from runtime.kernels.qgemm_fragment_layout import fragment_planes, qgemm_fragment_layout, qgemm_fragment_swiglu
    from runtime.kernels.swiglu import swiglu, swiglu_reference

    n, k = (64, 1024) if kernel_device == "cpu" else (34816, 5120)
    fp = fragment_planes(_packed(n, k, fmt, seed=5, device=kernel_device))
    x = torch.randn(t, k, device=kernel_device).to(torch.bfloat16)
    pair = torch.full((t, n), float("nan"), device=kernel_device, dtype=torch.bfloat16)
    qgemm_fragment_layout(x, fp, pair, warps=ks, programs=1, ksplit=ks)  # one split, as the fused launch
    want = swiglu(pair) if kernel_device == "cuda" else swiglu_reference(pair)
    got = torch.full((t, n // 2), float("nan"), device=kernel_device, dtype=torch.bfloat16)
    qgemm_fragment_swiglu(x, fp, got, ksplit=ks)
    assert torch.equal(got, want)
    odd = fragment_planes(_packed(48, 512, fmt, seed=6, device=kernel_device))
    with pytest.raises(ValueError, match="multiple of 32"):
        qgemm_fragment_swiglu(x[:, :512], odd, torch.empty(t, 24, device=kernel_device, dtype=torch.bfloat16))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # sigmoid of a large negative gate
def test_qlinear_swiglu_takes_fragment_order_when_asked(kernel_device, monkeypatch):
    """The engine's MLP call (qlinear_swiglu) runs a gate/up pair in fragment order through the fused launch with
    NINFER_SWIGLU_FRAGMENT set, and leaves it to the product and the swiglu kernel without (and under the
    interpreter, where qlinear multiplies fragment order densely: the kernel itself is tested above)."""
    import runtime.kernels as kernels
    from runtime.kernels import qlinear as ql
    from runtime.kernels.qgemm_fragment_layout import qgemm_fragment_swiglu, to_fragment_layout

    monkeypatch.setattr(kernels, "CPU_KERNELS", "triton")
    w = to_fragment_layout(_packed(64, 1024, "Q4G64_F16S", seed=3, device=kernel_device))
    x = torch.randn(3, 1024, device=kernel_device).to(torch.bfloat16)
    monkeypatch.setattr(ql, "SWIGLU_FRAGMENT_KS", 0)
    assert ql.qlinear_swiglu(x, w) is None
    monkeypatch.setattr(ql, "SWIGLU_FRAGMENT_KS", 2)
    if kernel_device == "cpu":
        assert ql.qlinear_swiglu(x, w) is None
        monkeypatch.setattr(ql, "interpreted", lambda: False)  # the PTX emulator stands in for the GPU here
    want = qgemm_fragment_swiglu(x, w.fragment, torch.empty(3, 32, device=kernel_device, dtype=torch.bfloat16), 2)
    assert torch.equal(ql.qlinear_swiglu(x, w), want)


def test_artifact_planes_kernel_runs_whole(kernel_device):
    """qgemm_rows_frag end to end (on a CPU: interpreted, its PTX emulated), K split across programs."""
    w = _packed(40, 1024, "Q5G64_F16S", seed=2, device=kernel_device)
    x = torch.randn(9, 1024, device=kernel_device).to(torch.bfloat16)
    y = torch.full((9, 40), float("nan"), device=kernel_device, dtype=torch.float32)
    frag.qgemm_rows_frag(x, w, y, warps=2, programs=4)
    assert frag.frag_splits(40, 16, 2, 4) == 2
    want = frag.frag_reference(x, w)
    assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("fmt,order", [(f, o) for f in FMTS for o in ("pairs", "bytes")]
                         + [("Q5G64_F16S", "fields"), ("Q6G64_F16S", "pairs"), ("W8G32_F16S", "bytes")])
def test_in_place_fragment_layout_keeps_every_product(fmt, order, monkeypatch):
    """to_fragment_layout permutes the planes in place (in row steps; pair order for the bf16 kernel, byte order
    for the int8 one; Q5 also as 5-bit fields; Q6 the output head's, W8 byte order only) and the weight still
    multiplies (24 rows: on a GPU Q6/W8 as blocks of 16), dequantizes rows for the prefill GEMM and refuses gathers:
    on a CPU through the torch references and then the GPU's routes interpreted, on a GPU through the kernels
    themselves; only byte order takes its input as dp4a words."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels import qlinear as ql

    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(fl, "CONVERT_ROWS", 32)  # several steps, one partial
    w = _packed(80, 1024, fmt, seed=3, device=device)
    dense = w.dense().clone().float()
    before = w.base.clone()
    w._dense = None
    fl.to_fragment_layout(w, order)
    assert w.fragment is not None and w.fragment.order == order and not torch.equal(w.base, before)
    assert w.fragment.codes.data_ptr() == w.base.data_ptr()  # in place
    assert torch.equal(w.dense().float(), dense)
    routes = ["torch", "triton"] if device == "cpu" else ["gpu"]
    for route in routes:
        if route == "triton":
            monkeypatch.setattr("runtime.kernels.CPU_KERNELS", "triton")  # the GPU's routes, interpreted
        if route != "torch":
            assert ql.takes_quantized_x(w, 1) == (order == "bytes")
        rows = ql.dequantize_rows(w, 16, 40, torch.float32)
        assert torch.equal(rows, dense[16:56])
        for t in (1, 3, 16, 24):  # one lane, row blocks, the prefill (rows put back, dequantized)
            x = torch.randn(t, 1024, device=device)
            want = x @ dense.t()
            got = ql.qlinear(x if device == "cpu" else x.to(torch.bfloat16), w).float()
            tol = 1e-4 if device == "cpu" else 2e-2 * want.abs().max().item()
            assert torch.allclose(got, want, atol=tol), (route, t, (got - want).abs().max())
    with pytest.raises(ValueError, match="fragment order"):
        ql.gather_rows(w, torch.tensor([1, 2], device=device))


@pytest.mark.parametrize("fmt", ["Q4G64_F16S", "Q6G64_F16S"])
def test_17_to_64_rows_in_fragment_order_multiply_as_16_row_blocks(fmt, monkeypatch):
    """Verify blocks of 5+ lanes (17-64 rows) over planes in fragment order: blocks of 16 rows on the fragment-order
    kernel (one read of the codes each), the rows of each in place in y (a Q6 head to 256 rows); more rows (prefill)
    and, for Q4/Q5 with NINFER_SLICED_ROWS=0, the dequantizing GEMM."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels import qlinear as ql

    w = _packed(32, 512, fmt, seed=5)
    fl.to_fragment_layout(w)
    calls = []

    def fake_kernel(x, fp, y, defer_sum=False):
        calls.append(x.shape[0])
        return y.copy_(x[:, :1].expand(-1, y.shape[1]))  # each row's first value: where the rows landed

    monkeypatch.setattr(ql, "torch_path", lambda x: False)
    monkeypatch.setattr(ql, "interpreted", lambda: False)
    monkeypatch.setattr(ql, "qgemm_fragment_layout", fake_kernel)
    monkeypatch.setattr(ql, "_gemm", lambda x, w, y: calls.append(("gemm", x.shape[0])) or y)
    x = torch.arange(40, dtype=torch.bfloat16)[:, None].expand(40, 512).contiguous()
    y = ql.qlinear(x, w)
    assert calls == [16, 16, 8] and torch.equal(y[:, 0], x[:, 0])
    calls.clear()
    ql.qlinear(torch.zeros(65, 512, dtype=torch.bfloat16), w)
    assert calls == ([16] * 4 + [1] if fmt.startswith("Q6") else [("gemm", 65)])  # Q6 (the head): to 256 rows
    calls.clear()
    ql.qlinear(torch.zeros(257, 512, dtype=torch.bfloat16), w)
    assert calls == [("gemm", 257)]
    calls.clear()
    monkeypatch.setattr(ql, "SLICED_ROWS", False)
    ql.qlinear(torch.zeros(24, 512, dtype=torch.bfloat16), w)
    assert calls == ([16, 8] if fmt.startswith("Q6") else [("gemm", 24)])


def test_engine_re_lays_out_layer_products_only(monkeypatch):
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_fragment_layout import takes_fragment_layout

    q4, odd = _packed(32, 512, "Q4G64_F16S", 1), _packed(24, 512, "Q4G64_F16S", 1)
    assert takes_fragment_layout("text/layers/3/mlp/gate_up", q4)
    assert takes_fragment_layout("mtp/layers/0/attention/output", q4)
    assert not takes_fragment_layout("text/token_embedding", q4)
    assert not takes_fragment_layout("text/layers/3/moe/experts_gate_up", q4)
    assert not takes_fragment_layout("dflash2/layers/0/mlp/gate_up", q4)
    assert not takes_fragment_layout("text/layers/3/mlp/gate_up", odd)  # 24 rows: not whole 16-row blocks
    assert not takes_fragment_layout("text/layers/3/mlp/gate_up", _packed(32, 256, "Q4G64_F16S", 1))
    assert not takes_fragment_layout("text/layers/3/mlp/gate_up", _packed(32, 512, "Q6G64_F16S", 1))
    # W8 (unless NINFER_FRAGMENT_W8=off): the MTP input projection and the DFlash2 drafter's whole products, K % 256
    w8 = _packed(32, 256, "W8G32_F16S", 1)
    monkeypatch.setattr(fl, "FRAGMENT_W8", "off")
    assert not takes_fragment_layout("mtp/input_projection", w8)
    monkeypatch.setattr(fl, "FRAGMENT_W8", "on")
    assert takes_fragment_layout("mtp/input_projection", w8) and takes_fragment_layout("dflash2/layers/1/mlp/down", w8)
    assert takes_fragment_layout("mtp/input_projection", w8, 8)
    assert not takes_fragment_layout("mtp/input_projection", w8, 16)  # 9-16 rows: the planes read W8 faster
    assert takes_fragment_layout("dflash2/layers/1/attention/query_key_value", w8)  # its key/value rows: a view
    assert not takes_fragment_layout("text/layers/3/moe/shared_expert/gate_up", w8)
    assert not takes_fragment_layout("mtp/input_projection", _packed(32, 128, "W8G32_F16S", 1))


def test_x_rows_reach_the_ptx_16_byte_aligned():
    buffer = torch.zeros(3 * 512 + 1, dtype=torch.bfloat16)
    odd = buffer[1:].view(3, 512)  # contiguous, 2 bytes past an aligned start
    assert odd.data_ptr() % 16 != 0
    fixed = frag.aligned_rows(odd)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, odd)
    assert frag.aligned_rows(buffer[:1536].view(3, 512)).data_ptr() == buffer.data_ptr()  # no copy when aligned


def test_fragment_order_shapes_cover_every_chunk_once():
    """Every chunk of K is summed by exactly one (split, warp share); each warp's share is even (its loop steps
    two); about programs x warps warps run in all; few-block products share K inside a program first."""
    from runtime.kernels.qgemm_fragment_layout import fragment_shape

    for blocks, chunks in ((320, 68), (2176, 20), (1024, 20), (896, 20), (320, 24), (4, 2), (64, 8), (1, 10)):
        for warps, programs, ksplit in ((4, 528, 0), (4, 1056, 0), (8, 528, 0), (4, 528, 1), (4, 528, 2),
                                        (4, 528, 4), (8, 264, 4)):
            bw, ks, splits, size = fragment_shape(blocks, chunks, warps, programs, ksplit)
            assert size % (2 * ks) == 0 and bw * ks == max(warps, ks) and (not ksplit or ks == ksplit)
            covered = [0] * chunks
            for split in range(splits):
                for share in range(ks):
                    first = split * size + share * (size // ks)
                    for ci in range(first, min(first + size // ks, chunks)):
                        covered[ci] += 1
            assert covered == [1] * chunks, (blocks, chunks, warps, programs, ksplit)
            if splits > 1:
                assert -(-blocks // bw) * splits * bw * ks <= 2 * programs * warps
    assert fragment_shape(2176, 20, 4, 528) == (4, 1, 1, 20)  # MLP gate_up: enough blocks, K whole
    assert fragment_shape(1024, 20, 4, 528) == (2, 2, 1, 20)  # GDN input: 2 warps per block, no partials
    assert fragment_shape(320, 68, 4, 528)[:2] == (1, 4)  # MLP down: 4 warps per block


def test_warps_sharing_k_chosen_per_product_and_rows(monkeypatch):
    """NINFER_FRAGMENT_KS names warps sharing K for a product (ROWSxCOLS) over a span of rows; other products and
    row counts keep the automatic shape; a malformed entry stops with a one-line error."""
    import runtime.kernels.qgemm_fragment_layout as fl

    table = fl.parse_warps_sharing_k("34816x5120@2-8=4, 5120x17408@16=2")
    assert table == {(34816, 5120): [(2, 8, 4)], (5120, 17408): [(16, 16, 2)]}
    monkeypatch.setattr(fl, "WARPS_SHARING_K", table)
    assert [fl.chosen_warps_sharing_k(34816, 5120, t) for t in (1, 2, 8, 9)] == [0, 4, 4, 0]
    assert fl.chosen_warps_sharing_k(5120, 17408, 16) == 2 and fl.chosen_warps_sharing_k(16384, 5120, 4) == 0
    for bad in ("34816x5120=4", "34816x5120@2-8=3", "34816x5120@0-8=4", "34816x5120@9-8=4", "ax5120@2=4"):
        with pytest.raises(SystemExit, match="NINFER_FRAGMENT_KS entry"):
            fl.parse_warps_sharing_k(bad)


def test_measured_rule_picks_warps_sharing_k_per_product_and_rows(monkeypatch):
    """The measured rule (FRAGMENT_KS_RULE) at the 27B's shapes: MLP gate_up (2,176 blocks: its whole-K warps fill
    the GPU) takes 4 warps sharing K at every row count; MLP down and GDN out (partials summed by the next norm)
    split K across programs up to 8 rows and share K between 4 warps at 9-16; GDN qkvz and attention qgkv keep the
    loop's 2. NINFER_FRAGMENT_KS still overrides it, and with the rule off every product takes the loop."""
    import runtime.kernels.qgemm_fragment_layout as fl

    class Planes:  # the geometry layout_shape reads
        def __init__(self, rows, cols, bits=4):
            self.rows, self.cols, self.blocks, self.groups = rows, cols, rows // 16, cols // 64

    gate_up, down, gdn_out, qkvz = Planes(34816, 5120), Planes(5120, 17408, 5), Planes(5120, 6144, 5), \
        Planes(16384, 5120)
    monkeypatch.setattr(fl, "WARPS_SHARING_K", {})
    monkeypatch.setattr(fl, "FRAGMENT_KS_RULE", True)
    monkeypatch.setitem(fl.FRAGMENT_TUNING, "ksplit", 0)
    assert {t: fl.layout_shape(gate_up, t)[:3] for t in (1, 8, 16)} == {1: (1, 4, 1), 8: (1, 4, 1), 16: (1, 4, 1)}
    for fp in (down, gdn_out):
        assert [fl.layout_shape(fp, t, defer_sum=True)[1] for t in (1, 8, 9, 16)] == [1, 1, 4, 4]
        assert fl.layout_shape(fp, 8, defer_sum=True)[2] > 1  # K across programs, partials left to the norm
    assert [fl.layout_shape(qkvz, t)[:3] for t in (1, 16)] == [(2, 2, 1)] * 2
    monkeypatch.setattr(fl, "WARPS_SHARING_K", fl.parse_warps_sharing_k("34816x5120@16=2"))
    assert fl.layout_shape(gate_up, 16)[1] == 2 and fl.layout_shape(gate_up, 8)[1] == 4
    monkeypatch.setattr(fl, "FRAGMENT_KS_RULE", False)
    assert fl.layout_shape(gate_up, 8)[:2] == (4, 1) and fl.layout_shape(down, 16, defer_sum=True)[1] == 1


@pytest.mark.parametrize("fmt,t,n,k,shape", [("Q4G64_F16S", 1, 40, 1024, (4, 528, 0)), ("Q5G64_F16S", 1, 32, 2048, (4, 3, 2)),
                                             ("Q5G64_F16S", 6, 21, 1024, (4, 528, 0)), ("Q4G64_F16S", 11, 16, 512, (2, 4, 1)),
                                             ("Q5G64_F16S", 16, 48, 1536, (4, 6, 4)),
                                             ("W8G32_F16S", 1, 40, 512, (4, 528, 0)), ("W8G32_F16S", 11, 24, 768, (2, 4, 1)),
                                             ("W8G32_F16S", 6, 32, 1024, (4, 3, 2))])
def test_int8_fragment_kernel_computes_the_dp4a_group_sums(kernel_device, fmt, t, n, k, shape):
    """The int8 fragment kernel (qgemm_fragment_int8; on a CPU interpreted, its PTX emulated) over planes in byte
    order, x quantized in its own launch or given as a producer's dp4a words: the dp4a GEMV's integer group sums
    times both scales (one and two column tiles, rows past N, K shared by warps and split across programs)."""
    from runtime.kernels.qgemm_fragment_int8 import fragment_int8_reference, qgemm_fragment_int8
    from runtime.kernels.qgemm_fragment_layout import fragment_planes
    from runtime.kernels.qgemv_int8 import QuantizedX

    w = _packed(n, k, fmt, seed=n + k, device=kernel_device)
    x = torch.randn(t, k, generator=torch.Generator().manual_seed(t)).to(kernel_device)
    x[0, 64:128] *= 1e-3  # a quiet group: its own scale
    x = x.to(torch.bfloat16) if kernel_device == "cuda" else x
    want = fragment_int8_reference(x, w)
    laid = _packed(n, k, fmt, seed=n + k, device=kernel_device)
    laid.fragment = fragment_planes(laid, "bytes")  # a copy: rows padded to whole 16-row blocks
    warps, programs, ksplit = shape
    for xq in (None, QuantizedX.empty(t, laid, kernel_device).fill(x)):
        y = torch.full((t, n), float("nan"), device=kernel_device, dtype=torch.float32)
        qgemm_fragment_int8(x, laid, y, xq, warps=warps, programs=programs, ksplit=ksplit)
        assert ((y - want).abs().max() / want.abs().max()).item() < 1e-5, (xq is None, (y - want).abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="full-size shapes of the int8 fragment kernel (inline PTX for "
                    "NVIDIA GPUs); its PTX runs emulated on the CPU in the test above")
@pytest.mark.parametrize("fmt", (*FMTS, "W8G32_F16S"))
@pytest.mark.parametrize("t,n,k", [(1, 5120, 17408), (8, 16384, 5120), (16, 1000, 2048), (1, 34816, 5120)])
def test_int8_fragment_kernel_on_the_gpu(fmt, t, n, k):
    from runtime.kernels.qgemm_fragment_int8 import fragment_int8_reference, qgemm_fragment_int8
    from runtime.kernels.qgemm_fragment_layout import fragment_planes

    w = _packed(n, k, fmt, seed=n + k, device="cuda")
    x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
    want = fragment_int8_reference(x, w)
    w.fragment = fragment_planes(w, "bytes")
    for defer in (False, True):  # partials summed here, or left to the next rmsnorm
        y = torch.full((t, n), float("nan"), device="cuda", dtype=torch.float32)
        got = qgemm_fragment_int8(x, w, y, defer_sum=defer)
        got = got.parts.sum(0) if hasattr(got, "parts") else got
        assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4, defer


def test_fragment_copy_and_its_first_rows_are_the_fragment_planes():
    """A Q6 fragment-order copy (built in row steps beside the artifact's planes) is fragment_planes' permutation;
    its row views of whole blocks (--draft-vocab's head, the first rows; DFlash2's key/value rows) are the
    permutation of those rows."""
    from runtime.kernels import qgemm_fragment_layout as fl

    w = _packed(48, 1024, "Q6G64_F16S", seed=3)
    before = (w.base.clone(), w.high.clone(), w.scale.clone())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fl, "CONVERT_ROWS", 16)  # three row steps
        copy = fl.fragment_copy(w)
    want = fl.fragment_planes(w)
    assert torch.equal(copy.codes, want.codes) and torch.equal(copy.scales, want.scales)
    assert torch.equal(copy.high, want.high) and copy.order == "pairs"
    assert all(torch.equal(a, b) for a, b in zip(before, (w.base, w.high, w.scale)))  # the artifact's planes stay
    head = fl.fragment_rows(copy, 32)
    first = fl.fragment_planes(PackedLinear(w.base[: 32 * 512], w.high[: 32 * 256], w.scale.view(torch.uint8)[: 32 * 32],
                                            32, 1024, w.fmt))
    assert torch.equal(head.codes, first.codes) and torch.equal(head.high, first.high)
    assert torch.equal(head.scales, first.scales) and head.rows == 32
    middle = fl.fragment_rows(copy, 48, 16)
    rows = fl.fragment_planes(PackedLinear(w.base[16 * 512 : 48 * 512], w.high[16 * 256 : 48 * 256],
                                           w.scale.view(torch.uint8)[16 * 32 : 48 * 32], 32, 1024, w.fmt))
    assert torch.equal(middle.codes, rows.codes) and torch.equal(middle.high, rows.high)
    assert torch.equal(middle.scales, rows.scales) and middle.rows == 32
    with pytest.raises(ValueError, match="whole 16-row blocks"):
        fl.fragment_rows(copy, 20)
    with pytest.raises(ValueError, match="whole 16-row blocks"):
        fl.fragment_rows(copy, 32, 8)


def test_one_lane_engines_lay_out_the_named_products(monkeypatch):
    """NINFER_FRAGMENT_ONE_LANE names products a one-lane engine lays out in fragment order too (their one-row
    products on the fragment-order kernel); others keep the default choice."""
    from runtime.kernels import qlinear as ql

    monkeypatch.setattr(ql, "FRAG_MODE", "auto")
    monkeypatch.setattr(ql, "FRAGMENT_ONE_LANE", ("gdn/query_key_value_z", "attention/query_gate_key_value"))
    assert ql.fragment_layout_enabled(1, 4, "text/layers/0/gdn/query_key_value_z")
    assert ql.fragment_layout_enabled(1, 4, "text/layers/3/attention/query_gate_key_value")
    assert not ql.fragment_layout_enabled(1, 4, "text/layers/0/mlp/gate_up")
    assert ql.fragment_layout_enabled(1, 5, "text/layers/0/mlp/down") and ql.fragment_layout_enabled(4, 4)
    monkeypatch.setattr(ql, "FRAGMENT_ONE_LANE", ())
    assert not ql.fragment_layout_enabled(1, 4, "text/layers/0/gdn/query_key_value_z")
