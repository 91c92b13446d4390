"""Where a forward's K/V rows go, computed once per forward: each row's page (its lane's block table at position //
PAGE) and slot (position % PAGE), with the lanes' block tables and context lengths gathered for the attention. One
launch where torch took six small kernels a step (the rows' lanes, the division, a cast, the table lookup, the
remainder, the gathers), none of which takes part in programmatic dependent launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait

# False: torch's indexing as before session 47 (side-by-side runs, bench/engine_ab.py
# runtime.kernels.kv_slots.ONE_LAUNCH:False; read at call time). Side by side on an H100 (session 48, one lane):
# 35B-A3B 2.071 against 2.080 ms a step with torch's indexing (0.4 %); with both back on torch the 27B 7.032 against
# 7.072 (0.6 %).
ONE_LAUNCH = True
BLOCK_ROWS = 128
BLOCK_PAGES = 1024


@triton.jit
def _kv_slots_kernel(lanes_ptr, pos_ptr, table_ptr, ctx_ptr, page_ptr, slot_ptr, tables_ptr, lane_ctx_ptr, T, PAGES,
                     table_stride, PAGE: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_PAGES: tl.constexpr):
    pdl_wait()  # the lanes, positions and lengths may come from the kernels before
    b = tl.program_id(0)
    lane = tl.load(lanes_ptr + b).to(tl.int64)
    table = table_ptr + lane * table_stride
    for r0 in range(0, T, BLOCK_ROWS):
        rows = r0 + tl.arange(0, BLOCK_ROWS)
        ok = rows < T
        pos = tl.load(pos_ptr + b * T + rows, mask=ok, other=0)
        tl.store(page_ptr + b * T + rows, tl.load(table + pos // PAGE, mask=ok, other=0), mask=ok)
        tl.store(slot_ptr + b * T + rows, pos % PAGE, mask=ok)
    for p0 in range(0, PAGES, BLOCK_PAGES):
        pages = p0 + tl.arange(0, BLOCK_PAGES)
        ok = pages < PAGES
        tl.store(tables_ptr + b * PAGES + pages, tl.load(table + pages, mask=ok, other=0), mask=ok)
    tl.store(lane_ctx_ptr + b, tl.load(ctx_ptr + lane))


def kv_slots(block_table: torch.Tensor, ctx_len: torch.Tensor, lanes_idx: torch.Tensor, t: int,
             positions: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions [B * t] (lane-major, non-negative) of lanes `lanes_idx` [B] -> (page [B * t], slot [B * t], the
    lanes' block tables [B, pages], their context lengths [B]), in the dtypes torch's indexing gives."""
    if torch_path(positions) or not ONE_LAUNCH:
        return kv_slots_reference(block_table, ctx_len, lanes_idx, t, positions, page_size)
    b, pages = lanes_idx.shape[0], block_table.shape[1]
    if positions.numel() != b * t or block_table.stride(1) != 1:
        raise ValueError(f"kv_slots: {positions.numel()} positions for {b} lanes of {t} rows")
    positions, lanes_idx = positions.contiguous(), lanes_idx.contiguous()  # no copies where they already are
    page = torch.empty(b * t, dtype=block_table.dtype, device=positions.device)
    slot = torch.empty(b * t, dtype=positions.dtype, device=positions.device)
    tables = torch.empty(b, pages, dtype=block_table.dtype, device=positions.device)
    lane_ctx = torch.empty(b, dtype=ctx_len.dtype, device=positions.device)
    if b:
        _kv_slots_kernel[(b,)](lanes_idx, positions, block_table, ctx_len, page, slot, tables, lane_ctx, t, pages,
                               block_table.stride(0), PAGE=page_size, BLOCK_ROWS=BLOCK_ROWS, BLOCK_PAGES=BLOCK_PAGES,
                               **LAUNCH)
    return page, slot, tables, lane_ctx


def kv_slots_reference(block_table, ctx_len, lanes_idx, t, positions, page_size):
    lane_of_row = lanes_idx.repeat_interleave(t)
    page = block_table[lane_of_row, (positions // page_size).long()]
    return page, positions % page_size, block_table[lanes_idx], ctx_len[lanes_idx]
