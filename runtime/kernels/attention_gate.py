"""The attention block's output gate: o * sigmoid(gate), with the H64 un-rotation of rotated-value
codecs folded in, in one launch (it was a gate copy, an optional float copy + matmul, a sigmoid and a
product per attention layer per step).

Qwen3.5's query projection interleaves per head [query (D) | gate (D)]; the kernel reads the gate
where the projection left it.
"""

from __future__ import annotations

import copy

import torch
import triton
import triton.language as tl

from runtime.kv.hadamard import hadamard_on_device, rotate_groups

from . import torch_path
from .hadamard import rotate_group64
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, producer_words, write_quantized_x


@triton.jit
def _gate_kernel(o_ptr, qg_ptr, h_ptr, y_ptr, xq_ptr, HEADS, GROUPS, qg_stride, D: tl.constexpr, ROTATE: tl.constexpr,
                 BLOCK_G: tl.constexpr, QUANT: tl.constexpr, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr,
                 QBITS: tl.constexpr, GROUP: tl.constexpr):
    """BLOCK_G (token, head, 64-lane group)s per program: one when rotating or writing dp4a words
    (decode), several for an unrotated prefill chunk's ~200K groups."""
    pdl_wait()
    group = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
    ok = (group < GROUPS)[:, None]
    G: tl.constexpr = D // 64
    token_head = group // G
    sub = group % G
    token = token_head // HEADS
    head = token_head % HEADS
    i = tl.arange(0, 64)
    o = tl.load(o_ptr + group[:, None] * 64 + i[None, :], mask=ok, other=0.0).to(tl.float32)
    if ROTATE:  # (one group per program)
        o = tl.reshape(rotate_group64(tl.reshape(o, (64,)), h_ptr), (1, 64))
    g = tl.load(qg_ptr + (token * qg_stride + head * (2 * D) + D + sub * 64)[:, None] + i[None, :], mask=ok,
                other=0.0).to(tl.float32)
    y = (o * tl.sigmoid(g)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + group[:, None] * 64 + i[None, :], y, mask=ok)
    if QUANT:  # (one group per program) these 64 lanes of the token's row, as the output projection would quantize them
        one = tl.program_id(0).to(tl.int64)
        write_quantized_x(xq_ptr + (one // G // HEADS) * ROW_INTS, tl.reshape(y.to(tl.float32), (64,)),
                          ((one // G) % HEADS * G + one % G) * 64, K_PAD, QBITS, GROUP, 64)


class AttentionGate:
    """The output gate of an attention block's n rows, to be applied where their attention is combined: the
    paged-attention combine launch takes it (`part(row0)` for rows from row0 on: a prefill chunk's and its
    riders' rows come from two attention calls) and writes the gated rows, and their dp4a words when it can;
    an attention call that does not combine splits (a prefill chunk) gates its rows with attention_gate.
    `finish()` returns the gated rows [n, heads * D] (filling the words if some part could not)."""

    def __init__(self, qg: torch.Tensor, rotate: bool, heads: int, head_dim: int, dtype: torch.dtype,
                 xq: QuantizedX | None = None):
        n = qg.shape[0]
        if head_dim % 64 or qg.stride(-1) != 1 or qg.shape[-1] != heads * 2 * head_dim:
            raise ValueError(f"attention gate: head size {head_dim} / projection layout {tuple(qg.shape)} not "
                             "supported")
        self.qg, self.rotate, self.xq, self.row0 = qg, rotate, xq, 0
        self.y = torch.empty(n, heads * head_dim, dtype=dtype, device=qg.device)
        self.fused, self.words, self.quant = producer_words(xq, self.y, n, heads * head_dim, 64, heads * head_dim)
        self.hadamard = hadamard_on_device(64, str(qg.device)) if not torch_path(qg) else self.y
        self.words_missing = xq is not None and not self.fused

    def part(self, row0: int) -> "AttentionGate":
        """The gate of the rows from row0 on (the decode rows riding after a prefill chunk's): the same buffers."""
        other = copy.copy(self)
        other.row0, other.parent = row0, self
        return other

    def apply(self, o: torch.Tensor) -> torch.Tensor:
        """Gate attention rows o [rows, heads, D] (this part's) with attention_gate; their words are left to
        finish()."""
        rows = o.shape[0] * o.shape[1] if o.dim() == 4 else o.shape[0]
        heads, d = o.shape[-2], o.shape[-1]
        attention_gate(o.reshape(rows, heads, d), self.qg[self.row0 : self.row0 + rows], self.rotate,
                       out=self.y[self.row0 : self.row0 + rows])
        getattr(self, "parent", self).words_missing = self.xq is not None
        return self.y[self.row0 : self.row0 + rows]

    def finish(self) -> torch.Tensor:
        if self.words_missing:
            self.xq.fill(self.y)
        return self.y


def attention_gate(o: torch.Tensor, qg: torch.Tensor, rotate: bool, xq: QuantizedX | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """o [n, heads, D] attention output (in the value storage basis when `rotate`); qg [n, heads * 2D]
    projection rows (unit stride inside a row). Returns [n, heads * D] in o's dtype (in `out` when given); with
    `xq`, also those rows as dp4a words for the output projection."""
    n, heads, d = o.shape
    if d % 64 or qg.stride(-1) != 1 or qg.shape[-1] != heads * 2 * d:
        raise ValueError(f"attention_gate: head size {d} / projection layout {tuple(qg.shape)} not supported")
    if torch_path(o):
        y = attention_gate_reference(o, qg, rotate)
        if out is not None:
            y = out.copy_(y)
        if xq is not None:
            xq.fill(y)
        return y
    o = o.contiguous()
    y = out if out is not None and out.is_contiguous() else torch.empty(n, heads * d, dtype=o.dtype, device=o.device)
    fused, words, quant = producer_words(xq, y, n, heads * d, 64, heads * d)
    groups = n * heads * (d // 64)
    block_g = 1 if rotate or quant["QUANT"] or groups < 1024 else 16
    if n:
        _gate_kernel[(triton.cdiv(groups, block_g),)](o, qg, hadamard_on_device(64, str(o.device)), y, words, heads,
                                                      groups, qg.stride(0), D=d, ROTATE=rotate, BLOCK_G=block_g, **quant,
                                                      num_warps=2, **LAUNCH)
    if xq is not None and not fused:
        xq.fill(y)
    if out is not None and y is not out:
        y = out.copy_(y)
    return y


def attention_gate_reference(o: torch.Tensor, qg: torch.Tensor, rotate: bool) -> torch.Tensor:
    n, heads, d = o.shape
    gate = qg.reshape(n, heads, 2 * d)[..., d:].float()
    of = rotate_groups(o.float()) if rotate else o.float()
    return (of * torch.sigmoid(gate)).reshape(n, heads * d).to(o.dtype)
