"""Test-only writer of upstream ninfer artifacts (v2 and v3), from one of our converted artifacts.

Written from the facts in ../shared/research/interop.md and upstream's published container description:
v2 stores fused objects under upstream names (`attention/query_key` + `attention/gate_value`, or one
`attention/query_key_gate_value` de-interleaved as [q, k, gate, v]; `gdn/query_key` + `gdn/value_z`;
`gdn/a_b_projection`; tap-major `gdn/convolution` [taps, C]; `moe/router_shared_gate`, `routed_*`; `mtp/layer/`;
`text/draft_head` rows by descending count) and `frontend/*` resources; v3 stores opaque object ids, logical
`bindings` (element ranges of objects), `uses`, `components` with the text config, and a `files` table over an
entry file and `NINPRT` continuation parts. Every weight keeps our bytes' decoded values, so a bound upstream
file must decode exactly as the artifact it came from. Independent of format/upstream*.py on purpose.
"""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path

import numpy as np

from format.container import Artifact
from format.layouts import RowSplitGeometry, align_up, pack_row_split, unpack_row_split
from format.numeric import FORMATS, GroupedFormat

V3_FORMAT = {"BF16": "bf16", "FP32": "fp32", "I32": "int32", "Q4G64_F16S": "q4_g64_fp16", "Q5G64_F16S": "q5_g64_fp16",
             "Q6G64_F16S": "q6_g64_fp16", "W8G32_F16S": "q8_g32_fp16", "NVFP4": "nvfp4",
             "FP8_E4M3FN_ROW_BF16S": "fp8_e4m3fn_row_bf16"}
V3_LAYOUT = {"contiguous-le-v1": "contiguous_le_v1", "row-split-k128-v1": "row_split_k128_v1",
             "blockscale-k16-m128x4-v1": "block_scale_k16_m128x4_v1", "row-scale-v1": "row_scale_v1"}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _e4m3(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 15, byte & 7
    if e == 15 and m == 7:
        return float("nan")
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


E4M3 = np.array([_e4m3(b) for b in range(256)], np.float32)
_POSITIVE = np.array([b for b in range(0x7F)], np.int64)  # finite, non-negative E4M3FN codes


def _nearest(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table entry for every value (the table need not be sorted)."""
    return np.abs(values[..., None] - table).argmin(-1)


class FloatRows:
    """NVFP4 (codes [N, K/2], natural scales [N, K/16], divisors [N]) or FP8 (codes [N, K], BF16 words [N])
    rows, with the interface of Rows; `decoded()` is this writer's own decode of what it stores."""

    def __init__(self, fmt, shape, codes, scales, divisors=None):
        self.fmt, self.shape, self.codes, self.scales, self.divisors = fmt, tuple(shape), codes, scales, divisors

    @classmethod
    def encode_nvfp4(cls, x: np.ndarray, divisors: np.ndarray) -> "FloatRows":
        n, k = x.shape
        blocks = x.reshape(n, k // 16, 16) * divisors[:, None, None]
        want = np.abs(blocks).max(-1) / 6
        scales = _POSITIVE[_nearest(want, E4M3[_POSITIVE])].astype(np.uint8)
        s = E4M3[scales][:, :, None]
        mags = _nearest(np.abs(blocks) / np.where(s > 0, s, 1), E2M1)
        nib = (mags | np.where(blocks < 0, 8, 0)).reshape(n, k).astype(np.uint8)
        return cls("NVFP4", (n, k), nib[:, 0::2] | (nib[:, 1::2] << 4), scales, divisors.astype(np.float32))

    @classmethod
    def encode_fp8(cls, x: np.ndarray) -> "FloatRows":
        n, k = x.shape
        scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(x).max(1), 1e-30) / 448))  # powers of two: exact in BF16
        finite = np.array([b for b in range(256) if (b & 0x7F) != 0x7F])
        codes = finite[_nearest(x / scale[:, None], E4M3[finite])].astype(np.uint8)
        words = (scale.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        return cls("FP8_E4M3FN_ROW_BF16S", (n, k), codes, words)

    def decoded(self) -> np.ndarray:
        n, k = self.shape
        if self.fmt == "NVFP4":
            nib = np.empty((n, k), np.uint8)
            nib[:, 0::2], nib[:, 1::2] = self.codes & 15, self.codes >> 4
            vals = E2M1[nib & 7] * np.where(nib & 8, -1.0, 1.0).astype(np.float32)
            return (vals.reshape(n, k // 16, 16) * E4M3[self.scales][:, :, None]).reshape(n, k) / self.divisors[:, None]
        scale = (self.scales.astype(np.uint32) << 16).view(np.float32)
        return E4M3[self.codes] * scale[:, None]

    @property
    def n(self) -> int:
        return self.shape[0]

    def take(self, rows) -> "FloatRows":
        rows = np.asarray(rows)
        return FloatRows(self.fmt, (len(rows), self.shape[1]), self.codes[rows], self.scales[rows],
                         None if self.divisors is None else self.divisors[rows])

    def encode(self) -> bytes:
        n, k = self.shape
        if self.fmt != "NVFP4":
            return self.codes.tobytes() + bytes(-(n * k) % 256) + self.scales.astype("<u2").tobytes()
        plane = np.zeros(n * k // 16, np.uint8)
        for row in range(n):  # upstream's swizzle: 128-row x 4-group tiles of 512 bytes
            for g in range(k // 16):
                at = ((row // 128) * (k // 64) + g // 4) * 512 + (row % 128 % 32) * 16 + (row % 128 // 32) * 4 + g % 4
                plane[at] = self.scales[row, g]
        return self.codes.tobytes() + bytes(-(n * k // 2) % 256) + plane.tobytes() + self.source_divisors().tobytes()

    def source_divisors(self) -> np.ndarray:
        """One divisor per stacked source: the fewest equal shares of whole 128-row tiles, each constant."""
        n = self.shape[0]
        for count in range(1, n // 128 + 1):
            if n % count or (n // count) % 128:
                continue
            shares = self.divisors.reshape(count, -1)
            if (shares == shares[:, :1]).all():
                return shares[:, 0].astype("<f4")
        raise AssertionError("divisors that vary inside a 128-row tile")


class Rows:
    """A tensor as rows: grouped -> (codes [N, K_pad], scale bits [N, G]); direct -> words [N, width]."""

    def __init__(self, fmt: str, shape, codes=None, scales=None, words=None):
        self.fmt, self.shape, self.codes, self.scales, self.words = fmt, tuple(shape), codes, scales, words

    @classmethod
    def read(cls, art: Artifact, name: str) -> "Rows":
        e = art.objects[name]
        f = FORMATS[e.format]
        if isinstance(f, GroupedFormat):
            base, high, scale, geo = art.planes(name)
            codes, scales = unpack_row_split(base, high, scale, geo.rows, f, geo.k_pad)
            return cls(e.format, e.shape, codes, scales)
        words = np.frombuffer(art.raw(name), dtype=f.numpy_dtype)
        width = e.shape[-1] if len(e.shape) > 1 else 1
        return cls(e.format, e.shape, words=words.reshape(-1, width))

    @property
    def n(self) -> int:
        return (self.codes if self.codes is not None else self.words).shape[0]

    def take(self, rows) -> "Rows":
        rows = np.asarray(rows)
        if self.codes is not None:
            return Rows(self.fmt, (len(rows), self.shape[1]), self.codes[rows], self.scales[rows])
        shape = (len(rows),) + self.shape[1:] if len(self.shape) > 1 else (len(rows),)
        return Rows(self.fmt, shape, words=self.words[rows])

    def widened(self, fmt: str) -> "Rows":
        """The same values in a wider grouped format (Q4 codes are Q5 codes; scales unchanged)."""
        return Rows(fmt, self.shape, self.codes, self.scales)

    @staticmethod
    def stack(parts: list["Rows"]) -> "Rows":
        first = parts[0]
        assert len({p.fmt for p in parts}) == 1
        if first.codes is not None:
            n = sum(p.n for p in parts)
            return Rows(first.fmt, (n, first.shape[1]), np.concatenate([p.codes for p in parts]),
                        np.concatenate([p.scales for p in parts]))
        words = np.concatenate([p.words for p in parts])
        shape = (words.shape[0],) + first.shape[1:] if len(first.shape) > 1 else (words.shape[0],)
        return Rows(first.fmt, shape, words=words)

    def encode(self) -> bytes:
        f = FORMATS[self.fmt]
        if isinstance(f, GroupedFormat):
            base, high, scale = pack_row_split(self.codes, self.scales, f)
            geo = RowSplitGeometry(self.shape[0], self.shape[1], f)
            out = bytearray(geo.total_bytes)
            out[: len(base)] = base
            out[geo.high_offset : geo.high_offset + len(high)] = high
            out[geo.scale_offset :] = scale
            return bytes(out)
        return np.ascontiguousarray(self.words).tobytes()


def upstream_objects(art: Artifact, fused_attention: bool, widen_gate_value: bool, floats=None) -> tuple[list, dict, dict]:
    """[(v2 name, Rows)], {logical name: [(v2 name, row begin, row end)]}, {resource role: bytes}.
    `floats`: our object names -> FloatRows stored instead of the artifact's rows (NVFP4 / FP8 profiles)."""
    floats = floats or {}

    class Read(Rows):
        @classmethod
        def read(cls, art, name):
            return floats[name] if name in floats else Rows.read(art, name)

    cfg = json.loads(art.resource_bytes("resource/config.json"))
    text = cfg.get("text_config", cfg)
    d, heads, kv = text["head_dim"], text["num_attention_heads"], text["num_key_value_heads"]
    kg = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    vg = text["linear_num_value_heads"] * text["linear_value_head_dim"]
    objs: list = []
    logical: dict = {}

    def put(name, rows: Rows, pieces=None):
        objs.append((name, rows))
        row = 0
        for lname, n in pieces or []:
            logical[lname] = [(name, row, row + n)]
            row += n
        assert not pieces or row == rows.n, (name, row, rows.n)

    def whole(our, up, lname=None):
        r = Read.read(art, our)
        put(up, r, [(lname or up, r.n)])

    def layer(ours: str, up: str, lg: str, full: bool):
        for n in ("input_norm", "post_attention_norm"):
            whole(ours + n, up + n, lg + n)
        if full:
            qgkv = Read.read(art, ours + "attention/query_gate_key_value")
            q = [r for h in range(heads) for r in range(h * 2 * d, h * 2 * d + d)]
            g = [r for h in range(heads) for r in range(h * 2 * d + d, (h + 1) * 2 * d)]
            k = list(range(2 * heads * d, 2 * heads * d + kv * d))
            v = list(range(2 * heads * d + kv * d, 2 * heads * d + 2 * kv * d))
            names = [(lg + "attention/" + x, n) for x, n in (("query", heads * d), ("key", kv * d))]
            gv = [(lg + "attention/" + x, n) for x, n in (("gate", heads * d), ("value", kv * d))]
            if fused_attention:
                put(up + "attention/query_key_gate_value", qgkv.take(q + k + g + v), names + gv)
            else:
                put(up + "attention/query_key", qgkv.take(q + k), names)
                second = qgkv.take(g + v)
                if widen_gate_value and isinstance(second, Rows):
                    second = second.widened("Q5G64_F16S")
                put(up + "attention/gate_value", second, gv)
            for n in ("attention/query_norm", "attention/key_norm", "attention/output"):
                whole(ours + n, up + n, lg + n)
        else:
            qkvz = Read.read(art, ours + "gdn/query_key_value_z")
            pieces = [(lg + "gdn/" + x, n) for x, n in (("query", kg), ("key", kg), ("value", vg), ("z", vg))]
            if fused_attention:
                put(up + "gdn/query_key_value_z", qkvz, pieces)
                alpha, beta = Read.read(art, ours + "gdn/alpha_projection"), Read.read(art, ours + "gdn/beta_projection")
                put(up + "gdn/a_b_projection", Rows.stack([alpha, beta]),
                    [(lg + "gdn/a_projection", alpha.n), (lg + "gdn/b_projection", beta.n)])
            else:
                put(up + "gdn/query_key", qkvz.take(range(2 * kg)), pieces[:2])
                put(up + "gdn/value_z", qkvz.take(range(2 * kg, 2 * kg + 2 * vg)), pieces[2:])
                whole(ours + "gdn/alpha_projection", up + "gdn/a_projection", lg + "gdn/a_projection")
                whole(ours + "gdn/beta_projection", up + "gdn/b_projection", lg + "gdn/b_projection")
            conv = Read.read(art, ours + "gdn/convolution")  # ours [C, taps] -> upstream tap-major [taps, C]
            t = Rows(conv.fmt, conv.shape[::-1], words=np.ascontiguousarray(conv.words.T))
            put(up + "gdn/convolution", t, [(lg + "gdn/convolution", t.n)])
            for n in ("gdn/a_log", "gdn/dt_bias", "gdn/norm", "gdn/output"):
                whole(ours + n, up + n, lg + n)
        if art.has(ours + "mlp/gate_up"):
            gu = Read.read(art, ours + "mlp/gate_up")
            put(up + "mlp/gate_up", gu, [(lg + "mlp/gate", gu.n // 2), (lg + "mlp/up", gu.n // 2)])
            whole(ours + "mlp/down", up + "mlp/down", lg + "mlp/down")
        else:
            router, shared = Read.read(art, ours + "moe/router"), Read.read(art, ours + "moe/shared_gate")
            put(up + "moe/router_shared_gate", Rows.stack([router, shared]),
                [(lg + "moe/router", router.n), (lg + "moe/shared_score", 1)])
            e, i = text["num_experts"], text["moe_intermediate_size"]
            egu = Read.read(art, ours + "moe/experts_gate_up")
            put(up + "moe/routed_gate_up", egu, [(f"{lg}moe/experts/{x}/{p}", i) for x in range(e) for p in ("gate", "up")])
            ed = Read.read(art, ours + "moe/experts_down")
            put(up + "moe/routed_down", ed, [(f"{lg}moe/experts/{x}/down", text["hidden_size"]) for x in range(e)])
            sgu = Read.read(art, ours + "moe/shared_gate_up")
            put(up + "moe/shared_gate_up", sgu, [(lg + "moe/shared/gate", sgu.n // 2), (lg + "moe/shared/up", sgu.n // 2)])
            whole(ours + "moe/shared_down", up + "moe/shared_down", lg + "moe/shared/down")

    whole("text/token_embedding", "text/token_embedding")
    for i, kind in enumerate(text["layer_types"]):
        p = f"text/layers/{i}/"
        layer(p, p, p, kind == "full_attention")
    whole("text/final_norm", "text/final_norm")
    whole("text/output_head", "text/output_head")
    if art.has("mtp/input_projection"):
        for n in ("input_projection", "embedding_norm", "hidden_norm", "final_norm"):
            whole("mtp/" + n, "mtp/" + n)
        layer("mtp/layers/0/", "mtp/layer/", "mtp/layers/0/", True)
    if art.has("lm_head_draft/head"):  # upstream orders rows by descending count: here, descending id
        ids = np.frombuffer(art.raw("lm_head_draft/token_ids"), "<i4")
        order = np.argsort(-ids, kind="stable")
        put("text/draft_head", Read.read(art, "lm_head_draft/head").take(order), [("proposal/head", len(ids))])
        put("text/draft_head_token_ids", Rows("I32", (len(ids),), words=ids[order].reshape(-1, 1).copy()),
            [("proposal/token_ids", len(ids))])
    if art.has("dflash2/config.json"):  # names as ours; fused q/k/v and gate/up split into logical parameters
        drafter = json.loads(art.resource_bytes("dflash2/config.json"))
        q = drafter["num_attention_heads"] * drafter["head_dim"]
        kv = drafter["num_key_value_heads"] * drafter["head_dim"]
        for n, e in art.objects.items():
            if not n.startswith("dflash2/") or e.kind != "tensor":
                continue
            r = Read.read(art, n)
            b = n.rsplit("/", 1)[0] + "/"
            if n.endswith("attention/query_key_value"):
                put(n, r, [(b + "query", q), (b + "key", kv), (b + "value", kv)])
                logical[b + "context_key"], logical[b + "context_value"] = logical[b + "key"], logical[b + "value"]
            elif n.endswith("mlp/gate_up"):
                put(n, r, [(b + "gate", r.n // 2), (b + "up", r.n // 2)])
            else:
                put(n, r, [(n, r.n)])
    if art.has("vision/patch_embed.proj.weight"):  # checkpoint names -> upstream's vision objects
        patch = Read.read(art, "vision/patch_embed.proj.weight")
        h = art.objects["vision/patch_embed.proj.weight"].shape[0]
        put("vision/patch_embedding", Rows(patch.fmt, (h, patch.words.size // h), words=patch.words.reshape(h, -1)),
            [("vision/patch_embedding", h)])
        simple = {"patch_embed.proj.bias": "patch_embedding_bias", "pos_embed.weight": "position_embedding",
                  "merger.norm.weight": "merger/norm/weight", "merger.norm.bias": "merger/norm/bias",
                  "merger.linear_fc1.weight": "merger/fc1", "merger.linear_fc1.bias": "merger/fc1_bias",
                  "merger.linear_fc2.weight": "merger/fc2", "merger.linear_fc2.bias": "merger/fc2_bias"}
        for key, up in simple.items():
            r = Read.read(art, "vision/" + key)
            put("vision/" + up, r, [("vision/" + up.replace("norm/", "norm_"), r.n)])
        blocks = sorted({int(n.split(".")[1]) for n in art.objects if n.startswith("vision/blocks.")})
        for i in blocks:
            b, up = f"vision/blocks.{i}.", f"vision/layers/{i}/"
            for key, name in (("attn.qkv.weight", "attention/qkv"), ("attn.qkv.bias", "attention/qkv_bias")):
                r = Read.read(art, b + key)
                suffix = "_bias" if key.endswith("bias") else ""
                put(up + name, r, [(up + "attention/" + x + suffix, r.n // 3) for x in ("query", "key", "value")])
            for key, name in (("attn.proj.weight", "attention/output"), ("attn.proj.bias", "attention/output_bias"),
                              ("mlp.linear_fc1.weight", "mlp/fc1"), ("mlp.linear_fc1.bias", "mlp/fc1_bias"),
                              ("mlp.linear_fc2.weight", "mlp/fc2"), ("mlp.linear_fc2.bias", "mlp/fc2_bias"),
                              ("norm1.weight", "norm1/weight"), ("norm1.bias", "norm1/bias"),
                              ("norm2.weight", "norm2/weight"), ("norm2.bias", "norm2/bias")):
                r = Read.read(art, b + key)
                put(up + name, r, [(up + name.replace("norm1/", "norm1_").replace("norm2/", "norm2_"), r.n)])
    resources = {}
    tok = json.loads(art.resource_bytes("resource/tokenizer.json"))
    tok_cfg = json.loads(art.resource_bytes("resource/tokenizer_config.json"))
    # upstream keeps some added tokens only in tokenizer_config.json: move every special token there
    moved = [t for t in tok["added_tokens"] if t.get("special")]
    tok["added_tokens"] = [t for t in tok["added_tokens"] if not t.get("special")]
    tok_cfg["added_tokens_decoder"] = {str(t["id"]): {"content": t["content"], "special": True} for t in moved}
    resources["tokenizer.json"] = json.dumps(tok).encode()
    resources["tokenizer_config.json"] = json.dumps(tok_cfg).encode()
    resources["chat_template.jinja"] = art.resource_bytes("resource/chat_template.jinja")
    if art.has("resource/preprocessor_config.json"):
        resources["preprocessor_config.json"] = art.resource_bytes("resource/preprocessor_config.json")
    if art.has("resource/generation_config.json"):
        resources["generation_config.json"] = art.resource_bytes("resource/generation_config.json")
    return objs, logical, resources


def _tensor_entry(name_key, name, rows, offset, nbytes, v3: bool) -> dict:
    fmt = rows.fmt
    layout = {"NVFP4": "blockscale-k16-m128x4-v1", "FP8_E4M3FN_ROW_BF16S": "row-scale-v1"}.get(fmt) or (
        "row-split-k128-v1" if isinstance(FORMATS[fmt], GroupedFormat) else "contiguous-le-v1")
    entry = {name_key: name, "kind": "tensor", "shape": list(rows.shape), "format": V3_FORMAT[fmt] if v3 else fmt,
             "layout": V3_LAYOUT[layout] if v3 else layout, "offset": offset, "bytes": nbytes}
    if fmt == "NVFP4" and len(rows.source_divisors()) > 1:
        entry["divisors"] = len(rows.source_divisors())
    return entry


def write_v2(src: Path, out: Path, model_id: str, fused_attention=False, widen_gate_value=True, extra_objects=(),
             floats=None, profile: str = "groupwise-int") -> Path:
    with Artifact(src) as art:
        objs, _, resources = upstream_objects(art, fused_attention, widen_gate_value, floats)
    entries, payload, offset = [], bytearray(), 0
    for name, rows in objs:
        data = rows.encode()
        offset = align_up(offset, 256)
        payload += bytes(offset - len(payload)) + data
        entries.append(_tensor_entry("name", name, rows, offset, len(data), v3=False))
        offset += len(data)
    for name, rows in extra_objects:
        data = rows.encode() if isinstance(rows, Rows) else rows[1]
        offset = align_up(offset, 256)
        payload += bytes(offset - len(payload)) + data
        entry = _tensor_entry("name", name, rows, offset, len(data), v3=False) if isinstance(rows, Rows) else \
            {"name": name, "kind": "tensor", **rows[0], "offset": offset, "bytes": len(data)}
        entries.append(entry)
        offset += len(data)
    for role, data in resources.items():
        payload += data
        entries.append({"name": "frontend/" + role, "kind": "resource", "encoding": "raw-bytes-v1", "offset": offset,
                        "bytes": len(data)})
        offset += len(data)
    root = json.dumps({"identity": {"model_id": model_id, "weights_id": profile}, "objects": entries}).encode()
    start = align_up(16 + len(root), 4096)
    out.write_bytes(b"NINFER\x00\x02" + struct.pack("<Q", len(root)) + root + bytes(start - 16 - len(root)) + payload)
    return out


def write_v3(src: Path, out: Path, fused_attention=True, widen_gate_value=False, part_bytes: int | None = None,
             name: str = "qwen3.6-35b-a3b", floats=None) -> Path:
    """`part_bytes`: payload bytes per file (a multiple of 4096): the rest goes to continuation parts."""
    with Artifact(src) as art:
        objs, logical, resources = upstream_objects(art, fused_attention, widen_gate_value, floats)
        cfg = json.loads(art.resource_bytes("resource/config.json"))
    text = cfg.get("text_config", cfg)
    ids = {n: f"w{i:04d}" for i, (n, _) in enumerate(objs)}
    objects, payload, offset = [], bytearray(), 0
    widths = {}
    for n, rows in objs:
        data = rows.encode()
        offset = align_up(offset, 256)
        payload += bytes(offset - len(payload)) + data
        objects.append(_tensor_entry("id", ids[n], rows, offset, len(data), v3=True))
        widths[n] = rows.shape[-1] if len(rows.shape) > 1 else 1
        offset += len(data)
    res_ids = {}
    for i, (role, data) in enumerate(resources.items()):
        payload += data
        res_ids[role] = f"r{i:02d}"
        objects.append({"id": res_ids[role], "kind": "resource", "encoding": "raw_bytes_v1", "offset": offset, "bytes": len(data)})
        offset += len(data)
    bindings = {}
    for lname, parts in logical.items():
        (n, b, e), = parts
        whole = b == 0 and e == dict(objs)[n].n
        bindings[lname] = {"object": ids[n]} if whole else \
            {"parts": [{"object": ids[n], "range": [b * widths[n], e * widths[n]]}]}
    uses = [{"parameter": lname, "input": lname.rsplit("/", 1)[0] + "/input", "activation_policy": "A16Only"}
            for lname in bindings]
    components = {"text": {"config": text, "resources": res_ids}}
    if any(n.startswith("mtp/") for n in logical):
        components["mtp"] = {"config": {"architectures": ["Qwen3_5MTP"]}, "target": "text"}
    if any(n.startswith("vision/") for n in logical):
        components["vision"] = {"config": cfg["vision_config"], "target": "text"}
    if any(n.startswith("dflash2/") for n in logical):
        with Artifact(src) as art:
            components["dflash2"] = {"config": json.loads(art.resource_bytes("dflash2/config.json")), "target": "text"}
    if "proposal/head" in logical:
        components["text"]["proposal"] = {"domain": "indexed", "rows": logical["proposal/head"][0][2]}
    sizes = [len(payload)] if not part_bytes or part_bytes >= len(payload) else \
        [part_bytes] * ((len(payload) - 1) // part_bytes) + [len(payload) - part_bytes * ((len(payload) - 1) // part_bytes)]
    files = [{"path": None if i == 0 else f"{out.name}.part-{i:04d}", "payload_bytes": s} for i, s in enumerate(sizes)]
    root = json.dumps({"components": components, "objects": objects, "bindings": bindings, "uses": uses, "files": files,
                       "metadata": {"name": name}}).encode()
    artifact_id = uuid.uuid4().bytes
    start = align_up(32 + len(root), 4096)
    cursor = sizes[0]
    out.write_bytes(b"NINFER\x00\x03" + struct.pack("<Q", len(root)) + artifact_id + root + bytes(start - 32 - len(root))
                    + payload[: sizes[0]])
    for i, s in enumerate(sizes[1:], start=1):
        head = b"NINPRT\x00\x03" + struct.pack("<Q", i) + artifact_id
        (out.parent / files[i]["path"]).write_bytes(head + bytes(4096 - 32) + payload[cursor : cursor + s])
        cursor += s
    return out
