"""Instructions the decode-attention kernels spend per 64 keys, from their sm_90 SASS, compiled on this machine (no
GPU needed: Triton's own ptxas and cuobjdump): the loop of the tl.dot kernel (paged_attention.py) and of the fragment
kernel (paged_attention_frag.py), their registers and stack, for int4 (rk4v4-e8), int8 or e8cube keys with int4
values (rk2v4-e8) at 27B shapes.

    python bench/sass_count.py [int4|int8|e8] [--json]
    python bench/sass_count.py q4|q5        # the fragment-order product's instructions per 64-lane group,
                                            # (q5: also with the codes as 5-bit fields)
                                            # lane / pair order, x loaded ahead, the int8 kernel, 8 and 16 columns
    python bench/sass_count.py w8           # the int8 fragment kernel over W8 (per 32-lane group), 8 and 16 columns
    python bench/sass_count.py prefill      # the prefill's grouped expert GEMM and dense dequantization over
                                            # row-split vs fragment-order Q4 / Q5 planes
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from runtime.kernels import paged_attention as pa  # noqa: E402
from runtime.kernels import paged_attention_frag as fa  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "k0": "*u8", "k1": "*fp16", "v0": "*u8",
            "v1": "*fp16", "block_table_ptr": "*i32", "ctx_len_ptr": "*i32"}
SCALARS = {"T": "i32", "HQ": "i32", "HKV": "i32", "PAGES_PER_LANE": "i32", "SPLITS": "i32", "SPLIT_MIN": "i32"}


def _sass(fn, signature: dict, constants: dict, warps: int) -> tuple[str, str]:
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(signature.values()) if ty.startswith("*")}
    kernel = triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 1})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return sass, usage


def _loop(sass: str) -> Counter:
    """Opcodes of the longest backward branch's body (the key loop)."""
    ins = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
           if (m := re.match(r"\s+/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line))]
    loop = (0, -1)
    for addr, _, line in ins:
        target = re.search(r"BRA (?:`\(\.L_x_\d+\) )?\(?(0x[0-9a-f]+)", line)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > loop[1] - loop[0]:
            loop = (int(target.group(1), 16), addr)
    return Counter(op for addr, op, _ in ins if loop[0] <= addr <= loop[1])


CODECS = {"int4": ("int4g64e8", 128, 128), "int8": ("int8g64", 256, 256), "e8": ("e8cube", 64, 128)}  # rk2v4-e8


def main(codec: str = "int4") -> dict:
    key_kind, width, value_width = CODECS[codec]
    kind, value_kind = pa.KIND_IDS[key_kind], pa.KIND_IDS["int8g64" if codec == "int8" else "int4g64"]
    block_n, dot_warps, _ = pa.ATTENTION_TILES[key_kind]
    dot_sig = {**POINTERS, **SCALARS, "scale": "fp32", **{k: "constexpr" for k in (
        "D", "KK", "VK", "KW0", "KW1", "VW0", "VW1", "BLOCK_M", "BLOCK_N", "DIRECT", "LDMATRIX")}}
    dot_const = {"D": 256, "KK": kind, "VK": value_kind, "KW0": width, "KW1": 4, "VW0": value_width, "VW1": 4,
                 "BLOCK_M": 16, "BLOCK_N": block_n, "DIRECT": False, "LDMATRIX": False}
    asm = fa.kernel_asm(4, width, 4, value_width, 4, fa.HINTS[fa.FRAG_ATTENTION["hint"]])
    frag_sig = {**POINTERS, **SCALARS, "TILES": "i32", "score_scale": "fp32", **{k: "constexpr" for k in (
        "KW0", "KW1", "VW0", "VW1", "W", *asm)}}
    frag_const = {"KW0": width, "KW1": 4, "VW0": value_width, "VW1": 4, "W": 4, **asm}
    out = {"codec": codec, "triton": triton.__version__}
    for name, fn, sig, const, warps, per_tile in (
            ("dot", pa._paged_attention_kernel, dot_sig, dot_const, dot_warps, dot_warps * 64 // block_n),
            ("fragment", fa._attention_frag_kernel, frag_sig, frag_const, 4, 1)):
        sass, usage = _sass(fn, sig, const, warps)
        ops = _loop(sass)
        out[name] = {"loops_per_64_keys": per_tile, "loop_instructions_per_warp": sum(ops.values()),
                     "instructions_per_64_keys": sum(ops.values()) * per_tile,
                     "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
                     "stack_bytes": int(m.group(1)) if (m := re.search(r"STACK:(\d+)", usage)) else 0,
                     "top": dict(ops.most_common(8))}
    out["ratio"] = out["dot"]["instructions_per_64_keys"] / out["fragment"]["instructions_per_64_keys"]
    return out


def fragment_gemv(bits: int, pairs: bool = True, nt: int = 1, xahead: int = 0, swiglu: bool = False, cs: int = 1,
                  fields: bool = False) -> dict:
    """The fragment-order product's key loop (qgemm_fragment_layout, T <= 8 (nt 1) or <= 16 (nt 2), one K share
    per warp, 4 warps): SASS instructions per 64-lane group and warp (two 4-group chunks per loop step); `pairs`:
    code words in pair order (_compute_asm); `xahead` the kernel's X_AHEAD (x a chunk ahead)."""
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_rows_frag import HINTS, _compute_asm

    sig = {"x_ptr": "*bf16", "codes_ptr": "*u8", "high_ptr": "*u8", "scales_ptr": "*fp16", "out_ptr": "*fp32",
           "N": "i32", "T": "i32", "K": "i32", "BLOCKS": "i32", "CHUNKS_PER_SPLIT": "i32",
           **{k: "constexpr" for k in ("G", "NT", "BW", "KS", "BITS", "X_AHEAD", "LOAD_ASM", "COMPUTE_ASM", "SWIGLU",
                                       "CS")}}
    const = {"G": 80, "NT": nt, "BW": 2 if swiglu else 4, "KS": 2 if swiglu else 1, "BITS": bits, "X_AHEAD": xahead,
             "SWIGLU": swiglu, "CS": cs,
             "LOAD_ASM": fl._chunk_load_asm(bits, HINTS[2]),
             "COMPUTE_ASM": _compute_asm(bits, nt, words=True, pairs=pairs, x_regs=bool(xahead), fields=fields)}
    sass, usage = _sass(fl._qgemm_fragment_layout_kernel, sig, const, 4 * cs)
    ops = _loop(sass)
    return {"bits": bits, "nt": nt, "pairs": pairs, "fields": fields, "xahead": xahead, "swiglu": swiglu, "cs": cs,
            "instructions_per_group": sum(ops.values()) / 8, "top": dict(ops.most_common(8)),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1))}


def fragment_int8_gemv(bits: int, nt: int = 1) -> dict:
    """The int8 fragment kernel's loop (qgemm_fragment_int8, same program shape as fragment_gemv): SASS
    instructions per group (64 lanes; W8: 32, the same 512 bytes of a 16-row block) and warp."""
    from runtime.kernels import qgemm_fragment_int8 as fi
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels.qgemm_rows_frag import HINTS

    sig = {"xq_ptr": "*i32", "codes_ptr": "*u8", "high_ptr": "*u8", "scales_ptr": "*fp16", "out_ptr": "*fp32",
           "N": "i32", "T": "i32", "BLOCKS": "i32", "CHUNKS_PER_SPLIT": "i32",
           **{k: "constexpr" for k in ("G", "NT", "BW", "KS", "BITS", "ROW_BYTES", "SCALES_AT", "LOAD_ASM",
                                       "COMPUTE_ASM")}}
    const = {"G": 80, "NT": nt, "BW": 4, "KS": 1, "BITS": bits, "ROW_BYTES": 4 * (4 * 640 + 160),
             "SCALES_AT": 4 * 4 * 640, "LOAD_ASM": fl._chunk_load_asm(bits, HINTS[2]),
             "COMPUTE_ASM": fi._w8_chunk_asm(nt, 4 * 1280) if bits == 8 else fi._int8_chunk_asm(bits, nt, 4 * 640,
                                                                                                4 * 80)}
    if bits == 8:  # K 5,120: 160 groups of 32, x words hold every lane
        const.update(G=160, ROW_BYTES=4 * (4 * 1280 + 320), SCALES_AT=4 * 4 * 1280)
    sass, usage = _sass(fi._qgemm_fragment_int8_kernel, sig, const, 4)
    ops = _loop(sass)
    return {"bits": bits, "nt": nt, "kernel": "int8", "instructions_per_group": sum(ops.values()) / 8,
            "top": dict(ops.most_common(8)), "registers": int(re.search(r"REG:(\d+)", usage).group(1))}


def prefill_dequant(bits: int, fragment: int) -> dict:
    """The prefill's readers of Q4/Q5 planes (35B-A3B / 27B shapes), row-split (fragment 0) or in fragment order
    (2: pair order): the grouped expert GEMM's key loop (SASS instructions per 128-lane step of a 64-row tile) and
    the dense dequantization kernel's whole body (per 64 x 128 tile), with their global load widths."""
    from runtime.kernels import moe
    from runtime.kernels import qlinear as ql

    high = 8 if bits == 5 else 0
    tile = {"BITS": bits, "GROUP": 64, "HIGH_BYTES": high, "BLOCK_N": 64, "BLOCK_K": 128, "FRAGMENT": fragment}
    gemm_sig = {"x_ptr": "*bf16", "x_rows_ptr": "*i32", "block_experts_ptr": "*i32", "base_ptr": "*u8",
                "high_ptr": "*u8", "scale_ptr": "*fp16", "y_ptr": "*bf16", "ROWS_PER_EXPERT": "i32", "K": "i32",
                "stride_x": "i32", **{k: "constexpr" for k in ("GPR", "K_PAD", "BLOCK_M", *tile)}}
    sass, _ = _sass(moe._expert_gemm_kernel, gemm_sig,
                    {"GPR": 32, "K_PAD": 2048, "BLOCK_M": moe.EXPERT_BLOCK_M, **tile}, 4)
    deq_sig = {"base_ptr": "*u8", "high_ptr": "*u8", "scale_ptr": "*fp16", "w_ptr": "*bf16", "N": "i32", "K": "i32",
               "row0": "i32", **{k: "constexpr" for k in ("GPR", "K_PAD", *tile)}}
    deq, _ = _sass(ql._dequant_kernel, deq_sig, {"GPR": 80, "K_PAD": 5120, **tile}, 4)
    body = [line for line in deq.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,5}\*/\s+", line)]
    return {"bits": bits, "fragment": fragment, "expert_gemm_loop": sum(_loop(sass).values()),
            "expert_gemm_loads": dict(Counter(re.findall(r"(LDG\.[A-Z0-9.]+)", sass))),
            "dequant_kernel": len(body), "dequant_loads": dict(Counter(re.findall(r"(LDG\.[A-Z0-9.]+)", deq)))}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":  # row-split vs fragment-order planes in the prefill's readers
        for bits in (4, 5):
            for fragment in (0, 2):
                print(json.dumps(prefill_dequant(bits, fragment)))
        sys.exit()
    if len(sys.argv) > 1 and sys.argv[1] in ("q4", "q5"):  # every variant of the group product, T <= 8 and <= 16
        for nt in (1, 2):
            for pairs in (False, True):
                print(json.dumps(fragment_gemv(int(sys.argv[1][1]), pairs, nt)))
            if nt == 1:  # x loaded a chunk ahead
                print(json.dumps(fragment_gemv(int(sys.argv[1][1]), True, nt, 1)))
            print(json.dumps(fragment_gemv(int(sys.argv[1][1]), True, nt, swiglu=True)))  # SwiGLU in the launch
            if sys.argv[1] == "q5":  # the codes as 5-bit fields (NINFER_Q5_FIELDS), x in place and ahead
                print(json.dumps(fragment_gemv(5, True, nt, fields=True)))
                if nt == 1:
                    print(json.dumps(fragment_gemv(5, True, nt, 1, fields=True)))
            print(json.dumps(fragment_int8_gemv(int(sys.argv[1][1]), nt)))
        sys.exit()
    if len(sys.argv) > 1 and sys.argv[1] == "w8":
        for nt in (1, 2):
            print(json.dumps(fragment_int8_gemv(8, nt)))
        sys.exit()
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    result = main(*(args[:1]))
    if "--json" in sys.argv:
        print(json.dumps(result))
    else:
        for name in ("dot", "fragment"):
            r = result[name]
            print(f"{name:9} {r['loops_per_64_keys']} x {r['loop_instructions_per_warp']:,} = "
                  f"{r['instructions_per_64_keys']:,} instructions per 64 keys, {r['registers']} registers, "
                  f"stack {r['stack_bytes']} B; {r['top']}")
        print(f"ratio {result['ratio']:.2f} ({result['codec']}, triton {result['triton']})")
