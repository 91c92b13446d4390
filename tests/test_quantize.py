"""Grouped encoders: numpy reference vs torch fast path (bit for bit), packing, round-trip bounds."""

import numpy as np
import pytest
import torch

from format.layouts import RowSplitGeometry, encoded_size, pack_row_split
from format.numeric import FORMATS, GroupedFormat
from format.quantize import dequantize, quantize_reference, quantize_torch
from format.errors import QuantizationError

GROUPED = [f for f in FORMATS.values() if isinstance(f, GroupedFormat)]
IDS = [f.name for f in GROUPED]


def _awkward(rows, cols, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * rng.choice([1e-3, 1.0, 40.0], size=(rows, 1))
    x[0, :] = 0.0  # all-zero row: scale +0
    if cols > 3:
        x[1, :3] = [1e-9, -2e-9, 3e-9]  # tiny group, exercises the 0x0001 rescue
        x[1, 3:] = 0
    if cols >= 4:
        x[-1, :4] = [3.5, -3.5, 0.5, 7.0]  # exact ties under a scale of 1
    return x


@pytest.mark.parametrize("fmt", GROUPED, ids=IDS)
@pytest.mark.parametrize("shape", [(3, 1), (5, 63), (4, 64), (7, 129), (2, 300)])
def test_torch_matches_reference_bit_for_bit(fmt, shape):
    x = _awkward(*shape, seed=42)
    codes_np, bits_np = quantize_reference(x, fmt)
    codes_t, bits_t = quantize_torch(torch.from_numpy(x), fmt)
    assert np.array_equal(codes_np, codes_t.numpy())
    assert np.array_equal(bits_np, bits_t.numpy().view(np.uint16))


@pytest.mark.parametrize("fmt", GROUPED, ids=IDS)
def test_round_trip_within_bound(fmt):
    x = _awkward(9, 200, seed=7)
    codes, bits = quantize_reference(x, fmt)
    planes = pack_row_split(codes, bits, fmt)
    w = dequantize(*planes, rows=9, cols=200, fmt=fmt)
    s = bits.view(np.float16).astype(np.float32)
    k_pad = codes.shape[1]
    padded = np.zeros((9, k_pad), np.float32)
    padded[:, :200] = x
    amax = np.abs(padded.reshape(9, -1, fmt.group_size)).max(-1)
    bound = 0.5 * s + np.maximum(0, amax - fmt.qmax * s)
    err = np.abs(w - x).reshape(9, -1)
    per_group = np.repeat(bound, fmt.group_size, axis=1)[:, :200] * (1 + 1e-6)
    assert (err <= per_group).all()
    assert (bits[0] == 0).all() and (codes[0] == 0).all()
    assert bits[1, 0] == 0x0001  # rescued subnormal scale


@pytest.mark.parametrize("fmt", GROUPED, ids=IDS)
def test_padding_codes_zero_and_padding_groups_zero_scale(fmt):
    x = np.ones((2, 65), np.float32)
    codes, bits = quantize_reference(x, fmt)
    assert codes.shape == (2, 128)
    assert (codes[:, 65:] == 0).all()
    full_pad_groups = [g for g in range(128 // fmt.group_size) if g * fmt.group_size >= 65]
    assert all((bits[:, g] == 0).all() for g in full_pad_groups)


def test_known_answer_packing():
    q4 = FORMATS["Q4G64_F16S"]
    codes = np.zeros((1, 128), np.int8)
    codes[0, :4] = [-8, 7, -1, 1]
    base, high, scale = pack_row_split(codes, np.array([[0x3C00, 0]], np.uint16), q4)
    assert base[:2] == bytes([0x78, 0x1F]) and high == b"" and scale == bytes([0x00, 0x3C, 0, 0])
    q6 = FORMATS["Q6G64_F16S"]
    codes = np.zeros((1, 128), np.int8)
    codes[0, :4] = [-32, 31, 16, -17]  # u = 0x20, 0x1F, 0x10, 0x2F -> high bits 10, 01, 01, 10
    _, high, _ = pack_row_split(codes, np.zeros((1, 2), np.uint16), q6)
    assert high[0] == 0b10_01_01_10
    q5 = FORMATS["Q5G64_F16S"]
    codes = np.zeros((1, 128), np.int8)
    codes[0, :8] = [-16, 0, 15, -1, 0, 0, 0, -16]  # high bit set for negative codes
    _, high, _ = pack_row_split(codes, np.zeros((1, 2), np.uint16), q5)
    assert high[0] == 0b1000_1001


def test_worked_sizes_from_the_spec():
    assert encoded_size("Q5G64_F16S", [2, 130]) == 528
    assert encoded_size("Q4G64_F16S", [7168, 5120]) == 19_496_960
    assert encoded_size("W8G32_F16S", [5120, 25600]) == 139_264_000
    assert RowSplitGeometry(3, 5, FORMATS["Q6G64_F16S"]).total_bytes == encoded_size("Q6G64_F16S", [3, 5])


def test_w8_never_emits_minus_128():
    x = np.full((1, 32), -1.0, np.float32)
    x[0, 0] = 1.0
    codes, _ = quantize_reference(x, "W8G32_F16S")
    assert codes.min() >= -127


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_input_rejected(bad):
    x = np.ones((1, 8), np.float32)
    x[0, 3] = bad
    with pytest.raises(QuantizationError, match="NaN or infinity"):
        quantize_reference(x, "Q4G64_F16S")
    with pytest.raises(QuantizationError, match="NaN or infinity"):
        quantize_torch(torch.from_numpy(x), "Q4G64_F16S")


def test_scale_overflow_rejected():
    with pytest.raises(QuantizationError, match="overflows binary16"):
        quantize_reference(np.full((1, 4), 1e9, np.float32), "Q4G64_F16S")


@pytest.mark.parametrize("fmt", GROUPED, ids=IDS)
def test_torch_dequant_matches_numpy_reference(fmt):
    from runtime.dequant import unpack_codes

    x = _awkward(6, 150, seed=3)
    codes, bits = quantize_reference(x, fmt)
    base, high, scale = pack_row_split(codes, bits, fmt)
    ref = dequantize(base, high, scale, 6, 150, fmt)
    u8 = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    got = unpack_codes(u8(base), u8(high) if high else None, 6, 256, fmt)
    s = torch.from_numpy(bits.astype(np.int16)).view(torch.float16).float()
    w = (got.view(6, -1, fmt.group_size).float() * s[:, :, None]).view(6, 256)[:, :150]
    assert np.array_equal(w.numpy(), ref)
