"""GPU check of the fragment expert launches (runtime/kernels/moe_fragment.py), part by part: each pair's error
against the exact product (tests/test_moe_fragment.py's cases), with and without the shared expert, at other
tiles, beside the known-good fragment-order SwiGLU launch on the same expert's rows.

    PYTHONPATH=. python bench/moe_fragment_check.py [pure]

`pure`: the launches take qgemm_rows_frag's pure thread ids instead of the pinned ones (patched before any compile).
"""

import sys

import torch

from runtime.kernels import moe_fragment as mf
from runtime.kernels.qgemm_fragment_layout import fragment_rows, qgemm_fragment_swiglu
from tests.test_moe_fragment import _case, _exact


def rel(a, b):
    return round(((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max()).item(), 4)


def main():
    if "pure" in sys.argv[1:]:
        from runtime.kernels.qgemm_rows_frag import _thread_ids
        mf._pinned_thread_ids = _thread_ids
        print("thread ids: pure")
    dev, inter, hid, top_k, tokens = "cuda", 512, 512, 2, 2
    ids = torch.tensor([2, 0, 1, 2], dtype=torch.int32, device=dev)
    pairs = ids.numel()
    for fmt in ("Q4G64_F16S", "Q5G64_F16S"):
        gu, dn, su, sd = _case(dev, fmt, 3, inter, hid)
        x = torch.randn(tokens, hid, device=dev).to(torch.bfloat16)
        want = _exact(x, ids, gu, 2 * inter, top_k, True, su)
        good = [qgemm_fragment_swiglu(x[p // top_k:p // top_k + 1], fragment_rows(
            gu.fragment, (int(ids[p]) + 1) * 2 * inter, int(ids[p]) * 2 * inter),
            torch.empty(1, inter, dtype=torch.bfloat16, device=dev))[0] for p in range(pairs)]
        print(fmt, "known-good swiglu launch per pair:", [rel(good[p], want[p]) for p in range(pairs)])
        for ks in (1, 2):
            mf.MOE_FRAGMENT_TUNING["gate_ks"] = ks
            act = mf.fragment_expert_gemv(x, ids, gu, 2 * inter, top_k, True)
            print(fmt, f"gate/up gate_ks {ks}, no shared, per pair:", [rel(act[p], want[p]) for p in range(pairs)],
                  "pair 0 rows 0-15 / 16-31:", rel(act[0, :16], want[0, :16]), rel(act[0, 16:32], want[0, 16:32]))
        mf.MOE_FRAGMENT_TUNING["gate_ks"] = 2
        act = mf.fragment_expert_gemv(x, ids, gu, 2 * inter, top_k, True, shared=su)
        print(fmt, "gate/up with shared, per row:", [rel(act[r], want[r]) for r in range(pairs + tokens)])
        want = _exact(act, ids, dn, hid, top_k, False, sd)
        for bw in (1, 4):
            mf.MOE_FRAGMENT_TUNING["down_bw"] = bw
            y = mf.fragment_expert_gemv(act, ids, dn, hid, top_k, False, shared=sd)
            print(fmt, f"down bw {bw} with shared, per row:", [rel(y[r], want[r]) for r in range(pairs + tokens)],
                  "pair 0 rows 0-15:", rel(y[0, :16], want[0, :16]))
        mf.MOE_FRAGMENT_TUNING["down_bw"] = 4


if __name__ == "__main__":
    main()
