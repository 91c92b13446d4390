"""Instruction counts of a kernel's sm_90a code, compiled locally (no GPU): the whole kernel and its main
loop (the longest backward branch), by opcode. Pointer arguments (and the integer sizes the JIT would
see as multiples of 16) are declared 16-byte divisible, as Triton specializes them at launch; without
that, loads compile to one byte per instruction and the counts mean nothing.

    python bench/sass_loop.py attention KK VK BLOCK_M BLOCK_N WARPS [STAGES]   # paged attention, D = 256
    python bench/sass_loop.py gemv BITS BLOCK_N BLOCK_K WARPS [STAGES]          # dp4a T = 1 GEMV (27B shapes)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from types import SimpleNamespace

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,5})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")


def compile_sm90(fn, signature: dict, constants: dict, warps: int, stages: int, divisible=()):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(signature.items())
             if ty.startswith("*") or name in divisible}
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def sass(kernel) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        return subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout


def counts(text: str) -> tuple[Counter, Counter]:
    """(opcodes of the whole kernel without padding, opcodes of its main loop)."""
    ins = [(int(m.group(1), 16), m.group(2), line) for line in text.splitlines() if (m := INSTRUCTION.match(line))]
    loop = (0, -1)
    for addr, _, line in ins:
        target = re.search(r"BRA (0x[0-9a-f]+)", line)
        if target and int(target.group(1), 16) < addr and addr - int(target.group(1), 16) > loop[1] - loop[0]:
            loop = (int(target.group(1), 16), addr)
    whole = Counter(op for _, op, _ in ins if op != "NOP")  # the cubin pads the code with NOPs
    return whole, Counter(op for addr, op, _ in ins if loop[0] <= addr <= loop[1])


def attention(kk, vk, block_m, block_n, warps, stages=3):
    from runtime.kernels import paged_attention as pa

    sig = {"q_ptr": "*fp16", "part_o_ptr": "*fp32", "part_ml_ptr": "*fp32", "k0": "*u8", "k1": "*fp16", "v0": "*u8",
           "v1": "*fp16", "block_table_ptr": "*i32", "ctx_len_ptr": "*i32", "T": "i32", "HQ": "i32", "HKV": "i32",
           "PAGES_PER_LANE": "i32", "SPLITS": "i32", "SPLIT_MIN": "i32", "scale": "fp32"}
    sig |= {name: "constexpr" for name in ("D", "KK", "VK", "KW0", "KW1", "VW0", "VW1", "BLOCK_M", "BLOCK_N", "DIRECT",
                                             "LDMATRIX")}
    key = next(name for name, kind in pa.KIND_IDS.items() if kind == kk)  # the key sub-codec of kind KK
    ldmatrix = pa.attention_tile(SimpleNamespace(key=key), block_m)[3]  # as the runtime would choose it
    consts = {"D": 256, "KK": kk, "VK": vk, "KW0": 128, "KW1": 4, "VW0": 128, "VW1": 4, "BLOCK_M": block_m,
              "BLOCK_N": block_n, "DIRECT": False, "LDMATRIX": ldmatrix}
    return compile_sm90(pa._paged_attention_kernel, sig, consts, warps, stages)


def gemv(bits, block_n, block_k, warps, stages=3):
    from runtime.kernels import qgemv_int8 as q

    n, k = (5120, 17408) if bits == 5 else (34816, 5120)  # MLP down (Q5), MLP gate_up (Q4, Q6, W8 alike)
    sig = {"x_ptr": "*i32", "base_ptr": "*i32", "high_ptr": "*i16" if bits == 6 else "*u8", "scale_ptr": "*fp16",
           "y_ptr": "*fp32", "N": "i32", "K": "i32", "K_PER_SPLIT": "i32"}
    sig |= {name: "constexpr" for name in ("GPR", "K_PAD", "BITS", "GROUP", "HIGH_BYTES", "BLOCK_N", "BLOCK_K",
                                             "USE_ASM", "PREQUANT")}
    consts = {"GPR": k // 64, "K_PAD": k, "BITS": bits, "GROUP": 64, "HIGH_BYTES": {5: 8, 6: 16}.get(bits, 0),
              "BLOCK_N": block_n, "BLOCK_K": block_k, "USE_ASM": True, "PREQUANT": True}
    return compile_sm90(q._qgemv_int8_kernel, sig, consts, warps, stages, divisible=("N", "K", "K_PER_SPLIT"))


if __name__ == "__main__":
    kind, args = sys.argv[1], [int(a) for a in sys.argv[2:]]
    kernel = {"attention": attention, "gemv": gemv}[kind](*args)
    whole, loop = counts(sass(kernel))
    print(f"kernel {sum(whole.values())} instructions, shared {kernel.metadata.shared} B")
    print(f"main loop {sum(loop.values())} instructions: " + ", ".join(f"{op} {n}" for op, n in loop.most_common(16)))
