"""Reading upstream ninfer artifacts (`.ninfer` v2 and v3 as published with the Qwen3.6 / Qwen3.8 models).

Their framing is ours (`NINFER\\0` + version), their directory is not (../shared/research/interop.md,
specs/container.md §6): v2 names upstream model ids (`qwen3.8-27b`) and weight profiles (`groupwise-int`,
`nvfp4`), carries companions (`mtp/*`, `text/draft_head*`, `dflash2/*`) and `frontend/*` resources instead of
`resource/config.json`; v3 has opaque object ids bound to logical parameter names (`bindings`), `uses`,
and a `files` table whose continuation parts (`NINPRT\\0\\x03`) extend one logical payload.

This module reads either directory into one description: objects (by id, formats in our spelling), the
*logical* parameters upstream's model code names (`text/layers/3/attention/query`, each a list of element
ranges of objects; v2's fused objects are split into them here), resources by role, and the text config.
`format/upstream_bind.py` turns that into the objects our runtime reads.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple
from pathlib import Path

from .errors import ArtifactError
from .layouts import MAX_U64, TENSOR_ALIGNMENT, align_up, encoded_size


UPSTREAM_MODEL_IDS = ("qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3.8-27b")
UPSTREAM_PROFILES = ("groupwise-int", "nvfp4")
PART_MAGIC = b"NINPRT\x00\x03"
PAGE = 4096
_MAX_PARTS = 4096

# v3 spellings -> ours (v2 spells formats as we do); formats this build does not decode keep their v2 name
V3_FORMATS = {"bf16": "BF16", "fp32": "FP32", "int32": "I32", "q4_g64_fp16": "Q4G64_F16S", "q5_g64_fp16": "Q5G64_F16S",
              "q6_g64_fp16": "Q6G64_F16S", "q8_g32_fp16": "W8G32_F16S", "nvfp4": "NVFP4",
              "fp8_e4m3fn_row_bf16": "FP8_E4M3FN_ROW_BF16S", "t2_g128_fp16": "T2G128_F16S"}
V3_LAYOUTS = {"contiguous_le_v1": "contiguous-le-v1", "row_split_k128_v1": "row-split-k128-v1",
              "block_scale_k16_m128x4_v1": "blockscale-k16-m128x4-v1", "row_scale_v1": "row-scale-v1"}
# upstream's on-disk layouts of the float formats (ours: FORMAT_LAYOUT; the binder converts NVFP4's)
UPSTREAM_LAYOUT = {"NVFP4": "blockscale-k16-m128x4-v1", "FP8_E4M3FN_ROW_BF16S": "row-scale-v1"}


class UpstreamArtifactError(ArtifactError):
    """An upstream ninfer artifact this build recognises but cannot run (the reason is in the message)."""

    def __init__(self, info: "UpstreamInfo", reason: str):
        self.info, self.reason = info, reason
        super().__init__(f"{info.path} is an upstream ninfer v{info.version} artifact (model {info.model_id or 'unknown'}, "
                         f"weights {info.profile or 'unknown'}) that this build cannot run: {reason}")


@dataclass
class UpstreamInfo:
    """What an upstream file is and holds (inspect prints it; the binder adds what runs)."""

    path: str
    version: int
    model_id: str | None
    profile: str | None
    objects: int
    components: list[str] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    resources: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"path": self.path, "origin": "upstream ninfer", "version": self.version, "model_id": self.model_id,
                "weights_profile": self.profile, "objects": self.objects, "components": self.components,
                "formats": self.formats, "resources": self.resources}


@dataclass(frozen=True)
class UpObject:
    id: str
    kind: str  # tensor | resource
    offset: int  # in the logical payload
    nbytes: int
    shape: tuple[int, ...] = ()
    format: str = ""  # our spelling (Q4G64_F16S, BF16, NVFP4, ...)
    layout: str = ""
    divisors: int = 1

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


# a logical parameter: element ranges [begin, end) of objects, concatenated in order
Parts = tuple[tuple[str, int, int], ...]


class PayloadFile(NamedTuple):
    file: object
    mm: mmap.mmap
    start: int  # where the file's payload begins in it
    begin: int  # P_i: its first byte in the logical payload
    nbytes: int  # B_i


class Payload:
    """The logical payload over the entry file and its continuation parts (v3 §2.2); read-only mmaps."""

    def __init__(self):
        self.files: list[PayloadFile] = []

    def add(self, f, mm, start: int, nbytes: int) -> None:
        self.files.append(PayloadFile(f, mm, start, self.size, nbytes))

    @property
    def size(self) -> int:
        return self.files[-1].begin + self.files[-1].nbytes if self.files else 0

    def read(self, offset: int, nbytes: int):
        """A memoryview when the range lies in one file, else a bytes copy joined across files."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ArtifactError(f"payload range [{offset}, {offset + nbytes}) lies outside the {self.size}-byte payload")
        pieces = []
        for _, mm, start, begin, size in self.files:
            a, b = max(offset, begin), min(offset + nbytes, begin + size)
            if a < b:
                pieces.append(memoryview(mm)[start + a - begin : start + b - begin])
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(bytes(p) for p in pieces)

    def close(self) -> None:
        for f, mm, *_ in self.files:
            try:
                mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping closes when it is released
            f.close()
        self.files = []


def _u64(value, what: str, positive: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not (1 if positive else 0) <= value <= MAX_U64:
        raise ArtifactError(f"{what} must be a{' positive' if positive else 'n'} unsigned 64-bit integer, not {str(value)[:40]!r}")
    return value


def is_upstream_root(root, version: int) -> bool:
    """Whether a JSON directory is upstream's (not a corrupt one of ours)."""
    if not isinstance(root, dict) or not isinstance(root.get("objects"), list):
        return False
    if version == 3:
        return all(k in root for k in ("bindings", "uses", "files")) and "identity" not in root
    identity = root.get("identity") if isinstance(root.get("identity"), dict) else {}
    return identity.get("model_id") in UPSTREAM_MODEL_IDS or identity.get("weights_id") in UPSTREAM_PROFILES


def _tensor_size(fmt: str, layout: str, shape: tuple[int, ...], divisors: int, what: str) -> int:
    from .numeric import FORMAT_LAYOUT

    expected = UPSTREAM_LAYOUT.get(fmt, FORMAT_LAYOUT.get(fmt))
    if expected is None:
        raise ArtifactError(f"{what}: format {str(fmt)[:40]!r} is not one this build reads")
    if layout != expected:
        raise ArtifactError(f"{what}: format {fmt} must use layout {expected}, not {str(layout)[:40]!r}")
    if fmt != "NVFP4":
        return encoded_size(fmt, shape, what)
    if len(shape) != 2:
        raise ArtifactError(f"{what}: format {fmt} needs a rank-2 shape, got {list(shape)}")
    n, k = shape
    if n % 128 or k % 64 or n % divisors or (n // divisors) % 128:
        raise ArtifactError(f"{what}: NVFP4 needs rows % 128 == 0, columns % 64 == 0 and each of its {divisors} "
                            "divisors covering whole 128-row tiles")
    return align_up(n * k // 2, 256) + n * k // 16 + 4 * divisors


class UpstreamDirectory:
    """An upstream artifact's directory: objects, logical parameters, resources, config. Every malformed
    member is an ArtifactError naming it."""

    def __init__(self, path: Path, version: int, root: dict, entry_file, entry_mm: mmap.mmap, start: int):
        self.path, self.version = Path(path), version
        self.payload = Payload()
        self.auxiliaries: dict[str, set[str]] = {}  # logical parameter -> auxiliary roles its uses carry
        self.metadata = root.get("metadata") if isinstance(root.get("metadata"), dict) else {}
        if version == 2:
            identity = root.get("identity") if isinstance(root.get("identity"), dict) else {}
            self.model_id, self.profile = identity.get("model_id"), identity.get("weights_id")
            if set(root) != {"identity", "objects"}:
                raise ArtifactError(f"{path}: an upstream v2 directory holds exactly identity and objects")
            if start > len(entry_mm):
                raise ArtifactError(f"{path}: the payload start lies beyond the file (truncated?)")
            self.payload.add(entry_file, entry_mm, start, len(entry_mm) - start)
            self.objects = self._objects(root["objects"], name_key="name")
            self.text_config = None
            self.components = {"text": {}}
            self.bindings, self.resources = {}, {}
        else:
            self._files(root, entry_file, entry_mm, start)
            comps = root.get("components")
            if not isinstance(comps, dict) or not isinstance(comps.get("text"), dict):
                raise ArtifactError(f"{path}: components must be an object holding text")
            self.components = comps
            config = comps["text"].get("config")
            if not isinstance(config, dict):
                raise ArtifactError(f"{path}: components.text.config must be an object")
            self.text_config = config
            self.model_id = next((v for v in (self.metadata.get("name"), config.get("model_id")) if isinstance(v, str)), None)
            self.profile = next((v for v in (self.metadata.get("weights_id"), self.metadata.get("profile")) if isinstance(v, str)), None)
            self.objects = self._objects(root["objects"], name_key="id")
            self.bindings = self._v3_bindings(root.get("bindings"))
            self._v3_uses(root.get("uses"))
            self.resources = {}
            for cid, comp in comps.items():
                res = comp.get("resources", {}) if isinstance(comp, dict) else None
                if not isinstance(res, dict):
                    raise ArtifactError(f"{path}: components.{cid}.resources must be an object")
                for role, oid in res.items():
                    o = self.objects.get(oid) if isinstance(oid, str) else None
                    if o is None or o.kind != "resource":
                        raise ArtifactError(f"{path}: components.{cid}.resources.{role} names no resource object")
                    self.resources[role] = oid
        self._check_spans()
        if version == 2:
            self._v2_logical()

    # --- framing ------------------------------------------------------------------

    def _files(self, root: dict, entry_file, entry_mm, start: int) -> None:
        files = root.get("files")
        if not isinstance(files, list) or not files or len(files) > _MAX_PARTS:
            raise ArtifactError(f"{self.path}: files must be a non-empty list (at most {_MAX_PARTS} entries)")
        artifact_id = bytes(entry_mm[16:32])
        self.artifact_id = uuid.UUID(bytes=artifact_id)
        for i, f in enumerate(files):
            if not isinstance(f, dict) or set(f) != {"path", "payload_bytes"}:
                raise ArtifactError(f"{self.path}: files[{i}] must hold exactly path and payload_bytes")
            nbytes = _u64(f["payload_bytes"], f"files[{i}].payload_bytes", positive=True)
            if i == 0:
                if f["path"] is not None:
                    raise ArtifactError(f"{self.path}: files[0].path must be null (the entry file)")
                if start + nbytes != len(entry_mm):
                    raise ArtifactError(f"{self.path}: the entry file is {len(entry_mm)} bytes; its directory says "
                                        f"{start + nbytes} (truncated or padded?)")
                self.payload.add(entry_file, entry_mm, start, nbytes)
                continue
            name = f["path"]
            if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\x00") \
                    or name == self.path.name:
                raise ArtifactError(f"{self.path}: files[{i}].path {str(name)[:60]!r} is not a sibling file name")
            part = self.path.parent / name
            try:
                pf = open(part, "rb")
            except OSError:
                raise ArtifactError(f"{self.path}: continuation part {name} is missing; download every "
                                    f"{self.path.name}.part-* file beside it") from None
            size = os.fstat(pf.fileno()).st_size
            if size != PAGE + nbytes:
                pf.close()
                raise ArtifactError(f"{part}: the part is {size} bytes; the directory says {PAGE + nbytes}")
            pm = mmap.mmap(pf.fileno(), 0, access=mmap.ACCESS_READ)
            magic, index = bytes(pm[:8]), struct.unpack_from("<Q", pm, 8)[0]
            if magic != PART_MAGIC or index != i or bytes(pm[16:32]) != artifact_id:
                pm.close()
                pf.close()
                raise ArtifactError(f"{part}: not part {i} of this artifact (magic, index or artifact id differs)")
            self.payload.add(pf, pm, PAGE, nbytes)

    def _objects(self, raw, name_key: str) -> dict[str, UpObject]:
        if not isinstance(raw, list) or not raw:
            raise ArtifactError(f"{self.path}: objects must be a non-empty list")
        out: dict[str, UpObject] = {}
        for i, o in enumerate(raw):
            if not isinstance(o, dict):
                raise ArtifactError(f"{self.path}: objects[{i}] is not an object")
            oid = o.get(name_key)
            if not isinstance(oid, str) or not oid or "\x00" in oid:
                raise ArtifactError(f"{self.path}: objects[{i}].{name_key} must be a non-empty string")
            what = f"object {oid[:80]}"
            if oid in out:
                raise ArtifactError(f"{self.path}: duplicate object {oid[:80]}")
            kind = o.get("kind")
            offset = _u64(o.get("offset"), f"{what}: offset")
            nbytes = _u64(o.get("bytes"), f"{what}: bytes", positive=True)
            if kind == "resource":
                enc = o.get("encoding")
                if enc not in ("raw-bytes-v1", "raw_bytes_v1"):
                    raise ArtifactError(f"{what}: resource encoding {str(enc)[:40]!r} is not raw bytes")
                out[oid] = UpObject(oid, "resource", offset, nbytes)
                continue
            if kind != "tensor":
                raise ArtifactError(f"{what}: kind {str(kind)[:40]!r} is neither tensor nor resource")
            fmt, layout = o.get("format"), o.get("layout")
            if self.version == 3:
                fmt, layout = V3_FORMATS.get(fmt, fmt), V3_LAYOUTS.get(layout, layout)
            shape = o.get("shape")
            if not isinstance(shape, list) or len(shape) > 16 or any(_u64(d, f"{what}: shape") == 0 for d in shape):
                raise ArtifactError(f"{what}: shape must be a list of at most 16 positive integers")
            divisors = _u64(o.get("divisors", 1), f"{what}: divisors", positive=True)
            if divisors != 1 and fmt != "NVFP4":
                raise ArtifactError(f"{what}: divisors > 1 is allowed only for NVFP4")
            if not isinstance(fmt, str) or not isinstance(layout, str):
                raise ArtifactError(f"{what}: format and layout must be strings")
            expected = _tensor_size(fmt, layout, tuple(shape), divisors, what)
            if nbytes != expected:
                raise ArtifactError(f"{what}: {nbytes} bytes, but {fmt} {list(shape)} encodes to {expected}")
            if offset % TENSOR_ALIGNMENT:
                raise ArtifactError(f"{what}: offset {offset} is not {TENSOR_ALIGNMENT}-byte aligned")
            out[oid] = UpObject(oid, "tensor", offset, nbytes, tuple(shape), fmt, layout, divisors)
        return out

    def _check_spans(self) -> None:
        cursor = 0
        for o in self.objects.values():
            if o.offset < cursor:
                raise ArtifactError(f"{self.path}: object {o.id[:80]} overlaps the one before it or is out of order")
            cursor = o.offset + o.nbytes
        if cursor > self.payload.size:
            raise ArtifactError(f"{self.path}: objects extend {cursor - self.payload.size} bytes beyond the payload (truncated?)")

    # --- logical parameters -----------------------------------------------------------

    def _v3_bindings(self, raw) -> dict[str, Parts]:
        if not isinstance(raw, dict):
            raise ArtifactError(f"{self.path}: bindings must be an object")
        out: dict[str, Parts] = {}
        for name, b in raw.items():
            what = f"binding {name[:80]}"
            if not isinstance(b, dict) or len(b) != 1 or not ({"object"} == set(b) or {"parts"} == set(b)):
                raise ArtifactError(f"{what}: holds exactly one of object or parts")
            if "object" in b:
                o = self.objects.get(b["object"]) if isinstance(b["object"], str) else None
                if o is None or o.kind != "tensor":
                    raise ArtifactError(f"{what}: names no tensor object")
                out[name] = ((o.id, 0, o.elements),)
                continue
            parts = b["parts"]
            if not isinstance(parts, list) or not parts:
                raise ArtifactError(f"{what}: parts must be a non-empty list")
            got = []
            for p in parts:
                o = self.objects.get(p.get("object")) if isinstance(p, dict) and isinstance(p.get("object"), str) else None
                rng = p.get("range") if isinstance(p, dict) else None
                if o is None or o.kind != "tensor" or set(p) != {"object", "range"}:
                    raise ArtifactError(f"{what}: a part must name a tensor object and a range")
                if not isinstance(rng, list) or len(rng) != 2:
                    raise ArtifactError(f"{what}: a part's range is [begin, end)")
                begin, end = _u64(rng[0], f"{what}: range begin"), _u64(rng[1], f"{what}: range end")
                if not begin < end <= o.elements:
                    raise ArtifactError(f"{what}: range [{begin}, {end}) is empty or beyond the {o.elements} elements of {o.id[:60]}")
                got.append((o.id, begin, end))
            out[name] = tuple(got)
        return out

    def _v3_uses(self, raw) -> None:
        if not isinstance(raw, list):
            raise ArtifactError(f"{self.path}: uses must be a list")
        for i, u in enumerate(raw):
            if not isinstance(u, dict) or not isinstance(u.get("parameter"), str) or not isinstance(u.get("input"), str):
                raise ArtifactError(f"{self.path}: uses[{i}] needs parameter and input names")
            if u["parameter"] not in self.bindings:
                raise ArtifactError(f"{self.path}: uses[{i}] names parameter {u['parameter'][:80]}, which has no binding")
            aux = u.get("auxiliaries", {})
            if not isinstance(aux, dict):
                raise ArtifactError(f"{self.path}: uses[{i}].auxiliaries must be an object")
            self.auxiliaries.setdefault(u["parameter"], set()).update(aux)

    def _v2_logical(self) -> None:
        """v2's fused objects split into upstream's logical parameters (the rows each fused object stacks,
        in order; interop.md §4-7 and the v2 -> v3 correspondence of upstream's own upgrade)."""
        from .shapes import NAMED_SHAPES

        if self.model_id not in NAMED_SHAPES:
            raise UpstreamArtifactError(self.info(), f"model id {str(self.model_id)[:40]!r} is not one of "
                                        f"{', '.join(UPSTREAM_MODEL_IDS)}, so its shape is unknown")
        text = NAMED_SHAPES[self.model_id]
        h, d = text["hidden_size"], text["head_dim"]
        q, kv = text["num_attention_heads"] * d, text["num_key_value_heads"] * d
        kg = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        nv = text["linear_num_value_heads"]
        vg = nv * text["linear_value_head_dim"]
        moe = "num_experts" in text
        rows = {"query": q, "key": kv, "gate": q, "value": kv}
        gdn_rows = {"query": kg, "key": kg, "value": vg, "z": vg}
        fused = {
            "attention/query_key": ("attention/", ("query", "key"), rows),
            "attention/gate_value": ("attention/", ("gate", "value"), rows),
            "attention/query_key_gate_value": ("attention/", ("query", "key", "gate", "value"), rows),
            "gdn/query_key": ("gdn/", ("query", "key"), gdn_rows),
            "gdn/value_z": ("gdn/", ("value", "z"), gdn_rows),
            "gdn/query_key_value_z": ("gdn/", ("query", "key", "value", "z"), gdn_rows),
            "gdn/a_b_projection": ("gdn/", ("a_projection", "b_projection"), {"a_projection": nv, "b_projection": nv}),
        }
        if moe:
            e, i = text["num_experts"], text["moe_intermediate_size"]
            s = text["shared_expert_intermediate_size"]
            fused["moe/router_shared_gate"] = ("moe/", ("router", "shared_score"), {"router": e, "shared_score": 1})
            fused["moe/routed_gate_up"] = ("moe/", tuple(f"experts/{x}/{p}" for x in range(e) for p in ("gate", "up")),
                                           {f"experts/{x}/{p}": i for x in range(e) for p in ("gate", "up")})
            fused["moe/routed_down"] = ("moe/", tuple(f"experts/{x}/down" for x in range(e)),
                                        {f"experts/{x}/down": h for x in range(e)})
            fused["moe/shared_gate_up"] = ("moe/", ("shared/gate", "shared/up"), {"shared/gate": s, "shared/up": s})
            renamed = {"moe/shared_down": "moe/shared/down"}
        else:
            n = text["intermediate_size"]
            fused["mlp/gate_up"] = ("mlp/", ("gate", "up"), {"gate": n, "up": n})
            renamed = {}
        from .shapes import dflash2_shape_config

        dcfg = dflash2_shape_config(text)
        drafter = {"attention/query_key_value": ("attention/", ("query", "key", "value"),
                                                 {"query": dcfg.num_heads * dcfg.head_dim, "key": dcfg.kv_rows,
                                                  "value": dcfg.kv_rows}),
                   "mlp/gate_up": ("mlp/", ("gate", "up"), None)}
        fused["attention/qkv"] = ("attention/", ("query", "key", "value"), None)  # vision blocks: three equal
        fused["attention/qkv_bias"] = ("attention/", ("query_bias", "key_bias", "value_bias"), None)
        renamed.update({"norm1/weight": "norm1_weight", "norm1/bias": "norm1_bias", "norm2/weight": "norm2_weight",
                        "norm2/bias": "norm2_bias", "norm/weight": "norm_weight", "norm/bias": "norm_bias"})
        layer = re.compile(r"(text/layers/\d+/|mtp/layer/|dflash2/layers/\d+/|vision/layers/\d+/|vision/merger/)(.+)")
        out: dict[str, Parts] = {}
        for o in self.objects.values():
            if o.kind == "resource":
                if o.id.startswith("frontend/"):
                    self.resources[o.id.removeprefix("frontend/")] = o.id
                continue
            if o.id.endswith("/input_scale_divisor"):
                continue  # NVFP4 activation scalars: auxiliaries of A4 execution, not weights
            m = layer.fullmatch(o.id)
            if m is None:
                name = {"text/draft_head": "proposal/head", "text/draft_head_token_ids": "proposal/token_ids"}.get(o.id, o.id)
                out[name] = ((o.id, 0, o.elements),)
                continue
            block, role = m.groups()
            block = "mtp/layers/0/" if block == "mtp/layer/" else block
            table = drafter if block.startswith("dflash2/") else fused
            if role in table:
                prefix, names, sizes = table[role]
                if sizes is None:  # equal parts: the drafter's MLP halves, a vision block's q/k/v
                    sizes = {nm: o.shape[0] // len(names) for nm in names}
                width = o.shape[-1] if len(o.shape) == 2 else 1
                if len(o.shape) not in (1, 2) or sum(sizes[nm] for nm in names) != o.shape[0]:
                    raise ArtifactError(f"{self.path}: {o.id} has shape {list(o.shape)}; {self.model_id} stacks "
                                        f"{'+'.join(str(sizes[nm]) for nm in names)} rows of {width} there")
                row = 0
                for nm in names:
                    out[block + prefix + nm] = ((o.id, row * width, (row + sizes[nm]) * width),)
                    row += sizes[nm]
                if block.startswith("dflash2/") and role == "attention/query_key_value":
                    out[block + "attention/context_key"] = out[block + "attention/key"]
                    out[block + "attention/context_value"] = out[block + "attention/value"]
                continue
            out[block + renamed.get(role, role)] = ((o.id, 0, o.elements),)
        self.bindings = out

    # --- description ----------------------------------------------------------------

    def info(self) -> UpstreamInfo:
        comps = set(self.components)
        for name in list(self.bindings) + [o.id for o in self.objects.values()]:
            head = name.split("/", 1)[0]
            if head in ("mtp", "vision", "dflash", "dflash2"):
                comps.add(head)
            if head == "proposal" or name.startswith("text/draft_head"):
                comps.add("draft_head")
        formats = sorted({o.format for o in self.objects.values() if o.kind == "tensor"})
        return UpstreamInfo(str(self.path), self.version, self.model_id if isinstance(self.model_id, str) else None,
                            self.profile if isinstance(self.profile, str) else None, len(self.objects),
                            sorted(comps), formats, sorted(self.resources))

    def object_bytes(self, oid: str):
        o = self.objects[oid]
        return self.payload.read(o.offset, o.nbytes)

    def close(self) -> None:
        self.payload.close()


def read_directory(path, entry_file, mm: mmap.mmap, version: int, root, payload_start: int) -> UpstreamDirectory | None:
    """The upstream directory of an open file whose JSON directory `root` (parsed by our reader) failed our
    spec, or None when it is not upstream's either (our reader's error then stands). A directory that is
    upstream's but malformed raises ArtifactError."""
    if version not in (2, 3) or not is_upstream_root(root, version):
        return None
    return UpstreamDirectory(Path(path), version, root, entry_file, mm, payload_start)
