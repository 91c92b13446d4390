"""The .nfer container: framing, JSON directory, reader and writer (specs/container.md)."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import struct
import uuid
from dataclasses import dataclass, field
from glob import escape as glob_escape
from pathlib import Path

import numpy as np

from .errors import ArtifactError
from .model_config import SUPPORTED_MODEL_TYPES
from .recipes import RECIPES
from .layouts import (
    RESOURCE_ALIGNMENT,
    TENSOR_ALIGNMENT,
    RowSplitGeometry,
    align_up,
    check_layout_pairing,
    encoded_size,
)
from .numeric import FORMAT_LAYOUT, RESOURCE_ENCODING, DirectFormat, GroupedFormat, get_format

MAGIC_PREFIX = b"NINFER\x00"
SUPPORTED_VERSIONS = (2, 3)
HEADER_BYTES = {2: 16, 3: 32}
PAYLOAD_ALIGNMENT = 4096
MAX_JSON_BYTES = 64 * 1024 * 1024
COMPONENTS = ("text", "mtp", "lm_head_draft", "dflash2", "vision")
V2_COMPONENTS = ("text", "vision")
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_./-]{0,255}$")
SHA256_PATTERN = re.compile(r"^[0-9a-f]{64}$")
SHA256_PLACEHOLDER = "0" * 64

_ROOT_MEMBERS = {2: {"identity", "objects"}, 3: {"identity", "components", "objects"}}
_ROOT_OPTIONAL = {2: set(), 3: {"metadata"}}
_IDENTITY_MEMBERS = {"model_id", "weights_id"}
_TENSOR_MEMBERS = {"name", "kind", "shape", "format", "layout", "offset", "bytes"}
_RESOURCE_MEMBERS = {"name", "kind", "encoding", "offset", "bytes"}
_COMPONENT_MEMBERS = {"objects"}


@dataclass(frozen=True)
class ObjectEntry:
    name: str
    kind: str  # "tensor" | "resource"
    offset: int  # relative to the payload start
    nbytes: int
    shape: tuple[int, ...] = ()
    format: str = ""
    layout: str = ""
    component: str = "text"
    sha256: str | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def component_of_name(name: str) -> str:
    """v2 has no component member; the component follows from the name's first segment."""
    head = name.split("/", 1)[0]
    if head in ("vision",):
        return "vision"
    if head in ("mtp", "lm_head_draft", "dflash2"):
        return head
    return "text"


def _is_int(v) -> bool:
    return type(v) is int


def _reject_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ArtifactError(f"invalid JSON directory: duplicate member {k!r}")
        out[k] = v
    return out


def _check_members(obj, required: set, optional: set, what: str) -> None:
    if not isinstance(obj, dict):
        raise ArtifactError(f"{what} must be a JSON object")
    keys = set(obj)
    missing = required - keys
    if missing:
        raise ArtifactError(f"{what} is missing member(s): {', '.join(sorted(missing))}")
    extra = keys - required - optional
    if extra:
        raise ArtifactError(f"{what} has unknown member(s): {', '.join(sorted(extra))}")


def _parse_object(raw, version: int, index: int) -> ObjectEntry:
    if not isinstance(raw, dict):
        raise ArtifactError(f"objects[{index}] must be a JSON object")
    name = raw.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise ArtifactError(f"objects[{index}].name {name!r} is not a valid object name")
    kind = raw.get("kind")
    extra_optional = {"component", "sha256"} if version == 3 else set()
    extra_required = {"component"} if version == 3 else set()
    if kind == "tensor":
        _check_members(raw, _TENSOR_MEMBERS | extra_required, extra_optional, f"tensor {name}")
    elif kind == "resource":
        _check_members(raw, _RESOURCE_MEMBERS | extra_required, extra_optional, f"resource {name}")
    else:
        raise ArtifactError(f"object {name}: kind {kind!r} is neither 'tensor' nor 'resource'")
    for member in ("offset", "bytes"):
        if not _is_int(raw[member]) or raw[member] < 0:
            raise ArtifactError(f"object {name}: {member} must be a non-negative integer, got {raw[member]!r}")
    if version == 3:
        component = raw["component"]
        if component not in COMPONENTS:
            raise ArtifactError(f"object {name}: unknown component {component!r} (known: {', '.join(COMPONENTS)})")
        digest = raw.get("sha256")
        if "sha256" in raw and (not isinstance(digest, str) or not SHA256_PATTERN.match(digest)):  # null included
            raise ArtifactError(f"object {name}: sha256 must be 64 lowercase hex digits")
    else:
        component, digest = component_of_name(name), None
    if kind == "resource":
        if raw["encoding"] != RESOURCE_ENCODING:
            raise ArtifactError(f"resource {name}: unknown encoding {raw['encoding']!r} (expected {RESOURCE_ENCODING})")
        return ObjectEntry(name, kind, raw["offset"], raw["bytes"], component=component, sha256=digest)
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise ArtifactError(f"tensor {name}: shape must be a list of non-negative integers, got {shape!r}")
    fmt, layout = raw["format"], raw["layout"]
    if not isinstance(fmt, str) or not isinstance(layout, str):
        raise ArtifactError(f"tensor {name}: format and layout must be strings")
    get_format(fmt)
    check_layout_pairing(fmt, layout, f"tensor {name}")
    expected = encoded_size(fmt, shape, f"tensor {name}")
    if raw["bytes"] != expected:
        raise ArtifactError(f"tensor {name} stores {raw['bytes']} bytes; layout requires {expected}")
    return ObjectEntry(name, kind, raw["offset"], raw["bytes"], tuple(shape), fmt, layout, component, digest)


class UpstreamFound(ArtifactError):
    """Artifact() met an upstream ninfer file; open_artifact() binds it (format/upstream_bind.py)."""

    def __init__(self, directory):
        self.directory = directory
        super().__init__(f"{directory.path} is an upstream ninfer v{directory.version} artifact; open it with open_artifact")


def open_artifact(path: str | os.PathLike) -> "Artifact":
    """Our .nfer artifact, or an upstream ninfer artifact (v2 or v3) bound to our object names. One
    ArtifactError line when neither can be read; UpstreamArtifactError (an ArtifactError that keeps the
    file's description for inspect) when an upstream file holds what this build cannot run."""
    try:
        return Artifact(path)
    except UpstreamFound as found:
        from .errors import BindingError
        from .upstream import UpstreamArtifactError
        from .upstream_bind import UpstreamArtifact

        directory = found.directory
        try:
            return UpstreamArtifact(path, directory)
        except UpstreamArtifactError:
            raise
        except (BindingError, ArtifactError) as exc:
            raise UpstreamArtifactError(directory.info(), str(exc)) from None


class Artifact:
    """A validated, memory-mapped .nfer file. Every spec violation raises ArtifactError."""

    origin = "ninfer"  # an upstream file bound to our names says so (format/upstream_bind.UpstreamArtifact)

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file = None
        self._mm = None
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        try:
            self._file = open(self.path, "rb")
        except FileNotFoundError:
            raise ArtifactError(f"{self.path}: no such file") from None
        except IsADirectoryError:
            raise ArtifactError(f"{self.path}: is a directory, not a .nfer artifact") from None
        size = os.fstat(self._file.fileno()).st_size
        self.file_bytes = size
        if size < 16:
            raise ArtifactError(f"artifact is shorter than the 16-byte prefix ({size} bytes)")
        self._mm = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        magic = bytes(self._mm[:8])
        if magic[:7] != MAGIC_PREFIX:
            raise ArtifactError(f"bad magic {magic!r}: not a .nfer artifact (expected {MAGIC_PREFIX!r} + version byte)")
        version = magic[7]
        if version not in SUPPORTED_VERSIONS:
            raise ArtifactError(f"unsupported .nfer version {version}; this build reads versions 2 and 3")
        self.version = version
        header = HEADER_BYTES[version]
        if size < header:
            raise ArtifactError(f"artifact is shorter than the {header}-byte v{version} header ({size} bytes)")
        (json_bytes,) = struct.unpack_from("<Q", self._mm, 8)
        if json_bytes == 0:
            raise ArtifactError("json_bytes must be positive")
        if json_bytes > MAX_JSON_BYTES:
            raise ArtifactError(f"json_bytes {json_bytes} exceeds the {MAX_JSON_BYTES}-byte limit")
        self.artifact_id = uuid.UUID(bytes=bytes(self._mm[16:32])) if version == 3 else None
        self.payload_offset = align_up(header + json_bytes, PAYLOAD_ALIGNMENT)
        if header + json_bytes > size or self.payload_offset > size:
            raise ArtifactError("declared JSON or payload start extends beyond the file (truncated?)")
        try:
            text = bytes(self._mm[header : header + json_bytes]).decode("utf-8")
            root = json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_int=_bounded_int)
        except (UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise ArtifactError(f"invalid JSON directory: {str(exc)[:200]}") from None
        except RecursionError:
            raise ArtifactError("invalid JSON directory: nested too deeply") from None
        if any(self._mm[header + json_bytes : self.payload_offset]):
            raise ArtifactError("the padding between the JSON directory and the payload is not all zero bytes")
        try:
            self._parse_root(root, version)
        except ArtifactError:
            from .upstream import read_directory

            directory = read_directory(self.path, self._file, self._mm, version, root, self.payload_offset)
            if directory is not None:  # upstream's directory, not a corrupt one of ours: open_artifact binds it
                self._file = self._mm = None  # the directory owns the mapping now
                raise UpstreamFound(directory) from None
            raise
        self._check_spans(size)

    def _parse_root(self, root, version: int) -> None:
        _check_members(root, _ROOT_MEMBERS[version], _ROOT_OPTIONAL[version], "JSON root")
        identity = root["identity"]
        _check_members(identity, _IDENTITY_MEMBERS, set(), "identity")
        for k in _IDENTITY_MEMBERS:
            if not isinstance(identity[k], str) or not identity[k]:
                raise ArtifactError(f"identity.{k} must be a non-empty string")
        if identity["model_id"] not in SUPPORTED_MODEL_TYPES:
            raise ArtifactError(f"identity.model_id {identity['model_id'][:60]!r} is not one of "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if identity["weights_id"] not in RECIPES:
            raise ArtifactError(f"identity.weights_id {identity['weights_id'][:60]!r} is not a recipe this build "
                                f"knows ({', '.join(RECIPES)})")
        self.identity = dict(identity)
        self.metadata = root.get("metadata", {})
        if not isinstance(self.metadata, dict):
            raise ArtifactError("metadata must be a JSON object")
        objects = root["objects"]
        if not isinstance(objects, list) or not objects:
            raise ArtifactError("objects must be a non-empty list")
        entries = [_parse_object(raw, version, i) for i, raw in enumerate(objects)]
        self.objects: dict[str, ObjectEntry] = {}
        for e in entries:
            if e.name in self.objects:
                raise ArtifactError(f"duplicate object name: {e.name}")
            self.objects[e.name] = e
        counts: dict[str, int] = {}
        for e in entries:
            counts[e.component] = counts.get(e.component, 0) + 1
        if version == 3:
            comps = root["components"]
            if not isinstance(comps, dict) or "text" not in comps:
                raise ArtifactError("components must be an object that contains 'text'")
            for cid, desc in comps.items():
                if cid not in COMPONENTS:
                    raise ArtifactError(f"unknown component {cid!r} (known: {', '.join(COMPONENTS)})")
                _check_members(desc, _COMPONENT_MEMBERS, set(), f"component {cid}")
                if not _is_int(desc["objects"]) or desc["objects"] != counts.get(cid, 0):
                    raise ArtifactError(
                        f"component {cid} declares {desc['objects']!r} objects but {counts.get(cid, 0)} objects name it"
                    )
            for cid in counts:
                if cid not in comps:
                    raise ArtifactError(f"objects name component {cid!r}, which components does not declare")
            self.components = tuple(c for c in COMPONENTS if c in comps)
        else:
            bad = [c for c in counts if c not in V2_COMPONENTS]
            if bad:
                first = next(e.name for e in entries if e.component in bad)
                raise ArtifactError(
                    f"object {first} is companion weight ({first.split('/')[0]}); version 2 carries only text and vision"
                )
            self.components = tuple(c for c in COMPONENTS if c in counts)
        self._entries = entries

    def _check_spans(self, size: int) -> None:
        cursor = 0
        for e in self._entries:
            alignment = TENSOR_ALIGNMENT if e.kind == "tensor" else RESOURCE_ALIGNMENT
            if e.offset % alignment:
                raise ArtifactError(f"object {e.name} is not {alignment}-byte aligned")
            if e.offset < cursor:
                raise ArtifactError(f"object {e.name} overlaps or is out of order")
            if self.payload_offset + e.end > size:
                raise ArtifactError(f"object {e.name} extends beyond the file (truncated artifact?)")
            cursor = e.end
        if self.payload_offset + cursor != size:
            raise ArtifactError(
                f"file has {size - self.payload_offset - cursor} trailing bytes after the last object"
            )

    # --- access ----------------------------------------------------------------------

    def entry(self, name: str) -> ObjectEntry:
        try:
            return self.objects[name]
        except KeyError:
            raise ArtifactError(f"required artifact object is missing: {name}") from None

    def raw(self, name: str) -> memoryview:
        e = self.entry(name)
        start = self.payload_offset + e.offset
        return memoryview(self._mm)[start : start + e.nbytes]

    def resource_bytes(self, name: str) -> bytes:
        e = self.entry(name)
        if e.kind != "resource":
            raise ArtifactError(f"object {name} is a tensor, not a resource")
        data = bytes(self.raw(name))
        # resources are small: their v3 checksums are always checked (tensors: inspect --verify)
        if e.sha256 is not None and e.sha256 != SHA256_PLACEHOLDER and hashlib.sha256(data).hexdigest() != e.sha256:
            raise ArtifactError(f"resource {name}: its bytes do not match its sha256 (the file is corrupt); "
                                "download or convert it again")
        return data

    def has(self, name: str) -> bool:
        return name in self.objects

    def planes(self, name: str) -> tuple[memoryview, memoryview | None, memoryview, RowSplitGeometry]:
        e = self.entry(name)
        fmt = get_format(e.format)
        if not isinstance(fmt, GroupedFormat):
            raise ArtifactError(f"tensor {name} is {e.format}, not a grouped format")
        geo = RowSplitGeometry(e.shape[0], e.shape[1], fmt)
        base, high, scale = geo.split(self.raw(name))
        return base, high, scale, geo

    def read_direct(self, name: str) -> np.ndarray:
        """Raw words of a BF16 (as uint16), FP32 or I32 tensor, shaped, zero-copy."""
        e = self.entry(name)
        fmt = get_format(e.format)
        if not isinstance(fmt, DirectFormat):
            raise ArtifactError(f"tensor {name} is {e.format}, not a direct format")
        return np.frombuffer(self.raw(name), dtype=fmt.numpy_dtype).reshape(e.shape)

    def read_float(self, name: str) -> np.ndarray:
        """Decode any tensor to float32 (I32 to int32) with the numpy reference decoders."""
        from .quantize import dequantize

        e = self.entry(name)
        fmt = get_format(e.format)
        if isinstance(fmt, GroupedFormat):
            base, high, scale, geo = self.planes(name)
            return dequantize(base, high, scale, geo.rows, geo.cols, fmt)
        if not isinstance(fmt, DirectFormat):  # floating-point codes
            from .float_codes import decode

            return decode(e.format, self.raw(name), e.shape[0], e.shape[1])
        words = self.read_direct(name)
        if e.format == "BF16":
            return (words.astype(np.uint32) << 16).view(np.float32)
        return words.copy()

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping closes when it is released
            self._mm = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- writer ----------------------------------------------------------------------------


@dataclass
class PlannedObject:
    name: str
    kind: str
    nbytes: int
    component: str
    shape: tuple[int, ...] = ()
    format: str = ""
    offset: int = 0
    written: int = 0  # bytes (direct/resource) or rows (grouped) received so far


@dataclass
class ArtifactPlan:
    """The full directory of an artifact, laid out before any payload byte is written."""

    version: int
    model_id: str
    weights_id: str
    metadata: dict = field(default_factory=dict)
    objects: list[PlannedObject] = field(default_factory=list)
    _names: set = field(default_factory=set)

    def __post_init__(self):
        if self.version not in SUPPORTED_VERSIONS:
            raise ArtifactError(f"cannot write .nfer version {self.version}; choose 2 or 3")

    def _add(self, obj: PlannedObject) -> None:
        if not NAME_PATTERN.match(obj.name):
            raise ArtifactError(f"invalid object name: {obj.name!r}")
        if obj.name in self._names:
            raise ArtifactError(f"duplicate object name: {obj.name}")
        allowed = COMPONENTS if self.version == 3 else V2_COMPONENTS
        if obj.component not in allowed:
            raise ArtifactError(
                f"version {self.version} cannot carry component {obj.component!r} ({obj.name}); "
                f"companion weights need --version 3"
            )
        self._names.add(obj.name)
        self.objects.append(obj)

    def add_tensor(self, name: str, shape, fmt: str, component: str | None = None) -> None:
        shape = tuple(int(d) for d in shape)
        nbytes = encoded_size(fmt, shape, f"tensor {name}")
        self._add(PlannedObject(name, "tensor", nbytes, component or component_of_name(name), shape, fmt))

    def add_resource(self, name: str, nbytes: int, component: str | None = None) -> None:
        self._add(PlannedObject(name, "resource", int(nbytes), component or component_of_name(name)))

    def directory(self, checksums: dict[str, str] | None, with_checksum_fields: bool) -> dict:
        objects = []
        for o in self.objects:
            if o.kind == "tensor":
                d = {"name": o.name, "kind": "tensor", "shape": list(o.shape), "format": o.format,
                     "layout": FORMAT_LAYOUT[o.format], "offset": o.offset, "bytes": o.nbytes}
            else:
                d = {"name": o.name, "kind": "resource", "encoding": RESOURCE_ENCODING,
                     "offset": o.offset, "bytes": o.nbytes}
            if self.version == 3:
                d["component"] = o.component
                if with_checksum_fields:
                    d["sha256"] = (checksums or {}).get(o.name, SHA256_PLACEHOLDER)
            objects.append(d)
        root = {"identity": {"model_id": self.model_id, "weights_id": self.weights_id}}
        if self.version == 3:
            counts: dict[str, int] = {}
            for o in self.objects:
                counts[o.component] = counts.get(o.component, 0) + 1
            root["components"] = {c: {"objects": counts[c]} for c in COMPONENTS if c in counts}
            if self.metadata:
                root["metadata"] = self.metadata
        root["objects"] = objects
        return root

    def assign_offsets(self) -> int:
        cursor = 0
        for o in self.objects:
            cursor = align_up(cursor, TENSOR_ALIGNMENT if o.kind == "tensor" else RESOURCE_ALIGNMENT)
            o.offset = cursor
            cursor += o.nbytes
        return cursor


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # every integer in a directory fits in 64 bits
        raise ValueError(f"an integer written with {len(text)} digits")
    return int(text)


def _remove_stale_temps(path: Path) -> None:
    """Temp files of this target left by writers that died (kill -9, power loss): their process is gone."""
    for stale in path.parent.glob(f"{glob_escape(path.name)}.tmp-*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except (PermissionError, OverflowError, ValueError):
            pass  # alive under another user, or not a pid: leave it


def _sha256_span(fd: int, start: int, length: int, chunk: int = 16 << 20) -> str:
    """Hash a file span with pread in bounded chunks (no mapping, so resident memory stays flat)."""
    h = hashlib.sha256()
    pos, end = start, start + length
    while pos < end:
        data = os.pread(fd, min(chunk, end - pos), pos)
        if not data:
            raise ArtifactError("short read while checksumming the new artifact")
        h.update(data)
        pos += len(data)
    return h.hexdigest()


class ArtifactWriter:
    """Writes a planned artifact to a temp file, then fsyncs and renames it into place.

    Payloads may arrive in any object order; inside an object, direct bytes and grouped
    rows must arrive in order, so coverage is checked with one counter per object.
    """

    def __init__(self, path: str | os.PathLike, plan: ArtifactPlan, checksums: bool = True):
        if not plan.objects:
            raise ArtifactError("an artifact needs at least one object")
        if "text" not in {o.component for o in plan.objects}:
            raise ArtifactError("an artifact needs text objects")
        self.path = Path(path)
        self.plan = plan
        self.checksums = checksums and plan.version == 3
        self.artifact_id = uuid.uuid4()
        payload_bytes = plan.assign_offsets()
        header = HEADER_BYTES[plan.version]
        self._json = self._encode_directory(None)
        self.payload_offset = align_up(header + len(self._json), PAYLOAD_ALIGNMENT)
        self.file_bytes = self.payload_offset + payload_bytes
        self._by_name = {o.name: o for o in plan.objects}
        self.tmp_path = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        _remove_stale_temps(self.path)
        self._fd = os.open(self.tmp_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(self._fd, self.file_bytes)
            self._write_header()
        except BaseException:
            self.abort()
            raise

    def _encode_directory(self, checksums) -> bytes:
        root = self.plan.directory(checksums, self.checksums)
        return json.dumps(root, separators=(",", ":"), ensure_ascii=False).encode("utf-8")

    def _write_header(self) -> None:
        prefix = MAGIC_PREFIX + bytes([self.plan.version]) + struct.pack("<Q", len(self._json))
        if self.plan.version == 3:
            prefix += self.artifact_id.bytes
        os.pwrite(self._fd, prefix + self._json, 0)

    def _pwrite(self, data, position: int) -> None:
        view = memoryview(data).cast("B")
        while view:
            n = os.pwrite(self._fd, view, position)
            view, position = view[n:], position + n

    def _obj(self, name: str, kind: str) -> PlannedObject:
        try:
            o = self._by_name[name]
        except KeyError:
            raise ArtifactError(f"object {name} is not in the artifact plan") from None
        if o.kind != kind:
            raise ArtifactError(f"object {name} is a {o.kind}, not a {kind}")
        return o

    def write_resource(self, name: str, data: bytes) -> None:
        o = self._obj(name, "resource")
        if o.written or len(data) != o.nbytes:
            raise ArtifactError(f"resource {name}: planned {o.nbytes} bytes, got {len(data)}")
        self._pwrite(data, self.payload_offset + o.offset)
        o.written = o.nbytes

    def write_direct(self, name: str, array: np.ndarray) -> None:
        """Append raw little-endian words (bf16 as uint16) for a direct-format tensor, in C order."""
        o = self._obj(name, "tensor")
        fmt = get_format(o.format)
        if not isinstance(fmt, DirectFormat):
            raise ArtifactError(f"tensor {name} is {o.format}; use write_rows")
        data = np.ascontiguousarray(array, dtype=fmt.numpy_dtype)
        if o.written + data.nbytes > o.nbytes:
            raise ArtifactError(f"tensor {name}: more bytes than its planned {o.nbytes}")
        self._pwrite(data, self.payload_offset + o.offset + o.written)
        o.written += data.nbytes

    def write_encoded(self, name: str, data: bytes) -> None:
        """A floating-point-code tensor's whole encoding (format/float_codes.py layouts), at once."""
        o = self._obj(name, "tensor")
        if isinstance(get_format(o.format), (DirectFormat, GroupedFormat)):
            raise ArtifactError(f"tensor {name} is {o.format}; use write_direct or write_rows")
        if o.written or len(data) != o.nbytes:
            raise ArtifactError(f"tensor {name}: planned {o.nbytes} bytes, got {len(data)}")
        self._pwrite(data, self.payload_offset + o.offset)
        o.written = o.nbytes

    def write_rows(self, name: str, row_begin: int, planes: tuple[bytes, bytes, bytes]) -> None:
        """Place packed row-split planes for rows [row_begin, row_begin + n) of a grouped tensor."""
        o = self._obj(name, "tensor")
        fmt = get_format(o.format)
        if not isinstance(fmt, GroupedFormat):
            raise ArtifactError(f"tensor {name} is {o.format}; use write_direct")
        if row_begin != o.written:
            raise ArtifactError(f"tensor {name}: rows must arrive in order (expected row {o.written}, got {row_begin})")
        geo = RowSplitGeometry(o.shape[0], o.shape[1], fmt)
        per_row = geo.groups_per_row * fmt.base_bytes_per_group
        rows = len(planes[0]) // per_row
        if rows == 0 or row_begin + rows > geo.rows:
            raise ArtifactError(f"tensor {name}: {rows} rows at {row_begin} do not fit its {geo.rows} rows")
        present = [p for p in planes if len(p)]
        spans = geo.row_spans(row_begin, row_begin + rows)
        if len(present) != len(spans) or any(len(p) != s[1] for p, s in zip(present, spans)):
            raise ArtifactError(f"tensor {name}: plane sizes do not match {rows} rows of {o.format}")
        for data, (off, _) in zip(present, spans):
            self._pwrite(data, self.payload_offset + o.offset + off)
        o.written += rows

    def leave_zero(self, name: str) -> None:
        """Declare a tensor's payload all-zero: the bytes are the file's sparse hole (the file is
        sized up front), so shape-only artifacts for benchmarks cost no disk and no write time."""
        o = self._obj(name, "tensor")
        if o.written:
            raise ArtifactError(f"tensor {name} already has payload written")
        o.written = o.shape[0] if isinstance(get_format(o.format), GroupedFormat) else o.nbytes

    def _complete(self, o: PlannedObject) -> bool:
        if o.kind == "tensor" and isinstance(get_format(o.format), GroupedFormat):
            return o.written == o.shape[0]
        return o.written == o.nbytes

    def finish(self) -> Path:
        missing = [o.name for o in self.plan.objects if not self._complete(o)]
        if missing:
            self.abort()
            raise ArtifactError(f"payload missing for {len(missing)} object(s), first: {missing[0]}")
        try:
            if self.checksums:
                sums = {o.name: _sha256_span(self._fd, self.payload_offset + o.offset, o.nbytes)
                        for o in self.plan.objects}
                final = self._encode_directory(sums)
                assert len(final) == len(self._json), "checksum fields are fixed width"
                self._json = final
                self._write_header()
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        return self.path

    def abort(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        try:
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
