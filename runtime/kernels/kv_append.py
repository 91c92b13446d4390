"""Encode new K or V vectors into their KV-cache planes and write them at (page, slot) in one launch.

One program per (token, kv head) vector. The integer sub-codecs of specs/kv-codecs.md (bf16, int8g64,
int4g64, int4g64e8) are encoded here with the reference's exact arithmetic: correctly rounded
divisions, round-half-to-even, the same E8 nearest-point rule; given the same (already rotated)
input they write the reference encoder's bytes. e8cube (rk2v4-e8's keys) follows the reference's rule;
its group scale comes from a sum of squares, whose summation order can move a scale by one f16 step,
so its bytes match the reference almost always and its decoded vectors always closely. The other
sub-codecs (fp8row, nvfp4) keep the torch encoder (`SUPPORTED` says which). Without this kernel each
attention layer paid ~40 small torch launches for the E8 rounding, nibble packing and scattered plane
writes per decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from runtime.kv.e8 import E8CUBE_SCALE_PER_RMS

from . import torch_path
from .launch import LAUNCH, pdl_wait

KIND_IDS = {"bf16": 0, "int8g64": 1, "int4g64": 2, "int4g64e8": 3, "e8cube": 4}
SUPPORTED = frozenset(KIND_IDS)
E8CUBE_QMAX = tl.constexpr(1.0 / E8CUBE_SCALE_PER_RMS)  # scale = f16(rms / qmax), as the reference computes it
RINT_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds |x| < 2^22 to nearest-even


@triton.jit
def _rint(x):
    return (x + RINT_MAGIC) - RINT_MAGIC


@triton.jit
def _group_scale(amax, QMAX: tl.constexpr):
    """f16(amax / qmax) with the 2^-24 rescue, and 1 / scale (0 for an all-zero group), as the spec says."""
    s = tl.math.div_rn(amax, QMAX).to(tl.float16).to(tl.float32)
    s = tl.where((s == 0.0) & (amax > 0.0), 5.960464477539063e-08, s)
    inv = tl.where(s > 0.0, tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), tl.maximum(s, 1e-30)), 0.0)
    return s, inv


@triton.jit
def _nearest_d8(xe, xo):
    """Nearest D8 point of 8-vectors given as even/odd halves [R, 4]: round every coordinate; on an
    odd sum move the coordinate with the largest rounding error (first on ties) one step towards x."""
    fe = _rint(xe)
    fo = _rint(xo)
    total = tl.sum(fe, axis=1) + tl.sum(fo, axis=1)
    odd = (total.to(tl.int32) & 1) != 0
    ee = xe - fe
    eo = xo - fo
    worst_err = tl.maximum(tl.max(tl.abs(ee), axis=1), tl.max(tl.abs(eo), axis=1))
    j = tl.arange(0, 4)
    pos_e = 2 * j[None, :]
    pos_o = 2 * j[None, :] + 1
    first = tl.minimum(tl.min(tl.where(tl.abs(ee) == worst_err[:, None], pos_e, 8), axis=1),
                       tl.min(tl.where(tl.abs(eo) == worst_err[:, None], pos_o, 8), axis=1))
    err_at = tl.sum(tl.where(pos_e == first[:, None], ee, 0.0), axis=1) + \
        tl.sum(tl.where(pos_o == first[:, None], eo, 0.0), axis=1)
    step = tl.where(err_at >= 0.0, 1.0, -1.0)
    move = odd[:, None]
    fe = fe + tl.where(move & (pos_e == first[:, None]), step[:, None], 0.0)
    fo = fo + tl.where(move & (pos_o == first[:, None]), step[:, None], 0.0)
    return fe, fo


@triton.jit
def _e8_round(ye, yo):
    """Nearest E8 point (D8 or D8 + 1/2, the nearer; D8 on ties), then rounded to integers again."""
    ae, ao = _nearest_d8(ye, yo)
    be, bo = _nearest_d8(ye - 0.5, yo - 0.5)
    be = be + 0.5
    bo = bo + 0.5
    da = tl.sum((ye - ae) * (ye - ae), axis=1) + tl.sum((yo - ao) * (yo - ao), axis=1)
    db = tl.sum((ye - be) * (ye - be), axis=1) + tl.sum((yo - bo) * (yo - bo), axis=1)
    pick_b = (db < da)[:, None]
    return _rint(tl.where(pick_b, be, ae)), _rint(tl.where(pick_b, bo, ao))


@triton.jit
def _e8cube_shift(y, SHIFT: tl.constexpr, SHIFT_BIT: tl.constexpr):
    """Nearest codebook point with shift SHIFT (spec §4.2 steps 1-2) for rows y [R, 8]:
    (squared error, magnitude byte, sign-and-shift byte)."""
    z = y - SHIFT
    m = tl.abs(z)
    big = m > 1.0
    level = tl.where(big, 1.5, 0.5)
    neg = z < 0.0
    err = (m - level) * (m - level)
    flip_cost = 4.0 * m * level
    other = 2.0 - level
    toggle_cost = (m - other) * (m - other) - err
    cost = tl.minimum(flip_cost, toggle_cost)
    i = tl.arange(0, 8)
    least = tl.min(cost, axis=1)
    at = tl.min(tl.where(cost == least[:, None], i[None, :], 8), axis=1)  # first coordinate of least cost
    mismatch = ((tl.sum(neg.to(tl.int32), axis=1) + tl.sum(big.to(tl.int32), axis=1)) & 1) != 0
    fix = mismatch[:, None] & (i[None, :] == at[:, None])
    by_flip = fix & (flip_cost <= toggle_cost)
    neg = neg ^ by_flip
    big = big ^ (fix & ~by_flip)
    total = tl.sum(err, axis=1) + tl.where(mismatch, least, 0.0)
    mag_byte = tl.sum(big.to(tl.int32) << i[None, :], axis=1)
    sign_byte = tl.sum((neg & (i[None, :] < 7)).to(tl.int32) << i[None, :], axis=1) | (SHIFT_BIT << 7)
    return total, mag_byte, sign_byte


@triton.jit
def _kv_append_kernel(x_ptr, page_ptr, slot_ptr, p0, p1, HKV, D: tl.constexpr, KIND: tl.constexpr,
                      W0: tl.constexpr, W1: tl.constexpr):
    pdl_wait()
    vec = tl.program_id(0)  # token * HKV + head
    token = vec // HKV
    head = vec % HKV
    page = tl.load(page_ptr + token).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    append_vector(x_ptr + vec.to(tl.int64) * D, (page * 64 + slot) * HKV + head, p0, p1, D, KIND, W0, W1)


@triton.jit
def append_vector(x_row, row, p0, p1, D: tl.constexpr, KIND: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr):
    """Encode the vector at x_row (D elements, any float dtype) into pool row `row` of planes p0 (codes or
    data) and p1 (scales)."""
    G: tl.constexpr = D // 64
    g = tl.arange(0, G)
    if KIND == 0:
        d = tl.arange(0, D)
        tl.store(p0 + row * W0 + d, tl.load(x_row + d).to(tl.bfloat16))
    elif KIND == 1:
        j = tl.arange(0, 64)
        x = tl.load(x_row + g[:, None] * 64 + j[None, :]).to(tl.float32)
        s, inv = _group_scale(tl.max(tl.abs(x), axis=1), 127.0)
        q = tl.minimum(tl.maximum(_rint(x * inv[:, None]), -127.0), 127.0)
        tl.store(p0 + row * W0 + g[:, None] * 64 + j[None, :], q.to(tl.int8))
        tl.store(p1 + row * W1 + g, s.to(tl.float16))
    elif KIND == 4:
        j = tl.arange(0, 64)
        x = tl.load(x_row + g[:, None] * 64 + j[None, :]).to(tl.float32)
        rms = tl.sqrt_rn(tl.sum(x * x, axis=1) / 64.0)
        s, inv = _group_scale(rms, E8CUBE_QMAX)
        y = tl.reshape(x * inv[:, None], (G * 8, 8))
        err_p, mag_p, sign_p = _e8cube_shift(y, 0.25, 0)
        err_m, mag_m, sign_m = _e8cube_shift(y, -0.25, 1)
        take_m = err_m < err_p  # ties keep +1/4
        sv = tl.arange(0, G * 8)
        tl.store(p0 + row * W0 + 2 * sv, tl.where(take_m, mag_m, mag_p).to(tl.uint8))
        tl.store(p0 + row * W0 + 2 * sv + 1, tl.where(take_m, sign_m, sign_p).to(tl.uint8))
        tl.store(p1 + row * W1 + g, s.to(tl.float16))
    else:
        j = tl.arange(0, 32)
        xe = tl.load(x_row + g[:, None] * 64 + 2 * j[None, :]).to(tl.float32)
        xo = tl.load(x_row + g[:, None] * 64 + 2 * j[None, :] + 1).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1))
        s, inv = _group_scale(amax, 7.0)
        ye = xe * inv[:, None]
        yo = xo * inv[:, None]
        if KIND == 3:  # sub-vectors of 8 = 4 even + 4 odd elements
            ye, yo = _e8_round(tl.reshape(ye, (G * 8, 4)), tl.reshape(yo, (G * 8, 4)))
            ye = tl.reshape(ye, (G, 32))
            yo = tl.reshape(yo, (G, 32))
        qe = tl.minimum(tl.maximum(_rint(ye), -7.0), 7.0).to(tl.int32)
        qo = tl.minimum(tl.maximum(_rint(yo), -7.0), 7.0).to(tl.int32)
        byte = (qe & 0xF) | ((qo & 0xF) << 4)
        tl.store(p0 + row * W0 + g[:, None] * 32 + j[None, :], byte.to(tl.uint8))
        tl.store(p1 + row * W1 + g, s.to(tl.float16))


def kv_append(x: torch.Tensor, kind: str, planes: list[torch.Tensor], page: torch.Tensor, slot: torch.Tensor) -> None:
    """x [n, HKV, D] (rotated already when the codec rotates); planes of one side ([pages, 64, HKV, W]);
    page, slot [n] int: where token i goes. Writes the encoded vectors in place."""
    if torch_path(x):
        return kv_append_reference(x, kind, planes, page, slot)
    n, hkv, d = x.shape
    p0, p1 = planes[0], planes[-1]
    _kv_append_kernel[(n * hkv,)](x.contiguous(), page, slot, p0, p1, hkv, D=d, KIND=KIND_IDS[kind],
                                  W0=p0.shape[-1], W1=p1.shape[-1], num_warps=1 if d <= 64 else 2, **LAUNCH)


def kv_append_reference(x: torch.Tensor, kind: str, planes: list[torch.Tensor], page: torch.Tensor,
                        slot: torch.Tensor) -> None:
    """The reference sub-codec encoder, scattered into the planes."""
    from runtime.kv.codecs import encode_sub_codec

    for plane, value in zip(planes, encode_sub_codec(kind, x.float()).values()):
        plane[page.long(), slot.long()] = value.view(plane.dtype) if value.dtype != plane.dtype else value


def append_keys_values(k: torch.Tensor, v: torch.Tensor, codec, k_planes: list[torch.Tensor],
                       v_planes: list[torch.Tensor], page: torch.Tensor, slot: torch.Tensor) -> None:
    """K and V [n, HKV, D] into their planes at (page, slot), each side H64-rotated first (float32) where the codec
    stores it rotated: a launch per rotation and side (attention_inputs folds them into its own)."""
    from .hadamard import rotate64

    for x, kind, rotate, planes in ((k, codec.key, codec.rotate_keys, k_planes),
                                    (v, codec.value, codec.rotate_values, v_planes)):
        kv_append(rotate64(x, torch.float32) if rotate else x, kind, planes, page, slot)
