"""The MoE decode paths of a tiny MoE whose shared expert rides in the routed experts' launches, against the
reference model (teacher-forced: relative RMS logit error of the prefill and three decode steps): the fused path
(routing in the gate/up launch, the combine in the next norm), the same with graphs off, with route() before the
launch, and the separate path. On the H200 (session 25) the fused path's engine test saw 0.18 where 0.08 passes.

    PYTHONPATH=. python bench/moe_decode_check.py
"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, ".")
from format.tiny import write_tiny_checkpoint
from format.convert import ConvertOptions, convert_checkpoint
from format.container import Artifact
from runtime.engine import Engine
import runtime.engine as em
from runtime.memory_plan import PlanOptions
from runtime.model import ReferenceModel

d = Path(tempfile.mkdtemp())
src = write_tiny_checkpoint(d / "hf", moe=True, seed=9, mtp_layers=0, shared_intermediate=32)
path = convert_checkpoint(src, d / "moe.nfer", ConvertOptions(recipe="q4")).output
PROMPT = [3, 17, 99, 150, 42, 7, 250, 11, 64, 300, 5, 128]
ref = ReferenceModel(Artifact(path))
state = ref.new_state()
want = [ref.forward(torch.tensor(PROMPT), state, 0)[-1]]
toks = [int(want[0].argmax())]
for i in range(3):
    want.append(ref.forward(torch.tensor([toks[-1]]), state, len(PROMPT) + i)[-1]); toks.append(int(want[-1].argmax()))

def rel(g, w):
    return ((g - w).pow(2).mean().sqrt() / w.pow(2).mean().sqrt()).item()

import runtime.kernels.moe as moe_mod  # noqa: E402
real_gemv = moe_mod.expert_gemv
real_partials = em.ExpertPartials
for label, moe_mode, graphs, route_in, combine_in_norm in [] if "--ties" in sys.argv else [
        ("fused", "fused", True, True, True), ("fused-nographs", "fused", False, True, True),
        ("fused-route-first", "fused", True, False, True), ("fused-combine-launch", "fused", True, True, False),
        ("separate", "separate", True, True, True)]:
    em.MOE_DECODE = moe_mode
    em.ExpertPartials = real_partials if combine_in_norm else (
        lambda routed, weights, shared, gate=None: moe_mod.combine_experts(routed, weights, shared, shared_gate=gate))
    if not route_in:
        def gemv(x, x_rows, experts, w, rows, shared=None, shared_x0=0, swiglu=False, route_into=None):
            if route_into is not None:
                ids, weights = moe_mod.route(route_into[0], x_rows)
                experts.copy_(ids.reshape(-1)); route_into[1].copy_(weights)
            return real_gemv(x, x_rows, experts, w, rows, shared, shared_x0, swiglu)
        em.expert_gemv = gemv
    else:
        em.expert_gemv = real_gemv
    e = Engine(path, PlanOptions(max_context=256, prefill_chunk=128, cuda_graphs=graphs),
               device="cuda" if torch.cuda.is_available() else "cpu")
    got = [e.prefill(0, PROMPT).cpu()]
    for t in toks[:-1]:
        got.append(e.decode_step([0], [t])[0].cpu())
    print(label, [round(rel(g, w), 4) for g, w in zip(got, want)], flush=True)
    e.close()

# Near ties: the fused path's router logits come from one product with the shared gate (bf16 rounding of another
# GEMM); where the k-th and (k+1)-th logits lie within a bf16 step, the two products may pick different experts.
em.MOE_DECODE = "fused"
em.ExpertPartials = real_partials
em.expert_gemv = real_gemv
e = Engine(path, PlanOptions(max_context=256, prefill_chunk=128, cuda_graphs=False),
           device="cuda" if torch.cuda.is_available() else "cpu")
real_ffn = em.Engine._ffn
step = {"i": 0}


def ffn(self, p, h, xq=None):
    m = p + "moe/"
    both = self.router_and_gate.get(m)
    if both is not None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        fused_logits = both(h)[:, :-1].float()
        alone = self.lin[m + "router"](h).float() if m + "router" in self.lin else fused_logits
        top = alone.topk(3, dim=-1).values
        picks = (fused_logits.topk(2, dim=-1).indices.sort(-1).values != alone.topk(2, dim=-1).indices.sort(-1).values)
        print(f"step {step['i']} {p}: max |fused - alone| {(fused_logits - alone).abs().max().item():.4f}, "
              f"gap k/k+1 {(top[:, 1] - top[:, 2]).min().item():.4f}, experts differ: {bool(picks.any())}")
    return real_ffn(self, p, h, xq)


em.Engine._ffn = ffn
e.prefill(0, PROMPT)
for t in toks[:-1]:
    step["i"] += 1
    e.decode_step([0], [t])
if "--ties" in sys.argv:  # the experts each path picks, step by step (graphs off: every step through Python)
    picks = {}
    for mode in ("fused", "separate"):
        em.MOE_DECODE = mode
        e = Engine(path, PlanOptions(max_context=256, prefill_chunk=128, cuda_graphs=False),
                   device="cuda" if torch.cuda.is_available() else "cpu")
        seen = []

        def ffn_picks(self, p, h, xq=None, _seen=seen):
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return real_ffn(self, p, h, xq)
            m = p + "moe/"
            both = self.router_and_gate.get(m)
            logits = (both(h)[:, :-1] if both is not None else self.lin[m + "router"](h)).float()
            top = logits.topk(3, dim=-1)
            _seen.append((p, top.indices[-1, :2].sort().values.tolist(), round((top.values[-1, 1] - top.values[-1, 2]).item(), 4)))
            return real_ffn(self, p, h, xq)

        em.Engine._ffn = ffn_picks
        e.prefill(0, PROMPT)
        for t in toks[:-1]:
            e.decode_step([0], [t])
        picks[mode] = seen
    for (p, a, gap), (_, b, _) in zip(picks["fused"], picks["separate"]):
        if a != b:
            print(f"{p}: fused picks {a}, separate {b} (gap k/k+1 {gap})")
    print("routing compared over", len(picks["fused"]), "layer steps")
