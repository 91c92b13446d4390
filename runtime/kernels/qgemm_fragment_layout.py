"""The fragment kernel over weights re-laid-out once in fragment order (Q4/Q5, T = 1..16 rows of x).

Why: the fragment kernel (qgemm_rows_frag) reads the artifact's row-major planes, so each warp-wide load
touches 8 weight rows x 32 bytes and the L1 sends L2 one 32-byte request per row; on the H200 it streams at
0.33-0.53 of copy at any T (bench/RESULTS.md §2). Here the planes are permuted at load time so that what one
thread needs for a 16-row block is contiguous: per (16-row block, 64-lane group) 512 bytes of code words, lane
L = 4g + c holding its 8 bytes of row g then its 8 of row g + 8; per (block, 4 groups) 128 bytes of scales,
lane g's 16 bytes being the 4 groups' (row g, row g + 8) scale pairs; Q5's high bits per (block, 4 groups) 512
bytes, lane L's 16 bytes the 4 groups' (row g, row g + 8) half-words. A warp's load is then one 512-byte run
(four whole lines) and the scales of 4 groups one line. Within each 32-bit code word the nibbles hold lanes
(0, 2, 4, 6, 1, 3, 5, 7) and each Q5 high byte its bits in that order ("pair order"): the bf16 pair a thread
builds from nibbles j and j + 4 is then lanes 2j and 2j + 1, which is how x's lanes lie in one loaded
register, so the kernel builds B without byte permutes. The int8 kernel (qgemm_fragment_int8) reads the code
words in the artifact's lane order and a Q5 group's 32 high bits of a thread permuted so that each code byte's
bit sits under it ("byte order": FragmentPlanes.order). The loads write their registers straight from memory (nothing
in a load waits for its data), so a thread keeps two chunks in flight while it computes. The group product
(PTX, unpacking, mma) is qgemm_rows_frag's own, in its one-register-per-operand form. Two options of the same
kernel: x loaded a chunk ahead (X_AHEAD; by a measured rule, loads_x_ahead), and a gate/up pair's program taking a
gate block and its up block and storing silu(gate) * up (SWIGLU, qgemm_fragment_swiglu). Q6 (the output head's
format) takes the same kernel: its high bits, 64 per thread, group and row pair, laid out so that one shift serves
a nibble pair (_q6_fields).

`FragmentPlanes` holds the permuted planes; `fragment_planes(w)` builds them from a PackedLinear (torch ops,
any device) and `row_planes` undoes it for any row range (prefill, references). Rows are padded to 16 with
zero codes and scales; K must be a multiple of 512 (two 4-group chunks per loop step).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from format.numeric import GroupedFormat

from ..switches import SWITCHES, setting
from . import interpreted, tuning_from_env
from .launch import LAUNCH, pdl_wait
from .qgemm_rows_frag import (FRAG_BITS, GROUP, HINTS, SplitPartials, _compute_asm, _store_rows,
                              _thread_ids, aligned_rows, finish_splits, split_partials)

CHUNK = 4  # groups per scale line and per load
ROWS_PER_BLOCK = 16  # rows of one warp's mma fragments


@dataclass
class FragmentPlanes:
    """A Q4/Q5/Q6/W8 matrix in fragment order (W8: 32-lane groups, each as a Q4 group's bytes, byte order only):
    codes [blocks, groups, 32 lanes, 16 bytes], scales [blocks, chunks, 8, 4, 2] float16, high (Q5) [blocks, chunks, 32 lanes, 4, 2 rows] 16-bit words, (Q6) [blocks, chunks, 2 group
    pairs, 32 lanes, 2 groups, 2 rows] 32-bit words of 16 two-bit fields (_q6_fields); `order`: "pairs" (code
    words and high bytes in pair order, for the bf16 kernel), "lanes" (the artifact's order inside words and
    bytes) or "bytes" (lane-order codes, high bits in byte order: the int8 kernel's; see high_to_byte_order)."""

    codes: torch.Tensor
    scales: torch.Tensor
    high: torch.Tensor | None
    rows: int
    cols: int
    fmt: GroupedFormat
    order: str = "pairs"

    @property
    def pairs(self) -> bool:
        return self.order == "pairs"

    @property
    def fields(self) -> bool:
        return self.order == "fields"

    @property
    def blocks(self) -> int:
        return -(-self.rows // ROWS_PER_BLOCK)

    @property
    def groups(self) -> int:
        return self.cols // self.fmt.group_size


LAYOUT_BITS = (*FRAG_BITS, 6)  # Q6 in pair or lane order only (the bf16 kernel; no int8 byte order)
# W8 (32 one-byte lanes a group: a group's 32 bytes a row, as a Q4 group's) in byte order only, for the int8 kernel
W8_BITS, W8_GROUP = 8, 32


def fragment_supported(fmt: GroupedFormat, cols: int) -> bool:
    nibbles = fmt.bits in LAYOUT_BITS and fmt.group_size == GROUP
    return (nibbles or fmt.bits == W8_BITS and fmt.group_size == W8_GROUP) and cols % (2 * CHUNK * fmt.group_size) == 0


# side-by-side runs: NINFER_FRAGMENT_PAIRS=0 keeps the artifact's lane order inside code words (the kernel then
# pairs x's lanes with byte permutes, as before pair order)
PAIR_ORDER = setting("NINFER_FRAGMENT_PAIRS") == "1"
# which products in fragment order run the int8 kernel (qgemm_fragment_int8, planes in byte order): off, q5 (the
# Q5 products) or on (all); built on a CPU and not yet measured on a GPU, so off by default
FRAGMENT_INT8_MODES = SWITCHES["NINFER_FRAGMENT_INT8"].choices  # checked where used too (tests set the constant)
FRAGMENT_INT8 = setting("NINFER_FRAGMENT_INT8")
ORDERS = ("pairs", "lanes", "bytes", "fields")
# Q5 layer products in "fields" order by default (session 44; NINFER_Q5_FIELDS=off keeps pair order): each thread's 5
# words of a group (its 4 code words and its high-bit word) hold its 32 codes as 5-bit fields side by side, three per
# 16-bit half at bits 0, 5 and 10 and the 16th register's pair in the halves' top bits (_fields_of_pairs), so the
# group product builds a bf16 pair with a shift and one lop3 as Q4 does, not with two shifts and two lop3 (sm_90 SASS
# per group 112 -> 75). Exact, the same sums; H100: MLP down at one row 21.9 -> 20.9 us, GDN out 8.6 -> 8.3, 27B one
# lane +1-2 %, lanes level (bench/RESULTS.md §1). The prefill's dequantizer reads them in place (qlinear._field_codes).
Q5_FIELDS = setting("NINFER_Q5_FIELDS")


def fragment_order(bits: int) -> str:
    """The order a `bits`-bit product's planes take in fragment order (see FragmentPlanes)."""
    if FRAGMENT_INT8 not in FRAGMENT_INT8_MODES:
        raise ValueError(f"NINFER_FRAGMENT_INT8={FRAGMENT_INT8!r} is not one of {', '.join(FRAGMENT_INT8_MODES)}; "
                         "unset it for off")
    if bits == W8_BITS or bits != 6 and (FRAGMENT_INT8 == "on" or (FRAGMENT_INT8 == "q5" and bits == 5)):
        return "bytes"
    return "pairs" if PAIR_ORDER else "lanes"


def layer_order(bits: int) -> str:
    """The order of a layer product's planes (an object of FRAGMENT_OBJECTS, or a MoE layer's stacked routed
    experts): fragment_order's, or "fields" for Q5 (unless NINFER_Q5_FIELDS=off)."""
    if Q5_FIELDS not in ("on", "off"):
        raise ValueError(f"NINFER_Q5_FIELDS={Q5_FIELDS!r} is not on or off; unset it for on")
    order = fragment_order(bits)
    return "fields" if Q5_FIELDS == "on" and bits == 5 and order == "pairs" else order


# (step, register) of a group product's 16 A registers, i = 4 step + register: the pair-order code word (0-3: row g's
# two, row g + 8's two), its nibble j (the pair is nibbles j and j + 4) and the thread's high-bit word's first bit
# for that word's nibbles (row g's 16 bits then row g + 8's; word 0 of a row bits 0-7, word 1 bits 8-15)
def _register_sources() -> list[tuple[int, int, int]]:
    out = []
    for i in range(16):
        step, reg = divmod(i, 4)
        half, j = reg % 2, 2 * (step % 2) + reg // 2
        word = 2 * half + step // 2
        out.append((word, j, 16 * half + 8 * (step // 2)))
    return out


def _fields_of_pairs(words: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """[..., 5] int64 words of a (thread, group) — pair order's 4 code words and its high-bit word — into fields
    order (or back). Register i's pair (u_lo, u_hi), u = code ^ 16 (the 5-bit code offset to unsigned, so 0x4300 | u is
    bf16 128 + 16 + code), lies for i < 15 in word i // 3 at bits 5 (i % 3) and 16 + 5 (i % 3); register 15's bit b
    of u_lo at bit 15 of word b, of u_hi at bit 31."""
    out = torch.zeros_like(words)
    for i, (word, j, hbit) in enumerate(_register_sources()):
        for part in range(2):  # u_lo (nibble j), u_hi (nibble j + 4)
            nib_at, high_at = 4 * (j + 4 * part), hbit + j + 4 * part
            if i < 15:
                field = (i // 3, 5 * (i % 3) + 16 * part)
            if not inverse:
                code = ((words[..., word] >> nib_at) & 0xF) | (((words[..., 4] >> high_at) & 1) << 4)
                u = code ^ 16
                if i < 15:
                    out[..., field[0]] |= u << field[1]
                else:
                    for b in range(5):
                        out[..., b] |= ((u >> b) & 1) << (15 + 16 * part)
            else:
                if i < 15:
                    u = (words[..., field[0]] >> field[1]) & 0x1F
                else:
                    u = sum((((words[..., b] >> (15 + 16 * part)) & 1) << b) for b in range(5))
                code = u ^ 16
                out[..., word] |= (code & 0xF) << nib_at
                out[..., 4] |= (code >> 4) << high_at
    return out


def _fields_planes(codes: torch.Tensor, high: torch.Tensor, inverse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Q5 planes in fragment order, uint8 codes [blocks, groups, 32 lanes, 16 bytes] and high [blocks, chunks, 32
    lanes, 4 groups, 2 rows, 2 bytes] in pair order -> fields order (or back), same shapes."""
    blocks, groups = codes.shape[0], codes.shape[1]
    cw = codes.contiguous().view(-1).view(torch.int32).view(blocks, groups, 32, 4)
    hw = high.contiguous().view(-1).view(torch.int32).view(blocks, groups // CHUNK, 32, CHUNK)
    hw = hw.permute(0, 1, 3, 2).reshape(blocks, groups, 32)  # [blocks, groups, lanes]: a thread's word of a group
    words = torch.cat([cw, hw[..., None]], dim=-1).to(torch.int64) & 0xFFFFFFFF
    out = _fields_of_pairs(words, inverse)
    out = torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)
    new_codes = out[..., :4].contiguous().view(-1).view(torch.uint8).view(codes.shape)
    new_high = out[..., 4].reshape(blocks, groups // CHUNK, CHUNK, 32).permute(0, 1, 3, 2).contiguous()
    return new_codes, new_high.view(-1).view(torch.uint8).view(high.shape)


def _nibbles(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return b & 0xF, b >> 4


def codes_to_pair_order(codes: torch.Tensor) -> torch.Tensor:
    """uint8 code bytes, 4 per 32-bit word (lanes 0-7 in nibbles 0-7) -> nibbles holding lanes
    (0, 2, 4, 6, 1, 3, 5, 7): bytes (l0 | l2, l4 | l6, l1 | l3, l5 | l7)."""
    (lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3) = (_nibbles(codes[..., i::4]) for i in range(4))
    out = torch.empty_like(codes)
    out[..., 0::4], out[..., 1::4] = lo0 | lo1 << 4, lo2 | lo3 << 4
    out[..., 2::4], out[..., 3::4] = hi0 | hi1 << 4, hi2 | hi3 << 4
    return out


def codes_from_pair_order(codes: torch.Tensor) -> torch.Tensor:
    (lo0, hi0), (lo1, hi1), (lo2, hi2), (lo3, hi3) = (_nibbles(codes[..., i::4]) for i in range(4))
    out = torch.empty_like(codes)
    out[..., 0::4], out[..., 1::4] = lo0 | lo2 << 4, hi0 | hi2 << 4
    out[..., 2::4], out[..., 3::4] = lo1 | lo3 << 4, hi1 | hi3 << 4
    return out


_PAIR_BITS = (0, 2, 4, 6, 1, 3, 5, 7)  # bit i of a pair-order high byte is lane _PAIR_BITS[i]'s


@functools.lru_cache(maxsize=None)
def _bit_table(inverse: bool, device: str) -> torch.Tensor:
    """The 256-byte table of the pair-order bit permutation (or its inverse), once per device: the load-time
    re-layout asks for it per 1,024-row step of every Q5 product."""
    byte = torch.arange(256)
    table = torch.zeros(256, dtype=torch.long)
    for i, lane in enumerate(_PAIR_BITS):
        src, dst = (i, lane) if inverse else (lane, i)
        table |= ((byte >> src) & 1) << dst
    return table.to(torch.uint8).to(device)


def high_to_pair_order(high: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """uint8 Q5 high bytes (lane l of 8 at bit l) -> pair order (bits 0-3 lanes 0, 2, 4, 6; 4-7 lanes 1, 3, 5, 7),
    or back."""
    return _bit_table(inverse, str(high.device))[high.long()]


def _byte_order_bits() -> list[tuple[int, int]]:
    """(source bit, destination bit) of a thread's 32 high bits of one group: lane order has byte 2 * row + word
    (row g or g + 8, the thread's code word 0 or 1) with lane l at bit l; byte order puts lane 2i + p's bit of
    (row, word) at bit 8i + 4 row + 2 word + p, i.e. under byte i of that word's even (p = 0) or odd (p = 1)
    code bytes, so one shift and one mask place four of them at bit 4 of each byte."""
    return [(8 * (2 * row + word) + 2 * i + p, 8 * i + 4 * row + 2 * word + p)
            for row in range(2) for word in range(2) for i in range(4) for p in range(2)]


def high_to_byte_order(high: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """uint8 Q5 high planes in fragment order (lane order), 4 bytes per (thread, group) -> byte order, or back."""
    words = high.contiguous().view(-1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(words)
    for src, dst in _byte_order_bits():
        if inverse:
            src, dst = dst, src
        out |= ((words >> src) & 1) << dst
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32).view(torch.uint8).view(high.shape)


def _q6_fields(pairs: bool) -> list[tuple[int, int]]:
    """(source field, destination field) of a thread's 16 two-bit Q6 high fields of one row and group: the
    artifact holds lane m (of the thread's 16) at bits 2m, 2m + 1 of its 32-bit word; the kernel (_q6_pair) wants
    code word w's nibble n (lane 8w + n, or 8w + (0, 2, 4, 6, 1, 3, 5, 7)[n] in pair order) at field n + 4w for n <
    4 and 8 + (n - 4) + 4w for n >= 4, so that one shift brings a nibble pair's fields under bits 4-5 and 20-21."""
    return [(8 * w + (_PAIR_BITS[n] if pairs else n), (n if n < 4 else 4 + n) + 4 * w)
            for w in range(2) for n in range(8)]


def q6_high_to_fields(words: torch.Tensor, pairs: bool, inverse: bool = False) -> torch.Tensor:
    """int32 Q6 high words (one per thread, row and group: 16 two-bit fields) -> the kernel's field order, or
    back."""
    src = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.zeros_like(src)
    for a, b in _q6_fields(pairs):
        if inverse:
            a, b = b, a
        out |= ((src >> (2 * a)) & 3) << (2 * b)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)


def fragment_planes(w, order: str | None = None) -> FragmentPlanes:
    """Permute a PackedLinear's planes into fragment order (a copy; the caller may free the original); `order`
    (default fragment_order(bits)): see FragmentPlanes."""
    order = fragment_order(w.fmt.bits) if order is None else order
    if order not in ORDERS:
        raise ValueError(f"fragment layout: order {order!r} is not one of {', '.join(ORDERS)}")
    if order == "fields":
        if w.fmt.bits != 5:
            raise ValueError(f"fragment layout: fields order is for Q5 only, not {w.fmt.name}")
        fp = fragment_planes(w, "pairs")
        blocks, groups = fp.blocks, fp.groups
        codes, high = _fields_planes(fp.codes.view(blocks, groups, 32, 16), fp.high.view(blocks, groups // CHUNK, 32,
                                                                                        CHUNK, 2, 2))
        return FragmentPlanes(codes.view(-1), fp.scales, high.view(-1), fp.rows, fp.cols, fp.fmt, "fields")
    pairs = order == "pairs"
    if not fragment_supported(w.fmt, w.cols):
        raise ValueError(f"fragment layout: {w.fmt.name} [{w.rows}, {w.cols}] is not Q4/Q5/Q6 with K a multiple of "
                         "512 or W8 with K a multiple of 256")
    if w.fmt.bits == W8_BITS and order != "bytes":
        raise ValueError("fragment layout: W8 has byte order only (the int8 fragment kernel's)")
    n, groups = w.rows, w.cols // w.fmt.group_size
    blocks = -(-n // ROWS_PER_BLOCK)
    pad = blocks * ROWS_PER_BLOCK - n

    def rows_of(plane: torch.Tensor, width: int) -> torch.Tensor:
        t = plane.view(n, -1)[:, :width]
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    base = rows_of(w.base.view(torch.uint8), groups * 32)  # [rows, groups * 32 bytes]
    if pairs:
        base = codes_to_pair_order(base)
    codes = base.reshape(blocks, 2, 8, groups, 4, 8).permute(0, 3, 2, 4, 1, 5).contiguous()
    scale = rows_of(w.scale.view(torch.float16), groups)
    scales = scale.reshape(blocks, 2, 8, groups // CHUNK, CHUNK).permute(0, 3, 2, 4, 1).contiguous()
    high = None
    if w.fmt.bits == 6:
        if order == "bytes":
            raise ValueError("fragment layout: Q6 has no byte order (the int8 fragment kernel takes Q4/Q5)")
        h = rows_of(w.high.view(torch.uint8), groups * 16).contiguous().view(torch.int32)  # thread c's word at c
        h = q6_high_to_fields(h, pairs)
        # per (block, chunk): groups 0-1 then 2-3, each 512 bytes: lane 4g + c's (group, row g / g + 8) words
        high = h.reshape(blocks, 2, 8, groups // CHUNK, 2, 2, 4).permute(0, 3, 4, 2, 6, 5, 1).contiguous()
        high = high.view(torch.uint8)
    if w.fmt.bits == 5:
        h = rows_of(w.high.view(torch.uint8), groups * 8)  # 8 bytes per group: thread c's 2 bytes at 2c
        if pairs:
            h = high_to_pair_order(h)
        high = h.reshape(blocks, 2, 8, groups // CHUNK, CHUNK, 4, 2).permute(0, 3, 2, 5, 4, 1, 6).contiguous()
        if order == "bytes":
            high = high_to_byte_order(high)
    return FragmentPlanes(codes.view(-1), scales.view(-1), None if high is None else high.view(-1), n, w.cols, w.fmt,
                          order)


# Objects the engine may re-lay out (qlinear.fragment_layout_enabled says when): products that only ever go through
# qlinear whole (no row views, gathers or expert kernels read them). A MoE's shared expert is not one: its rows ride
# in the routed experts' decode launches (moe.shared_fusable), which read the artifact's planes.
FRAGMENT_OBJECTS = ("attention/query_gate_key_value", "attention/output", "gdn/query_key_value_z", "gdn/output",
                    "mlp/gate_up", "mlp/down", "mtp/input_projection")
CONVERT_ROWS = 1024  # rows permuted per step in place (a bounded temporary)
# W8 products in byte order on the int8 fragment kernel (qgemm_fragment_int8: its codes are the mma's A bytes as
# stored), for engines of several rows a step. Measured on the H100 (session 36, `bench/device_frag.sh s42`): at 2-8
# rows 0.73-0.82 of copy against the planes' dequantizing row kernel at 0.40-0.86 (4 rows: 0.40-0.63 -> 0.76-0.82);
# end to end level for MTP3 lanes, DFlash2 K = 7 619.1 -> 624.7 tok/s. NINFER_FRAGMENT_W8=off keeps the planes. The
# DFlash2 drafter's query/key/value product is also read through a view of its key/value rows, whole 16-row blocks
# (fragment_rows).
FRAGMENT_W8 = setting("NINFER_FRAGMENT_W8")
# W8 in byte order only for engines of at most W8_MAX_ROWS rows a step: at 12-16 rows (two mma column tiles) the int8
# kernel read W8 at 0.39-0.63 of copy against the planes' 0.55-0.65, and DFlash2 over 2 lanes (16-row drafter
# blocks) lost 1,011 -> 985 tok/s (session 36, H100); MTP3 over 4 lanes was level (14.09 / 14.05 ms a round).
W8_MAX_ROWS = 8
W8_OBJECTS = ("mtp/input_projection", "dflash2/feature_projection", "attention/query_key_value", "attention/output",
              "mlp/gate_up", "mlp/down")


def in_place_supported(w) -> bool:
    """Q4/Q5/Q6 with K a multiple of 512 or W8 with K a multiple of 256 (so the planes have no K padding) and whole
    16-row blocks (no row padding): the fragment-order planes then fill exactly the artifact's plane bytes."""
    return fragment_supported(w.fmt, w.cols) and w.rows % ROWS_PER_BLOCK == 0


def takes_fragment_layout(name: str, w, rows_per_step: int = 1) -> bool:
    """Whether an engine multiplying up to `rows_per_step` rows a step re-lays out layer product `name` (a
    PackedLinear) in fragment order: Q4/Q5 (Q6 layer products, the q6 recipe's, keep the artifact's planes until
    their kernel is measured as the head's was); W8 ones (the MTP input projection, the DFlash2 drafter's whole
    products) up to W8_MAX_ROWS rows a step unless NINFER_FRAGMENT_W8=off."""
    if w.fmt.bits == W8_BITS:
        return FRAGMENT_W8 == "on" and rows_per_step <= W8_MAX_ROWS and name.endswith(W8_OBJECTS) \
            and name.startswith(("mtp/", "dflash2/")) and in_place_supported(w)
    return (name.endswith(FRAGMENT_OBJECTS) and (name.startswith("text/layers/") or name.startswith("mtp/"))
            and w.fmt.bits in FRAG_BITS and in_place_supported(w))


def _permute_rows(w, order: str, into: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]) -> FragmentPlanes:
    """w's planes permuted into fragment order CONVERT_ROWS rows at a time (a small temporary; rows a multiple of
    16, so a step's blocks fill exactly its rows' byte ranges) into `into` ([rows, -1] views of codes, scales,
    high: w's own planes, in place, or new ones)."""
    from .qlinear import PackedLinear

    base, scale = w.base.view(torch.uint8).view(w.rows, -1), w.scale.view(torch.float16).view(w.rows, -1)
    high = w.high.view(torch.uint8).view(w.rows, -1) if w.high is not None else None
    codes, scales, high_out = into
    for r0 in range(0, w.rows, CONVERT_ROWS):
        r1 = min(w.rows, r0 + CONVERT_ROWS)
        part = PackedLinear(base[r0:r1].reshape(-1), None if high is None else high[r0:r1].reshape(-1),
                            scale[r0:r1].reshape(-1).view(torch.uint8), r1 - r0, w.cols, w.fmt)
        fp = fragment_planes(part, order)
        codes[r0:r1].reshape(-1).copy_(fp.codes)
        scales[r0:r1].reshape(-1).copy_(fp.scales)
        if high_out is not None:
            high_out[r0:r1].reshape(-1).copy_(fp.high)
    return FragmentPlanes(codes.view(-1), scales.view(-1), None if high_out is None else high_out.view(-1), w.rows,
                          w.cols, w.fmt, order)


def to_fragment_layout(w, order: str | None = None):
    """Permute a PackedLinear's planes into fragment order in place and attach the FragmentPlanes views; returns w.
    `order`: as fragment_planes."""
    order = fragment_order(w.fmt.bits) if order is None else order
    if not in_place_supported(w):
        raise ValueError(f"fragment layout: {w.fmt.name} [{w.rows}, {w.cols}] needs Q4/Q5/Q6 with K a multiple of "
                         "512 or W8 with K a multiple of 256, and rows a multiple of 16")
    planes = (w.base.view(torch.uint8).view(w.rows, -1), w.scale.view(torch.float16).view(w.rows, -1),
              w.high.view(torch.uint8).view(w.rows, -1) if w.high is not None else None)
    w.fragment = _permute_rows(w, order, planes)
    return w


def copy_supported(w) -> bool:
    """Q4/Q5/Q6, K a multiple of 512, whole 16-row blocks, planes not already in fragment order: fragment_copy
    takes it."""
    return w.fragment is None and w.fmt.bits != W8_BITS and in_place_supported(w)


def fragment_copy(w) -> FragmentPlanes:
    """A fragment-order copy of a PackedLinear's planes (pair order) beside them, the artifact's planes kept: for
    side-by-side measurements of one matrix on both (bench/gemv_compare.py head)."""
    if not copy_supported(w):
        raise ValueError(f"fragment copy: {w.fmt.name} [{w.rows}, {w.cols}] needs Q4/Q5/Q6, K a multiple of 512, "
                         "rows a multiple of 16 and planes in the artifact's order")
    planes = (torch.empty_like(w.base.view(torch.uint8)).view(w.rows, -1),
              torch.empty_like(w.scale.view(torch.float16)).view(w.rows, -1),
              torch.empty_like(w.high.view(torch.uint8)).view(w.rows, -1) if w.high is not None else None)
    return _permute_rows(w, "pairs", planes)


def fragment_rows(fp: FragmentPlanes, end: int, begin: int = 0) -> FragmentPlanes:
    """Rows [begin, end) (whole 16-row blocks) of a matrix in fragment order, a view: every plane is block-major."""
    if begin % ROWS_PER_BLOCK or end % ROWS_PER_BLOCK or not 0 <= begin < end <= fp.rows:
        raise ValueError(f"fragment rows: rows {begin}..{end} of {fp.rows} (whole 16-row blocks)")
    per_row = fp.groups  # elements per plane scale with rows x groups

    def rows_of(plane: torch.Tensor, width: int) -> torch.Tensor:
        return plane[begin * per_row * width : end * per_row * width]

    high = None if fp.high is None else rows_of(fp.high, fp.high.numel() // (fp.blocks * ROWS_PER_BLOCK * per_row))
    return FragmentPlanes(rows_of(fp.codes, 32), rows_of(fp.scales, 1), high, end - begin, fp.cols, fp.fmt, fp.order)


def row_planes(fp: FragmentPlanes, row0: int = 0, n: int | None = None):
    """Rows [row0, row0 + n) back in the artifact's row-split planes (uint8 base, uint8 high or None, float16
    scales), for the prefill's dequantization and the references; only the 16-row blocks holding them are
    copied."""
    n = fp.rows - row0 if n is None else n
    b0, b1 = row0 // ROWS_PER_BLOCK, -(-(row0 + n) // ROWS_PER_BLOCK)
    groups, chunks, rows = fp.groups, fp.groups // CHUNK, (b1 - b0) * ROWS_PER_BLOCK
    if fp.fields:  # its blocks back in pair order first, then as pair order's
        codes, high = _fields_planes(fp.codes.view(fp.blocks, groups, 32, 16)[b0:b1],
                                     fp.high.view(fp.blocks, chunks, 32, CHUNK, 2, 2)[b0:b1], inverse=True)
        part = FragmentPlanes(codes.view(-1), fp.scales.view(fp.blocks, -1)[b0:b1].reshape(-1), high.view(-1),
                              rows, fp.cols, fp.fmt, "pairs")
        return row_planes(part, row0 - b0 * ROWS_PER_BLOCK, n)
    first = row0 - b0 * ROWS_PER_BLOCK
    base = fp.codes.view(fp.blocks, groups, 8, 4, 2, 8)[b0:b1].permute(0, 4, 2, 1, 3, 5).reshape(rows, groups * 32)
    scale = fp.scales.view(fp.blocks, chunks, 8, CHUNK, 2)[b0:b1].permute(0, 4, 2, 1, 3).reshape(rows, groups)
    high = None
    if fp.high is not None and fp.fmt.bits == 6:
        words = fp.high.view(torch.int32).view(fp.blocks, chunks, 2, 8, 4, 2, 2)[b0:b1].permute(0, 6, 3, 1, 2, 5, 4)
        words = q6_high_to_fields(words.reshape(rows, groups * 4), fp.pairs, inverse=True)
        high = words.view(torch.uint8).view(rows, groups * 16)[first : first + n]
    elif fp.high is not None:
        high = fp.high.view(fp.blocks, chunks, 8, 4, CHUNK, 2, 2)[b0:b1]
        if fp.order == "bytes":
            high = high_to_byte_order(high, inverse=True)
        high = high.permute(0, 5, 2, 1, 4, 3, 6)
        high = high.reshape(rows, groups * 8)[first : first + n]
        if fp.pairs:
            high = high_to_pair_order(high, inverse=True)
    base = base[first : first + n]
    return codes_from_pair_order(base) if fp.pairs else base, high, scale[first : first + n]


def _chunk_load_asm(bits: int, hint: str) -> str:
    """4 groups of this thread's rows, each output one loaded register: $0-$15 code words (group j's at 4j..4j + 3:
    row g's two, row g + 8's two), $16-$19 group j's (row g, row g + 8) scales, Q5: $20-$23 group j's high-bit
    halves, Q6: $20-$23 group j's 64 high bits; then the inputs: codes, scales, high-bit addresses, load or not."""
    outputs = 20 if bits in (4, W8_BITS) else 24
    codes, scales, high, ok = (f"${outputs + i}" for i in range(4))
    ld = f"@p ld.global.nc{hint}"
    lines = [f"{{ .reg .pred p; setp.ne.s32 p, {ok}, 0;"] + [f"mov.b{64 if bits == 6 and i >= 20 else 32} ${i}, 0;"
                                                           for i in range(outputs)]
    lines += [f"{ld}.v4.b32 {{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}, [{codes}+{512 * j}];"
              for j in range(4)]
    lines.append(f"@p ld.global.nc.v4.b32 {{$16, $17, $18, $19}}, [{scales}];")  # a line shared by the quad: L1
    if bits == 5:
        lines.append(f"{ld}.v4.b32 {{$20, $21, $22, $23}}, [{high}];")
    if bits == 6:  # 64 bits a group (rows g and g + 8): groups 0-1, then 2-3 one 512-byte run later
        lines.append(f"{ld}.v2.b64 {{$20, $21}}, [{high}]; {ld}.v2.b64 {{$22, $23}}, [{high}+512];")
    return " ".join(lines) + " }"


_CHUNK_CONSTRAINTS_Q4 = tl.constexpr(",".join(["=r"] * 20 + ["l", "l", "l", "r"]))
_CHUNK_CONSTRAINTS_Q5 = tl.constexpr(",".join(["=r"] * 24 + ["l", "l", "l", "r"]))
_CHUNK_CONSTRAINTS_Q6 = tl.constexpr(",".join(["=r"] * 20 + ["=l"] * 4 + ["l", "l", "l", "r"]))
_WORDS_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 6 + ["l"] * 2))
_WORDS_X_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 14))
_WORDS_X2_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 14 + ["l"]))  # + 2nd tile's x address
# Q6: the group's high bits one 64-bit operand
_WORDS_CONSTRAINTS_Q6 = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 5 + ["l"] * 3))
_WORDS_X_CONSTRAINTS_Q6 = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 5 + ["l"] + ["r"] * 8))
_WORDS_X2_CONSTRAINTS_Q6 = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 5 + ["l"] + ["r"] * 8 + ["l"]))
# one group's x fragment of this thread (one column tile): its 16 lanes of row g, 8 registers
_X_GROUP_ASM = tl.constexpr("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$8]; ld.global.nc.v4.b32 {$4, $5, $6, $7}, [$8+16];")
_X_GROUP_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["l"]))
X_GROUP_BYTES: tl.constexpr = tl.constexpr(128)  # one 64-lane group of an x row, bf16


@triton.jit
def _load_chunk(ca, sa, ha, ci, ok, BITS: tl.constexpr, LOAD_ASM: tl.constexpr):
    """The 20 (Q4, W8) or 24 (Q5, Q6: its 4 high-bit words 64-bit) words of chunk ci (groups 4ci..4ci + 3) of this
    thread's rows, loaded when ok; Q4's and W8's 4 high-bit words are zeros."""
    args = [ca + ci * 2048, sa + ci * 128, ha + ci * (1024 if BITS == 6 else 512), ok.to(tl.int32)]
    if BITS == 6:  # one return statement: Triton checks every return's type, even under a constexpr branch
        chunk = tl.inline_asm_elementwise(LOAD_ASM, _CHUNK_CONSTRAINTS_Q6, args,
                                          dtype=(tl.int32,) * 20 + (tl.int64,) * 4, is_pure=False, pack=1)
    elif BITS == 5:
        chunk = tl.inline_asm_elementwise(LOAD_ASM, _CHUNK_CONSTRAINTS_Q5, args, dtype=(tl.int32,) * 24,
                                          is_pure=False, pack=1)
    else:
        zero = ok.to(tl.int32) * 0
        chunk = tl.inline_asm_elementwise(LOAD_ASM, _CHUNK_CONSTRAINTS_Q4, args, dtype=(tl.int32,) * 20,
                                          is_pure=False, pack=1) + (zero, zero, zero, zero)
    return chunk


@triton.jit
def _word_group(acc, w0, w1, w2, w3, scales, high, xa0, xa1, gi, BITS: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    """acc + one group's contribution from its loaded words (_compute_asm, words form); x's groups X_GROUP_BYTES
    apart."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    args = [a0, a1, a2, a3, a4, a5, a6, a7, w0, w1, w2, w3, scales, high, xa0 + gi * X_GROUP_BYTES, xa1 + gi * X_GROUP_BYTES]
    if BITS == 6:
        return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_CONSTRAINTS_Q6, args, dtype=(tl.float32,) * 8,
                                         is_pure=False, pack=1)
    return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_CONSTRAINTS, args, dtype=(tl.float32,) * 8, is_pure=False,
                                     pack=1)


@triton.jit
def _x_group(xa0, gi):
    """Group gi's x fragment of this thread (_X_GROUP_ASM)."""
    return tl.inline_asm_elementwise(_X_GROUP_ASM, _X_GROUP_CONSTRAINTS, [xa0 + gi * X_GROUP_BYTES], dtype=(tl.int32,) * 8,
                                     is_pure=False, pack=1)


@triton.jit
def _chunk_x(xa0, ci):
    """Chunk ci's x (its 4 groups' fragments, 32 registers), loaded in one go."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _x_group(xa0, ci * 4)
    b0, b1, b2, b3, b4, b5, b6, b7 = _x_group(xa0, ci * 4 + 1)
    c0, c1, c2, c3, c4, c5, c6, c7 = _x_group(xa0, ci * 4 + 2)
    d0, d1, d2, d3, d4, d5, d6, d7 = _x_group(xa0, ci * 4 + 3)
    return (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
            c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7)


@triton.jit
def _word_group_x(acc, w0, w1, w2, w3, scales, high, x0, x1, x2, x3, x4, x5, x6, x7, xa1, gi, NT: tl.constexpr,
                  BITS: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    """_word_group with the group's x fragment of the first column tile already loaded (_compute_asm with x_regs);
    with two column tiles the second tile's x is loaded in the product, from xa1."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    args = [a0, a1, a2, a3, a4, a5, a6, a7, w0, w1, w2, w3, scales, high, x0, x1, x2, x3, x4, x5, x6, x7]
    if BITS == 6:
        if NT == 2:
            return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_X2_CONSTRAINTS_Q6, args + [xa1 + gi * X_GROUP_BYTES],
                                             dtype=(tl.float32,) * 8, is_pure=False, pack=1)
        return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_X_CONSTRAINTS_Q6, args, dtype=(tl.float32,) * 8,
                                         is_pure=False, pack=1)
    if NT == 2:
        return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_X2_CONSTRAINTS, args + [xa1 + gi * X_GROUP_BYTES],
                                         dtype=(tl.float32,) * 8, is_pure=False, pack=1)
    return tl.inline_asm_elementwise(COMPUTE_ASM, _WORDS_X_CONSTRAINTS, args, dtype=(tl.float32,) * 8, is_pure=False,
                                     pack=1)


@triton.jit
def _chunk_product_x(acc, chunk, xs, xa1, ci, NT: tl.constexpr, BITS: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    """_chunk_product over a chunk's x loaded beforehand (_chunk_x; the first column tile's)."""
    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, s0, s1, s2, s3, h0, h1, h2, h3) = chunk
    (a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
     e0, e1, e2, e3, e4, e5, e6, e7, d0, d1, d2, d3, d4, d5, d6, d7) = xs
    acc = _word_group_x(acc, c0, c1, c2, c3, s0, h0, a0, a1, a2, a3, a4, a5, a6, a7, xa1, ci * 4, NT, BITS,
                        COMPUTE_ASM)
    acc = _word_group_x(acc, c4, c5, c6, c7, s1, h1, b0, b1, b2, b3, b4, b5, b6, b7, xa1, ci * 4 + 1, NT,
                        BITS, COMPUTE_ASM)
    acc = _word_group_x(acc, c8, c9, c10, c11, s2, h2, e0, e1, e2, e3, e4, e5, e6, e7, xa1, ci * 4 + 2, NT,
                        BITS, COMPUTE_ASM)
    return _word_group_x(acc, c12, c13, c14, c15, s3, h3, d0, d1, d2, d3, d4, d5, d6, d7, xa1, ci * 4 + 3, NT,
                         BITS, COMPUTE_ASM)


@triton.jit
def _chunk_product(acc, chunk, xa0, xa1, ci, BITS: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, s0, s1, s2, s3, h0, h1, h2, h3) = chunk
    acc = _word_group(acc, c0, c1, c2, c3, s0, h0, xa0, xa1, ci * 4, BITS, COMPUTE_ASM)
    acc = _word_group(acc, c4, c5, c6, c7, s1, h1, xa0, xa1, ci * 4 + 1, BITS, COMPUTE_ASM)
    acc = _word_group(acc, c8, c9, c10, c11, s2, h2, xa0, xa1, ci * 4 + 2, BITS, COMPUTE_ASM)
    return _word_group(acc, c12, c13, c14, c15, s3, h3, xa0, xa1, ci * 4 + 3, BITS, COMPUTE_ASM)


@triton.jit
def _chunk_loop(acc, c0, c1, ca, sa, ha, zero, count, first, xa0, xa1, STEPS: tl.constexpr, last,
                BITS: tl.constexpr, LOAD_ASM: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    """A warp's share: STEPS chunks from `first`, two a loop step, each step's products over the chunks loaded
    before (c0, c1) while the next two load; chunks past the warp's `count` are zeros, x read in bounds."""
    for ci in range(0, STEPS, 2):
        acc = _chunk_product(acc, c0, xa0, xa1, tl.minimum(first + ci, last), BITS, COMPUTE_ASM)
        c0 = _load_chunk(ca, sa, ha, ci + 2, zero + ci + 2 < count, BITS, LOAD_ASM)
        acc = _chunk_product(acc, c1, xa0, xa1, tl.minimum(first + ci + 1, last), BITS, COMPUTE_ASM)
        c1 = _load_chunk(ca, sa, ha, ci + 3, zero + ci + 3 < count, BITS, LOAD_ASM)
    return acc


@triton.jit
def _chunk_addresses(codes_ptr, scales_ptr, high_ptr, tid, pid, split, BLOCKS, CHUNKS_PER_SPLIT, G: tl.constexpr,
                     BW: tl.constexpr, KS: tl.constexpr, PAIRED: tl.constexpr, BITS: tl.constexpr):
    """This thread's share: byte addresses at its first chunk, that chunk's index and how many it sums. Warp w
    takes block w % BW of the program and the (w // BW)-th share of the split (the last split is shorter: a
    share may be empty); a warp past the last block reads the last one (valid memory), its rows are not stored.
    PAIRED (BW = 2, a gate/up pair): the program's two blocks are block pid of the first half of the rows and
    block pid of the second."""
    warp = tid // 32
    lane = tid % 32
    if PAIRED:
        block = (pid + (warp % 2) * (BLOCKS // 2)).to(tl.int64)
    else:
        block = tl.minimum(pid * BW + warp % BW, BLOCKS - 1).to(tl.int64)
    per_warp = CHUNKS_PER_SPLIT // KS
    first = split * CHUNKS_PER_SPLIT + (warp // BW) * per_warp
    count = tl.minimum(tl.maximum(G // 4 - first, 0), per_warp)
    ca = (codes_ptr + (block * G + first * 4) * 512 + lane * 16).to(tl.int64, bitcast=True)
    sa = (scales_ptr + ((block * (G // 4) + first) * 8 + lane // 4) * 8).to(tl.int64, bitcast=True)
    if BITS == 6:  # 1,024 high bytes a chunk (_chunk_load_asm)
        ha = (high_ptr + (block * (G // 4) + first) * 1024 + lane * 16).to(tl.int64, bitcast=True)
    else:
        ha = (high_ptr + (block * (G // 4) + first) * 512 + lane * 16).to(tl.int64, bitcast=True)
    return ca, sa, ha, first, count


@triton.jit
def _program_start(codes_ptr, scales_ptr, high_ptr, BLOCKS, CHUNKS_PER_SPLIT, G: tl.constexpr, BW: tl.constexpr,
                   KS: tl.constexpr, BITS: tl.constexpr, LOAD_ASM: tl.constexpr, PAIRED: tl.constexpr,
                   CS: tl.constexpr = 1):
    """A fragment-order program's ids, zeros of its shape, each thread's lane, its chunk addresses
    (_chunk_addresses) and first two chunks: weights are never written during inference, so they are fetched
    before waiting on x's writer. CS (column split): the program's warps repeat CS times, each repeat for one
    8-column tile of x, over the same chunks (their second reads are L1 hits)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    zero = tl.zeros([32 * BW * KS * CS], tl.int32)
    tid = _thread_ids(zero) % (32 * BW * KS)  # CS column tiles: their warps read the same chunks
    ca, sa, ha, first, count = _chunk_addresses(codes_ptr, scales_ptr, high_ptr, tid, pid, split, BLOCKS,
                                                CHUNKS_PER_SPLIT, G, BW, KS, PAIRED, BITS)
    c0 = _load_chunk(ca, sa, ha, 0, zero < count, BITS, LOAD_ASM)
    c1 = _load_chunk(ca, sa, ha, 1, zero + 1 < count, BITS, LOAD_ASM)
    return pid, split, zero, tid % 32, ca, sa, ha, first, count, c0, c1


@triton.jit
def _sum_share(a, BW: tl.constexpr, KS: tl.constexpr, CS: tl.constexpr):
    """One accumulator [CS * KS * 32 * BW] summed over its KS shares: [CS * 32 * BW]."""
    return tl.reshape(tl.sum(tl.reshape(a, (CS, KS, 32 * BW)), axis=1), (CS * 32 * BW,))


@triton.jit
def _sum_warp_shares(acc, BW: tl.constexpr, KS: tl.constexpr, CS: tl.constexpr = 1):
    """A program's accumulators [CS * 32 * BW * KS] with the KS warps sharing each block's K summed (Triton
    reduces across warps): [CS * 32 * BW], column tile by tile, block slot by block slot."""
    if KS > 1:
        a0, a1, a2, a3, a4, a5, a6, a7 = acc
        acc = (_sum_share(a0, BW, KS, CS), _sum_share(a1, BW, KS, CS), _sum_share(a2, BW, KS, CS),
               _sum_share(a3, BW, KS, CS), _sum_share(a4, BW, KS, CS), _sum_share(a5, BW, KS, CS),
               _sum_share(a6, BW, KS, CS), _sum_share(a7, BW, KS, CS))
    return acc


@triton.jit
def _store_program(out_ptr, acc, pid, split, T, N, BW: tl.constexpr, KS: tl.constexpr, NT: tl.constexpr,
                   CS: tl.constexpr = 1):
    """A program's accumulators stored (_store_rows): the KS warps sharing each block's K summed first (Triton
    reduces across warps), then the block's rows from the first warp of each (of each column tile: its columns 8
    further)."""
    acc = _sum_warp_shares(acc, BW, KS, CS)
    first_warps = tl.arange(0, CS * 32 * BW)
    tile, slot = first_warps // (32 * BW), first_warps % (32 * BW)
    row0 = (pid * BW + slot // 32) * 16 + (slot % 32) // 4
    _store_rows(out_ptr, acc, split, T, N, row0, slot % 4 + 4 * tile, NT)  # columns 2c + 8 * tile


@triton.jit
def _gate_times_up(a, ty: tl.constexpr):
    """silu(gate) * up from a paired program's accumulator [64] (gate block's 32 threads, then up block's): each
    rounded to ty first, as the product would store them, then the swiglu kernel's arithmetic."""
    g, u = tl.split(tl.permute(tl.reshape(a, (2, 32)), (1, 0)))
    g = g.to(ty).to(tl.float32)
    u = u.to(ty).to(tl.float32)
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_shares(acc, KS: tl.constexpr, ty: tl.constexpr):
    """A paired program's accumulators (gate block, up block; KS warps sharing K summed first) as silu(gate) * up:
    8 accumulators [32], thread t's rows 16-row block row t // 4 (+ 8), columns as _store_rows takes them."""
    a0, a1, a2, a3, a4, a5, a6, a7 = _sum_warp_shares(acc, 2, KS)
    return (_gate_times_up(a0, ty), _gate_times_up(a1, ty), _gate_times_up(a2, ty), _gate_times_up(a3, ty),
            _gate_times_up(a4, ty), _gate_times_up(a5, ty), _gate_times_up(a6, ty), _gate_times_up(a7, ty))


@triton.jit
def _store_swiglu(out_ptr, acc, pid, T, N, KS: tl.constexpr, NT: tl.constexpr):
    """A paired program's accumulators (gate block pid, up block pid) stored as silu(gate) * up (_swiglu_shares):
    rows pid * 16 .. + 15 of out [T, N] (N = the pair's rows / 2)."""
    y = _swiglu_shares(acc, KS, out_ptr.dtype.element_ty)
    threads = tl.arange(0, 32)
    _store_rows(out_ptr, y, 0, T, N, pid * 16 + threads // 4, threads % 4, NT)


@triton.jit
def _qgemm_fragment_layout_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, N, T, K, BLOCKS, CHUNKS_PER_SPLIT,
                                  G: tl.constexpr, NT: tl.constexpr, BW: tl.constexpr, KS: tl.constexpr,
                                  BITS: tl.constexpr, X_AHEAD: tl.constexpr, LOAD_ASM: tl.constexpr,
                                  COMPUTE_ASM: tl.constexpr, SWIGLU: tl.constexpr, CS: tl.constexpr = 1):
    """One program: BW 16-row blocks, one K-split of CHUNKS_PER_SPLIT 4-group chunks shared by KS warps per
    block (warp w: block w % BW, the (w // BW)-th even share of the split; the last split is shorter and some
    warps may get no chunk) and summed across them in the program; out is [T, N] (one split: y itself) or this
    split's float32 partials. X_AHEAD: each chunk's x (of the first column tile) is loaded a chunk ahead, as the code
    words are, instead of inside each group's product right before its mma. SWIGLU (BW = 2, one split): the program
    multiplies block pid of a gate/up pair's gate rows and of its up rows and stores silu(gate) * up (N: the
    output's width, half the pair's rows). CS = 2 (NT = 1, 9-16 rows): the warps repeat for x's second 8-column
    tile (the same chunks, read again from L1), so each warp multiplies one column tile."""
    pid, split, zero, lane, ca, sa, ha, first, count, c0, c1 = _program_start(
        codes_ptr, scales_ptr, high_ptr, BLOCKS, CHUNKS_PER_SPLIT, G, BW, KS, BITS, LOAD_ASM, SWIGLU, CS)
    pdl_wait()
    g, c = lane // 4, lane % 4
    g = g + 8 * (_thread_ids(zero) // (32 * BW * KS))  # x's rows of this warp's column tile
    xa0 = (x_ptr + tl.minimum(g, T - 1).to(tl.int64) * K + c * 16).to(tl.int64, bitcast=True)
    xa1 = (x_ptr + tl.minimum(g + 8, T - 1).to(tl.int64) * K + c * 16).to(tl.int64, bitcast=True)
    f = tl.zeros([32 * BW * KS * CS], tl.float32)
    acc = (f, f, f, f, f, f, f, f)
    last = G // 4 - 1
    if X_AHEAD:
        x0 = _chunk_x(xa0, tl.minimum(first, last))
        for ci in range(0, CHUNKS_PER_SPLIT // KS, 2):
            x1 = _chunk_x(xa0, tl.minimum(first + ci + 1, last))
            acc = _chunk_product_x(acc, c0, x0, xa1, tl.minimum(first + ci, last), NT, BITS, COMPUTE_ASM)
            c0 = _load_chunk(ca, sa, ha, ci + 2, zero + ci + 2 < count, BITS, LOAD_ASM)
            x0 = _chunk_x(xa0, tl.minimum(first + ci + 2, last))
            acc = _chunk_product_x(acc, c1, x1, xa1, tl.minimum(first + ci + 1, last), NT, BITS, COMPUTE_ASM)
            c1 = _load_chunk(ca, sa, ha, ci + 3, zero + ci + 3 < count, BITS, LOAD_ASM)
    else:
        acc = _chunk_loop(acc, c0, c1, ca, sa, ha, zero, count, first, xa0, xa1, CHUNKS_PER_SPLIT // KS, last, BITS,
                          LOAD_ASM, COMPUTE_ASM)
    if SWIGLU:
        _store_swiglu(out_ptr, acc, pid, T, N, KS, NT)
    else:
        _store_program(out_ptr, acc, pid, split, T, N, BW, KS, NT, CS)


# warps: per program; ksplit 0 chooses the warps sharing a block's K per product (fragment_shape); xahead N >= 1 loads
# x a chunk ahead (the kernel's X_AHEAD) from N to 8 rows, 0 never, -1 by the measured rule (loads_x_ahead); xwide 1
# loads the first column tile's x a chunk ahead at 9-16 rows too, 0 never, -1 by the measured rule; tiles 2 splits
# 9-16 rows' two 8-column tiles of x across twice the warps of a program (each then multiplies one tile, as at 8 rows;
# the second warp's chunk loads hit L1), 1 keeps both in each warp, -1 by the measured rule (splits_column_tiles).
# side-by-side runs: NINFER_FRAGMENT_TILE=hint,warps,programs[,ksplit[,xahead[,xwide[,tiles]]]]
FRAGMENT_TUNING = tuning_from_env("NINFER_FRAGMENT_TILE",
                                  ("hint", "warps", "programs", "ksplit", "xahead", "xwide", "tiles"),
                                  {"warps": 4, "programs": 528, "hint": 2, "ksplit": 0, "xahead": -1, "xwide": -1,
                                   "tiles": -1})


# Warps sharing each block's K by how a product is called, measured per product and row count (H100, session 33:
# `bench/gemv_compare.py OUT shapes`, every 27B fragment-order product at T = 1, 2, 4, 8, 16 as the engine calls it):
# a product whose 16-row blocks alone fill the GPU's warps (MLP gate_up: one split of whole-K warps) is faster with 4
# warps sharing each block's K at every T (T = 8 44.6 -> 39.6 us, T = 16 66.2 -> 63.0); one whose K-split partials
# the next norm sums (MLP down, GDN out) splits K across programs only up to 8 rows and lets 4 warps share K at 9-16
# (T = 16: down 36.2 -> 30.5, GDN out 14.5 -> 13.0); the others keep fragment_shape's loop (4 warps slower there).
# 27B, 4 lanes of batched MTP3 rounds 18.06 -> 17.02 ms, 8 lanes 10.71 -> 10.37 ms a step.
# NINFER_FRAGMENT_KS_RULE=off leaves every product to fragment_shape's loop, for side-by-side runs.
FRAGMENT_KS_RULE = setting("NINFER_FRAGMENT_KS_RULE") == "on"


def measured_warps_sharing_k(blocks: int, chunks: int, warps: int, programs: int, t: int, defer_sum: bool) -> int:
    """Warps sharing each block's K for a product of `blocks` 16-row blocks and `chunks` 4-group chunks at t rows
    (FRAGMENT_KS_RULE, see there); 0 leaves the choice to fragment_shape."""
    if chunks < 8:  # fewer than two chunks for each of 4 warps
        return 1 if defer_sum else 0
    if defer_sum:
        return 4 if t > 8 else 1
    return 4 if blocks * 2 > programs * warps else 0


def parse_warps_sharing_k(text: str) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    """NINFER_FRAGMENT_KS: warps sharing each block's K for chosen products and row counts, for side-by-side runs
    before a choice becomes a default: entries ROWSxCOLS@T=KS or ROWSxCOLS@T1-T2=KS (KS 1, 2 or 4), comma-separated,
    e.g. 34816x5120@2-8=4 (MLP gate_up of the 27B at 2-8 rows). -> {(rows, cols): [(t1, t2, ks)]}; a malformed
    entry stops with a one-line error naming the variable and the form."""
    table: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        try:
            shape, rest = entry.split("@")
            span, ks = rest.split("=")
            rows, cols = (int(v) for v in shape.lower().split("x"))
            t1, _, t2 = span.partition("-")
            t1, t2, ks = int(t1), int(t2 or t1), int(ks)
            if ks not in (1, 2, 4) or not 1 <= t1 <= t2 <= 16:
                raise ValueError
        except ValueError:
            raise SystemExit(f"ninfer: NINFER_FRAGMENT_KS entry {entry!r} is not ROWSxCOLS@T=KS or "
                             "ROWSxCOLS@T1-T2=KS (T 1-16, KS 1, 2 or 4); unset it for the defaults") from None
        table.setdefault((rows, cols), []).append((t1, t2, ks))
    return table


WARPS_SHARING_K = parse_warps_sharing_k(setting("NINFER_FRAGMENT_KS"))


def chosen_warps_sharing_k(rows: int, cols: int, t: int) -> int:
    """NINFER_FRAGMENT_KS's warps sharing K for this product at t rows, 0 where it names none."""
    return next((ks for t1, t2, ks in WARPS_SHARING_K.get((rows, cols), ()) if t1 <= t <= t2), 0)


def fragment_shape(blocks: int, chunks: int, warps: int, programs: int, ksplit: int = 0) -> tuple[int, int, int, int]:
    """(blocks per program, warps per block, splits, chunks per split). About programs x warps warps in all
    keep enough loads in flight: a product with few 16-row blocks (MLP down 5120 x 17408: 320) first lets up to 4
    warps of a program share each block's K (summed in the program, no extra launch), then splits K across
    programs (float32 partials, summed by finish_splits or the next rmsnorm). Each split is a multiple of
    2 x warps-per-block chunks (every warp's loop steps two), the last one taking what is left."""
    ks = ksplit
    if not ks:
        ks = 1
        while ks < 4 and blocks * ks * 2 <= programs * warps and chunks >= 4 * ks:
            ks *= 2
    bw = max(1, warps // ks)
    per_split = triton.cdiv(blocks, bw)
    wanted = max(1, min(programs * warps // (per_split * bw * ks), chunks // (2 * ks)))
    size = 2 * ks * triton.cdiv(chunks, 2 * ks * wanted)
    return bw, ks, triton.cdiv(chunks, size), size


def layout_shape(fp: FragmentPlanes, t: int, warps: int | None = None, programs: int | None = None,
                 ksplit: int | None = None, defer_sum: bool = False) -> tuple[int, int, int, int]:
    """fragment_shape of qgemm_fragment_layout's launch for t rows of x (benchmarks report it too): warps sharing K
    from the argument, else NINFER_FRAGMENT_TILE, else NINFER_FRAGMENT_KS for this product, else the measured rule
    (measured_warps_sharing_k); with the rule off, a product whose partials the next norm sums splits K across
    programs only (their sum costs no launch) and the rest take fragment_shape's loop."""
    warps = warps or FRAGMENT_TUNING["warps"]
    programs = programs or FRAGMENT_TUNING["programs"]
    blocks, chunks = fp.blocks, fp.groups // CHUNK
    if ksplit is None:
        ksplit = FRAGMENT_TUNING["ksplit"] or chosen_warps_sharing_k(fp.rows, fp.cols, t)
    if not ksplit and FRAGMENT_KS_RULE:
        ksplit = measured_warps_sharing_k(blocks, chunks, warps, programs, t, defer_sum)
    if not ksplit and defer_sum:
        ksplit = 1
    return fragment_shape(blocks, chunks, warps, programs, ksplit)


# x a chunk ahead (X_AHEAD), the measured rule. Nsight Compute (session 33): the kernel waits on loads, x's L1 hits
# among them, so row blocks stall more than one row; with x a chunk ahead its sm_90 SASS issues a chunk's x loads in
# the loop step before, at 104 registers for Q4 / 128 for Q5 against 91 / 96. Measured on the H100 (session 34,
# `bench/gemv_compare.py OUT shapes`, 27B products as the engine calls them): at 2-8 rows faster on every product
# (T = 8: gate_up 39.2 -> 35.4 us, qgkv 20.1 -> 16.3, GDN qkvz 20.9 -> 17.7, MLP down 23.6 -> 22.3, GDN out 9.9 ->
# 9.8; 8 lanes 10.59 -> 9.89 ms a step, 2 lanes of batched MTP3 rounds 13.04 -> 11.95 ms); at one row faster for the
# Q4 products whose two warps share K in one split (GDN qkvz 17.8 -> 16.1, qgkv 17.0 -> 14.7) and slower for the rest
# (gate_up with 4 warps sharing K 33.8 -> 36.1, the Q5 products at 128 registers: MLP down 21.9 -> 26.8). At 9-16
# rows (two mma column tiles) only the first tile's x fits ahead (Q4 153 registers against 106, Q5 145 against 139):
# faster for the Q4 product whose 4 warps share K in one split (MLP gate_up T = 12 54.6 -> 49.0 us, T = 16 63.4 ->
# 51.7), slightly slower for the others (qgkv T = 16 27.1 -> 29.1, GDN qkvz 29.3 -> 30.7, MLP down even); batched
# MTP3 rounds over 4 lanes (16 rows) 17.10 -> 16.33 ms with it on every product.
# Q5 fields products of 1-8 rows are compiled with their registers capped at 128 and load x a chunk ahead at 2-8 rows
# (ptxas: 77.4 instructions a group against 74.5 uncapped, one 8-byte spill), so as many warps fit an SM as in pair
# order. Per product on an H100 (session 45, `bench/gemv_compare.py OUT fields`, each twice alternated), µs at T = 1 /
# 2 / 4 / 8: MLP down 21.0 / 22.4 / 22.6 / 24.1 -> 20.5 / 20.8 / 20.7 / 21.1, GDN out 8.3 / 8.7 / 9.2 / 9.4 -> 7.7 /
# 8.1 / 8.6 / 9.0; at 12-16 rows the cap is slower (MLP down 31.0 -> 34.2), so those stay uncapped. 27B steps in one
# engine (bench/engine_ab.py, 3 rounds alternated): 1 / 2 / 8 lanes 7.630 / 8.051 / 10.418 -> 7.596 / 7.979 / 10.334
# ms. NINFER_FIELDS_REGS=off: uncapped, x in place.
FIELDS_REGS = {"off": 0, "128": 128}[setting("NINFER_FIELDS_REGS")]


def loads_x_ahead(t: int, xahead: int | None = None, bits: int = 4, shape: tuple[int, int, int, int] | None = None,
                  fields: bool = False) -> bool:
    """Whether a t-row product of `bits`-bit codes (`fields`: Q5 as 5-bit fields) launched in `shape`
    (layout_shape's) loads x a chunk ahead: `xahead` (else FRAGMENT_TUNING's) N >= 1 from N to 8 rows, 0 never, -1
    by the measured rule above; at 9-16 rows (the first column tile's x) by FRAGMENT_TUNING's xwide (1 always, 0
    never, -1 the rule) unless `xahead` is 0."""
    first = FRAGMENT_TUNING["xahead"] if xahead is None else xahead
    if first < 0 and bits == 6:  # Q6 with x ahead: 156 registers against 96, the head 1-3 % slower (session 35)
        return False
    if t > 8:
        wide = FRAGMENT_TUNING["xwide"]
        if first == 0 or wide == 0:
            return False
        return wide > 0 or bits == 4 and shape is not None and shape[1] == 4 and shape[2] == 1
    if first >= 0:
        return 0 < first <= t <= 8
    if fields:  # x ahead only under the register cap: uncapped it takes 140 registers against 114 in place (pair
        return FIELDS_REGS > 0 and 2 <= t <= 8  # order's 127), fewer warps an SM: MLP down at 2-8 rows 22.2 -> 25.1 us
    if t == 1:
        return bits == 4 and shape is not None and shape[1] == 2 and shape[2] == 1
    return 2 <= t <= 8


def register_cap(t: int, fields: bool) -> int:
    """The register cap a t-row product is compiled with (0: none): NINFER_FIELDS_REGS's for Q5 fields at 1-8 rows."""
    return FIELDS_REGS if fields and t <= 8 else 0


# 9-16 rows' column tiles split across twice the warps, the measured rule. H100, session 35 (`bench/gemv_compare.py
# OUT shapes`, x ahead by its rule in each warp): faster for the Q4 products whose two warps share K in one split
# (GDN qkvz T = 12 28.9 -> 26.0 us, T = 16 29.4 -> 26.9; attention qgkv 26.9 -> 24.7, 27.4 -> 25.4), slower for the
# rest (MLP gate_up T = 16 51.5 -> 66.0 against its first tile's x ahead, MLP down 30.4 -> 47.1, GDN out 13.0 ->
# 18.7): with it on every product 4 lanes of batched MTP3 rounds took 16.36 -> 20.14 ms.
def splits_column_tiles(t: int, bits: int, shape: tuple[int, int, int, int], tiles: int | None = None) -> bool:
    """Whether a t-row product of `bits`-bit codes launched in `shape` (layout_shape's) splits its two column tiles
    across twice the warps: `tiles` (else FRAGMENT_TUNING's) 2 always at 9-16 rows, 1 never, -1 the rule above."""
    tiles = FRAGMENT_TUNING["tiles"] if tiles is None else tiles
    if t <= 8 or tiles == 1:
        return False
    return tiles == 2 or bits == 4 and shape[1] == 2 and shape[2] == 1


def qgemm_fragment_layout(x: torch.Tensor, fp: FragmentPlanes, y: torch.Tensor, warps: int | None = None,
                          programs: int | None = None, hint: int | None = None, defer_sum: bool = False,
                          ksplit: int | None = None, xahead: int | None = None,
                          tiles: int | None = None, maxnreg: int | None = None) -> torch.Tensor | SplitPartials:
    """y [T, N] = x [T, K] @ W^T, W in fragment order, bf16 x with 1..16 rows (GPU only); `xahead`: x loaded a chunk
    ahead (loads_x_ahead); `tiles` (else FRAGMENT_TUNING's): 9-16 rows' two 8-column tiles of x in each warp (1),
    split across twice the warps (2: the kernel's CS; each warp then as at 8 rows, x ahead by its rule) or by the
    measured rule (-1: splits_column_tiles); `maxnreg` caps the kernel's registers (0: no cap; else
    NINFER_FIELDS_REGS's cap for fields products of 1-8 rows)."""
    t, k = x.shape
    if not 1 <= t <= 16 or x.dtype != torch.bfloat16 or k != fp.cols:
        raise ValueError(f"qgemm_fragment_layout: {t} rows of {x.dtype} with {k} columns against [{fp.rows}, "
                         f"{fp.cols}] (1-16 bf16 rows of the matrix's width)")
    x = aligned_rows(x)
    warps = warps or FRAGMENT_TUNING["warps"]
    hint = FRAGMENT_TUNING["hint"] if hint is None else hint
    bw, ks, split, size = layout_shape(fp, t, warps, programs, ksplit, defer_sum)
    cs = 2 if splits_column_tiles(t, fp.fmt.bits, (bw, ks, split, size), tiles) else 1
    nt = 1 if t <= 8 or cs == 2 else 2  # column tiles per warp
    x_ahead = loads_x_ahead(8 if cs == 2 else t, xahead, fp.fmt.bits, (bw, ks, split, size), fp.fields)
    maxnreg = register_cap(t, fp.fields) if maxnreg is None else maxnreg
    target = split_partials(y, split)
    high = fp.high if fp.high is not None else fp.codes
    grid = (triton.cdiv(fp.blocks, bw), split)
    _qgemm_fragment_layout_kernel[grid](x, fp.codes, high, fp.scales, target, fp.rows, t, k, fp.blocks, size,
                                        G=fp.groups, NT=nt, BW=bw, KS=ks, BITS=fp.fmt.bits, X_AHEAD=x_ahead,
                                        LOAD_ASM=_chunk_load_asm(fp.fmt.bits, HINTS[hint]),
                                        COMPUTE_ASM=_compute_asm(fp.fmt.bits, nt, words=True, pairs=fp.pairs,
                                                                 x_regs=x_ahead, fields=fp.fields),
                                        SWIGLU=False, CS=cs, num_warps=bw * ks * cs,
                                        **({"maxnreg": maxnreg} if maxnreg and not interpreted() else {}), **LAUNCH)
    return finish_splits(target, y, defer_sum)


# SwiGLU in the gate/up product's launch for 1-16 rows over fragment order (qgemm_fragment_swiglu): a launch less per
# MLP layer in an engine of several lanes or with speculation, the warps sharing each block's K (2 warps: 4 per
# program, the shape gate_up took at 2-16 rows before session 33). Not yet measured, so off:
# NINFER_SWIGLU_FRAGMENT=2|4 turns it on with that many warps sharing K.
SWIGLU_FRAGMENT_KS = {"off": 0, "1": 1, "2": 2, "4": 4}[setting("NINFER_SWIGLU_FRAGMENT")]


def swiglu_pair_supported(fp: FragmentPlanes) -> bool:
    """Whether a gate/up pair in fragment order splits into gate and up at a 16-row block boundary."""
    return fp.rows % 32 == 0


def qgemm_fragment_swiglu(x: torch.Tensor, fp: FragmentPlanes, y: torch.Tensor, ksplit: int | None = None,
                          hint: int | None = None, xahead: int | None = None) -> torch.Tensor:
    """y [T, I] = silu(x @ G^T) * (x @ U^T) for a gate/up pair W = [G; U] [2I, K] in fragment order, bf16 x with
    1..16 rows, in one launch: a program per 16-row block pair, `ksplit` warps sharing each block's K (GPU only;
    the numbers the product and the swiglu kernel give, bit for bit, at the same warps sharing K)."""
    t, k = x.shape
    ks = ksplit or SWIGLU_FRAGMENT_KS or 2
    if not 1 <= t <= 16 or x.dtype != torch.bfloat16 or k != fp.cols or not swiglu_pair_supported(fp) \
            or y.shape != (t, fp.rows // 2) or ks not in (1, 2, 4):
        raise ValueError(f"qgemm_fragment_swiglu: {t} rows of {x.dtype} with {k} columns into {tuple(y.shape)} against "
                         f"[{fp.rows}, {fp.cols}] (1-16 bf16 rows of the pair's width, rows a multiple of 32; 1, 2 or "
                         "4 warps sharing K)")
    x = aligned_rows(x)
    nt = 1 if t <= 8 else 2
    chunks = fp.groups // CHUNK
    size = 2 * ks * triton.cdiv(chunks, 2 * ks)  # one split: every warp's share even
    high = fp.high if fp.high is not None else fp.codes
    hint = FRAGMENT_TUNING["hint"] if hint is None else hint
    x_ahead = loads_x_ahead(t, xahead, fp.fmt.bits, (2, ks, 1, size), fp.fields)
    _qgemm_fragment_layout_kernel[(fp.blocks // 2, 1)](
        x, fp.codes, high, fp.scales, y, fp.rows // 2, t, k, fp.blocks, size, G=fp.groups, NT=nt, BW=2, KS=ks,
        BITS=fp.fmt.bits, X_AHEAD=x_ahead, LOAD_ASM=_chunk_load_asm(fp.fmt.bits, HINTS[hint]),
        COMPUTE_ASM=_compute_asm(fp.fmt.bits, nt, words=True, pairs=fp.pairs, x_regs=x_ahead,
                                 fields=fp.fields), SWIGLU=True,
        num_warps=2 * ks, **LAUNCH)
    return y
