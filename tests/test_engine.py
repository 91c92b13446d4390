"""The Triton runtime end to end on the tiny models: greedy tokens equal the torch reference for
several weight recipes and KV codecs, chunked prefill across pages, and batched lanes stay apart."""

import pytest
import torch

pytest.importorskip("triton")

from format.container import Artifact  # noqa: E402
from format.convert import ConvertOptions, convert_checkpoint  # noqa: E402
from runtime.engine import UNKNOWN_TOKEN, Engine  # noqa: E402
from runtime.memory_plan import MemoryPlanError, PlanOptions  # noqa: E402
from runtime.model import ReferenceModel  # noqa: E402
from runtime.transfers import HostCopy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = [3, 17, 99, 150, 42, 7, 250, 11, 64, 300, 5, 128]
NEW = 6
# bf16 activations (and a lossy KV codec) against the float32 reference on a random tiny model
GPU_LOGIT_REL_RMS = 0.08


@pytest.fixture(scope="module")
def artifacts(tiny_with_mtp, hf_moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("engine")
    out = {}
    for name, src, recipe in [("dense-q4", tiny_with_mtp, "q4"), ("dense-w8", tiny_with_mtp, "w8"),
                              ("moe-q5", hf_moe, "q5")]:
        out[name] = convert_checkpoint(src, d / f"{name}.nfer", ConvertOptions(recipe=recipe)).output
    return out


def _reference(path, prompt, n):
    return ReferenceModel(Artifact(path)).generate(prompt, n)


# a MoE router's k-th and (k+1)-th logits closer than this (a few bf16 steps at the tiny model's logit sizes): bf16
# activations may pick the other expert, which moves the step's logits far more than rounding does (session 27:
# the fused MoE decode's 0.18 on the H200 was such a flip at a 0.010 gap, where the separate launches happened to agree)
ROUTING_NEAR_TIE = 0.03


class _RoutingGaps:
    """Records, per reference forward, the smallest top-k / top-(k+1) router-logit gap of its last row."""

    def __init__(self):
        self.gaps: list[float] = []
        self._step = float("inf")

    def __enter__(self):
        import runtime.reference_ops as ops

        self._ops, self._real = ops, ops.moe

        def moe(x, router, *rest):
            logits = (x[-1:].float() @ router.float().t())
            top = logits.topk(rest[-1] + 1, dim=-1).values[0]
            self._step = min(self._step, (top[-2] - top[-1]).item())
            return self._real(x, router, *rest)

        ops.moe = moe
        return self

    def close_step(self):
        self.gaps.append(self._step)
        self._step = float("inf")

    def __exit__(self, *exc):
        self._ops.moe = self._real


def _clear_pick(logits: torch.Tensor) -> bool:
    """The top logit leads the second by more than bf16 noise: a GPU run must pick the same token there."""
    top2 = logits.float().topk(2).values
    return (top2[0] - top2[1]).item() > 0.05 * logits.float().std().item()


def _assert_matches_reference(engine, path, prompt, n):
    """CPU (float32 everywhere): greedy tokens must be identical. GPU (bf16 activations): teacher-force
    the reference's tokens and require close logits, and the same argmax wherever the reference's
    top-2 margin is clear of bf16 noise; a step whose MoE routing is a near tie (ROUTING_NEAR_TIE) is
    left out (fewer than two clear steps: skipped, saying so)."""
    ref_tokens = _reference(path, prompt, n)
    if DEVICE == "cpu":
        assert engine.generate(prompt, n) == ref_tokens
        return
    ref = ReferenceModel(Artifact(path))
    state = ref.new_state()
    with _RoutingGaps() as routing:
        want = [ref.forward(torch.tensor(prompt), state, 0)[-1]]
        routing.close_step()
        got = [engine.prefill(0, prompt).cpu()]
        for i, tok in enumerate(ref_tokens[:-1]):
            want.append(ref.forward(torch.tensor([tok]), state, len(prompt) + i)[-1])
            routing.close_step()
            got.append(engine.decode_step([0], [tok])[0].cpu())
    compared = 0
    for step, (w, g, gap) in enumerate(zip(want, got, routing.gaps)):
        if gap < ROUTING_NEAR_TIE:
            continue
        compared += 1
        rel = ((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()
        assert rel < GPU_LOGIT_REL_RMS, f"step {step}: relative RMS logit error {rel:.4f}"
        if _clear_pick(w):
            assert int(g.argmax()) == int(w.argmax())
    # the gap is the smallest over every MoE layer of a step, so the tiny random router (8 experts, top 2) ties
    # somewhere often (H100, session 28: 4 of 6 steps; another prompt all 4): with fewer than two clear steps
    # there is nothing to compare on this GPU, which is said, not passed
    if compared < 2:
        pytest.skip(f"routing near ties at {len(want) - compared} of {len(want)} steps (gaps {[round(g, 4) for g in routing.gaps]})")


@pytest.mark.parametrize("name,kv", [("dense-q4", "bf16"), ("dense-q4", "int8"), ("dense-w8", "rk4v4-e8"),
                                     ("dense-q4", "fp8"), ("moe-q5", "bf16")])
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.triton_kernels)])
def test_greedy_tokens_equal_reference(artifacts, name, kv, kernels):
    """Both CPU paths (each op's torch reference; the Triton kernels under the interpreter) generate the
    reference runtime's tokens; on a GPU the kernels always run."""
    engine = Engine(artifacts[name], PlanOptions(max_context=256, kv_dtype=kv, prefill_chunk=128), device=DEVICE)
    _assert_matches_reference(engine, artifacts[name], PROMPT, NEW)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_moe_prefill_chunks_take_the_grouped_experts_and_match_the_reference(artifacts, monkeypatch):
    """A MoE prompt of more than 16 tokens (one 21-row prefill chunk through the grouped experts, then
    decode) generates the reference's tokens through either grouped path (fused kernel, dense experts with
    the vendor grouped GEMM), and the grouped experts are what ran; the per-expert loop kept for
    side-by-side runs (NINFER_MOE_PREFILL=loop) generates them too."""
    import runtime.engine as engine_module

    import runtime.kernels.moe as moe

    calls, dense_calls = [], []
    grouped, dense = engine_module.expert_prefill, moe._dense_experts
    monkeypatch.setattr(engine_module, "expert_prefill", lambda *a, **k: calls.append(a[0].shape[0]) or grouped(*a, **k))
    monkeypatch.setattr(moe, "_dense_experts", lambda *a: dense_calls.append(a[0].shape[0]) or dense(*a))
    prompt, path = (PROMPT * 2)[:21], artifacts["moe-q5"]
    ref_tokens = _reference(path, prompt, 2) if DEVICE == "cpu" else None
    # "fused" is what auto takes for 21 x k pairs (asserted below), so the interpreter runs it once (CI time)
    for mode in ("auto", "dense", "loop") if DEVICE == "cpu" else ("auto", "fused", "dense", "loop"):
        monkeypatch.setenv("NINFER_MOE_PREFILL", mode)
        calls.clear(), dense_calls.clear()
        engine = Engine(path, PlanOptions(max_context=256, kv_dtype="bf16", prefill_chunk=128), device=DEVICE)
        if DEVICE == "cpu":  # the prefill's token and one decode step after it
            assert engine.generate(prompt, 2) == ref_tokens, mode
        else:
            _assert_matches_reference(engine, path, prompt, 4)
        assert (max(calls, default=0) == 21) == (mode != "loop"), (mode, calls)
        assert (set(dense_calls) == {21}) == (mode == "dense"), (mode, dense_calls)  # auto: 21 x k pairs are few


def test_unknown_moe_prefill_path_is_refused_in_one_line(artifacts, monkeypatch):
    from runtime.switches import SwitchError

    monkeypatch.setenv("NINFER_MOE_PREFILL", "grouped")  # stop 16's name for what is now "fused"
    with pytest.raises(SwitchError, match="NINFER_MOE_PREFILL='grouped' .* one of auto, fused, dense, loop"):
        Engine(artifacts["moe-q5"], PlanOptions(max_context=128, prefill_chunk=128), device=DEVICE)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_mlp_swiglu_in_the_gate_up_launch_gives_the_same_logits(artifacts, monkeypatch):
    """A one-row decode step's dense MLP with SwiGLU in the gate/up product's launch (where the down product reads
    x in bf16: its Q5 planes in fragment order on a GPU; here its dp4a words are left to the product itself) and
    with the swiglu launch after it (NINFER_SWIGLU_EPILOGUE=0) compute the same logits, bit for bit on the CPU."""
    import runtime.engine as engine_module
    import runtime.kernels.qlinear as ql

    fused_calls = []
    original = engine_module.qlinear_swiglu
    monkeypatch.setattr(engine_module, "qlinear_swiglu",
                        lambda *a: (lambda y: fused_calls.append(y is not None) or y)(original(*a)))
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(ql, "SWIGLU_EPILOGUE", on)
        engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, kv_dtype="bf16", prefill_chunk=128),
                        device=DEVICE)
        quantized_input = engine._quantized_input
        monkeypatch.setattr(engine, "_quantized_input",
                            lambda name, rows: None if name.endswith("mlp/down") else quantized_input(name, rows))
        first = engine.prefill(0, PROMPT)
        fused_calls.clear()
        logits[on] = engine.decode_step([0], [int(first.argmax())])[0]
        assert fused_calls and all(fused_calls) == on, (on, fused_calls)  # every layer's MLP took it, or none
    assert torch.equal(logits[True], logits[False]) if DEVICE == "cpu" else \
        torch.allclose(logits[True], logits[False], rtol=2e-2, atol=2e-2)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_gdn_conv_in_the_qkvz_launch_gives_the_same_logits(artifacts, monkeypatch):
    """NINFER_CONV_EPILOGUE=on: a one-lane decode step's GDN conv runs in the qkvz product's launch (every GDN layer),
    and the logits of three steps and the lane's conv windows are those of the two launches (bit for bit on the
    CPU)."""
    import runtime.engine as engine_module
    import runtime.kernels.qlinear as ql

    fused_calls = []
    original = engine_module.qlinear_conv
    monkeypatch.setattr(engine_module, "qlinear_conv",
                        lambda *a: (lambda y: fused_calls.append(y is not None) or y)(original(*a)))
    logits, windows = {}, {}
    for on in (True, False):
        monkeypatch.setattr(ql, "CONV_EPILOGUE", on)
        engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, kv_dtype="bf16", prefill_chunk=128,
                                                           cuda_graphs=False),  # graphs replay without Python
                        device=DEVICE)
        token = int(engine.prefill(0, PROMPT).argmax())
        fused_calls.clear()
        steps = []
        for _ in range(3):
            steps.append(engine.decode_step([0], [token])[0])
            token = int(steps[-1].argmax())
        gdn_layers = sum(not engine.cfg.is_full_attention(i) for i in range(engine.cfg.num_layers))
        assert fused_calls == [on] * (3 * gdn_layers), (on, fused_calls)
        logits[on], windows[on] = torch.stack(steps), engine.conv_stack[:, 0, 0].clone()
    if DEVICE == "cpu":
        assert torch.equal(logits[True], logits[False]) and torch.equal(windows[True], windows[False])
    else:
        assert torch.allclose(logits[True], logits[False], rtol=2e-2, atol=2e-2)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_gdn_norm_in_the_recurrence_launch_gives_the_same_logits(artifacts, monkeypatch):
    """NINFER_GDN_NORM_EPILOGUE=on: every GDN layer's output norm runs in the recurrence's launch (prefill through
    the recurrent kernel on the CPU, then decode steps of two lanes), and the logits are those of the two launches
    (bit for bit on the CPU)."""
    import runtime.engine as engine_module

    gated = []  # one entry per recurrence launch that takes the norm in
    original = engine_module.gdn_fused

    def spy(*args, gate=None, **kwargs):
        if gate is not None:
            gated.append(1)
        return original(*args, gate=gate, **kwargs)

    monkeypatch.setattr(engine_module, "gdn_fused", spy)
    logits = {}
    for on in (True, False):
        monkeypatch.setattr(engine_module, "GDN_NORM_EPILOGUE", on)
        gated.clear()
        engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, kv_dtype="bf16", prefill_chunk=128,
                                                           max_concurrency=2, cuda_graphs=False), device=DEVICE)
        firsts = [engine.prefill(lane, PROMPT[lane:]) for lane in (0, 1)]
        tokens = [int(f.argmax()) for f in firsts]
        steps = []
        for _ in range(2):
            steps.append(engine.decode_step([0, 1], tokens))
            tokens = steps[-1].argmax(-1).tolist()
        gdn_layers = sum(not engine.cfg.is_full_attention(i) for i in range(engine.cfg.num_layers))
        assert len(gated) == (4 * gdn_layers if on else 0), (on, len(gated))
        assert not engine.gdn_norm_counts.any()
        logits[on] = torch.cat([torch.stack(firsts), *steps])
    if DEVICE == "cpu":
        assert torch.equal(logits[True], logits[False])
    else:
        assert torch.allclose(logits[True], logits[False], rtol=2e-2, atol=2e-2)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_attention_launches_fused_or_separate_give_the_same_logits(artifacts, monkeypatch):
    """NINFER_ATTENTION_LAUNCHES=separate (norms and RoPE, K/V rotations and appends, the query rotation and the
    output gate a launch each) and the fused default compute the same prefill and decode logits (bit for bit on
    the CPU) with a rotating codec; an unknown value is refused in one line."""
    import runtime.engine as engine_module
    from runtime.memory_plan import MemoryPlanError

    logits = {}
    for mode in ("fused", "separate"):
        monkeypatch.setattr(engine_module, "ATTENTION_LAUNCHES", mode)
        engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, kv_dtype="rk4v4-e8", prefill_chunk=128),
                        device=DEVICE)
        first = engine.prefill(0, PROMPT)
        logits[mode] = (first, engine.decode_step([0], [int(first.argmax())])[0])
    for a, b in zip(logits["fused"], logits["separate"]):  # on a GPU the rotations' sums may differ in order
        assert torch.equal(a, b) if DEVICE == "cpu" else torch.allclose(a, b, rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(engine_module, "ATTENTION_LAUNCHES", "merged")
    with pytest.raises(MemoryPlanError, match="NINFER_ATTENTION_LAUNCHES='merged' is not an attention path"):
        Engine(artifacts["dense-q4"], PlanOptions(max_context=128, prefill_chunk=128), device=DEVICE)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_chunked_prefill_across_pages_and_chunks(artifacts):
    prompt = [(i * 37 + 11) % 380 for i in range(140)]  # 2 chunks of 128, 3 pages of 64
    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    _assert_matches_reference(engine, artifacts["dense-q4"], prompt, 3)


@pytest.mark.parametrize("kv", ["bf16", "rk4v4-e8"])
def test_prefill_chunks_through_the_segment_route_match_the_paged_attention(artifacts, kv, monkeypatch):
    """Eager prefill chunks hand their lengths to the attention, which (the cuDNN route, forced here: on the CPU its
    segments run through plain torch) attends to the keys before the chunk and the chunk's own as two segments
    merged by their log-sum-exps: the prompt's logits are the paged attention's, and so are the tokens after."""
    from runtime.kernels import prefill_attention_vendor as vendor

    seen = []
    monkeypatch.setattr(vendor, "vendor_prefill",
                        lambda q, host_ctx, *rest: seen.append(host_ctx) or (host_ctx is not None and q.shape[1] > 8))
    prompt = [(i * 37 + 11) % 380 for i in range(300)]  # chunks of 128: keys before the chunk from the second on
    # eager: on a GPU the 44-token tail would replay a padded piece graph, which hands the attention no host lengths
    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=384, prefill_chunk=128, kv_dtype=kv,
                                                       cuda_graphs=False), device=DEVICE)
    routed = engine.prefill(0, prompt).float().cpu()
    routed_tokens = engine.generate(prompt, 3)
    assert {(128,), (256,), (300,)} <= set(seen)  # every chunk's end, as the host knows it
    monkeypatch.setattr(vendor, "vendor_prefill", lambda *a: False)
    paged = engine.prefill(0, prompt).float().cpu()
    tol = 1e-4 if DEVICE == "cpu" else 5e-2
    torch.testing.assert_close(routed, paged, atol=tol * paged.abs().max().item(), rtol=0)
    assert routed_tokens == engine.generate(prompt, 3)


@pytest.mark.triton_kernels  # the kernels composed in the engine
def test_batched_lanes_do_not_mix(artifacts):
    path = artifacts["dense-q4"]
    a, b = PROMPT, [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]
    engine = Engine(path, PlanOptions(max_context=128, max_concurrency=2, prefill_chunk=128), device=DEVICE)
    la, lb = engine.prefill(0, a), engine.prefill(1, b)
    ta, tb = [int(la.argmax())], [int(lb.argmax())]
    for _ in range(3):
        logits = engine.decode_step([0, 1], [ta[-1], tb[-1]])
        ta.append(int(logits[0].argmax()))
        tb.append(int(logits[1].argmax()))
    if DEVICE == "cpu":
        assert ta == _reference(path, a, 4) and tb == _reference(path, b, 4)
    else:  # each lane must equal the same lane decoded alone on this device
        solo = Engine(path, PlanOptions(max_context=128, max_concurrency=1, prefill_chunk=128), device=DEVICE)
        assert ta == solo.generate(a, 4) and tb == solo.generate(b, 4)


def test_prompt_longer_than_context_is_refused(artifacts):
    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=64, prefill_chunk=128), device=DEVICE)
    with pytest.raises(MemoryPlanError, match="leaves no room in --max-context 64"):
        engine.prefill(0, list(range(64)))


def test_engine_fails_fast_when_memory_is_short(artifacts):
    with pytest.raises(MemoryPlanError, match=r"short\); the largest context that fits is"):
        Engine(artifacts["dense-q4"], PlanOptions(max_context=4096), device=DEVICE, available_bytes=1_000_000)


def test_seeded_sampling_is_reproducible(artifacts):
    from runtime.kernels.sampling import SamplingParams

    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=128, prefill_chunk=128), device=DEVICE)
    params = SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.1)
    runs = [engine.generate(PROMPT, 4, params=params, generator=torch.Generator(DEVICE).manual_seed(3)) for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 4


def _assert_reused_logits_close(got, want):
    """Logits after a lane's reused state (built by one-row decode steps: 14-bit activations in the dp4a
    GEMV) vs a fresh prefill. On a GPU the fresh prefill also takes other kernels (bf16 GEMMs, fla's chunked
    GDN), so the logits agree to a few percent there (run 24: elementwise gaps up to ~0.03 on logits of ~1,
    same argmax): judged by relative L2."""
    got, want = got.float().cpu(), want.float().cpu()
    if DEVICE == "cpu":
        assert torch.allclose(got, want, rtol=1e-2, atol=1e-2)
    else:
        assert ((got - want).norm() / want.norm()).item() < 0.05


def test_returning_conversation_reuses_the_lane_prefix(artifacts):
    path = artifacts["dense-q4"]
    engine = Engine(path, PlanOptions(max_context=128, prefill_chunk=128), device=DEVICE)
    first = engine.generate(PROMPT, 3)
    history = PROMPT + first[:-1]  # the last token returned was sampled but not yet fed to the lane
    follow_up = history + [first[-1], 21, 22, 23]
    assert engine.reusable_prefix(0, follow_up) == len(history)
    chunks = list(engine.prefill_chunks(0, follow_up, reuse=True))
    assert engine.stats.reused_tokens == len(history)
    fresh = Engine(path, PlanOptions(max_context=128, prefill_chunk=128), device=DEVICE)
    want = fresh.prefill(0, follow_up)
    got = chunks[-1]
    assert int(got.argmax()) == int(want.argmax())
    _assert_reused_logits_close(got, want)
    assert engine.reusable_prefix(0, [999] + follow_up) == 0  # a different conversation starts over


def test_turn_checkpoint_resumes_a_conversation_whose_tail_changed(artifacts):
    """Turn 2 re-renders turn 1's reply differently (reasoning dropped): the lane's history is no longer
    a prefix, but the prompt agrees with it up to the turn checkpoint, so only the rest is computed."""
    path = artifacts["dense-q4"]
    opts = PlanOptions(max_context=128, prefill_chunk=128)
    engine = Engine(path, opts, device=DEVICE)
    shared = PROMPT + [33, 44]
    turn1 = shared + [1, 2, 3]  # [1, 2, 3] = the generation header, rendered differently next turn
    list(engine.prefill_chunks(0, turn1, reuse=True, checkpoint_at=len(shared)))
    engine.decode_step([0], [7])
    turn2 = shared + [1, 9, 9, 50, 51]
    assert engine.reusable_prefix(0, turn2) == len(shared)
    got = list(engine.prefill_chunks(0, turn2, reuse=True))[-1]
    assert engine.stats.reused_tokens == len(shared)
    want = Engine(path, opts, device=DEVICE).prefill(0, turn2)
    assert int(got.argmax()) == int(want.argmax())
    _assert_reused_logits_close(got, want)
    # the checkpoint is gone once the lane holds a different prefix
    list(engine.prefill_chunks(0, [5, 6, 7], reuse=True))
    assert engine.reusable_prefix(0, turn2) == 0


@pytest.mark.triton_kernels  # the kernels composed in the engine
@pytest.mark.parametrize("align", [False, True])
def test_decode_rows_ride_in_a_shared_prefill_chunk(artifacts, align, monkeypatch):
    """Lane 1 decodes while lane 0 prefills: the chunks shrink to --prefill-chunk-shared and lane 1's rows
    ride inside them (one weight read for both); both lanes' greedy tokens stay those of running alone.
    Aligned (NINFER_RIDE_ALIGN=on), the rider's row comes out of the piece: 31 prompt rows + 1 rider = 32."""
    import runtime.engine as engine_module
    from runtime.engine import Riders

    monkeypatch.setattr(engine_module, "RIDE_ALIGN", align)
    path = artifacts["dense-q4"]
    long = [(i * 37 + 11) % 380 for i in range(100)]
    short = [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]
    engine = Engine(path, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128, shared_prefill_chunk=32),
                    device=DEVICE)
    decoded = [int(engine.prefill(1, short).argmax())]
    riders = Riders()
    chunks = engine.prefill_chunks(0, long, riders=riders)
    sizes, last, rider_logits = [], None, []
    while last is None:
        before = engine.stats.prefill_tokens
        riders.offer([1], [decoded[-1]])
        last = next(chunks)
        sizes.append(engine.stats.prefill_tokens - before)
        assert riders.advanced == [1] and riders.logits is not None and riders.logits.shape[0] == 1
        rider_logits.append(riders.logits[0].clone())
        decoded.append(int(riders.logits[0].argmax()))
    assert sizes == ([31, 31, 31, 7] if align else [32, 32, 32, 4]) and engine.stats.rider_tokens == 4
    assert engine.held_tokens(1) == len(short) + 4
    if DEVICE == "cpu":
        assert decoded == _reference(path, short, 5)
        assert int(last.argmax()) == _reference(path, long, 1)[0]
        tail = engine.decode_step([0, 1], [int(last.argmax()), decoded[-1]])  # both lanes go on decoding
        assert [int(tail[0].argmax()), int(tail[1].argmax())] == [_reference(path, long, 2)[1], _reference(path, short, 6)[5]]
    else:  # bf16: a padded or shared chunk takes other product kernels than one-row steps, so a near tie of
        # the tiny random model may flip; each step's logits (fed the same tokens) must agree, and clear picks too
        solo = Engine(path, PlanOptions(max_context=256, max_concurrency=1, prefill_chunk=128), device=DEVICE)
        solo.prefill(0, short)
        for step, got in enumerate(rider_logits):
            want = solo.decode_step([0], [decoded[step]])[0]
            _assert_reused_logits_close(got, want)
            if _clear_pick(want):
                assert int(got.argmax()) == int(want.argmax()), f"step {step}: a clear pick changed"


def test_riders_are_refused_where_they_cannot_ride(artifacts):
    """A lane offered to its own prefill, or a speculative engine: nothing rides (the scheduler decodes
    them after the chunk), but the chunk still shrinks so their wait stays short."""
    from runtime.engine import Riders

    path = artifacts["dense-q4"]
    engine = Engine(path, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128, shared_prefill_chunk=32,
                                      spec="mtp"), device=DEVICE)
    engine.prefill(1, [5, 6, 7])
    riders = Riders()
    chunks = engine.prefill_chunks(0, list(range(1, 80)), riders=riders)
    riders.offer([1], [3])
    assert next(chunks) is None and riders.logits is None and riders.advanced == []
    assert engine.stats.prefill_tokens == 3 + 32 and engine.held_tokens(1) == 3
    assert not engine.can_ride([0], 0)


def test_scheduler_rides_decoding_lanes_on_a_long_prefill(artifacts):
    """Through the serve scheduler: a request decodes while a long prompt arrives beside it; the decoder's
    tokens come from the prefill chunks' forwards (rider_tokens) and both outputs are those of running alone."""
    import threading

    from runtime.serve.scheduler import GenerationRequest, Scheduler

    path = artifacts["dense-q4"]
    long = [(i * 37 + 11) % 380 for i in range(100)]
    short = [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]
    engine = Engine(path, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128, shared_prefill_chunk=32),
                    device=DEVICE)
    scheduler = Scheduler(engine)
    outputs = {"short": [], "long": []}
    done = {name: threading.Event() for name in outputs}
    long_request = GenerationRequest(long, 3, outputs["long"].append, lambda *_: done["long"].set())

    def on_short_token(token):
        outputs["short"].append(token)
        if len(outputs["short"]) == 1:  # the short lane decodes: now the long prompt arrives
            scheduler.submit(long_request)

    scheduler.submit(GenerationRequest(short, 8, on_short_token, lambda *_: done["short"].set()))
    try:
        assert done["short"].wait(600) and done["long"].wait(600)
    finally:
        scheduler.close()
    assert engine.stats.rider_tokens >= 3  # the long prompt's chunks carried the short lane's rows
    if DEVICE == "cpu":
        assert outputs["short"] == _reference(path, short, 8) and outputs["long"] == _reference(path, long, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the torch path serves CPU tensors; a GPU runs the kernels")
def test_cpu_torch_path_keeps_dequantized_weights_within_its_budget(monkeypatch):
    """The CPU's torch path keeps a weight's float32 copy while the process-wide budget allows (and gives the
    budget back when the weight goes), else dequantizes it per call; results are the same either way."""
    import gc

    import runtime.kernels
    from runtime.kernels import qlinear as ql

    from .test_kernels import _packed
    from format.numeric import FORMATS

    monkeypatch.setattr(runtime.kernels, "CPU_KERNELS", "torch")  # also under NINFER_CPU_KERNELS=triton
    gc.collect()
    x = torch.randn(3, 256)
    monkeypatch.setattr(ql, "DENSE_CACHE_BYTES", ql._dense_cached_bytes + 64 * 256 * 4)  # room for one 64x256
    a, b = _packed(64, 256, FORMATS["Q4G64_F16S"], seed=1), _packed(64, 256, FORMATS["Q5G64_F16S"], seed=2)
    ya, yb = ql.qlinear(x, a), ql.qlinear(x, b)
    assert a._dense is not None and b._dense is None  # b is over the budget: rebuilt per call
    assert torch.equal(ql.qlinear(x, b), yb) and torch.equal(ql.qlinear(x, a), ya)
    del a
    gc.collect()
    c = _packed(64, 256, FORMATS["Q6G64_F16S"], seed=3)
    ql.qlinear(x, c)
    assert c._dense is not None  # a's share came back when it went


@pytest.fixture(scope="module")
def wide_q4(tmp_path_factory):
    """A tiny model wide enough (hidden 512, MLP 1,024) that its products meet the fragment kernels' shape rules:
    attention input, GDN input and the MLP in fragment order; attention output (K 256) on artifact planes; GDN output
    (K 64) on the other kernels."""
    from format.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("wide")
    src = write_tiny_checkpoint(d / "hf", seed=5, layers=4, mtp_layers=0, hidden=512, intermediate=1024)
    return convert_checkpoint(src, d / "wide.nfer", ConvertOptions(recipe="q4")).output


def test_wide_model_products_reach_the_fragment_kernels(wide_q4, monkeypatch):
    from runtime.kernels.qgemm_fragment_layout import takes_fragment_layout
    from runtime.kernels.qgemm_rows_frag import frag_supported

    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    quant = {n: lin.packed for n, lin in engine.lin.items() if hasattr(lin, "packed")}
    layout = [n for n, w in quant.items() if takes_fragment_layout(n, w)]
    planes = [n for n, w in quant.items() if n not in layout and frag_supported(w, 4)]
    assert any(n.endswith("mlp/down") for n in layout) and any(n.endswith("attention/query_gate_key_value") for n in layout)
    assert any(n.endswith("attention/output") for n in planes)
    # NINFER_GEMV_FRAG=layout: the engine permutes those products in place and still generates the reference's tokens
    from runtime.kernels import qlinear as ql

    monkeypatch.setattr(ql, "FRAG_MODE", "layout")
    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    assert all(engine.lin[n].packed.fragment is not None for n in layout)
    with pytest.raises(ValueError, match="fragment order"):
        engine.lin[layout[0]].rows(8, 32)
    assert engine.generate(PROMPT, NEW) == _reference(wide_q4, PROMPT, NEW)
    # auto: one plain lane keeps its Q4 products on the artifact's planes; several lanes (or verify blocks) take
    # fragment order
    monkeypatch.setattr(ql, "FRAG_MODE", "auto")
    two_lanes = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128, max_concurrency=2), device="cpu")
    assert two_lanes.rows_per_step == 2
    assert all(two_lanes.lin[n].packed.fragment is not None for n in layout)
    assert two_lanes.fragment_order_products == len(layout) + 1  # and the Q6 head; the server's start-up line
    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    assert all((engine.lin[n].packed.fragment is not None) == (engine.lin[n].packed.fmt.bits == 5) for n in layout)
    assert any(engine.lin[n].packed.fmt.bits == 5 for n in layout) and any(engine.lin[n].packed.fmt.bits == 4
                                                                          for n in layout)


def test_the_q6_head_in_fragment_order(wide_q4, monkeypatch):
    """A Q6 output head goes to fragment order in place even for one plain lane (NINFER_HEAD_FRAGMENT=auto): the
    engine still generates the reference's tokens, row views (--draft-vocab's) take whole 16-row blocks of it (the
    logits of those token ids), and NINFER_HEAD_FRAGMENT=off keeps the artifact's planes; a bad value is refused."""
    import runtime.engine as engine_module

    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    head = engine.lin["text/output_head"]
    assert head.packed.fmt.bits == 6 and head.packed.fragment is not None
    assert engine.generate(PROMPT, NEW) == _reference(wide_q4, PROMPT, NEW)
    h = torch.randn(3, head.packed.cols)
    first = head.rows(0, 288)
    assert first.packed.rows == 288 and torch.allclose(first(h), head(h)[:, :288], atol=1e-5)
    assert torch.allclose(head.rows(32, 64)(h), head(h)[:, 32:64], atol=1e-5)  # whole blocks anywhere
    with pytest.raises(ValueError, match="whole blocks of 16 rows only"):
        head.rows(8, 32)
    with pytest.raises(ValueError, match="whole blocks of 16 rows only"):
        head.rows(0, 300)
    monkeypatch.setattr(engine_module, "HEAD_FRAGMENT", "off")
    planes = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    assert planes.lin["text/output_head"].packed.fragment is None
    assert torch.allclose(planes.lin["text/output_head"](h), head(h), atol=1e-5)
    monkeypatch.setattr(engine_module, "HEAD_FRAGMENT", "on")
    with pytest.raises(MemoryPlanError, match="NINFER_HEAD_FRAGMENT='on' is not a head path; use auto or off"):
        Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")


@pytest.mark.parametrize("int8", ["q5", "on"])
def test_int8_fragment_order_lays_out_and_generates(wide_q4, int8, monkeypatch):
    """NINFER_FRAGMENT_INT8: one plain lane lays out its Q5 products (q5) or every layer product (on) in byte order
    (the int8 kernel's), the rest keep their layout, and the engine generates the reference's tokens (on a CPU the
    products multiply through the planes read back, and the prefill dequantizes byte order in place); a bad value
    is refused in one line."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_fragment_layout import takes_fragment_layout

    monkeypatch.setattr(fl, "FRAGMENT_INT8", int8)
    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    quant = {n: lin.packed for n, lin in engine.lin.items() if hasattr(lin, "packed")}
    layout = [n for n, w in quant.items() if takes_fragment_layout(n, w)]
    for n in layout:
        w = quant[n]
        want = "bytes" if int8 == "on" or w.fmt.bits == 5 else None
        assert (w.fragment.order if w.fragment is not None else None) == want, (n, w.fmt.name)
    assert engine.generate(PROMPT, NEW) == _reference(wide_q4, PROMPT, NEW)
    monkeypatch.setattr(fl, "FRAGMENT_INT8", "yes")
    with pytest.raises(ValueError, match="NINFER_FRAGMENT_INT8='yes' is not one of off, q5, on"):
        Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")


def test_q5_fields_order_lays_out_and_generates(wide_q4, monkeypatch):
    """By default (NINFER_Q5_FIELDS=on) an engine of several lanes lays out its Q5 layer products as 5-bit fields,
    its Q4 ones and the Q6 head in pair order, and generates the reference's tokens (on a CPU the products and the
    prefill read the planes back through row_planes); a bad value is refused in one line."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_fragment_layout import takes_fragment_layout

    monkeypatch.setattr(fl, "Q5_FIELDS", "on")
    engine = Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128, max_concurrency=2), device="cpu")
    quant = {n: lin.packed for n, lin in engine.lin.items() if hasattr(lin, "packed")}
    layout = [n for n, w in quant.items() if takes_fragment_layout(n, w)]
    assert any(quant[n].fmt.bits == 5 for n in layout)
    for n in layout:
        assert quant[n].fragment.order == ("fields" if quant[n].fmt.bits == 5 else "pairs"), n
    assert quant["text/output_head"].fragment.order == "pairs"
    assert engine.generate(PROMPT, NEW) == _reference(wide_q4, PROMPT, NEW)
    monkeypatch.setattr(fl, "Q5_FIELDS", "yes")
    with pytest.raises(ValueError, match="NINFER_Q5_FIELDS='yes' is not on or off"):
        Engine(wide_q4, PlanOptions(max_context=128, prefill_chunk=128, max_concurrency=2), device="cpu")


@pytest.mark.skipif(DEVICE != "cuda", reason="the fragment kernels are inline PTX for NVIDIA GPUs; their PTX is "
                    "emulated on the CPU in tests/test_frag_kernel.py")
@pytest.mark.parametrize("mode", ["auto", "rows", "layout", "int8", "swiglu", "head", "pairs"])
def test_fragment_kernels_in_the_engine(wide_q4, mode, monkeypatch):
    """The engine with the fragment kernels (rows: row blocks over the artifact's planes; auto with 4 lanes and
    layout: every 1..16-row product in fragment order; int8: NINFER_FRAGMENT_INT8=on, those products on the int8
    kernel, their inputs as dp4a words; swiglu: NINFER_SWIGLU_FRAGMENT=2, SwiGLU in the gate/up launch; pairs:
    NINFER_Q5_FIELDS=off, the Q5 products in pair order rather than as 5-bit fields; head:
    the Q6 output head in fragment order, against NINFER_HEAD_FRAGMENT=off) matches the reference
    runtime, and 4 lanes decoding at once give the logits of the kernels turned off."""
    import runtime.engine as engine_module
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels import qlinear as ql

    head = mode == "head"
    if head:
        mode = "auto"
    if mode == "int8":
        monkeypatch.setattr(fl, "FRAGMENT_INT8", "on")
        mode = "auto"
    if mode == "swiglu":
        monkeypatch.setattr(ql, "SWIGLU_FRAGMENT_KS", 2)
        mode = "auto"
    if mode == "pairs":
        monkeypatch.setattr(fl, "Q5_FIELDS", "off")
        mode = "auto"
    monkeypatch.setattr(ql, "FRAG_MODE", mode)
    engine = Engine(wide_q4, PlanOptions(max_context=128, max_concurrency=4, prefill_chunk=128), device=DEVICE)
    if head:
        assert engine.lin["text/output_head"].packed.fragment is not None
    if mode != "rows":
        assert any(getattr(lin, "packed", None) is not None and lin.packed.fragment is not None
                   for lin in engine.lin.values())
    _assert_matches_reference(engine, wide_q4, PROMPT, NEW)
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:], PROMPT[:7]]
    steps, first = {}, None
    for m in (mode, "off"):  # fresh engines: the layout is chosen at bind
        monkeypatch.setattr(ql, "FRAG_MODE", m)
        monkeypatch.setattr(engine_module, "HEAD_FRAGMENT", "auto" if m != "off" else "off")
        e = Engine(wide_q4, PlanOptions(max_context=128, max_concurrency=4, prefill_chunk=128), device=DEVICE)
        prefilled = [int(e.prefill(lane, p).argmax()) for lane, p in enumerate(prompts)]
        first = first or prefilled  # the same next tokens for both (a near tie may round either way)
        steps[m] = e.decode_step([0, 1, 2, 3], first).float().cpu()
    rel = ((steps[mode] - steps["off"]).pow(2).mean().sqrt() / steps["off"].pow(2).mean().sqrt()).item()
    assert rel < 2e-2, f"4-lane logits {mode} vs off: relative RMS {rel:.4f}"


@pytest.fixture(scope="module")
def moe_equal_shared(tmp_path_factory):
    """A tiny MoE whose shared expert is as wide as a routed one (as the 35B-A3B's: 512 and 512), so its
    products ride in the routed experts' launches."""
    from format.tiny import write_tiny_checkpoint

    d = tmp_path_factory.mktemp("moe-shared")
    src = write_tiny_checkpoint(d / "hf", moe=True, seed=9, mtp_layers=0, shared_intermediate=32)
    return convert_checkpoint(src, d / "moe.nfer", ConvertOptions(recipe="q4")).output


@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.triton_kernels)])
def test_moe_shared_expert_rides_with_the_routed_ones(moe_equal_shared, kernels, monkeypatch):
    """NINFER_MOE_DECODE=fused: decode runs the shared expert inside the routed experts' two launches (its rows
    after the pairs') and still generates the reference's tokens; separate (side-by-side runs) too."""
    import runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "MOE_DECODE", "fused")
    calls = []
    real = engine_module.expert_gemv
    monkeypatch.setattr(engine_module, "expert_gemv", lambda *a, **kw: calls.append(kw.get("shared")) or real(*a, **kw))
    engine = Engine(moe_equal_shared, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    _assert_matches_reference(engine, moe_equal_shared, PROMPT, NEW)
    assert calls and all(shared is not None for shared in calls)  # every decode step took the fused launches
    if kernels == "triton":  # the separate launches' kernels are each checked in test_kernels (CI time)
        return
    # NINFER_MOE_DECODE=separate: a launch each, as before (side-by-side runs), the same tokens
    monkeypatch.setattr(engine_module, "MOE_DECODE", "separate")
    calls.clear()
    engine = Engine(moe_equal_shared, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    assert not engine.router_and_gate
    _assert_matches_reference(engine, moe_equal_shared, PROMPT, NEW)
    assert calls and all(shared is None for shared in calls)


def test_moe_shared_expert_apart_from_the_routed_launches(moe_equal_shared, monkeypatch):
    """NINFER_MOE_SHARED_APART=N: fused MoE decode of N or more rows takes the shared expert out of the routed
    experts' launches (its own products, one weight read for every row) and still generates the reference's
    tokens; fewer rows keep it riding."""
    import runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "MOE_DECODE", "fused")
    calls = []
    real = engine_module.expert_gemv
    monkeypatch.setattr(engine_module, "expert_gemv", lambda *a, **kw: calls.append(kw.get("shared")) or real(*a, **kw))
    for rows, riding in ((1, False), (len(PROMPT) + 1, True)):  # decode steps have 1 row, the prompt 12
        monkeypatch.setattr(engine_module, "MOE_SHARED_APART_ROWS", rows)
        calls.clear()
        engine = Engine(moe_equal_shared, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
        _assert_matches_reference(engine, moe_equal_shared, PROMPT, NEW)
        assert calls and all((shared is not None) == riding for shared in calls), rows


def test_moe_router_and_shared_gate_are_one_product(artifacts, monkeypatch):
    """The plan lays a MoE layer's router and shared-expert gate side by side: the fused MoE decode multiplies both
    in one product (the gate's logit its last column) and still generates the reference's tokens."""
    import runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "MOE_DECODE", "fused")
    engine = Engine(artifacts["moe-q5"], PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    moe_layers = [n for n in engine.lin if n.endswith("moe/router")]
    assert moe_layers and len(engine.router_and_gate) == len(moe_layers)
    m = moe_layers[0][: -len("router")]
    both = engine.router_and_gate[m].weight
    assert torch.equal(both[:-1].float(), engine.lin[m + "router"].weight.float())
    assert torch.equal(both[-1:].float(), engine.lin[m + "shared_gate"].weight.float())
    _assert_matches_reference(engine, artifacts["moe-q5"], PROMPT, NEW)


def test_moe_router_in_the_norm_before_it(artifacts, monkeypatch):
    """NINFER_ROUTER_IN_NORM=rows: decode / verify rows' router + shared gate product is taken by the post-attention
    norm's launch (on a CPU its torch path multiplies after the norm); tokens are the reference's, and the norm
    gets the fused product's weight for each MoE layer of steps of up to 16 rows only (not the prompt's 21)."""
    import runtime.engine as engine_module

    monkeypatch.setattr(engine_module, "MOE_DECODE", "fused")
    monkeypatch.setattr(engine_module, "ROUTER_IN_NORM_ROWS", 8)
    routed_rows = []
    real = engine_module.rmsnorm
    monkeypatch.setattr(engine_module, "rmsnorm", lambda *a, **kw: (
        routed_rows.append(kw["router_out"].shape[0]) if kw.get("router") is not None else None) or real(*a, **kw))
    engine = Engine(artifacts["moe-q5"], PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    _assert_matches_reference(engine, artifacts["moe-q5"], (PROMPT * 2)[:21], NEW)
    assert routed_rows and set(routed_rows) == {1}


@pytest.mark.triton_kernels
def test_weight_cache_keeps_layer_products_in_spare_memory(artifacts):
    """Memory the plan leaves spare holds dense copies of the layer products (not the MoE experts, which
    have their own prefill path): on a GPU an engine with room keeps them and its prefill gives the logits of
    one with --weight-cache off; on a CPU the selection alone (its torch path never reads them)."""
    path = artifacts["moe-q5"]
    opts = PlanOptions(max_context=256, prefill_chunk=128)
    engine = Engine(path, opts, device=DEVICE)
    if DEVICE == "cpu":
        assert engine.weight_cache_bytes == 0
        engine._keep_dense_weights(1 << 30)
    kept = {n for n, lin in engine.lin.items() if getattr(getattr(lin, "packed", None), "resident_dense", None) is not None}
    assert kept and engine.weight_cache_bytes > 0
    assert all(n.startswith("text/layers/") and "/experts_" not in n for n in kept)
    assert any(n.endswith("shared_gate_up") for n in kept) and not any("experts_" in n for n in kept)
    if DEVICE == "cpu":
        return
    from dataclasses import replace

    off = Engine(path, replace(opts, weight_cache="off"), device=DEVICE)
    assert off.weight_cache_bytes == 0
    prompt = (PROMPT * 3)[:33]
    got, want = engine.prefill(0, prompt).float().cpu(), off.prefill(0, prompt).float().cpu()
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < 1e-2


@pytest.mark.parametrize("kind, align", [("dense-q4", False), ("dense-q4", True), ("moe-q5", False)])
def test_padded_prompt_pieces_change_nothing(artifacts, monkeypatch, kind, align):
    """NINFER_PIECE_GRAPHS: a prompt piece shorter than the shared chunk padded to a graph bucket (pad rows with
    GDN decay 1 and beta 0, the conv window after the real rows, logits of the last real row) leaves every
    lane's logits, tokens, recurrent and conv state and length as the unpadded piece does, riders included; a
    MoE too with NINFER_MOE_PREFILL_GRAPHS=on (pad rows route to experts of their own: the real rows' are unchanged).
    With NINFER_RIDE_ALIGN the pieces a lane rides in leave its row out of the bucket (31 + 1 rows, not 32 + 1)."""
    import runtime.engine as engine_module
    from runtime.engine import Riders

    path = artifacts[kind]
    monkeypatch.setattr(engine_module, "MOE_PREFILL_GRAPHS", True)
    monkeypatch.setattr(engine_module, "RIDE_ALIGN", align)
    long = [(i * 37 + 11) % 300 for i in range(100)]  # within both tiny vocabularies (384, 320)
    short = [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]

    def run(padded: bool):
        engine = Engine(path, PlanOptions(max_context=256, max_concurrency=2, prefill_chunk=128,
                                          shared_prefill_chunk=32), device=DEVICE)
        engine.piece_graphs = padded
        pieces = []
        real = engine._padded_piece
        monkeypatch.setattr(engine, "_padded_piece", lambda lane, piece, *a: pieces.append((len(piece), a[1])) or
                            real(lane, piece, *a))
        decoded = [int(engine.prefill(1, short).argmax())]  # 10 tokens: padded to 32, nobody riding
        riders = Riders()
        chunks = engine.prefill_chunks(0, long, riders=riders)
        last = None
        while last is None:  # 32, 32, 32 and a 4-token tail padded to 32, lane 1 riding each
            riders.offer([1], [decoded[-1]])
            last = next(chunks)
            decoded.append(int(riders.logits[0].argmax()))
        states = [stack[:, :2, 0].clone() for stack in (engine.conv_stack, engine.rec_stack)]
        lengths = engine.ctx_len.tolist()
        tail = engine.decode_step([0, 1], [int(last.argmax()), decoded[-1]])
        return pieces, decoded, last, tail, states, lengths

    pieces, decoded, last, tail, states, lengths = run(True)
    plain_pieces, plain_decoded, plain_last, plain_tail, plain_states, plain_lengths = run(False)
    whole, tail_piece = ((31, 31), (7, 31)) if align else ((32, 32), (4, 32))  # (piece, bucket)
    full = [] if DEVICE == "cuda" else [whole] * 3  # with CUDA graphs full shared chunks keep their ride graph
    assert pieces == [(10, 32)] + full + [tail_piece] and plain_pieces == []
    assert lengths == plain_lengths == [100, len(short) + 4]
    if DEVICE == "cpu":  # float32: the same numbers
        assert decoded == plain_decoded == _reference(path, short, 5)
        torch.testing.assert_close(last, plain_last, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(tail, plain_tail, atol=2e-4, rtol=2e-4)
        for got, want in zip(states, plain_states):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    else:  # bf16: a 10-row piece multiplies on the row kernels, its 32-row padding on the GEMM (other roundings)
        for got, want in [(last, plain_last), (tail, plain_tail)] + list(zip(states, plain_states)):
            got, want = got.float(), want.float()
            assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < GPU_LOGIT_REL_RMS


def test_bench_decode_chained_as_the_server_runs_it_gives_the_same_tokens(artifacts):
    """The bench times plain decode as the server chains it (each step fed on the device, the host a step behind):
    the lane ends up with the tokens the host-synced loop picks."""
    from runtime.bench import _decode

    held = {}
    for chained in (False, True):
        eng = Engine(artifacts["dense-q4"], PlanOptions(max_context=64), device=DEVICE, cuda_graphs=False)
        first = int(torch.argmax(eng.prefill(0, PROMPT)))
        n, secs = _decode(eng, first, NEW, chained=chained)
        assert n == NEW and secs > 0
        held[chained] = list(eng.lane_tokens[0])
    assert held[True] == held[False] and len(held[True]) == len(PROMPT) + NEW
    assert UNKNOWN_TOKEN not in held[True]  # every fed token told to the engine


def test_device_ints_are_the_host_values(monkeypatch):
    from runtime import transfers

    for queued in (True, False):
        monkeypatch.setattr(transfers, "QUEUED_COPIES", queued)
        got = transfers.device_ints([[1, 2], [3, 2**40]], torch.device(DEVICE))
        assert got.dtype == torch.long and got.device.type == DEVICE and got.tolist() == [[1, 2], [3, 2**40]]


@pytest.mark.skipif(DEVICE != "cuda", reason="a host sync is a CUDA stream's; the CPU has none to avoid")
def test_a_chained_decode_step_is_queued_without_waiting_for_the_gpu(artifacts):
    """A chained step (tokens fed on the device) and the copy of its tokens to the host must not synchronize: one
    blocking host-to-device copy makes every step wait for the one before and idles the GPU while the host launches
    the next (torch.tensor(..., device="cuda") did, three times a step, until session 46). Speculative rounds are
    not held to this: their acceptance reads the verify block back."""
    eng = Engine(artifacts["dense-q4"], PlanOptions(max_context=64, max_concurrency=2), device=DEVICE)
    first = int(torch.argmax(eng.prefill(0, PROMPT)))
    eng.prefill(1, PROMPT[:5])
    for lanes in ([0], [0, 1]):
        picked = eng.decode_step(lanes, [first] * len(lanes)).argmax(-1)  # captures this batch size's graph
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eng.decode_step(lanes, [first] * len(lanes))  # the host's tokens: queued as well
            for _ in range(3):
                picked = eng.decode_step(lanes, None, device_tokens=picked).argmax(-1)
                copy = HostCopy.start(picked)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(copy.tolist()) == len(lanes)
    # steps of the host's tokens and chained steps share one graph per batch size (the plan holds one's memory)
    assert sorted(key[1] for key in eng._graphs if key[0] == "decode") == [1, 2]


def test_step_paths_make_no_blocking_host_to_device_copies():
    """torch.tensor(..., device=...) on a GPU waits for the whole stream (a blocking copy), so the modules that
    queue decode steps and speculative rounds build device ints with runtime.transfers.device_ints instead; this
    keeps a new blocking copy out of them on a CPU-only CI, where the GPU test above cannot run."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "runtime"
    found = []
    for name in ("engine.py", "speculate.py", "mtp.py", "dflash2.py", "generate.py"):
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("tensor", "as_tensor") and any(k.arg == "device" for k in node.keywords):
                found.append(f"runtime/{name}:{node.lineno}")
    assert not found, f"blocking host-to-device copies: {found}"


class _ReplayedForward:
    """A CUDA graph's stand-in on the CPU: replay() runs the captured forward again over its static inputs and
    writes the result into the static outputs, as a replay writes the graph's buffers."""

    def __init__(self, fn, lanes_t, inputs, outputs):
        self.fn, self.lanes_t, self.inputs, self.outputs = fn, lanes_t, inputs, outputs

    def replay(self):
        _copy_into(self.outputs, self.fn(self.lanes_t, *self.inputs))


def _cloned(outputs):
    """A forward's outputs (a tensor, or tuples / lists of them and None) as buffers of their own."""
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return type(outputs)(_cloned(o) for o in outputs) if isinstance(outputs, (tuple, list)) else outputs


def _copy_into(buffers, outputs):
    if isinstance(buffers, torch.Tensor):
        buffers.copy_(outputs)
    elif isinstance(buffers, (tuple, list)):
        for b, o in zip(buffers, outputs):
            _copy_into(b, o)


def _graphs_on_the_cpu(engine, monkeypatch):
    """Engine.run_step's graph bookkeeping on the CPU: the capture runs the forward once as the real capture's warm-up
    does (the lanes' GDN state put back) and keys a _ReplayedForward; on a GPU the engine's own graphs."""
    if DEVICE == "cuda":
        return
    engine.use_graphs = engine.piece_graphs = True
    engine._ride_pool = "one pool"

    def capture(fn, lanes_t, inputs, pool=None):
        lanes_t, inputs = lanes_t.clone(), [x.clone() for x in inputs]
        lanes_idx = lanes_t if lanes_t.dim() == 1 else lanes_t[0]
        saved = [(stack, stack[:, lanes_idx, 0].clone()) for stack in (engine.conv_stack, engine.rec_stack)]
        outputs = _cloned(fn(lanes_t, *inputs))
        for stack, old in saved:
            stack[:, lanes_idx, 0] = old
        return _ReplayedForward(fn, lanes_t, inputs, outputs), lanes_t, inputs, outputs

    monkeypatch.setattr(engine, "_capture", capture)


@pytest.mark.parametrize("kind", ["dense-q4", "moe-q5"])
def test_warm_up_captures_what_serving_meets_and_leaves_no_trace(artifacts, monkeypatch, kind):
    """Engine.warm_up (serve's start-up): afterwards lanes arriving one by one — prompt pieces alone and with 1 and 2
    lanes riding, whole shared chunks with a rider, decode steps of 1-3 rows — capture no graph (each capture
    mid-serving stops every lane), and every lane decodes the tokens an engine without the warm-up gives."""
    import runtime.engine as engine_module
    from runtime.engine import EngineStats, Riders

    monkeypatch.setattr(engine_module, "MOE_PREFILL_GRAPHS", True)
    path = artifacts[kind]
    prompts = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 77], [(i * 37 + 11) % 300 for i in range(100)], [5, 6, 7, 8, 9, 10, 11]]

    def serve(warm: bool):
        engine = Engine(path, PlanOptions(max_context=256, max_concurrency=3, prefill_chunk=128,
                                          shared_prefill_chunk=32), device=DEVICE)
        _graphs_on_the_cpu(engine, monkeypatch)
        warmed = engine.warm_up() if warm else 0
        if warm:
            assert warmed == len(engine._graphs) > 3 and engine.stats == EngineStats()
            assert not any(engine.lane_tokens) and not engine.ctx_len.any()
            assert not engine.conv_stack[:, :, 0].any() and not engine.rec_stack[:, :, 0].any()
        last: dict[int, int] = {}
        riders = Riders()
        for lane, prompt in enumerate(prompts):  # each arrives while the lanes before it decode, riding its chunks
            decoding = list(last)
            chunks = engine.prefill_chunks(lane, prompt, riders=riders)
            logits = None
            while logits is None:
                riders.offer(decoding, [last[d] for d in decoding])
                logits = next(chunks)
                if riders.logits is not None:
                    last.update((d, int(row.argmax())) for d, row in zip(riders.advanced, riders.logits))
            last[lane] = int(logits.argmax())
            for _ in range(2):
                lanes = list(last)
                step = engine.decode_step(lanes, [last[d] for d in lanes])
                last.update((d, int(row.argmax())) for d, row in zip(lanes, step))
        return last, engine.stats.graphs_captured_serving, engine.stats.rider_tokens

    warm_tokens, warm_captures, warm_riders = serve(True)
    cold_tokens, cold_captures, cold_riders = serve(False)
    assert warm_riders == cold_riders > 0
    assert warm_captures == 0 < cold_captures
    if DEVICE == "cpu":  # (float32: exact; a GPU's bf16 graphs captured at other times should agree too, unasserted)
        assert warm_tokens == cold_tokens


def test_warm_up_covers_prompts_of_any_length_beside_any_riders(artifacts, monkeypatch):
    """After Engine.warm_up, a prompt of any length (around every bucket's edges, within and past the shared chunk)
    prefilled with 0, 1 or 2 lanes riding its chunks captures no graph."""
    from runtime.engine import Riders

    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=512, max_concurrency=3, prefill_chunk=256,
                                                       shared_prefill_chunk=128), device=DEVICE)
    _graphs_on_the_cpu(engine, monkeypatch)
    engine.warm_up()
    riders = Riders()
    for riding in (0, 1, 2):
        for length in (1, 2, 30, 31, 32, 33, 62, 63, 64, 65, 100, 125, 126, 127, 128, 129, 200, 300):
            decoding = list(range(1, riding + 1))
            chunks = engine.prefill_chunks(0, [(i * 7 + 3) % 300 for i in range(length)], riders=riders)
            logits = None
            while logits is None:
                riders.offer(decoding, [5] * riding)
                logits = next(chunks)
            for lane in [0] + decoding:
                engine.reset_lane(lane)
            assert engine.stats.graphs_captured_serving == 0, (length, riding, sorted(map(str, engine._graphs)))


def test_a_capture_the_warm_up_missed_is_named(artifacts, monkeypatch, capsys):
    """A graph captured after Engine.warm_up (a shape it did not meet) is named on stderr in one line; an engine
    that never warmed up captures on first use without a word."""
    engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, max_concurrency=2), device=DEVICE)
    _graphs_on_the_cpu(engine, monkeypatch)
    engine.decode_step([0], [5])
    assert "captured a CUDA graph" not in capsys.readouterr().err
    engine.reset_lane(0)
    engine.warm_up()
    del engine._graphs[("decode", 2, True)]  # as if the warm-up had not met two lanes decoding
    engine.decode_step([0, 1], [5, 6])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the warm-up had not (('decode', 2, True))" in err
    assert engine.stats.graphs_captured_serving == 2  # the first use before the warm-up and the missed one


def test_warm_up_with_speculation_captures_every_round_size(artifacts, monkeypatch):
    """With --spec, Engine.warm_up runs a speculative round of every batch size: afterwards rounds of 1 and 2 lanes
    capture no graph, the tokens are those of an engine without the warm-up, and the speculation counts start at 0."""
    from runtime.engine import EngineStats

    prompts = [[3, 17, 99, 150, 42, 7, 250, 11], [9, 8, 7, 6, 5, 4, 3, 2, 1, 77]]

    def serve(warm: bool):
        engine = Engine(artifacts["dense-q4"], PlanOptions(max_context=256, max_concurrency=2, spec="mtp",
                                                           draft_tokens=2), device=DEVICE)
        _graphs_on_the_cpu(engine, monkeypatch)
        if warm:
            assert engine.warm_up() == len(engine._graphs) >= 6  # decode, draft and verify of 1 and 2 lanes
            assert engine.stats == EngineStats() and engine.speculator.stats.rounds == 0
        spec, out = engine.speculator, {}
        for lane, prompt in enumerate(prompts):
            out[lane] = [int(list(engine.prefill_chunks(lane, prompt))[-1].argmax())]
            for _ in range(2):
                lanes = list(out)
                for lane_, new in zip(lanes, spec.round(lanes, [out[d][-1] for d in lanes], [3] * len(lanes))):
                    out[lane_] += new
        return out, engine.stats.graphs_captured_serving

    warm_tokens, warm_captures = serve(True)
    cold_tokens, cold_captures = serve(False)
    assert warm_captures == 0 < cold_captures
    if DEVICE == "cpu":  # (float32: exact; a GPU's bf16 graphs captured at other times should agree too, unasserted)
        assert warm_tokens == cold_tokens
