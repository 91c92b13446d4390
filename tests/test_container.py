"""Container reader/writer: byte-exact round trip of every format, and a matrix of corrupted files."""

import json
import struct

import numpy as np
import pytest

from format.container import Artifact, ArtifactPlan, ArtifactWriter
from format.errors import ArtifactError
from format.quantize import encode_rows

MATRIX = np.random.default_rng(42).standard_normal((5, 70)).astype(np.float32)


def _write(path, version=3, checksums=True):
    plan = ArtifactPlan(version, "qwen3_5", "q4")
    plan.add_resource("resource/config.json", 2)
    plan.add_tensor("text/a_bf16", (3, 4), "BF16")
    plan.add_tensor("text/b_fp32", (2,), "FP32")
    plan.add_tensor("text/c_i32", (3,), "I32")
    for fmt in ("Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"):
        plan.add_tensor(f"text/{fmt}", MATRIX.shape, fmt)
    with ArtifactWriter(path, plan, checksums=checksums) as w:
        w.write_resource("resource/config.json", b"{}")
        w.write_direct("text/a_bf16", np.arange(12, dtype=np.uint16).reshape(3, 4))
        w.write_direct("text/b_fp32", np.array([1.5, -2.0], np.float32))
        w.write_direct("text/c_i32", np.array([7, -1, 3], np.int32))
        for fmt in ("Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"):
            w.write_rows(f"text/{fmt}", 0, encode_rows(MATRIX[:2], fmt))  # two row blocks, in order
            w.write_rows(f"text/{fmt}", 2, encode_rows(MATRIX[2:], fmt))
    return path


@pytest.mark.parametrize("version", [2, 3])
def test_round_trip_every_format(tmp_path, version):
    p = _write(tmp_path / "a.nfer", version)
    with Artifact(p) as art:
        assert art.version == version
        assert art.resource_bytes("resource/config.json") == b"{}"
        assert np.array_equal(art.read_direct("text/a_bf16"), np.arange(12).reshape(3, 4))
        assert np.array_equal(art.read_float("text/b_fp32"), [1.5, -2.0])
        assert np.array_equal(art.read_direct("text/c_i32"), [7, -1, 3])
        for fmt in ("Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"):
            whole = encode_rows(MATRIX, fmt)
            base, high, scale, _ = art.planes(f"text/{fmt}")
            assert (bytes(base), bytes(high or b""), bytes(scale)) == whole
        assert all(e.offset % 256 == 0 for e in art.objects.values() if e.kind == "tensor")
        assert art.payload_offset % 4096 == 0
        if version == 3:
            assert art.components == ("text",) and all(e.sha256 for e in art.objects.values())
            from format.inspect import verify

            assert verify(art) == []


def test_writer_is_atomic_and_checks_coverage(tmp_path):
    target = tmp_path / "keep.nfer"
    target.write_bytes(b"previous artifact")
    plan = ArtifactPlan(3, "qwen3_5", "q4")
    plan.add_tensor("text/x", (2, 2), "BF16")
    with pytest.raises(ArtifactError, match="payload missing"):
        with ArtifactWriter(target, plan) as w:
            w.write_direct("text/x", np.zeros(2, np.uint16))  # half the tensor
    assert target.read_bytes() == b"previous artifact"
    assert list(tmp_path.iterdir()) == [target]


def test_writer_rejects_companions_in_v2():
    plan = ArtifactPlan(2, "qwen3_5", "q4")
    with pytest.raises(ArtifactError, match="companion weights need --version 3"):
        plan.add_tensor("mtp/final_norm", (4,), "BF16")


# --- corrupted files -----------------------------------------------------------------------


def _split(path):
    data = path.read_bytes()
    version = data[7]
    header = 16 if version == 2 else 32
    (n,) = struct.unpack_from("<Q", data, 8)
    root = json.loads(data[header : header + n])
    payload_start = -(-(header + n) // 4096) * 4096
    return data, header, root, data[payload_start:]


def _reframe(path, root, payload, data, header):
    js = json.dumps(root).encode()
    start = -(-(header + len(js)) // 4096) * 4096
    head = data[:8] + struct.pack("<Q", len(js)) + data[16:header] + js
    path.write_bytes(head + bytes(start - len(head)) + payload)


def _mutate_json(fn):
    def apply(path):
        data, header, root, payload = _split(path)
        fn(root)
        _reframe(path, root, payload, data, header)
    return apply


def _obj(root, name):
    return next(o for o in root["objects"] if o["name"] == name)


CASES = {
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-100]), "extends beyond the file"),
    "trailing junk": (lambda p: p.write_bytes(p.read_bytes() + b"junk"), "trailing bytes"),
    "tiny file": (lambda p: p.write_bytes(b"NINFER"), "shorter than the 16-byte prefix"),
    "bad magic": (lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:]), "bad magic"),
    "version 9": (lambda p: p.write_bytes(p.read_bytes()[:7] + b"\x09" + p.read_bytes()[8:]), "unsupported .nfer version 9"),
    "json_bytes zero": (lambda p: p.write_bytes(p.read_bytes()[:8] + bytes(8) + p.read_bytes()[16:]), "json_bytes must be positive"),
    "json_bytes huge": (lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<Q", 1 << 40) + p.read_bytes()[16:]), "exceeds"),
    "bad json": (lambda p: p.write_bytes(p.read_bytes()[:40] + b"{{{{" + p.read_bytes()[44:]), "invalid JSON directory"),
    "wrong size": (_mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("bytes", 26)), "stores 26 bytes; layout requires 24"),
    "overlap": (_mutate_json(lambda r: _obj(r, "text/b_fp32").__setitem__("offset", _obj(r, "text/a_bf16")["offset"])), "overlaps or is out of order"),
    "misaligned": (_mutate_json(lambda r: _obj(r, "text/c_i32").__setitem__("offset", _obj(r, "text/c_i32")["offset"] + 8)), "not 256-byte aligned"),
    "unknown format": (_mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("format", "Q3K")), "unknown tensor format"),
    "unknown layout": (_mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("layout", "tiled")), "unknown tensor layout"),
    "extra member": (_mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("recipe", "x")), "unknown member"),
    "missing member": (_mutate_json(lambda r: _obj(r, "text/a_bf16").pop("shape")), "missing member"),
    "bool as int": (_mutate_json(lambda r: _obj(r, "text/c_i32").__setitem__("bytes", True)), "non-negative integer"),
    "duplicate name": (_mutate_json(lambda r: _obj(r, "text/b_fp32").__setitem__("name", "text/a_bf16")), "duplicate object name"),
    "component count": (_mutate_json(lambda r: r["components"]["text"].__setitem__("objects", 99)), "declares 99 objects"),
    "undeclared component": (_mutate_json(lambda r: (_obj(r, "text/a_bf16").__setitem__("component", "mtp"),
                                                     r["components"]["text"].__setitem__("objects", 7))), "does not declare"),
    "bad checksum text": (_mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("sha256", "xyz")), "sha256 must be"),
    "root extra": (_mutate_json(lambda r: r.__setitem__("hack", 1)), "unknown member"),
    "empty objects": (_mutate_json(lambda r: r.__setitem__("objects", [])), "non-empty list"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_reader_rejects_corruption(tmp_path, case):
    mutate, message = CASES[case]
    p = _write(tmp_path / "c.nfer", 3)
    mutate(p)
    with pytest.raises(ArtifactError, match=message):
        Artifact(p)


def test_v2_rejects_companion_objects(tmp_path):
    p = _write(tmp_path / "v2.nfer", 2)
    _mutate_json(lambda r: _obj(r, "text/a_bf16").__setitem__("name", "mtp/a"))(p)
    with pytest.raises(ArtifactError, match="version 2 carries only text and vision"):
        Artifact(p)


def test_verify_detects_payload_corruption(tmp_path):
    from format.inspect import verify

    p = _write(tmp_path / "v.nfer", 3)
    data = bytearray(p.read_bytes())
    with Artifact(p) as art:
        pos = art.payload_offset + art.objects["text/Q4G64_F16S"].offset
    data[pos] ^= 0xFF
    p.write_bytes(bytes(data))
    with Artifact(p) as art:
        failures = verify(art)
    assert failures and "sha256 mismatch" in failures[0]


def test_verify_detects_illegal_codes_without_checksums(tmp_path):
    from format.inspect import verify

    p = _write(tmp_path / "w.nfer", 3, checksums=False)
    data = bytearray(p.read_bytes())
    with Artifact(p) as art:
        e = art.objects["text/W8G32_F16S"]
        pos = art.payload_offset + e.offset
    data[pos] = 0x80  # code -128
    p.write_bytes(bytes(data))
    with Artifact(p) as art:
        assert any("-128" in f for f in verify(art))


def _upstream_file(path, version: int, root: dict) -> None:
    """An artifact framed as upstream frames it (the directory is theirs; payload bytes are zeros)."""
    import json as _json
    import struct as _struct

    text = _json.dumps(root).encode()
    head = b"NINFER\x00" + bytes([version]) + _struct.pack("<Q", len(text)) + (b"\x11" * 16 if version == 3 else b"")
    body = head + text
    path.write_bytes(body + bytes(-len(body) % 4096) + bytes(8192))


def test_malformed_upstream_directories_are_one_line(tmp_path):
    """A file framed and directed as upstream's but malformed (sizes that do not match the format, a v3
    directory without files) is one line naming the member, from the reader and from `inspect`; binding
    well-formed ones is tests/test_upstream.py."""
    import json as _json

    from typer.testing import CliRunner

    from format.container import Artifact, open_artifact
    from format.upstream import UpstreamArtifactError
    from ninfer_cli.main import app

    tensor = lambda name, fmt="Q4G64_F16S": {"name": name, "kind": "tensor", "shape": [128, 128], "format": fmt,  # noqa: E731
                                             "layout": "row-split-k128-v1", "offset": 0, "bytes": 4096}
    v2 = tmp_path / "qwen3.8-27b.ninfer"
    _upstream_file(v2, 2, {"identity": {"model_id": "qwen3.8-27b", "weights_id": "groupwise-int"}, "objects": [
        tensor("text/layers/0/attention/query_key"), tensor("text/layers/0/attention/gate_value", "Q5G64_F16S")]})
    v3 = tmp_path / "qwen3.6-35b-a3b.ninfer"
    _upstream_file(v3, 3, {"components": {"text": {"config": {"model_id": "qwen3.6-35b-a3b"}}, "vision": {}},
                           "objects": [{"id": "a1", "format": "nvfp4", "layout": "block_scale_k16_m128x4_v1"}],
                           "bindings": [{"name": "text/layers/0/moe/routed_gate_up", "object": "a1"}],
                           "uses": [], "files": [], "metadata": {"weights_id": "nvfp4"}})
    with pytest.raises(ArtifactError) as err:
        open_artifact(v2)
    line = str(err.value)
    assert "\n" not in line and "text/layers/0/attention/query_key: 4096 bytes" in line and "encodes to" in line
    with pytest.raises(ArtifactError, match="files must be a non-empty list"):
        Artifact(v3)
    r = CliRunner().invoke(app, ["inspect", str(v3), "--json"])
    d = _json.loads(r.stdout)
    assert r.exit_code == 1 and not d["runnable"] and "files must be a non-empty list" in d["problems"][0]
    run = CliRunner().invoke(app, ["generate", str(v2), "--prompt", "hi"])
    assert run.exit_code == 1 and "encodes to" in run.output and "Traceback" not in run.output
    # a v2 file of ours with a companion stays our own error (not mistaken for upstream)
    ours = tmp_path / "ours.nfer"
    _upstream_file(ours, 2, {"identity": {"model_id": "qwen3_5", "weights_id": "q4"},
                             "objects": [{**tensor("mtp/x"), "bytes": 8704}]})
    with pytest.raises(ArtifactError) as err:
        Artifact(ours)
    assert not isinstance(err.value, UpstreamArtifactError) and "companion weight" in str(err.value)
