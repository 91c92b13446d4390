"""A tiny emulator of one warp running an inline-PTX block, for the kernels whose thread-level work lives in
inline PTX (runtime/kernels/qgemm_rows_frag.py): the CPU cannot run them under Triton's interpreter, so the
tests run their PTX here, lane by lane in lockstep, with mma.sync computed from the fragment layouts of the
PTX ISA (m16n8k16, A row-major, B column-major). Only the instructions those kernels use are known; anything
else raises, so a new instruction cannot pass unchecked.
"""

from __future__ import annotations

import ctypes
import functools
import re

import numpy as np

MASK32 = 0xFFFFFFFF


def f32_bits(value: float) -> int:
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def bits_f32(bits: int) -> float:
    return float(np.array(bits & MASK32, dtype=np.uint32).view(np.float32))


def _bf16(bits16: int) -> float:
    return bits_f32((bits16 & 0xFFFF) << 16)


def _to_bf16(value: float) -> int:
    bits = f32_bits(value)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF  # round to nearest even


def _f16(bits16: int) -> float:
    return float(np.array(bits16 & 0xFFFF, dtype=np.uint16).view(np.float16))


def _to_f16(value: float) -> int:
    return int(np.array(value, dtype=np.float32).astype(np.float16).view(np.uint16))  # round to nearest even


def _f16x2(a: int, b: int, op) -> int:
    """A packed-half operation: each 16-bit half computed exactly, then rounded once to fp16."""
    halves = [_to_f16(op(np.float64(_f16(a >> s)), np.float64(_f16(b >> s)))) for s in (0, 16)]
    return halves[0] | (halves[1] << 16)


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """The three-input logic op: bit i of the result is lut[(a_i << 2) | (b_i << 1) | c_i]."""
    out = 0
    for minterm in range(8):
        if (lut >> minterm) & 1:
            out |= ((a if minterm & 4 else ~a) & (b if minterm & 2 else ~b) & (c if minterm & 1 else ~c)) & MASK32
    return out


class Memory:
    """Byte buffers at fake addresses; reads are little-endian."""

    def __init__(self):
        self.buffers: list[tuple[int, bytes]] = []
        self.next = 1 << 20

    def place(self, data: bytes) -> int:
        addr = self.next
        self.buffers.append((addr, bytes(data)))
        self.next += (len(data) + 4096) // 4096 * 4096 + 4096
        return addr

    def read(self, addr: int, size: int) -> bytes:
        for base, data in self.buffers:
            if base <= addr and addr + size <= base + len(data):
                return data[addr - base : addr - base + size]
        raise IndexError(f"emulated load of {size} bytes at {addr:#x} is outside every buffer")


@functools.lru_cache(maxsize=256)
def _split(asm: str) -> tuple[str, ...]:
    out = []
    for part in asm.split(";"):
        part = part.strip().lstrip("{").strip().rstrip("}").strip()
        if part and not part.startswith(".reg"):
            out.append(part)
    return tuple(out)


def _operands(text: str) -> list[str]:
    """'d, {a, b}, [x+16], 0x5' -> ['d', '{a, b}', '[x+16]', '0x5'] (commas inside braces kept)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class HostMemory:
    """The process's own memory (CPU tensors' data pointers, as Triton's interpreter passes them)."""

    def read(self, addr: int, size: int) -> bytes:
        if addr < 4096:
            raise IndexError(f"emulated load of {size} bytes at {addr:#x}: not an address")
        return ctypes.string_at(addr, size)


def run_warp(asm: str, inputs: list[list[int]], n_outputs: int, memory, tid_base: int = 0) -> list[list[int]]:
    """Run `asm` for the 32 lanes of a warp. inputs[lane][i] is operand $(n_outputs + i) as a bit pattern
    (f32 as its bits, 64-bit values as ints); returns outputs[lane][i] for $i as bit patterns. %tid.x of
    lane l is tid_base + l."""
    lanes = [dict() for _ in range(32)]
    for lane, values in enumerate(inputs):
        for i, value in enumerate(values):
            lanes[lane][f"${n_outputs + i}"] = value

    def get(lane: int, name: str) -> int:
        name = name.strip()
        if name.startswith("0f"):
            return int(name[2:], 16)
        if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", name):
            return int(name, 0) & MASK32
        if name == "%tid.x":
            return tid_base + lane
        return lanes[lane][name]

    for ins in _split(asm):
        op, _, rest = ins.partition(" ")
        args = _operands(rest)
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            _mma(lanes, args, half=_f16 if ".f16.f16." in op else _bf16)
            continue
        if op.startswith("mma.sync.aligned.m16n8k32.row.col.s32."):
            atype, btype = op.split(".")[-3:-1]  # ... .s32.<atype>.<btype>.s32
            _mma_int8(lanes, args, a_signed=atype == "s8", b_signed=btype == "s8")
            continue
        if op == "shfl.sync.bfly.b32":  # d = a of lane ^ b (whole warp, clamp 0x1f)
            source = [get(lane, args[1]) for lane in range(32)]
            for lane in range(32):
                lanes[lane][args[0]] = source[lane ^ get(lane, args[2])]
            continue
        if op == "movmatrix.sync.aligned.m8n8.trans.b16":  # an 8x8 b16 fragment (row lane / 4, cols 2 (lane % 4) ..)
            source = [get(lane, args[1]) for lane in range(32)]
            for lane in range(32):
                row, col = lane // 4, 2 * (lane % 4)
                pick = [(source[4 * k + row // 2] >> (16 * (row % 2))) & 0xFFFF for k in (col, col + 1)]
                lanes[lane][args[0]] = pick[0] | (pick[1] << 16)
            continue
        guarded = op.startswith("@")
        if guarded:
            guard = op[1:]
            op, _, rest = rest.partition(" ")
            args = _operands(rest)
        for lane in range(32):
            regs = lanes[lane]
            if guarded and not regs[guard]:
                continue
            if op == "setp.ne.s32":
                regs[args[0]] = get(lane, args[1]) != get(lane, args[2])
            elif op == "setp.gt.s32":
                signed = [(v & MASK32) - ((v & 0x80000000) << 1) for v in (get(lane, args[1]), get(lane, args[2]))]
                regs[args[0]] = signed[0] > signed[1]
            elif op.startswith("ld.global"):
                dst, src = args
                m = re.fullmatch(r"\[(\S+?)(?:\+(\d+))?\]", src)
                addr = get(lane, m.group(1)) + int(m.group(2) or 0)
                names = [n.strip() for n in dst.strip("{}").split(",")]
                width = 2 if op.endswith(".b16") else 4
                data = memory.read(addr, width * len(names))
                for i, n in enumerate(names):
                    regs[n] = int.from_bytes(data[i * width : (i + 1) * width], "little")
            elif op in ("mov.b64", "mov.b32") and args[0].startswith("{"):  # unpack into narrower registers
                names = [n.strip() for n in args[0].strip("{}").split(",")]
                value, width = get(lane, args[1]), int(op[-2:]) // len(names)
                for i, n in enumerate(names):
                    regs[n] = (value >> (width * i)) & ((1 << width) - 1)
            elif op in ("mov.b64", "mov.b32") and args[1].startswith("{"):  # pack narrower registers
                names = [n.strip() for n in args[1].strip("{}").split(",")]
                width = int(op[-2:]) // len(names)
                regs[args[0]] = sum(get(lane, n) << (width * i) for i, n in enumerate(names))
            elif op in ("mov.b32", "mov.f32", "mov.u32", "mov.b16"):
                regs[args[0]] = get(lane, args[1])
            elif op == "cvt.u32.u16":
                regs[args[0]] = get(lane, args[1]) & 0xFFFF
            elif op == "cvt.f32.f16":
                regs[args[0]] = f32_bits(_f16(get(lane, args[1])))
            elif op == "shl.b32":
                regs[args[0]] = (get(lane, args[1]) << get(lane, args[2])) & MASK32
            elif op == "bfe.u32":  # unsigned bit-field extract: len bits from pos
                value, pos, length = (get(lane, x) for x in args[1:])
                regs[args[0]] = (value >> pos) & ((1 << length) - 1)
            elif op == "bfi.b32":  # insert len low bits of a into b at pos
                a, b, pos, length = (get(lane, x) for x in args[1:])
                field = ((1 << length) - 1) << pos
                regs[args[0]] = (b & ~field & MASK32) | ((a << pos) & field)
            elif op == "popc.b32":
                regs[args[0]] = bin(get(lane, args[1]) & MASK32).count("1")
            elif op in ("and.b32", "xor.b32"):
                a, b = get(lane, args[1]), get(lane, args[2])
                regs[args[0]] = (a & b) if op == "and.b32" else (a ^ b)
            elif op in ("mul.lo.u32", "mul.lo.s32"):  # the low 32 bits are the same for either signedness
                regs[args[0]] = (get(lane, args[1]) * get(lane, args[2])) & MASK32
            elif op == "mad.lo.s32":
                regs[args[0]] = (get(lane, args[1]) * get(lane, args[2]) + get(lane, args[3])) & MASK32
            elif op == "cvt.rn.f32.s32":
                v = get(lane, args[1]) & MASK32
                regs[args[0]] = f32_bits(np.float32(v - (1 << 32) if v >= 1 << 31 else v))
            elif op in ("shr.u32", "shr.b32"):
                regs[args[0]] = get(lane, args[1]) >> get(lane, args[2])
            elif op == "or.b32":
                regs[args[0]] = get(lane, args[1]) | get(lane, args[2])
            elif op == "lop3.b32":
                regs[args[0]] = _lop3(*(get(lane, x) for x in args[1:]))
            elif op == "prmt.b32":
                a, b, sel = get(lane, args[1]), get(lane, args[2]), get(lane, args[3])
                pool = a | (b << 32)
                regs[args[0]] = sum(((pool >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
            elif op == "fma.rn.bf16x2":
                a, b, c = (get(lane, x) for x in args[1:])
                halves = [_to_bf16(_bf16(a >> s) * _bf16(b >> s) + _bf16(c >> s)) for s in (0, 16)]
                regs[args[0]] = halves[0] | (halves[1] << 16)
            elif op == "sub.rn.f16x2":
                regs[args[0]] = _f16x2(get(lane, args[1]), get(lane, args[2]), lambda x, y: x - y)
            elif op == "mul.rn.f16x2":
                regs[args[0]] = _f16x2(get(lane, args[1]), get(lane, args[2]), lambda x, y: x * y)
            elif op == "cvt.rn.f16x2.f32":  # d = {a (high half), b (low half)}
                a, b = (bits_f32(get(lane, x)) for x in args[1:])
                regs[args[0]] = _to_f16(b) | (_to_f16(a) << 16)
            elif op in ("mul.f32", "add.f32", "sub.f32", "max.f32"):
                a, b = (np.float32(bits_f32(get(lane, x))) for x in args[1:])
                regs[args[0]] = f32_bits({"mul.f32": np.multiply, "add.f32": np.add, "sub.f32": np.subtract,
                                          "max.f32": np.maximum}[op](a, b))
            elif op == "fma.rn.f32":
                a, b, c = (bits_f32(get(lane, x)) for x in args[1:])
                regs[args[0]] = f32_bits(np.float32(np.float64(a) * b + c))
            else:
                raise NotImplementedError(f"ptx_warp does not know {op!r} ({ins})")
    return [[lanes[lane][f"${i}"] for i in range(n_outputs)] for lane in range(32)]


def _mma(lanes: list[dict], args: list[str], half=_bf16) -> None:
    """D = A (16x16) . B (16x8) + C (16x8 f32), A and B bf16 or fp16 (`half` decodes one), from/to the lanes'
    fragments (PTX ISA layouts)."""
    d, a, b, c = ([n.strip() for n in x.strip("{}").split(",")] for x in args)
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(a):  # a0: (g, 2t..), a1: (g + 8, 2t..), a2: (g, 2t + 8..), a3: (g + 8, 2t + 8..)
            row, col = g + 8 * (r % 2), 2 * t + 8 * (r // 2)
            A[row, col], A[row, col + 1] = half(regs[name]), half(regs[name] >> 16)
        for r, name in enumerate(b):  # b0: k = 2t, 2t + 1; b1: k = 2t + 8, 2t + 9; column g
            B[2 * t + 8 * r, g], B[2 * t + 8 * r + 1, g] = half(regs[name]), half(regs[name] >> 16)
        for r, name in enumerate(c):  # c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
            C[g + 8 * (r // 2), 2 * t + r % 2] = bits_f32(regs[name])
    D = A @ B + C
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(d):
            regs[name] = f32_bits(np.float32(D[g + 8 * (r // 2), 2 * t + r % 2]))


def _byte(word: int, i: int, signed: bool) -> int:
    v = (word >> (8 * i)) & 0xFF
    return v - 256 if signed and v >= 128 else v


def _mma_int8(lanes: list[dict], args: list[str], a_signed: bool, b_signed: bool) -> None:
    """D = A (16x32 bytes) . B (32x8 bytes) + C (16x8 s32), m16n8k32 (PTX ISA layouts), int32 wrap-around."""
    d, a, b, c = ([n.strip() for n in x.strip("{}").split(",")] for x in args)
    A, B, C = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64), np.zeros((16, 8), np.int64)
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(a):  # a0: (g, 4t..), a1: (g + 8, 4t..), a2: (g, 4t + 16..), a3: (g + 8, 4t + 16..)
            row, col = g + 8 * (r % 2), 4 * t + 16 * (r // 2)
            for i in range(4):
                A[row, col + i] = _byte(regs[name], i, a_signed)
        for r, name in enumerate(b):  # b0: k = 4t..4t + 3, b1: k = 4t + 16..; column g
            for i in range(4):
                B[4 * t + 16 * r + i, g] = _byte(regs[name], i, b_signed)
        for r, name in enumerate(c):  # c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
            v = regs[name] & MASK32
            C[g + 8 * (r // 2), 2 * t + r % 2] = v - (1 << 32) if v >= 1 << 31 else v
    D = A @ B + C
    for lane, regs in enumerate(lanes):
        g, t = lane // 4, lane % 4
        for r, name in enumerate(d):
            regs[name] = int(D[g + 8 * (r // 2), 2 * t + r % 2]) & MASK32


_BITS = {"fp32": (np.uint32, np.float32), "int32": (np.uint32, np.int32), "int64": (np.uint64, np.int64)}


class _AsmResults:
    def __init__(self, handles):
        self.handles = handles

    def get_result(self, i):
        return self.handles[i]


def interpret_inline_asm(builder, asm, constraints, values, types, is_pure, pack):
    """Triton's interpreter hook for tl.inline_asm_elementwise (monkeypatched over InterpreterBuilder's
    create_inline_asm): the kernels keep one element per thread, so element i of a program's tensors is
    thread i; each warp's 32 elements run the PTX here over the host memory the pointers address."""
    from triton.runtime.interpreter import TensorHandle

    if pack != 1:
        raise NotImplementedError("ptx_warp runs one element per thread (pack=1)")
    shape = values[0].data.shape
    n = values[0].data.size
    words = []
    for v in values:  # each operand as its bit pattern
        data = np.ascontiguousarray(np.broadcast_to(v.data, shape)).reshape(-1)
        bits = data.astype(np.uint32) if data.dtype == np.bool_ else data.view(f"u{data.dtype.itemsize}")
        words.append(bits.astype(np.uint64))
    outs = [np.zeros(n, dtype=np.uint64) for _ in types]
    memory = HostMemory()
    for base in range(0, n, 32):
        inputs = [[int(w[base + lane]) for w in words] for lane in range(32)]
        result = run_warp(asm, inputs, len(types), memory, tid_base=base)
        for lane in range(32):
            for i, value in enumerate(result[lane]):
                outs[i][base + lane] = value
    handles = []
    for out, ty in zip(outs, types):
        unsigned, signed = _BITS[ty.element_ty.name]
        handles.append(TensorHandle(out.astype(unsigned).view(signed).reshape(shape), ty.element_ty))
    return _AsmResults(handles)
