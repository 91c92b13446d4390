"""KV codecs: byte sizes agree with specs/kv-codecs.md, round trips are exact where they must be,
quality floors hold, and the E8 tables are what the spec says."""

import itertools

import pytest
import torch

from runtime.kv.codecs import CODECS, get_codec
from runtime.kv.e8 import e8_lattice_round, e8cube_decode, e8cube_encode
from runtime.kv.hadamard import hadamard_matrix, rotate_groups
from runtime.kv.quality import codec_quality, gaussian_key_cosine

from .spec_tables import SPECS, table_rows

SPEC = (SPECS / "kv-codecs.md").read_text()


def _registry_rows():
    return table_rows(SPEC, "| `--kv-dtype`")


def test_spec_registry_matches_code():
    rows = _registry_rows()
    assert [r[0] for r in rows] == list(CODECS)
    for name, key, value, rotation, nbytes, _ in rows:
        c = CODECS[name]
        assert (c.key, c.value) == (key, value)
        assert c.rotate_keys == c.rotate_values == (rotation != "none")
        assert c.bytes_per_token_head(256) == int(nbytes)


@pytest.mark.parametrize("name", list(CODECS))
def test_planes_have_declared_shapes_and_decode_is_finite(name):
    c = CODECS[name]
    k, v = torch.randn(5, 3, 128) * 3, torch.randn(5, 3, 128)
    k[0, 0] = 0  # an all-zero vector must survive every codec
    planes = c.encode(k, v)
    declared = {p.name: p for p in c.planes(128)}
    assert set(planes) == set(declared)
    for n, t in planes.items():
        assert t.dtype == declared[n].dtype and t.shape == (5, 3, declared[n].width), n
    kk, vv = c.decode_keys(planes), c.decode_values(planes)
    assert torch.isfinite(kk).all() and torch.isfinite(vv).all()
    assert (c.finish_output(kk)[0, 0] == 0).all() if c.rotate_keys else (kk[0, 0] == 0).all()


def test_int8_and_bf16_exactness():
    k = torch.randn(4, 2, 64).bfloat16().float()
    assert torch.equal(CODECS["bf16"].decode_keys(CODECS["bf16"].encode(k, k)), k)
    x = torch.arange(-127, 128, dtype=torch.float32)[:64].repeat(2, 1) / 127 * 3.0  # exact multiples
    p = CODECS["int8"].encode(x, x)
    assert torch.allclose(CODECS["int8"].decode_keys(p), x, rtol=1e-3, atol=1e-3)


def test_hadamard_is_orthogonal_and_self_inverse():
    h = hadamard_matrix(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6)
    x = torch.randn(3, 256)
    assert torch.allclose(rotate_groups(rotate_groups(x)), x, atol=1e-5)


def test_rotation_preserves_scores():
    c = CODECS["rk8v4"]
    q, k = torch.randn(2, 256), torch.randn(2, 256)
    assert torch.allclose(c.prepare_queries(q) @ rotate_groups(k).t(), q @ k.t(), atol=1e-4)


def _e8cube_codebook() -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.stack([torch.arange(256).repeat_interleave(256), torch.arange(256).repeat(256)], -1).to(torch.uint8)
    return codes, e8cube_decode(codes)


def test_e8cube_points_are_the_shifted_e8_points_of_the_cube():
    codes, points = _e8cube_codebook()
    shift = torch.where(codes[:, 1] >= 128, -0.25, 0.25)[:, None]
    e8 = points - shift
    assert torch.equal(e8 - 0.5, torch.round(e8 - 0.5)) and (e8.abs() <= 1.5).all()  # {±½, ±3/2}^8
    assert (e8.sum(-1) % 2 == 0).all()  # even coordinate sum: in E8
    assert len({tuple(p.tolist()) for p in points}) == 65536  # every code names its own point
    assert points[0].tolist() == [0.75] * 8 and points[1].tolist() == [-0.25] + [0.75] * 6 + [-0.25]
    assert torch.equal(codes[256 * 3 + 128], torch.tensor([3, 128], dtype=torch.uint8))
    assert e8cube_decode(torch.tensor([3, 128], dtype=torch.uint8)).tolist() == [1.25, 1.25] + [0.25] * 6


def test_e8cube_encoder_finds_the_nearest_codebook_point():
    _, points = _e8cube_codebook()
    g = torch.Generator().manual_seed(7)
    y = torch.cat([torch.randn(300, 8, generator=g) * sd for sd in (0.3, 1.0, 2.5)])
    y[0] = 0  # an all-zero 8-vector: ties between the shifts
    y[1] = torch.tensor([1.0, -1.0, 0.25, -0.25, 1.25, 0.0, 2.0, -0.75])  # magnitude and shift ties
    got = ((e8cube_decode(e8cube_encode(y)) - y) ** 2).sum(-1)
    best = torch.cdist(y, points).pow(2).min(-1).values
    assert (got <= best + 1e-4).all(), (got - best).max()


def test_e8cube_codebook_points_encode_to_themselves():
    codes, points = _e8cube_codebook()
    assert torch.equal(e8cube_encode(points), codes)


def test_e8_nearest_point_is_in_e8_and_nearest():
    from runtime.kv.e8 import _nearest_d8

    x = torch.randn(2000, 8) * 3

    d8 = _nearest_d8(x)
    assert (d8.sum(-1) % 2 == 0).all()
    # brute force against all D8 points near the rounded vector for a few samples
    for row in x[:50]:
        base = torch.floor(row)
        best = min(((row - (base + torch.tensor(bits, dtype=torch.float32))) ** 2).sum().item()
                   for bits in itertools.product((0, 1), repeat=8)
                   if int((base + torch.tensor(bits, dtype=torch.float32)).sum()) % 2 == 0)
        got = ((row - _nearest_d8(row[None])[0]) ** 2).sum().item()
        assert got <= best + 1e-5
    q = e8_lattice_round(x)
    assert torch.equal(q, torch.round(q))


# Floors: our measured levels on the real-shaped data (specs/kv-codecs.md §5), a little under them.
FLOORS = {"int8": (0.9999, 0.9995), "fp8": (0.9995, 0.997), "nvfp4": (0.995, 0.96), "k8v4": (0.9995, 0.99),
          "rk8v4": (0.9999, 0.99), "rk4v4": (0.994, 0.985), "rk4v4-e8": (0.98678, 0.98), "rk2v4-e8": (0.952, 0.93)}


@pytest.mark.parametrize("name", list(FLOORS))
def test_quality_floors(name):
    r = codec_quality(name, tokens=512, heads=2)
    key_floor, out_floor = FLOORS[name]
    assert r["key_tile_cosine"] >= key_floor and r["attention_output_cosine"] >= out_floor, r


def test_gaussian_key_cosines_match_upstreams_benchmark():
    """Upstream's codec micro-benchmark (Gaussian keys): rk4v4-e8 98.678 %. Its 96.155 % "2-bit" figure is
    a 4-bit-per-element tile (spec §5); at 2.25 bits per key element e8cube must stay well above the 0.919
    of the root code it replaced."""
    assert gaussian_key_cosine("rk4v4-e8", tokens=1024) >= 0.9865
    assert gaussian_key_cosine("rk2v4-e8", tokens=1024) >= 0.947


def test_unknown_codec_message():
    with pytest.raises(ValueError, match="unknown --kv-dtype 'int3'"):
        get_codec("int3")
