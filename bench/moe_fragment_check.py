"""GPU check of the fragment expert launches (runtime/kernels/moe_fragment.py), part by part: each output row's
error against the exact product, with and without routing inside and the shared expert, and the known-good
fragment-order SwiGLU launch on the same expert's rows.

    PYTHONPATH=. python bench/moe_fragment_check.py
"""

import torch

from runtime.kernels import moe_fragment as mf
from runtime.kernels.qgemm_fragment_layout import fragment_rows, qgemm_fragment_swiglu, to_fragment_layout
from tests.test_frag_kernel import _packed


def rel(a, b):
    return ((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max()).item()


def main():
    dev = "cuda"
    experts, inter, hid, top_k, tokens = 3, 512, 512, 2, 2
    for fmt in ("Q4G64_F16S", "Q5G64_F16S"):
        gu = to_fragment_layout(_packed(experts * 2 * inter, hid, fmt, seed=5, device=dev), "pairs")
        dn = to_fragment_layout(_packed(experts * hid, inter, fmt, seed=6, device=dev), "pairs")
        su = _packed(2 * inter, hid, "W8G32_F16S", seed=7, device=dev)
        sd = _packed(hid, inter, "W8G32_F16S", seed=8, device=dev)
        x = torch.randn(tokens, hid, device=dev).to(torch.bfloat16)
        ids = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=dev)
        dense = gu.dense()
        exact = []
        for p in range(ids.numel()):
            e = int(ids[p])
            y = x[p // top_k].float() @ dense[e * 2 * inter:(e + 1) * 2 * inter].t()
            g, u = y.chunk(2)
            exact.append(torch.nn.functional.silu(g) * u)
        exact = torch.stack(exact)
        good = torch.stack([qgemm_fragment_swiglu(x[p // top_k:p // top_k + 1],
                                                  fragment_rows(gu.fragment, (int(ids[p]) + 1) * 2 * inter,
                                                                int(ids[p]) * 2 * inter),
                                                  torch.empty(1, inter, dtype=torch.bfloat16, device=dev))[0]
                            for p in range(ids.numel())])
        print(fmt, "known-good swiglu launch per pair:", [round(rel(good[p], exact[p]), 4) for p in range(4)])
        act = mf.fragment_expert_gemv(x, ids, gu, 2 * inter, top_k, True)
        print(fmt, "gate/up, ids given, no shared, per pair:", [round(rel(act[p], exact[p]), 4) for p in range(4)])
        torch.cuda.synchronize()
        for ks in (1, 2):
            mf.MOE_FRAGMENT_TUNING["gate_ks"] = ks
            act = mf.fragment_expert_gemv(x, ids, gu, 2 * inter, top_k, True)
            print(fmt, f"gate_ks {ks}: rows 0-15 / 16-31 / all of pair 0:", round(rel(act[0, :16], exact[0, :16]), 4),
                  round(rel(act[0, 16:32], exact[0, 16:32]), 4), round(rel(act[0], exact[0]), 4))
        mf.MOE_FRAGMENT_TUNING["gate_ks"] = 2
        act_s = mf.fragment_expert_gemv(x, ids, gu, 2 * inter, top_k, True, shared=su)
        s_exact = [torch.nn.functional.silu(v[:inter]) * v[inter:] for v in (x.float() @ su.dense().t())]
        print(fmt, "with shared: routed", [round(rel(act_s[p], exact[p]), 4) for p in range(4)],
              "shared", [round(rel(act_s[4 + t], s_exact[t]), 4) for t in range(tokens)])
        a = exact.to(torch.bfloat16)
        ddense = dn.dense()
        d_exact = torch.stack([a[p].float() @ ddense[int(ids[p]) * hid:(int(ids[p]) + 1) * hid].t() for p in range(4)])
        for bw in (1, 4):
            mf.MOE_FRAGMENT_TUNING["down_bw"] = bw
            y = mf.fragment_expert_gemv(a, ids, dn, hid, top_k, False)
            print(fmt, f"down bw {bw} per pair:", [round(rel(y[p], d_exact[p]), 4) for p in range(4)],
                  "rows 0-15 of pair 0", round(rel(y[0, :16], d_exact[0, :16]), 4))
        mf.MOE_FRAGMENT_TUNING["down_bw"] = 4


if __name__ == "__main__":
    main()
