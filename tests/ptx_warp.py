"""A tiny emulator of one warp running an inline-PTX block, for the kernels whose thread-level work lives in
inline PTX (runtime/kernels/qgemm_rows_frag.py): the CPU cannot run them under Triton's interpreter, so the
tests run their PTX here, the 32 lanes in lockstep, with mma.sync computed from the fragment layouts of the
PTX ISA (m16n8k16, A row-major, B column-major). Only the instructions those kernels use are known; anything
else raises, so a new instruction cannot pass unchecked. Each instruction runs for the 32 lanes at once (numpy
arrays of one value per lane); loads go lane by lane.
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


LANES = np.arange(32, dtype=np.uint64)
_G, _T = LANES // 4, LANES % 4  # a lane's mma fragment coordinates: group (row / column) and thread in group
M32 = np.uint64(MASK32)


def _bf16s(words) -> np.ndarray:
    """The low bf16 of each word, as float64."""
    return ((words & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32).view(np.float32).astype(np.float64)


def _f16s(words) -> np.ndarray:
    return (words & np.uint64(0xFFFF)).astype(np.uint16).view(np.float16).astype(np.float64)


def _f32s(words) -> np.ndarray:
    return (words & M32).astype(np.uint32).view(np.float32)


def _f32_words(values) -> np.ndarray:
    return np.asarray(values).astype(np.float32).view(np.uint32).astype(np.uint64)


def _to_bf16s(values) -> np.ndarray:
    bits = _f32_words(values)  # (float64 -> float32 first, as the per-lane emulator rounded)
    return ((bits + np.uint64(0x7FFF) + ((bits >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)) & np.uint64(0xFFFF)


def _to_f16s(values) -> np.ndarray:
    return np.asarray(values).astype(np.float32).astype(np.float16).view(np.uint16).astype(np.uint64)


def _signed32(words) -> np.ndarray:
    return (words & M32).astype(np.uint32).view(np.int32).astype(np.int64)


def _shift_left(a, b) -> np.ndarray:
    return np.where(b >= 32, np.uint64(0), (a << np.minimum(b, np.uint64(63))) & M32)


def _shift_right(a, b) -> np.ndarray:
    return np.where(b >= 64, np.uint64(0), a >> np.minimum(b, np.uint64(63)))


def _lop3_lanes(a, b, c, lut: int) -> np.ndarray:
    out = np.zeros(32, np.uint64)
    for minterm in range(8):
        if (lut >> minterm) & 1:
            out |= (a if minterm & 4 else ~a) & (b if minterm & 2 else ~b) & (c if minterm & 1 else ~c)
    return out & M32


@functools.lru_cache(maxsize=1024)
def _constant(name: str) -> int | None:
    if name.startswith("0f"):
        return int(name[2:], 16)
    if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", name):
        return int(name, 0) & MASK32
    return None


@functools.lru_cache(maxsize=256)
def _program(asm: str) -> tuple[tuple[str, tuple[str, ...], str | None], ...]:
    """The block's instructions as (opcode, operands, guard predicate or None), parsed once per PTX string."""
    out = []
    for ins in _split(asm):
        op, _, rest = ins.partition(" ")
        guard = None
        if op.startswith("@"):
            guard = op[1:]
            op, _, rest = rest.partition(" ")
        out.append((op, tuple(_operands(rest)), guard))
    return tuple(out)


def _names(group: str) -> list[str]:
    return [n.strip() for n in group.strip("{}").split(",")]


def run_warp_lanes(asm: str, inputs: list[np.ndarray], n_outputs: int, memory, tid_base: int = 0) -> list[np.ndarray]:
    """run_warp over arrays: inputs[i] holds operand $(n_outputs + i) of the 32 lanes (uint64 bit patterns, one
    per lane); returns the outputs $0.. the same way. Every instruction runs for the whole warp at once."""
    regs: dict[str, np.ndarray] = {f"${n_outputs + i}": np.broadcast_to(v, (32,)).astype(np.uint64) for i, v in enumerate(inputs)}

    def get(name: str) -> np.ndarray:
        value = _constant(name)
        if value is not None:
            return np.full(32, value, np.uint64)
        if name == "%tid.x":
            return LANES + np.uint64(tid_base)
        return regs[name]

    for op, args, guard in _program(asm):
        if op.startswith("mma.sync.aligned.m16n8k16.row.col.f32."):
            _mma(regs, args, half=_f16s if ".f16.f16." in op else _bf16s)
            continue
        if op.startswith("mma.sync.aligned.m16n8k32.row.col.s32."):
            atype, btype = op.split(".")[-3:-1]  # ... .s32.<atype>.<btype>.s32
            _mma_int8(regs, args, a_signed=atype == "s8", b_signed=btype == "s8")
            continue
        if op == "shfl.sync.bfly.b32":  # d = a of lane ^ b (whole warp, clamp 0x1f)
            regs[args[0]] = get(args[1])[(LANES ^ get(args[2])).astype(np.int64)]
            continue
        if op == "movmatrix.sync.aligned.m8n8.trans.b16":  # an 8x8 b16 fragment (row lane / 4, cols 2 (lane % 4) ..)
            source = get(args[1])
            row, col = _G, 2 * _T
            pick = [(source[(4 * k + row // 2).astype(np.int64)] >> (np.uint64(16) * (row % 2))) & np.uint64(0xFFFF)
                    for k in (col, col + 1)]
            regs[args[0]] = pick[0] | (pick[1] << np.uint64(16))
            continue
        active = regs[guard].astype(bool) if guard is not None else None
        if op.startswith("ld.global"):
            dst, src = args
            m = re.fullmatch(r"\[(\S+?)(?:\+(\d+))?\]", src)
            addrs = get(m.group(1)) + np.uint64(int(m.group(2) or 0))
            names = _names(dst)
            width = 2 if op.endswith(".b16") else 8 if op.endswith(".b64") else 4
            loaded = [regs.get(n, np.zeros(32, np.uint64)).copy() for n in names]
            for lane in range(32):
                if active is not None and not active[lane]:
                    continue
                data = memory.read(int(addrs[lane]), width * len(names))
                for i in range(len(names)):
                    loaded[i][lane] = int.from_bytes(data[i * width : (i + 1) * width], "little")
            for n, value in zip(names, loaded):
                regs[n] = value
            continue
        out = _alu(op, args, get)
        if isinstance(out, dict):  # several destinations (an unpacking move)
            for n, value in out.items():
                regs[n] = value if active is None else np.where(active, value, regs.get(n, np.uint64(0)))
        else:
            dst = args[0]
            regs[dst] = out if active is None else np.where(active, out, regs.get(dst, np.zeros_like(out)))
    return [regs[f"${i}"] for i in range(n_outputs)]


def _alu(op: str, args: tuple[str, ...], get):
    """One lane-wise instruction over the whole warp: the destination's new values (a dict for several)."""
    if op == "setp.ne.s32":
        return get(args[1]) != get(args[2])
    if op == "setp.gt.s32":
        return _signed32(get(args[1])) > _signed32(get(args[2]))
    if op in ("mov.b64", "mov.b32") and args[0].startswith("{"):  # unpack into narrower registers
        names = _names(args[0])
        value, width = get(args[1]), int(op[-2:]) // len(names)
        mask = np.uint64((1 << width) - 1)
        return {n: (value >> np.uint64(width * i)) & mask for i, n in enumerate(names)}
    if op in ("mov.b64", "mov.b32") and args[1].startswith("{"):  # pack narrower registers
        names = _names(args[1])
        width = int(op[-2:]) // len(names)
        out = np.zeros(32, np.uint64)
        for i, n in enumerate(names):
            out = out + (get(n) << np.uint64(width * i))
        return out
    if op in ("mov.b32", "mov.f32", "mov.u32", "mov.b16", "mov.b64"):
        return get(args[1]).copy()
    if op == "cvt.u32.u16":
        return get(args[1]) & np.uint64(0xFFFF)
    if op == "cvt.f32.f16":
        return _f32_words(_f16s(get(args[1])))
    if op == "shl.b32":
        return _shift_left(get(args[1]), get(args[2]))
    if op == "bfe.u32":  # unsigned bit-field extract: len bits from pos
        value, pos, length = (get(x) for x in args[1:])
        return _shift_right(value, pos) & ((np.uint64(1) << length) - np.uint64(1))
    if op == "bfi.b32":  # insert len low bits of a into b at pos
        a, b, pos, length = (get(x) for x in args[1:])
        field = ((np.uint64(1) << length) - np.uint64(1)) << pos
        return (b & ~field & M32) | ((a << pos) & field)
    if op == "popc.b32":
        return np.bitwise_count(get(args[1]) & M32).astype(np.uint64)
    if op in ("and.b32", "xor.b32", "or.b32"):
        a, b = get(args[1]), get(args[2])
        return {"and.b32": a & b, "xor.b32": a ^ b, "or.b32": a | b}[op]
    if op in ("mul.lo.u32", "mul.lo.s32"):  # the low 32 bits are the same for either signedness
        return ((get(args[1]) & M32) * (get(args[2]) & M32)) & M32
    if op == "mad.lo.s32":
        return ((get(args[1]) & M32) * (get(args[2]) & M32) + get(args[3])) & M32
    if op == "cvt.rn.f32.s32":
        return _f32_words(_signed32(get(args[1])).astype(np.float32))
    if op in ("shr.u32", "shr.b32"):
        return _shift_right(get(args[1]), get(args[2]))
    if op == "lop3.b32":
        lut = _constant(args[4])
        if lut is None:
            raise NotImplementedError("ptx_warp: lop3 with a lookup table in a register")
        return _lop3_lanes(get(args[1]), get(args[2]), get(args[3]), lut)
    if op == "prmt.b32":
        a, b, sel = get(args[1]), get(args[2]), get(args[3])
        pool = (a & M32) | ((b & M32) << np.uint64(32))
        out = np.zeros(32, np.uint64)
        for i in range(4):
            index = (sel >> np.uint64(4 * i)) & np.uint64(7)
            out |= ((pool >> (np.uint64(8) * index)) & np.uint64(0xFF)) << np.uint64(8 * i)
        return out
    if op == "fma.rn.bf16x2":
        a, b, c = (get(x) for x in args[1:])
        halves = [_to_bf16s(_bf16s(a >> s) * _bf16s(b >> s) + _bf16s(c >> s)) for s in (np.uint64(0), np.uint64(16))]
        return halves[0] | (halves[1] << np.uint64(16))
    if op in ("sub.rn.f16x2", "mul.rn.f16x2"):  # each half computed exactly, then rounded once to fp16
        a, b = get(args[1]), get(args[2])
        fn = np.subtract if op == "sub.rn.f16x2" else np.multiply
        halves = [_to_f16s(fn(_f16s(a >> s), _f16s(b >> s))) for s in (np.uint64(0), np.uint64(16))]
        return halves[0] | (halves[1] << np.uint64(16))
    if op == "cvt.rn.f16x2.f32":  # d = {a (high half), b (low half)}
        a, b = (_f32s(get(x)) for x in args[1:])
        return _to_f16s(b) | (_to_f16s(a) << np.uint64(16))
    if op in ("mul.f32", "add.f32", "sub.f32", "max.f32"):
        a, b = (_f32s(get(x)) for x in args[1:])
        return _f32_words({"mul.f32": np.multiply, "add.f32": np.add, "sub.f32": np.subtract,
                           "max.f32": np.maximum}[op](a, b))
    if op == "fma.rn.f32":
        a, b, c = (_f32s(get(x)).astype(np.float64) for x in args[1:])
        return _f32_words(a * b + c)
    raise NotImplementedError(f"ptx_warp does not know {op!r} ({op} {', '.join(args)})")


def run_warp(asm: str, inputs: list[list[int]], n_outputs: int, memory, tid_base: int = 0) -> list[list[int]]:
    """Run `asm` for the 32 lanes of a warp. inputs[lane][i] is operand $(n_outputs + i) as a bit pattern
    (f32 as its bits, 64-bit values as ints); returns outputs[lane][i] for $i as bit patterns. %tid.x of
    lane l is tid_base + l."""
    columns = [np.array([int(lane[i]) for lane in inputs], dtype=np.uint64) for i in range(len(inputs[0]))]
    outs = run_warp_lanes(asm, columns, n_outputs, memory, tid_base)
    return [[int(out[lane]) for out in outs] for lane in range(32)]


def _mma(regs: dict, args: tuple[str, ...], half=_bf16s) -> None:
    """D = A (16x16) . B (16x8) + C (16x8 f32), A and B bf16 or fp16 (`half` decodes the low half of each word),
    from/to the lanes' fragments (PTX ISA layouts)."""
    d, a, b, c = (_names(x) for x in args)
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    g, t = _G.astype(np.int64), _T.astype(np.int64)
    for r, name in enumerate(a):  # a0: (g, 2t..), a1: (g + 8, 2t..), a2: (g, 2t + 8..), a3: (g + 8, 2t + 8..)
        row, col = g + 8 * (r % 2), 2 * t + 8 * (r // 2)
        A[row, col], A[row, col + 1] = half(regs[name]), half(regs[name] >> np.uint64(16))
    for r, name in enumerate(b):  # b0: k = 2t, 2t + 1; b1: k = 2t + 8, 2t + 9; column g
        B[2 * t + 8 * r, g], B[2 * t + 8 * r + 1, g] = half(regs[name]), half(regs[name] >> np.uint64(16))
    for r, name in enumerate(c):  # c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
        C[g + 8 * (r // 2), 2 * t + r % 2] = _f32s(regs[name])
    D = A @ B + C
    for r, name in enumerate(d):
        regs[name] = _f32_words(D[g + 8 * (r // 2), 2 * t + r % 2])


def _bytes_of(words: np.ndarray, signed: bool) -> np.ndarray:
    """[32, 4] the four bytes of each lane's word (int64)."""
    b = ((words[:, None] >> (np.uint64(8) * np.arange(4, dtype=np.uint64))) & np.uint64(0xFF)).astype(np.int64)
    return np.where(b >= 128, b - 256, b) if signed else b


def _mma_int8(regs: dict, args: tuple[str, ...], a_signed: bool, b_signed: bool) -> None:
    """D = A (16x32 bytes) . B (32x8 bytes) + C (16x8 s32), m16n8k32 (PTX ISA layouts), int32 wrap-around."""
    d, a, b, c = (_names(x) for x in args)
    A, B, C = np.zeros((16, 32), np.int64), np.zeros((32, 8), np.int64), np.zeros((16, 8), np.int64)
    g, t = _G.astype(np.int64), _T.astype(np.int64)
    four = np.arange(4)
    for r, name in enumerate(a):  # a0: (g, 4t..), a1: (g + 8, 4t..), a2: (g, 4t + 16..), a3: (g + 8, 4t + 16..)
        row, col = g + 8 * (r % 2), 4 * t + 16 * (r // 2)
        A[row[:, None], col[:, None] + four] = _bytes_of(regs[name], a_signed)
    for r, name in enumerate(b):  # b0: k = 4t..4t + 3, b1: k = 4t + 16..; column g
        B[(4 * t + 16 * r)[:, None] + four, g[:, None]] = _bytes_of(regs[name], b_signed)
    for r, name in enumerate(c):  # c0, c1: row g, columns 2t, 2t + 1; c2, c3: row g + 8
        C[g + 8 * (r // 2), 2 * t + r % 2] = _signed32(regs[name])
    D = A @ B + C
    for r, name in enumerate(d):
        regs[name] = (D[g + 8 * (r // 2), 2 * t + r % 2] & MASK32).astype(np.uint64)


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
        result = run_warp_lanes(asm, [w[base : base + 32] for w in words], len(types), memory, tid_base=base)
        for out, value in zip(outs, result):
            out[base : base + 32] = value
    handles = []
    for out, ty in zip(outs, types):
        unsigned, signed = _BITS[ty.element_ty.name]
        handles.append(TensorHandle(out.astype(unsigned).view(signed).reshape(shape), ty.element_ty))
    return _AsmResults(handles)
