"""MoE decode over routed experts in fragment order (runtime/kernels/moe_fragment.py): both launches against the
exact products of the dequantized experts, routing inside the gate/up launch and the shared expert riding after
the routed pairs. On a CPU the kernel runs in Triton's interpreter with its PTX in the warp emulator
(kernel_device); the torch path is held to the same products."""

import pytest
import torch

from format.numeric import FORMATS
from runtime.kernels.moe import route_reference
from runtime.kernels.qgemm_fragment_layout import to_fragment_layout
from tests.test_frag_kernel import _packed


def _case(device, fmt, experts=3, inter=512, hid=512, seed=5, order="pairs"):
    gate_up = to_fragment_layout(_packed(experts * 2 * inter, hid, fmt, seed=seed, device=device), order)
    down = to_fragment_layout(_packed(experts * hid, inter, fmt, seed=seed + 1, device=device), order)
    shared_up = _packed(2 * inter, hid, "W8G32_F16S", seed=seed + 2, device=device)
    shared_down = _packed(hid, inter, "W8G32_F16S", seed=seed + 3, device=device)
    return gate_up, down, shared_up, shared_down


def _exact(x, ids, w, rows, top_k, gate_up, shared):
    """Each pair's product with the dequantized expert, in float32 (then SwiGLU for gate/up)."""
    dense = w.dense().cpu()
    pairs = ids.numel()
    out = [x[p // top_k if gate_up else p].float().cpu() @ dense[int(e) * rows:(int(e) + 1) * rows].t()
           for p, e in enumerate(ids.cpu().tolist())]
    tokens = 0 if shared is None else x.shape[0] if gate_up else x.shape[0] - pairs
    out += [x[t if gate_up else pairs + t].float().cpu() @ shared.dense().cpu().t() for t in range(tokens)]
    y = torch.stack(out)
    if gate_up:
        g, u = y.chunk(2, dim=-1)
        y = torch.nn.functional.silu(g) * u
    return y


def _close(got, want, tol=2e-2):
    err = (got.float().cpu() - want).abs().max() / want.abs().max()
    assert err < tol, f"relative error {err:.3g}"


@pytest.mark.parametrize("fmt,order", [("Q4G64_F16S", "pairs"), ("Q5G64_F16S", "pairs"), ("Q5G64_F16S", "fields")])
def test_fragment_expert_launches_route_and_multiply(kernel_device, monkeypatch, fmt, order):
    from runtime.kernels import moe_fragment as mf

    monkeypatch.setattr("runtime.kernels.CPU_KERNELS", "triton")
    tokens, top_k, experts, inter, hid = 2, 2, 3, 512, 512
    gate_up, down, shared_up, shared_down = _case(kernel_device, fmt, experts, inter, hid, order=order)
    x = torch.randn(tokens, hid, device=kernel_device).to(torch.bfloat16)
    logits = torch.cat([torch.randn(tokens, experts), torch.full((tokens, 1), 1e9)], dim=1).to(kernel_device)
    ids = torch.full((tokens * top_k,), -1, dtype=torch.int32, device=kernel_device)
    weights = torch.full((tokens, top_k), float("nan"), device=kernel_device)
    act = mf.fragment_expert_gemv(x, ids, gate_up, 2 * inter, top_k, True, shared=shared_up,
                                  route_into=(logits[:, :experts], weights))
    want_ids, want_w = route_reference(logits[:, :experts].cpu(), top_k)
    assert torch.equal(ids.cpu().view(tokens, top_k), want_ids) and torch.allclose(weights.cpu(), want_w, atol=1e-6)
    assert act.shape == (tokens * top_k + tokens, inter)
    _close(act, _exact(x, ids, gate_up, 2 * inter, top_k, True, shared_up))
    y = mf.fragment_expert_gemv(act, ids, down, hid, top_k, False, shared=shared_down)
    assert y.shape == (tokens * top_k + tokens, hid)
    _close(y, _exact(act, ids, down, hid, top_k, False, shared_down))
    # without the shared expert: the routed rows alone, the same numbers
    alone = mf.fragment_expert_gemv(act[: tokens * top_k], ids, down, hid, top_k, False)
    assert torch.equal(alone, y[: tokens * top_k])


def test_fragment_expert_torch_path_and_refusals():
    from runtime.kernels import moe_fragment as mf

    gate_up, down, shared_up, shared_down = _case("cpu", "Q4G64_F16S")
    x = torch.randn(1, 512).to(torch.bfloat16)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    act = mf.fragment_expert_gemv(x, ids, gate_up, 1024, 2, True, shared=shared_up)
    _close(act, _exact(x, ids, gate_up, 1024, 2, True, shared_up), 1e-2)
    assert mf.fragment_experts_supported(gate_up, 1024, True) and not mf.fragment_experts_supported(gate_up, 1008, True)
    assert mf.shared_rides(shared_up, 1024, 512) and not mf.shared_rides(shared_up, 512, 512)
    with pytest.raises(ValueError, match="fragment order"):
        mf.fragment_expert_gemv(x, ids, _packed(3 * 1024, 512, "Q4G64_F16S", seed=1), 1024, 2, True)
    with pytest.raises(ValueError, match="shared expert"):
        mf.fragment_expert_gemv(x, ids, gate_up, 1024, 2, True, shared=shared_down)


def test_expert_gemm_reads_experts_in_fragment_order(kernel_device, monkeypatch):
    """The prefill's grouped expert kernel reads experts laid out in fragment order in place (any order the
    dequantizer reads, W8's byte order and Q5 fields too): the numbers it gives over the artifact's planes (pair
    order: up to the rounding of a sum taken in another lane order)."""
    from runtime.kernels.moe import expert_gemm, sort_pairs

    monkeypatch.setattr("runtime.kernels.CPU_KERNELS", "triton")
    for fmt, order in (("Q4G64_F16S", "pairs"), ("Q5G64_F16S", "pairs"), ("Q5G64_F16S", "bytes"),
                       ("Q5G64_F16S", "fields"), ("W8G32_F16S", "bytes")):
        planes = _packed(3 * 32, 512, fmt, seed=7, device=kernel_device)
        laid_out = to_fragment_layout(_packed(3 * 32, 512, fmt, seed=7, device=kernel_device), order)
        x = torch.randn(5, 512, device=kernel_device).to(torch.bfloat16)
        ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [0, 1]], dtype=torch.int32, device=kernel_device)
        x_rows, block_experts, _ = sort_pairs(ids, 3, block_m=16)
        want = expert_gemm(x, x_rows, block_experts, planes, 32, block_m=16)
        got = expert_gemm(x, x_rows, block_experts, laid_out, 32, block_m=16)
        if order == "pairs":  # read byte by byte, x's lanes permuted: the dot's sum in another order
            torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
        else:
            assert torch.equal(got, want)


@pytest.fixture(scope="module")
def moe_fragment_sized(tmp_path_factory):
    """A small MoE whose expert matrices take fragment order (hidden, expert and shared widths 512)."""
    from format.convert import ConvertOptions, convert_checkpoint
    from format.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("moe-fragment")
    src = write_tiny_checkpoint(d / "hf", moe=True, seed=3, layers=2, mtp_layers=0, hidden=512, moe_intermediate=512,
                                shared_intermediate=512)
    return convert_checkpoint(src, d / "moe.nfer", ConvertOptions(recipe="q4")).output


@pytest.mark.parametrize("fields", ["off", "on"])
def test_engine_decodes_over_experts_in_fragment_order(moe_fragment_sized, monkeypatch, fields):
    """NINFER_MOE_FRAGMENT=on: the engine lays the routed experts out in fragment order at bind (by default the Q5
    down projections as 5-bit fields, NINFER_Q5_FIELDS=off in pair order), decodes through the fragment expert
    launches (the shared expert riding) and prefills through the grouped kernel reading them in place, and generates
    the reference's tokens."""
    import runtime.engine as engine_module
    from runtime.engine import Engine
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.memory_plan import PlanOptions
    from tests.test_engine import DEVICE, PROMPT, _assert_matches_reference

    monkeypatch.setattr(engine_module, "MOE_FRAGMENT", "on")
    monkeypatch.setattr(fl, "Q5_FIELDS", fields)
    calls = []
    real = engine_module.fragment_expert_gemv
    monkeypatch.setattr(engine_module, "fragment_expert_gemv",
                        lambda *a, **kw: calls.append((kw.get("shared"), kw.get("expert_major"))) or real(*a, **kw))
    engine = Engine(moe_fragment_sized, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    laid_out = [n for n, lin in engine.lin.items() if n.endswith(("experts_gate_up", "experts_down"))
                and lin.packed.fragment is not None]
    assert len(laid_out) == 4
    orders = {engine.lin[n].packed.fmt.bits: engine.lin[n].packed.fragment.order for n in laid_out}
    assert orders == {4: "pairs", 5: "fields" if fields == "on" else "pairs"}
    _assert_matches_reference(engine, moe_fragment_sized, PROMPT, 4)
    assert calls and all(shared is not None for shared, _ in calls) and not all(major for _, major in calls)
    # two lanes (the same prompt, so every expert is shared by both tokens, and another): routed first, then expert
    # by expert; each lane's tokens are those it decodes alone
    calls.clear()
    lanes = Engine(moe_fragment_sized, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128),
                   device=DEVICE)
    for other in (PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]):
        first = [int(lanes.prefill(0, PROMPT).argmax()), int(lanes.prefill(1, other).argmax())]
        got = [[first[0]], [first[1]]]
        for _ in range(3):
            logits = lanes.decode_step([0, 1], [got[0][-1], got[1][-1]])
            for lane in (0, 1):
                got[lane].append(int(logits[lane].argmax()))
        assert got == [engine.generate(PROMPT, 4), engine.generate(other, 4)]
    assert any(major for _, major in calls)


@pytest.mark.parametrize("fmt,tokens,shared", [("Q4G64_F16S", 3, True), ("Q5G64_F16S", 3, False),
                                               ("Q4G64_F16S", 10, False)])
def test_expert_major_launches_read_each_expert_once(kernel_device, monkeypatch, fmt, tokens, shared):
    """expert_major: the first pair of each expert multiplies it for every token that picked it (one x column each,
    a second 8-column tile past 8 tokens); every pair row is the exact product, as pair by pair."""
    from runtime.kernels import moe_fragment as mf

    monkeypatch.setattr("runtime.kernels.CPU_KERNELS", "triton")
    top_k, experts, inter, hid = 2, 3, 512, 512
    gate_up, down, shared_up, shared_down = _case(kernel_device, fmt, experts, inter, hid)
    x = torch.randn(tokens, hid, device=kernel_device).to(torch.bfloat16)
    # every expert shared by several tokens, in either slot; past 8 tokens expert 0 takes all (two column tiles)
    picks = [[t % 3, (t + 1) % 3] if tokens <= 8 else [0, 1 + t % 2] for t in range(tokens)]
    ids = torch.tensor([p[:: 1 - 2 * ((t // 2) % 2)] for t, p in enumerate(picks)], dtype=torch.int32,
                       device=kernel_device).reshape(-1)
    act = mf.fragment_expert_gemv(x, ids, gate_up, 2 * inter, top_k, True, shared=shared_up if shared else None,
                                  expert_major=True)
    _close(act, _exact(x, ids, gate_up, 2 * inter, top_k, True, shared_up if shared else None))
    y = mf.fragment_expert_gemv(act, ids, down, hid, top_k, False, shared=shared_down if shared else None,
                                expert_major=True)
    _close(y, _exact(act, ids, down, hid, top_k, False, shared_down if shared else None))
    with pytest.raises(ValueError, match="routed beforehand"):
        mf.fragment_expert_gemv(x, ids, gate_up, 2 * inter, top_k, True, expert_major=True,
                                route_into=(torch.zeros(tokens, experts), torch.zeros(tokens, top_k)))


def test_moe_fragment_auto_lays_out_experts_only_for_several_rows_on_a_gpu(moe_fragment_sized, monkeypatch):
    """NINFER_MOE_FRAGMENT=auto (the default): a GPU engine of several rows a step lays the experts out (the
    expert-major launches' gain); a one-lane engine keeps the dp4a pair, and a CPU engine never lays them out."""
    import runtime.engine as engine_module
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    monkeypatch.setattr(engine_module, "MOE_FRAGMENT", "auto")
    engine = Engine(moe_fragment_sized, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128),
                    device="cpu")
    packed = engine.lin["text/layers/0/moe/experts_gate_up"].packed
    assert packed.fragment is None and not engine._lays_out_experts("text/layers/0/moe/experts_gate_up", packed)
    monkeypatch.setattr(engine, "device", torch.device("cuda"))  # the rule alone (no GPU needed)
    assert engine._lays_out_experts("text/layers/0/moe/experts_gate_up", packed)
    monkeypatch.setattr(engine, "rows_per_step", 1)
    assert not engine._lays_out_experts("text/layers/0/moe/experts_gate_up", packed)


def test_expert_major_threshold_from_the_tuning(moe_fragment_sized, monkeypatch):
    """NINFER_MOE_FRAGMENT_TILE's 4th field: from how many tokens the launches go expert by expert (0: never), so
    side-by-side runs can take the pair-by-pair launches in a lanes engine."""
    import runtime.engine as engine_module
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from tests.test_engine import DEVICE, PROMPT

    monkeypatch.setattr(engine_module, "MOE_FRAGMENT", "on")
    tokens = None
    for threshold, down, want in ((0, 2, {False}), (2, 2, {False, True}), (1, 1, {True}), (1, 0, {True, False})):
        monkeypatch.setitem(engine_module.MOE_FRAGMENT_TUNING, "expert_major", threshold)
        monkeypatch.setitem(engine_module.MOE_FRAGMENT_TUNING, "down_major", down)  # 5th field: the down launch
        calls = []
        real = engine_module.fragment_expert_gemv
        monkeypatch.setattr(engine_module, "fragment_expert_gemv",
                            lambda *a, **kw: calls.append(kw.get("expert_major")) or real(*a, **kw))
        engine = Engine(moe_fragment_sized, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128),
                        device=DEVICE)
        first = [int(engine.prefill(0, PROMPT).argmax()), int(engine.prefill(1, PROMPT[:5]).argmax())]
        engine.decode_step([0], [first[0]])
        engine.decode_step([0, 1], first)
        monkeypatch.setattr(engine_module, "fragment_expert_gemv", real)
        assert set(calls) == want, (threshold, set(calls))
        if down == 0:  # gate/up expert by expert, down pair by pair over the routed pairs
            assert calls[0::2] == [True] * (len(calls) // 2) and not any(calls[1::2])
        got = engine.decode_step([0, 1], first).argmax(-1).tolist()
        assert tokens is None or got == tokens  # every split of the launches decodes the same tokens
        tokens = got


def test_fused_expert_kernel_fits_an_sm90_block(tmp_path):
    """The prefill's fused expert kernel, compiled for sm_90 (here, on the CPU, by bench/compile_check.py) at the
    engine's block rows and the launch's warps and pipeline stages, needs no more shared memory than a block may take
    in every order it reads: Q5 as fields needed 254 KB (seven lane-wide gathers a step, each buffered per stage), and
    every launch failed on the GPU."""
    from tests.sm90 import assert_compiles_for_sm90

    from runtime.kernels.moe import EXPERT_GEMM_TILE
    from runtime.memory_plan import MOE_BLOCK_ROWS

    pointers = {"x_ptr": "*bf16", "x_rows_ptr": "*i32", "block_experts_ptr": "*i32", "base_ptr": "*u8",
                "high_ptr": "*u8", "scale_ptr": "*fp16", "y_ptr": "*bf16", "ROWS_PER_EXPERT": "i32", "K": "i32",
                "stride_x": "i32"}
    launches = []
    for bits, fragment in ((4, 0), (5, 0), (4, 2), (5, 2), (5, 3), (5, 4)):  # planes, pairs, bytes, fields
        constants = {"GPR": 8, "K_PAD": 512, "BITS": bits, "GROUP": 64, "HIGH_BYTES": 8 if bits == 5 else 0,
                     "BLOCK_M": MOE_BLOCK_ROWS, "BLOCK_N": EXPERT_GEMM_TILE["block_n"],
                     "BLOCK_K": EXPERT_GEMM_TILE["block_k"], "FRAGMENT": fragment}
        launches.append({"module": "runtime.kernels.moe", "name": "_expert_gemm_kernel",
                         "signature": {**pointers, **{k: "constexpr" for k in constants}}, "constants": constants,
                         "num_warps": EXPERT_GEMM_TILE["num_warps"], "num_stages": EXPERT_GEMM_TILE["num_stages"]})
    assert_compiles_for_sm90(launches, tmp_path)
