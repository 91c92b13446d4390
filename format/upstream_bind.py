"""The binder for upstream ninfer artifacts: their logical parameters as the objects our runtime reads.

`UpstreamArtifact` opens an official `.ninfer` file (v2 or v3, see format/upstream.py) and presents it
through the `Artifact` interface under our names and layouts (specs/container.md §6):

- each of our objects is a list of row blocks of upstream's logical parameters, e.g. our
  `attention/query_gate_key_value` takes, per head, that head's query rows then its gate rows, then the
  key and value rows (upstream stores them de-interleaved, [q, k, gate, v]); `gdn/query_key_value_z`
  stacks query, key, value, z; `moe/router_shared_gate` splits into `moe/router` + `moe/shared_gate`;
- an object that is one whole upstream object in the same format is a zero-copy view of the file;
  any other is laid out once when the runtime reads it (rows gathered plane by plane; the tap-major
  GDN convolution transposed to channel-major; the draft head's rows ordered by token id);
- no weight is re-quantized: where one of our matrices stacks parents of different widths (the 27B's
  Q4 query/key and Q5 gate/value), the narrower codes are re-packed in the wider format with the same
  scales, which decodes to the same values bit for bit (a Q4 code is a Q5 code; a G64 group is two
  G32 groups with the same scale);
- resources come from `frontend/*` (v2) or the components' resource roles (v3); the config from the
  v3 text component or, for v2, from the model id's known shape; tokenizer_config's added tokens are
  merged into the tokenizer, whose size masks the padded vocabulary rows at sampling.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .container import Artifact, ObjectEntry, component_of_name
from .errors import ArtifactError, BindingError, ConvertError
from .float_codes import (
    Fp8RowGeometry,
    decode_fp8_rows,
    decode_nvfp4,
    fp8_rows_bytes,
    nvfp4_from_block_scale,
    nvfp4_rows_bytes,
)
from .inventory import (
    DFLASH2_CONFIG,
    DRAFT_HEAD,
    DRAFT_TOKEN_IDS,
    FIXED_ROLE_FORMATS,
    RESOURCE_NAMES,
    ObjectSpec,
    dflash2_inventory,
    required_mtp_names,
    required_text_names,
)
from .layouts import RowSplitGeometry, align_up, encoded_size, pack_row_split, unpack_row_split
from .model_config import DFlash2Config, ModelConfig
from .numeric import FORMAT_LAYOUT, FORMATS, DirectFormat, FloatCodeFormat, GroupedFormat, get_format
from .upstream import UpstreamArtifactError, UpstreamDirectory

# upstream frontend roles -> our resource names (the vision preprocessor joins a bound vision tower)
_RESOURCES = {"tokenizer.json": "tokenizer", "tokenizer_config.json": "tokenizer_config",
              "chat_template.jinja": "chat_template", "generation_config.json": "generation_config"}


@dataclass(frozen=True)
class Block:
    """Rows `rows` of upstream object `oid`, viewed as [N, width] (width = last dim; 1 for vectors)."""

    oid: str
    rows: np.ndarray | range

    @property
    def index(self):
        """The rows as an index into a [N, ...] array: a slice (a view) for a range, else the row array."""
        return slice(self.rows.start, self.rows.stop) if isinstance(self.rows, range) else self.rows


@dataclass
class Plan:
    """How one of our objects is made: its blocks in order, its format, and an optional transpose."""

    spec_name: str
    shape: tuple[int, ...]
    fmt: str
    blocks: list[Block]
    transpose: bool = False
    notes: list[str] = field(default_factory=list)
    entry_shape: tuple[int, ...] | None = None  # the same elements under our shape (the 5-D patch embedding)


def _matrix_view(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, width) of an upstream object seen as a matrix: vectors and scalars are one column."""
    if len(shape) <= 1:
        return (shape[0] if shape else 1), 1
    return math.prod(shape[:-1]), shape[-1]


class _Logical:
    """Row blocks of upstream logical parameters."""

    def __init__(self, d: UpstreamDirectory):
        self.d = d
        self.used: set[str] = set()

    def blocks(self, name: str, begin: int | None = None, end: int | None = None) -> list[Block]:
        """The parameter's rows [begin, end) as blocks of its objects' rows."""
        parts = self.d.bindings.get(name)
        if parts is None:
            raise BindingError(f"the upstream artifact has no parameter {name}")
        self.used.add(name)
        applied = self.d.auxiliaries.get(name, set()) - {"activation_input_divisor"}  # A4 only: A16 ignores it
        if applied:  # e.g. hadamard_signs: the stored matrix multiplies a rotated input
            raise BindingError(f"upstream parameter {name} is used with {', '.join(sorted(applied))}, which this "
                               "build does not apply")
        out = []
        for oid, b, e in parts:
            n_rows, width = _matrix_view(self.d.objects[oid].shape)
            if b % width or e % width:
                raise BindingError(f"upstream parameter {name} binds elements [{b}, {e}) of {oid[:60]}, which are not "
                                   f"whole rows of {width}; this build binds whole rows only")
            out.append(Block(oid, range(b // width, e // width)))
        if begin is None:
            return out
        picked, cursor = [], 0
        for blk in out:
            lo, hi = max(begin, cursor), min(end, cursor + len(blk.rows))
            if lo < hi:
                picked.append(Block(blk.oid, blk.rows[lo - cursor : hi - cursor]))
            cursor += len(blk.rows)
        if cursor < end:
            raise BindingError(f"upstream parameter {name} has {cursor} rows; rows up to {end} are needed")
        return picked


def _sources(cfg: ModelConfig, logical: _Logical, spec: ObjectSpec) -> tuple[list[Block], bool]:
    """The blocks our object `spec` is made of (and whether it is transposed)."""
    name, L = spec.name, logical
    block, role = "", name
    if name.startswith(("text/layers/", "mtp/layers/")):
        parts = name.split("/")
        block, role = "/".join(parts[:3]) + "/", "/".join(parts[3:])
    if name.startswith("vision/"):
        return sum((L.blocks(n) for n in _vision_sources(name)), []), False
    if role == "attention/query_gate_key_value":
        d, heads = cfg.head_dim, cfg.num_heads
        out = []
        for h in range(heads):  # our q rows keep HF's per-head [query, gate] interleave
            out += L.blocks(block + "attention/query", h * d, (h + 1) * d)
            out += L.blocks(block + "attention/gate", h * d, (h + 1) * d)
        return out + L.blocks(block + "attention/key") + L.blocks(block + "attention/value"), False
    if role == "gdn/query_key_value_z":
        return sum((L.blocks(block + "gdn/" + p) for p in ("query", "key", "value", "z")), []), False
    simple = {"gdn/beta_projection": "gdn/b_projection", "gdn/alpha_projection": "gdn/a_projection",
              "moe/shared_gate": "moe/shared_score", "moe/shared_down": "moe/shared/down"}
    if role in simple:
        return L.blocks(block + simple[role]), False
    if role == "gdn/convolution":
        return L.blocks(block + "gdn/convolution"), True
    if role == "mlp/gate_up":
        return L.blocks(block + "mlp/gate") + L.blocks(block + "mlp/up"), False
    if role == "moe/shared_gate_up":
        return L.blocks(block + "moe/shared/gate") + L.blocks(block + "moe/shared/up"), False
    if role == "moe/experts_gate_up":
        return sum((L.blocks(f"{block}moe/experts/{e}/{p}") for e in range(cfg.num_experts) for p in ("gate", "up")), []), False
    if role == "moe/experts_down":
        return sum((L.blocks(f"{block}moe/experts/{e}/down") for e in range(cfg.num_experts)), []), False
    if name.startswith("dflash2/") and name.endswith("attention/query_key_value"):
        b = name.removesuffix("query_key_value")
        return L.blocks(b + "query") + L.blocks(b + "key") + L.blocks(b + "value"), False
    if name.startswith("dflash2/") and name.endswith("mlp/gate_up"):
        b = name.removesuffix("gate_up")
        return L.blocks(b + "gate") + L.blocks(b + "up"), False
    return L.blocks(name), False


VISION_PATCH = "vision/patch_embed.proj.weight"


def _vision_sources(name: str) -> list[str]:
    """Upstream's logical vision parameters our checkpoint-named object `name` stacks."""
    key = name.removeprefix("vision/")
    fixed = {"patch_embed.proj.weight": "patch_embedding", "patch_embed.proj.bias": "patch_embedding_bias",
             "pos_embed.weight": "position_embedding", "merger.norm.weight": "merger/norm_weight",
             "merger.norm.bias": "merger/norm_bias", "merger.linear_fc1.weight": "merger/fc1",
             "merger.linear_fc1.bias": "merger/fc1_bias", "merger.linear_fc2.weight": "merger/fc2",
             "merger.linear_fc2.bias": "merger/fc2_bias"}
    if key in fixed:
        return ["vision/" + fixed[key]]
    _, block, rest = key.split(".", 2)  # blocks.{i}.<rest>
    b = f"vision/layers/{block}/"
    per_block = {"norm1.weight": ["norm1_weight"], "norm1.bias": ["norm1_bias"], "norm2.weight": ["norm2_weight"],
                 "norm2.bias": ["norm2_bias"], "attn.qkv.weight": ["attention/query", "attention/key", "attention/value"],
                 "attn.qkv.bias": ["attention/query_bias", "attention/key_bias", "attention/value_bias"],
                 "attn.proj.weight": ["attention/output"], "attn.proj.bias": ["attention/output_bias"],
                 "mlp.linear_fc1.weight": ["mlp/fc1"], "mlp.linear_fc1.bias": ["mlp/fc1_bias"],
                 "mlp.linear_fc2.weight": ["mlp/fc2"], "mlp.linear_fc2.bias": ["mlp/fc2_bias"]}
    return [b + p for p in per_block[rest]]


def _target_format(spec: ObjectSpec, formats: set[str], what: str) -> tuple[str, list[str]]:
    """Our format for an object whose blocks come in `formats` (never lossy for matrices)."""
    unknown = sorted(f for f in formats if f not in FORMATS)
    if unknown:
        raise BindingError(f"{what}: upstream format {unknown[0]} is not one this build decodes")
    fixed = FIXED_ROLE_FORMATS.get(spec.role)
    if fixed is not None:
        if formats == {fixed} or (fixed == "FP32" and formats <= {"BF16", "FP32"}):
            return fixed, []
        if fixed == "BF16" and not any(isinstance(FORMATS[f], DirectFormat) for f in formats):
            return fixed, [f"{spec.name}: {'/'.join(sorted(formats))} decoded to BF16 (this role runs in BF16 here)"]
        raise BindingError(f"{what}: upstream stores it as {'/'.join(sorted(formats))}; this build reads {fixed} there")
    if len(formats) == 1:
        return next(iter(formats)), []
    grouped = [FORMATS[f] for f in formats]
    if not all(isinstance(f, GroupedFormat) for f in grouped):
        raise BindingError(f"{what}: its parents mix {'/'.join(sorted(formats))}, which this build cannot stack")
    widest = "W8G32_F16S" if "W8G32_F16S" in formats else max(formats, key=lambda f: FORMATS[f].bits)
    return widest, [f"{spec.name}: {'+'.join(sorted(formats))} parents stacked as {widest} (same values)"]


class UpstreamArtifact(Artifact):
    """An upstream artifact bound to our object names (see module doc); read-only, like Artifact."""

    origin = "upstream ninfer"

    def __init__(self, path, directory: UpstreamDirectory):
        self.path = Path(path)
        self._file = self._mm = None
        self.directory = d = directory
        self.version = d.version
        self.file_bytes = sum(f.start + f.nbytes for f in d.payload.files)
        self.payload_offset = d.payload.files[0].start
        self.artifact_id = getattr(d, "artifact_id", None)
        self.upstream = d.info()
        self.notes: list[str] = []
        self.unbound: dict[str, str] = {}  # component -> why this build leaves it out
        try:
            self._bind()
        except BaseException:
            d.close()
            raise

    # --- binding -----------------------------------------------------------------------

    def _config_dict(self) -> dict:
        from .shapes import NAMED_SHAPES

        d = self.directory
        text = dict(d.text_config) if d.text_config is not None else dict(NAMED_SHAPES.get(d.model_id) or {})
        if not text:
            raise UpstreamArtifactError(self.upstream, f"model id {str(d.model_id)[:40]!r} names no known shape")
        text.setdefault("mtp_num_hidden_layers", 1 if any(n.startswith("mtp/") for n in d.bindings) else 0)
        base = str(text.get("model_type", "qwen3_5_text")).removesuffix("_text")
        arch = "Qwen3_5MoeForConditionalGeneration" if base == "qwen3_5_moe" else "Qwen3_5ForConditionalGeneration"
        return {"architectures": [arch], "model_type": base, "text_config": text}

    def _bind(self) -> None:
        d = self.directory
        self._resources: dict[str, bytes] = {}
        self._config = self._config_dict()
        generation = d.object_bytes(d.resources["generation_config.json"]) if "generation_config.json" in d.resources else None
        try:
            self.config = ModelConfig.from_hf_dict(self._config, json.loads(bytes(generation)) if generation else None)
        except (ConvertError, ValueError) as exc:
            raise UpstreamArtifactError(self.upstream, f"its text config does not describe a model this build runs ({exc})") from None
        self._resources[RESOURCE_NAMES["config"]] = json.dumps(self._config).encode()
        for role, ours in _RESOURCES.items():
            if role in d.resources:
                self._resources[RESOURCE_NAMES[ours]] = bytes(d.object_bytes(d.resources[role]))
        if RESOURCE_NAMES["tokenizer"] in self._resources:
            self._resources[RESOURCE_NAMES["tokenizer"]] = merged_tokenizer(
                self._resources[RESOURCE_NAMES["tokenizer"]], self._resources.get(RESOURCE_NAMES["tokenizer_config"]))
        logical = _Logical(d)
        cfg = self.config
        text_params = [n for n in d.bindings if n.startswith(("text/", "mtp/", "proposal/"))]
        specs = list(required_text_names(cfg).values())
        self.plans: dict[str, Plan] = {}
        for spec in specs:  # the text model: any failure here is the file's one-line error
            self.plans[spec.name] = self._plan(spec, logical)
        optional: dict[str, list[ObjectSpec]] = {}
        if any(n.startswith("mtp/") for n in d.bindings):
            optional["mtp"] = list(required_mtp_names(cfg, 1).values())
        if "proposal/head" in d.bindings:
            optional["lm_head_draft"] = []
        if any(n.startswith("dflash2/") for n in d.bindings):
            try:
                dcfg = self._dflash2_config(cfg)
                self._resources[DFLASH2_CONFIG] = json.dumps(dcfg.to_hf_dict()).encode()
                optional["dflash2"] = dflash2_inventory(dcfg)
            except (ConvertError, BindingError) as exc:
                self.unbound["dflash2"] = str(exc)
        if any(n.startswith("vision/") for n in d.bindings):
            try:
                optional["vision"] = self._vision_specs(cfg)
            except (BindingError, ConvertError, KeyError, TypeError) as exc:
                self.unbound["vision"] = f"its vision config cannot be read ({exc})"
                self._set_vision_config(None)
        if any(n.startswith("dflash/") for n in d.bindings):
            self.unbound["dflash"] = "DFlash (v1) drafters are not implemented in this build; DFlash2 is"
        for comp, comp_specs in optional.items():
            try:
                plans = {s.name: self._plan(s, logical) for s in comp_specs}
                if comp == "vision":
                    plans[VISION_PATCH].entry_shape = self._patch_shape
                    for role in ("preprocessor_config.json",):
                        if role in d.resources:
                            self._resources[RESOURCE_NAMES["preprocessor_config"]] = bytes(d.object_bytes(d.resources[role]))
                if comp == "lm_head_draft":
                    plans = self._draft_plans(logical, cfg)
            except (BindingError, ArtifactError) as exc:
                self.unbound[comp] = str(exc)
                if comp == "vision":  # the text model runs without it: its config section goes too
                    self._set_vision_config(None)
                continue
            self.plans.update(plans)
        stray = [n for n in text_params if n not in logical.used and not (n.startswith("mtp/") and "mtp" in self.unbound)
                 and not (n.startswith("proposal/") and "lm_head_draft" in self.unbound)]
        if stray:
            raise UpstreamArtifactError(self.upstream, f"its parameter {stray[0][:80]} is not one the {cfg.model_type} "
                                        "model of this build uses")
        # weights_id must name a recipe our own reader accepts when the file is re-written (convert --from-artifact);
        # no recipe of ours is upstream's profile, which the metadata keeps
        self.identity = {"model_id": cfg.model_type, "weights_id": "q4"}
        self.metadata = {"upstream_model_id": d.model_id, "upstream_version": d.version, "upstream_profile": d.profile}
        self._entries = []
        offset = 0
        for name, p in self.plans.items():
            nbytes = encoded_size(p.fmt, p.shape, name)
            self._entries.append(ObjectEntry(name, "tensor", offset, nbytes, p.entry_shape or p.shape, p.fmt,
                                             FORMAT_LAYOUT[p.fmt], component_of_name(name)))
            offset = align_up(offset + nbytes, 256)
            self.notes += p.notes
        for name, data in self._resources.items():
            self._entries.append(ObjectEntry(name, "resource", offset, len(data), (), "", "raw-bytes-v1",
                                             component_of_name(name) if not name.startswith("resource/") else "text"))
            offset += len(data)
        self.objects = {e.name: e for e in self._entries}
        comps = {e.component for e in self._entries}
        self.components = tuple(c for c in ("text", "vision", "mtp", "lm_head_draft", "dflash2") if c in comps)

    def _plan(self, spec: ObjectSpec, logical: _Logical) -> Plan:
        what = f"{self.path.name}: {spec.name}"
        blocks, transpose = _sources(self.config, logical, spec)
        fmt, notes = _target_format(spec, {self.directory.objects[b.oid].format for b in blocks}, what)
        rows = sum(len(b.rows) for b in blocks)
        widths = {_matrix_view(self.directory.objects[b.oid].shape)[1] for b in blocks}
        # a transposed object is stored [taps, C] for our [C, taps]
        want_rows, want_width = (spec.shape[1], spec.shape[0]) if transpose else _matrix_view(spec.shape)
        if rows != want_rows or widths != {want_width}:
            raise BindingError(f"{what}: upstream holds {rows} rows of {'/'.join(map(str, sorted(widths)))}; "
                               f"{self.directory.model_id} needs {want_rows} rows of {want_width} ({list(spec.shape)})")
        return Plan(spec.name, tuple(spec.shape), fmt, blocks, transpose, notes)

    def _set_vision_config(self, vcfg: dict | None) -> None:
        """The config resource with the tower's section (None: without it, the text model alone)."""
        if vcfg is None:
            self._config.pop("vision_config", None)
        else:
            self._config["vision_config"] = vcfg
        self._resources[RESOURCE_NAMES["config"]] = json.dumps(self._config).encode()

    def _vision_specs(self, cfg: ModelConfig) -> list[ObjectSpec]:
        """Our vision objects (the checkpoint's names under vision/, format/shapes.vision_inventory) for
        the tower's config: v3's vision component, or v2's model id (every family member has the same tower)."""
        from .convert import VISION_MATRICES
        from .shapes import _VISION, vision_inventory

        comp = self.directory.components.get("vision")
        vcfg = dict(comp["config"]) if isinstance(comp, dict) and isinstance(comp.get("config"), dict) else dict(_VISION)
        vcfg.setdefault("out_hidden_size", cfg.hidden_size)
        vcfg.setdefault("in_channels", 3)
        self._set_vision_config(vcfg)
        specs = []
        for name, shape in vision_inventory(vcfg):
            matrix = name.endswith(VISION_MATRICES) and len(shape) == 2
            if name == VISION_PATCH:  # upstream stores it as the [hidden, C*T*P*P] matrix it multiplies
                self._patch_shape = tuple(shape)
                shape = (shape[0], math.prod(shape[1:]))
            specs.append(ObjectSpec(name, tuple(shape), "companion_matrix" if matrix else "norm", "vision", ()))
        return specs

    def _draft_plans(self, logical: _Logical, cfg: ModelConfig) -> dict[str, Plan]:
        """Upstream orders the draft head's rows by descending token count; ours ascend by token id."""
        ids_blocks = logical.blocks("proposal/token_ids")
        if len(ids_blocks) != 1:
            raise BindingError("the draft head's token ids are not one block")
        ids = self._direct_rows(ids_blocks[0], np.dtype("<i4")).reshape(-1)
        if ids.size == 0 or ids.min() < 0 or ids.max() >= cfg.vocab_size or np.unique(ids).size != ids.size:
            raise BindingError("the draft head's token ids repeat or fall outside the vocabulary")
        order = np.argsort(ids, kind="stable")
        head = logical.blocks("proposal/head")
        if len(head) != 1 or len(head[0].rows) != ids.size:
            raise BindingError("the draft head is not one block of one row per token id")
        oid = head[0].oid
        fmt = self.directory.objects[oid].format
        rows = np.asarray(head[0].rows)[order]
        width = _matrix_view(self.directory.objects[oid].shape)[1]
        id_rows = np.asarray(ids_blocks[0].rows)[order]
        return {DRAFT_HEAD: Plan(DRAFT_HEAD, (ids.size, width), fmt, [Block(oid, rows)]),
                DRAFT_TOKEN_IDS: Plan(DRAFT_TOKEN_IDS, (ids.size,), "I32", [Block(ids_blocks[0].oid, id_rows)])}

    def _dflash2_config(self, cfg: ModelConfig) -> DFlash2Config:
        from .shapes import NAMED_SHAPES, dflash2_shape_config

        comp = self.directory.components.get("dflash2")
        if isinstance(comp, dict) and isinstance(comp.get("config"), dict):
            raw = dict(comp["config"])
            draft = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}
            raw.setdefault("hidden_size", cfg.hidden_size)
            raw.setdefault("vocab_size", cfg.vocab_size)
            if "block_size" not in raw and "block_size" not in draft:
                raw["block_size"] = 8
            dcfg = DFlash2Config.from_hf_dict(raw)
        elif self.directory.model_id in NAMED_SHAPES:
            dcfg = dflash2_shape_config(NAMED_SHAPES[self.directory.model_id])
        else:
            raise BindingError("the DFlash2 drafter's config is unknown")
        dcfg.check_target(cfg)
        return dcfg

    # --- reading -----------------------------------------------------------------------

    def _direct_rows(self, blk: Block, dtype: np.dtype) -> np.ndarray:
        o = self.directory.objects[blk.oid]
        n_rows, width = _matrix_view(o.shape)
        arr = np.frombuffer(self.directory.object_bytes(blk.oid), dtype=dtype).reshape(n_rows, width)
        return arr[blk.index]

    def _grouped_rows(self, blk: Block, fmt: GroupedFormat):
        """(base, high, scale) plane rows [r, bytes] of a block, in its parent's format."""
        o = self.directory.objects[blk.oid]
        geo = RowSplitGeometry(o.shape[0], o.shape[1], fmt)
        base, high, scale = geo.split(self.directory.object_bytes(blk.oid))
        n, rows = o.shape[0], blk.index
        return [np.frombuffer(base, np.uint8).reshape(n, -1)[rows],
                np.frombuffer(high, np.uint8).reshape(n, -1)[rows] if high is not None else None,
                np.frombuffer(scale, np.uint8).reshape(n, -1)[rows]]

    def _build(self, p: Plan) -> bytes | memoryview:
        d = self.directory
        if len(p.blocks) == 1 and not p.transpose:
            o = d.objects[p.blocks[0].oid]
            rows = p.blocks[0].rows
            if o.format == p.fmt and o.layout == FORMAT_LAYOUT[p.fmt] and isinstance(rows, range) and rows.start == 0 \
                    and rows.stop == _matrix_view(o.shape)[0]:
                return d.object_bytes(o.id)  # zero-copy: the whole upstream object is ours as it is
        target = get_format(p.fmt)
        if isinstance(target, DirectFormat):
            pieces = []
            for b in p.blocks:
                src = d.objects[b.oid].format
                if not isinstance(FORMATS[src], DirectFormat):  # a fixed-BF16 role stored quantized
                    pieces.append(_bf16_bits(self._dequantized(b)))
                elif src == p.fmt:
                    pieces.append(self._direct_rows(b, np.dtype(target.numpy_dtype)))
                else:  # BF16 -> FP32, exact
                    words = self._direct_rows(b, np.dtype("<u2")).astype(np.uint32) << 16
                    pieces.append(words.view("<f4"))
            arr = np.concatenate(pieces, axis=0)
            if p.transpose:
                arr = np.ascontiguousarray(arr.T)
            return arr.reshape(-1).tobytes()
        if isinstance(target, FloatCodeFormat):
            return self._float_codes(p)
        base, high, scale = [], [], []
        for b in p.blocks:
            src = FORMATS[d.objects[b.oid].format]
            planes = self._grouped_rows(b, src)
            if src.name != target.name:
                planes = _widen(planes, src, target, d.objects[b.oid].shape[1])
            base.append(planes[0])
            high.append(planes[1])
            scale.append(planes[2])
        geo = RowSplitGeometry(p.shape[0], p.shape[1], target)
        out = np.zeros(geo.total_bytes, np.uint8)
        out[: geo.base_bytes] = np.concatenate(base).reshape(-1)
        if geo.high_bytes:
            out[geo.high_offset : geo.high_offset + geo.high_bytes] = np.concatenate(high).reshape(-1)
        out[geo.scale_offset :] = np.concatenate(scale).reshape(-1)
        return out.tobytes()

    def _float_planes(self, oid: str, cache: dict):
        """A float-code parent as row arrays: NVFP4 (codes, natural scales, per-row divisors), FP8 (codes,
        BF16 multiplier words); NVFP4's swizzled scales are moved to row order once per parent."""
        if oid not in cache:
            o = self.directory.objects[oid]
            n, k = o.shape
            raw = self.directory.object_bytes(oid)
            if o.format == "NVFP4":
                cache[oid] = nvfp4_from_block_scale(raw, n, k, o.divisors)
            else:
                codes, scales = Fp8RowGeometry(n, k).split(raw)
                cache[oid] = (np.frombuffer(codes, np.uint8).reshape(n, k), np.frombuffer(scales, "<u2"))
        return cache[oid]

    def _float_codes(self, p: Plan) -> bytes:
        cache: dict = {}
        picked = []
        for b in p.blocks:
            picked.append([plane[b.index] for plane in self._float_planes(b.oid, cache)])
        planes = [np.concatenate([blk[i] for blk in picked]) for i in range(len(picked[0]))]
        return nvfp4_rows_bytes(*planes) if p.fmt == "NVFP4" else fp8_rows_bytes(*planes)

    def _dequantized(self, b: Block) -> np.ndarray:
        from .quantize import dequantize

        o = self.directory.objects[b.oid]
        fmt = FORMATS[o.format]
        if isinstance(fmt, FloatCodeFormat):
            planes = [plane[b.index] for plane in self._float_planes(b.oid, {})]
            rows = planes[0].shape[0]
            if o.format == "NVFP4":
                return decode_nvfp4(planes[0].tobytes(), planes[1].tobytes(), planes[2].astype("<f4").tobytes(),
                                    rows, o.shape[1])
            return decode_fp8_rows(planes[0].tobytes(), planes[1].tobytes(), rows, o.shape[1])
        base, high, scale = self._grouped_rows(b, fmt)
        rows = base.shape[0]
        return dequantize(base.tobytes(), None if high is None else high.tobytes(), scale.tobytes(), rows, o.shape[1], fmt)

    def raw(self, name: str):
        e = self.entry(name)
        if e.kind == "resource":
            return memoryview(self._resources[name])
        data = self._build(self.plans[name])
        if len(data) != e.nbytes:
            raise ArtifactError(f"{name}: bound {len(data)} bytes, expected {e.nbytes} (binder defect)")
        return memoryview(data)

    def resource_bytes(self, name: str) -> bytes:
        e = self.entry(name)
        if e.kind != "resource":
            raise ArtifactError(f"object {name} is a tensor, not a resource")
        return self._resources[name]

    def close(self) -> None:
        self.directory.close()

    def describe(self) -> dict:
        """What the file is and which of its parts this build runs (inspect)."""
        info = self.upstream.as_dict()
        info.update(runnable=True, bound_components=list(self.components), unbound=dict(self.unbound), notes=list(self.notes),
                    model=self.config.model_type, layers=self.config.num_layers, hidden=self.config.hidden_size)
        return info


def _widen(planes, src: GroupedFormat, dst: GroupedFormat, cols: int):
    """Re-pack plane rows of `src` codes in the wider `dst` with the same scales (same decoded values)."""
    base, high, scale = planes
    rows = base.shape[0]
    if src.bits == 4 and dst.bits in (5, 6):  # same low nibbles; the high bits only sign-extend each code
        sign = np.empty((rows, base.shape[1] * 2), np.uint8)
        sign[:, 0::2], sign[:, 1::2] = (base >> 3) & 1, (base >> 7) & 1  # lane order: even lane = low nibble
        bits = sign if dst.bits == 5 else np.repeat(sign, 2, axis=1)  # Q6: bits 4 and 5 of each lane
        return base, np.packbits(bits, axis=1, bitorder="little"), scale
    k_pad = align_up(cols, 128)
    codes, bits = unpack_row_split(base.tobytes(), None if high is None else high.tobytes(), scale.tobytes(), rows, src, k_pad)
    if dst.group_size != src.group_size:  # a G64 group is G32 groups with its scale
        bits = np.repeat(bits, src.group_size // dst.group_size, axis=1)
    b, h, s = pack_row_split(codes, bits, dst)
    return (np.frombuffer(b, np.uint8).reshape(rows, -1), np.frombuffer(h, np.uint8).reshape(rows, -1) if h else None,
            np.frombuffer(s, np.uint8).reshape(rows, -1))


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 words, round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def merged_tokenizer(tokenizer: bytes, tokenizer_config: bytes | None) -> bytes:
    """tokenizer.json with tokenizer_config's added_tokens_decoder entries it lacks (upstream's frontend
    keeps ids such as 248,070-248,076 only there)."""
    if not tokenizer_config:
        return tokenizer
    try:
        tok, cfg = json.loads(tokenizer), json.loads(tokenizer_config)
    except (ValueError, UnicodeDecodeError):
        return tokenizer  # the resource checks report unreadable JSON
    extra = cfg.get("added_tokens_decoder") if isinstance(cfg, dict) else None
    if not isinstance(tok, dict) or not isinstance(extra, dict):
        return tokenizer
    added = tok.setdefault("added_tokens", [])
    have = {t.get("id") for t in added if isinstance(t, dict)}
    new = []
    for tid, t in extra.items():
        if not isinstance(t, dict) or not isinstance(t.get("content"), str) or not str(tid).isdigit() or int(tid) in have:
            continue
        new.append({"id": int(tid), "content": t["content"], "single_word": bool(t.get("single_word", False)),
                    "lstrip": bool(t.get("lstrip", False)), "rstrip": bool(t.get("rstrip", False)),
                    "normalized": bool(t.get("normalized", False)), "special": bool(t.get("special", False))})
    if not new:
        return tokenizer
    added += sorted(new, key=lambda t: t["id"])
    return json.dumps(tok, ensure_ascii=False).encode()
