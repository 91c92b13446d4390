"""HF safetensors checkpoint directory -> .nfer, tensor by tensor with bounded memory."""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from .checkpoint import Checkpoint
from .container import ArtifactPlan, ArtifactWriter
from .errors import ConvertError
from .inventory import (
    DFLASH2_CONFIG,
    DRAFT_HEAD,
    DRAFT_TOKEN_IDS,
    RESOURCE_NAMES,
    ObjectSpec,
    SourceNames,
    SourcePart,
    dflash2_inventory,
    mtp_inventory,
    text_inventory,
)
from .model_config import DFlash2Config, ModelConfig, load_json
from .numeric import FloatCodeFormat, GroupedFormat, get_format
from .quantize import encode_rows
from .recipes import RECIPES, format_for

CHUNK_SOURCE_BYTES = 16 << 20  # rows per encode step are sized to about this much float32
TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.", "")
VISION_PREFIXES = ("model.visual.", "visual.", "vision_tower.")
# --vision-recipe: the vision tower's products (attention, MLP, patch merger) in this format; the patch
# embedding, position table, norms and biases stay BF16
VISION_RECIPES = {"bf16": "BF16", "w8": "W8G32_F16S", "q6": "Q6G64_F16S"}
VISION_MATRICES = ("attn.qkv.weight", "attn.proj.weight", "mlp.linear_fc1.weight", "mlp.linear_fc2.weight",
                   "merger.linear_fc1.weight", "merger.linear_fc2.weight")


def vision_format(recipe: str, name: str, shape) -> str:
    """The format `recipe` stores the vision tensor `name` (of `shape`) in: its products quantized, the rest
    BF16; an unknown recipe is a ConvertError."""
    if recipe not in VISION_RECIPES:
        raise ConvertError(f"unknown vision recipe {recipe!r}; choose one of {', '.join(VISION_RECIPES)}")
    return VISION_RECIPES[recipe] if name.endswith(VISION_MATRICES) and len(shape) == 2 else "BF16"


@dataclass
class ConvertOptions:
    version: int = 3
    recipe: str = "q4"
    mtp: bool | None = None  # None: include when present (v3), skip with a note (v2)
    vision: bool | None = None  # None: include when present
    vision_recipe: str = "bf16"  # the vision tower's matrices: bf16 (as the checkpoint), w8 or q6
    lm_head_draft: int = 0  # rows of the frequency-ranked draft head; 0 = none
    draft_ranking: Path | None = None  # i64 per-token counts (raw LE or .npy); default ranks by token id
    dflash2: Path | None = None  # DFlash2 drafter checkpoint directory
    checksums: bool = True


@dataclass
class ConvertReport:
    output: str
    version: int
    recipe: str
    model_type: str
    components: list[str]
    objects: int
    file_bytes: int
    bytes_by_format: dict[str, int]
    seconds: float
    peak_rss_bytes: int
    largest_shard_bytes: int
    notes: list[str] = field(default_factory=list)


@dataclass
class _Job:
    """One object to write: its spec and where its rows come from."""

    spec: ObjectSpec
    fmt: str
    source: Checkpoint
    row_ids: np.ndarray | None = None  # draft head: gather these rows of the single source part


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _source_names(ckpt: Checkpoint, cfg: ModelConfig) -> SourceNames:
    for prefix in TEXT_PREFIXES:
        if ckpt.has(f"{prefix}embed_tokens.weight"):
            break
    else:
        raise ConvertError("checkpoint has no embed_tokens.weight; is this a Qwen3.5 text checkpoint?")
    head = "lm_head.weight"
    if not ckpt.has(head):
        if not cfg.tie_word_embeddings:
            raise ConvertError("checkpoint lacks lm_head.weight and the config does not tie embeddings")
        head = f"{prefix}embed_tokens.weight"
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in ckpt.tensors)
    return SourceNames(prefix, head, fused)


def load_dflash2_source_config(directory: Path) -> DFlash2Config:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{directory} has no config.json (expected a DFlash2 drafter checkpoint directory)")
    return DFlash2Config.from_json_bytes(path.read_bytes())


def _part_shape(ckpt: Checkpoint, part: SourcePart) -> tuple[int, ...]:
    shape = ckpt.shape(part.key)
    if part.index is not None:
        if len(shape) != 3 or part.index >= shape[0]:
            raise ConvertError(f"tensor {part.key} has shape {list(shape)}; expected [experts, rows, cols]")
        return shape[1:]
    if part.squeeze_conv:
        if len(shape) != 3 or shape[1] != 1:
            raise ConvertError(f"tensor {part.key} has shape {list(shape)}; expected a [channels, 1, width] kernel")
        return (shape[0], shape[2])
    return shape


def _check_sources(job: _Job) -> None:
    spec, ckpt = job.spec, job.source
    shapes = [tuple(_part_shape(ckpt, p)) for p in spec.parts]
    if job.row_ids is not None:
        if shapes and (len(shapes[0]) != 2 or shapes[0][1] != spec.shape[1]):
            raise ConvertError(f"{spec.parts[0].key} has shape {list(shapes[0])}; the draft head needs [vocab, hidden]")
        return
    if len(spec.parts) == 1:
        if shapes[0] != spec.shape:
            raise ConvertError(f"{spec.parts[0].key} has shape {list(shapes[0])}; {spec.name} needs {list(spec.shape)}")
        return
    rows = sum(s[0] for s in shapes)
    if any(len(s) != 2 or s[1] != spec.shape[1] for s in shapes) or rows != spec.shape[0]:
        got = ", ".join(f"{p.key} {list(s)}" for p, s in zip(spec.parts, shapes))
        raise ConvertError(f"{spec.name} needs shape {list(spec.shape)} but the sources are: {got}")


def _count_mtp_layers(ckpt: Checkpoint) -> int:
    found = {int(m.group(1)) for k in ckpt.tensors if (m := re.match(r"mtp\.layers\.(\d+)\.", k))}
    return max(found) + 1 if found else 0


def _load_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    value = load_json(path.read_bytes(), path.name)
    if not isinstance(value, dict):
        raise ConvertError(f"{path.name} must be a JSON object")
    return value


def _resources(src: Path, tok_cfg: dict | None) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for key, fname in (("config", "config.json"), ("generation_config", "generation_config.json"),
                       ("tokenizer", "tokenizer.json"), ("tokenizer_config", "tokenizer_config.json"),
                       ("preprocessor_config", "preprocessor_config.json")):
        p = src / fname
        if p.is_file():
            out[RESOURCE_NAMES[key]] = p.read_bytes()
    template = src / "chat_template.jinja"
    if template.is_file():
        out[RESOURCE_NAMES["chat_template"]] = template.read_bytes()
    elif tok_cfg and isinstance(tok_cfg.get("chat_template"), str):
        out[RESOURCE_NAMES["chat_template"]] = tok_cfg["chat_template"].encode("utf-8")
    if RESOURCE_NAMES["tokenizer"] not in out:
        raise ConvertError(f"{src} has no tokenizer.json; the artifact must carry its tokenizer")
    _check_tokenizer(out[RESOURCE_NAMES["tokenizer"]])
    return out


def plan_bytes(plan) -> int:
    return sum(o.nbytes for o in plan.objects)


def _check_tokenizer(data: bytes) -> None:
    """The tokenizer must load before it is written: an artifact that converts must also run."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception types
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ConvertError(f"tokenizer.json does not load ({reason}); the artifact must carry a working tokenizer") from None


def _special_token_ids(src: Path, tok_cfg: dict | None) -> set[int]:
    ids: set[int] = set()
    for tid, info in ((tok_cfg or {}).get("added_tokens_decoder") or {}).items():
        if isinstance(info, dict) and info.get("special"):
            ids.add(int(tid))
    tok = _load_json(src / "tokenizer.json") or {}
    for t in tok.get("added_tokens") or []:
        if t.get("special"):
            ids.add(int(t["id"]))
    return ids


def draft_token_ids(vocab: int, rows: int, specials: set[int], ranking: Path | None) -> np.ndarray:
    """Pick `rows` token ids: every special token, then the most frequent others (ties by id).

    Without a ranking file, lower BPE ids (earlier merges, i.e. more frequent pairs) rank first.
    Returned ascending, so the head's rows are read from the source in one forward pass.
    """
    if not 0 < rows <= vocab:
        raise ConvertError(f"--lm-head-draft {rows} must be in 1..{vocab} (the vocabulary size)")
    specials = {i for i in specials if 0 <= i < vocab}
    if ranking is not None:
        try:
            counts = np.load(ranking) if str(ranking).endswith(".npy") else np.fromfile(ranking, dtype="<i8")
        except (OSError, ValueError) as exc:
            raise ConvertError(f"cannot read --draft-ranking {ranking}: {exc}") from None
        counts = np.asarray(counts, dtype=np.int64).reshape(-1)
        if counts.size < vocab:
            raise ConvertError(f"--draft-ranking has {counts.size} counts; the vocabulary has {vocab} rows")
        counts = counts[:vocab]
    else:
        counts = -np.arange(vocab, dtype=np.int64)
    order = np.lexsort((np.arange(vocab), -counts))  # descending count, then ascending id
    chosen = [int(i) for i in order if int(i) not in specials][: max(0, rows - len(specials))]
    ids = np.array(sorted(set(chosen) | specials), dtype=np.int32)
    if ids.size != rows:
        raise ConvertError(f"--lm-head-draft {rows} is smaller than the {len(specials)} special tokens it must keep")
    return ids


def _plan_jobs(src: Path, ckpt: Checkpoint, cfg: ModelConfig, opts: ConvertOptions, notes: list[str]) -> list[_Job]:
    names = _source_names(ckpt, cfg)
    jobs = [_Job(s, format_for(opts.recipe, s.role), ckpt) for s in text_inventory(cfg, names)]

    mtp_layers = cfg.mtp_layers or _count_mtp_layers(ckpt)
    has_mtp = ckpt.has("mtp.fc.weight") and mtp_layers > 0
    if opts.mtp and not has_mtp:
        raise ConvertError("--mtp was given but the checkpoint has no mtp.* weights")
    if opts.mtp and opts.version == 2:
        raise ConvertError("version 2 cannot carry companion weights (MTP head); use --version 3 or drop --mtp")
    if has_mtp and opts.mtp is None and opts.version == 2:
        notes.append("skipped the MTP head: version 2 carries no companion weights (use --version 3)")
    elif has_mtp and opts.mtp is not False:
        jobs += [_Job(s, format_for(opts.recipe, s.role), ckpt) for s in mtp_inventory(cfg, names, mtp_layers)]

    vision_keys = [k for k in ckpt.tensors if k.startswith(VISION_PREFIXES)]
    if opts.vision and not vision_keys:
        raise ConvertError("--vision was given but the checkpoint has no vision tower weights")
    vision_format(opts.vision_recipe, "", ())  # an unknown vision recipe is refused even without a tower
    if vision_keys and opts.vision is not False:
        for k in sorted(vision_keys):
            rest = next(k[len(p):] for p in VISION_PREFIXES if k.startswith(p))
            spec = ObjectSpec(f"vision/{rest}", ckpt.shape(k), "small", "vision", (SourcePart(k),))
            jobs.append(_Job(spec, vision_format(opts.vision_recipe, rest, ckpt.shape(k)), ckpt))

    if opts.lm_head_draft:
        if opts.version == 2:
            raise ConvertError("version 2 cannot carry companion weights (lm-head draft); use --version 3")
        tok_cfg = _load_json(src / "tokenizer_config.json")
        ids = draft_token_ids(cfg.vocab_size, opts.lm_head_draft, _special_token_ids(src, tok_cfg), opts.draft_ranking)
        head = ObjectSpec(DRAFT_HEAD, (len(ids), cfg.hidden_size), "draft_head", "lm_head_draft",
                          (SourcePart(names.head_key),))
        jobs.append(_Job(head, format_for(opts.recipe, "draft_head"), ckpt, row_ids=ids))
        jobs.append(_Job(ObjectSpec(DRAFT_TOKEN_IDS, (len(ids),), "ids", "lm_head_draft", ()), "I32", ckpt,
                         row_ids=ids))

    if opts.dflash2 is not None:
        if opts.version == 2:
            raise ConvertError("version 2 cannot carry companion weights (DFlash2 drafter); use --version 3")
        dcfg = load_dflash2_source_config(opts.dflash2)
        dcfg.check_target(cfg)
        drafter = Checkpoint(opts.dflash2)
        specs = dflash2_inventory(dcfg)
        jobs += [_Job(s, format_for(opts.recipe, s.role), drafter) for s in specs]
        used = {p.key for s in specs for p in s.parts}
        unused = sorted(k for k in drafter.tensors if k not in used)
        if unused:
            notes.append(f"skipped {len(unused)} drafter tensor(s) DFlash2 does not use: {', '.join(unused[:4])}"
                         + (" ..." if len(unused) > 4 else ""))
    for job in jobs:
        _check_sources(job)
    used = {p.key for j in jobs if j.source is ckpt for p in j.spec.parts}
    skipped = tuple(VISION_PREFIXES) + ("mtp.",)  # left out on request (or by version 2), said above
    unused = sorted(k for k in ckpt.tensors if k not in used and not k.startswith(skipped))
    if unused:  # a tensor this build does not know: the artifact would silently lack it
        notes.append(f"warning: {len(unused)} checkpoint tensor(s) are not used by this model and were not written: "
                     + ", ".join(unused[:6]) + (" ..." if len(unused) > 6 else ""))
    return jobs


def _encode_job(writer: ArtifactWriter, job: _Job, advance: Callable[[int], None]) -> None:
    spec, fmt = job.spec, get_format(job.fmt)
    ckpt = job.source
    if spec.role == "ids":
        writer.write_direct(spec.name, job.row_ids.astype("<i4"))
        return
    cols = spec.shape[1] if len(spec.shape) == 2 else None
    row_cursor = 0
    for part in spec.parts:
        pshape = _part_shape(ckpt, part)
        if job.row_ids is not None or len(pshape) != 2 or part.squeeze_conv:
            tensors = [_gather_rows(ckpt, part, job.row_ids)] if job.row_ids is not None else [_read_whole(ckpt, part)]
            chunks = ((0, t) for t in tensors)
        else:
            step = max(1, CHUNK_SOURCE_BYTES // (4 * max(1, pshape[1])))
            chunks = ((r, ckpt.read(part.key, part.index, r, min(r + step, pshape[0]))) for r in range(0, pshape[0], step))
        for _, t in chunks:
            if isinstance(fmt, GroupedFormat):
                writer.write_rows(spec.name, row_cursor, encode_rows(t.reshape(-1, cols), fmt))
            elif job.fmt == "BF16":
                import torch

                writer.write_direct(spec.name, t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
            else:
                import torch

                writer.write_direct(spec.name, t.to(torch.float32).numpy())
            rows = t.shape[0] if t.dim() >= 1 else 1
            row_cursor += rows
            advance(t.numel())


def _read_whole(ckpt: Checkpoint, part: SourcePart):
    t = ckpt.read(part.key, part.index)
    return t.reshape(t.shape[0], t.shape[2]) if part.squeeze_conv else t


def _gather_rows(ckpt: Checkpoint, part: SourcePart, ids: np.ndarray):
    import torch

    rows, cols = ckpt.shape(part.key)
    step = max(1, CHUNK_SOURCE_BYTES // (4 * cols))
    picked = []
    for r in range(0, rows, step):
        sel = ids[(ids >= r) & (ids < r + step)]
        if sel.size:
            block = ckpt.read(part.key, None, r, min(r + step, rows))
            picked.append(block[torch.from_numpy(sel - r).long()])
    return torch.cat(picked)


def convert_checkpoint(src: str | os.PathLike, out: str | os.PathLike, opts: ConvertOptions,
                       progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Convert; `progress(done_elements, total_elements)` is called as tensors are encoded."""
    start = time.monotonic()
    src, out = Path(src), Path(out)
    if opts.version not in (2, 3):
        raise ConvertError(f"--version {opts.version} is not writable; choose 2 or 3")
    if opts.recipe not in RECIPES:
        raise ConvertError(f"unknown recipe {opts.recipe!r}; choose one of {', '.join(RECIPES)}")
    config_raw = _load_json(src / "config.json") if src.is_dir() else None
    if config_raw is None:
        raise ConvertError(f"{src} has no config.json (expected a Hugging Face checkpoint directory)")
    gen_cfg = _load_json(src / "generation_config.json")
    cfg = ModelConfig.from_hf_dict(config_raw, gen_cfg)
    tok_cfg = _load_json(src / "tokenizer_config.json")
    resources = _resources(src, tok_cfg)
    ckpt = Checkpoint(src)
    notes: list[str] = []
    jobs = _plan_jobs(src, ckpt, cfg, opts, notes)

    plan = ArtifactPlan(opts.version, cfg.model_type, opts.recipe,
                        metadata={"converter": "ninfer", "recipe": opts.recipe, "source": src.name})
    for name, data in resources.items():
        plan.add_resource(name, len(data), "text")
    if opts.dflash2 is not None:
        resources[DFLASH2_CONFIG] = (opts.dflash2 / "config.json").read_bytes()
        plan.add_resource(DFLASH2_CONFIG, len(resources[DFLASH2_CONFIG]), "dflash2")
    for job in jobs:
        plan.add_tensor(job.spec.name, job.spec.shape, job.fmt, job.spec.component)

    total = sum(int(np.prod(j.spec.shape)) for j in jobs if j.spec.role != "ids")
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with ArtifactWriter(out, plan, checksums=opts.checksums) as writer:
            for name, data in resources.items():
                writer.write_resource(name, data)
            for job in jobs:
                _encode_job(writer, job, advance)
    except OSError as exc:  # disk full, permissions, a vanished directory: the temp file is already gone
        reason = exc.strerror or type(exc).__name__
        raise ConvertError(f"cannot write {out}: {reason} (it needs {plan_bytes(plan)} bytes); nothing was written") \
            from None
    by_format: dict[str, int] = {}
    for o in plan.objects:
        key = o.format if o.kind == "tensor" else "resource"
        by_format[key] = by_format.get(key, 0) + o.nbytes
    components = sorted({o.component for o in plan.objects})
    return ConvertReport(str(out), opts.version, opts.recipe, cfg.model_type, components, len(plan.objects),
                         out.stat().st_size, by_format, round(time.monotonic() - start, 3), _peak_rss_bytes(),
                         ckpt.largest_shard_bytes, notes)


def rewrite_artifact(src: str | os.PathLike, out: str | os.PathLike, checksums: bool = True,
                     progress=None) -> ConvertReport:
    """Any artifact this build reads, re-written as version 3 (`convert --from-artifact`): the same objects,
    bytes and formats, with v3's components and per-object checksums; a temp file renamed at the end.
    An upstream ninfer file is written as bound to our names and layouts (format/upstream_bind.py)."""
    from .container import open_artifact

    start = time.monotonic()
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise ConvertError(f"{out}: the output would replace the artifact being read; choose another path")
    with open_artifact(src) as art:
        metadata = {**art.metadata, "rewritten_from": f"v{art.version} {src.name}"}
        plan = ArtifactPlan(3, art.identity["model_id"], art.identity["weights_id"], metadata=metadata)
        for name, e in art.objects.items():
            if e.kind == "tensor":
                plan.add_tensor(name, e.shape, e.format, e.component)
            else:
                plan.add_resource(name, e.nbytes, e.component)
        total, done = sum(e.nbytes for e in art.objects.values()), 0
        by_format: dict[str, int] = {}
        with ArtifactWriter(out, plan, checksums=checksums) as writer:
            for name, e in art.objects.items():
                if e.kind == "resource":
                    writer.write_resource(name, art.resource_bytes(name))
                elif isinstance(get_format(e.format), GroupedFormat):
                    base, high, scale, _ = art.planes(name)
                    writer.write_rows(name, 0, (base, high if high is not None else b"", scale))
                elif isinstance(get_format(e.format), FloatCodeFormat):
                    writer.write_encoded(name, bytes(art.raw(name)))
                else:
                    writer.write_direct(name, art.read_direct(name))
                if e.kind == "tensor":
                    by_format[e.format] = by_format.get(e.format, 0) + e.nbytes
                done += e.nbytes
                if progress is not None:
                    progress(done, total)
        components = list(dict.fromkeys(e.component for e in art.objects.values()))
        return ConvertReport(str(out), 3, art.identity["weights_id"], art.identity["model_id"], components,
                             len(plan.objects), out.stat().st_size, by_format, round(time.monotonic() - start, 3),
                             _peak_rss_bytes(), src.stat().st_size,
                             [f"re-written from version {art.version}; every byte of every object is the source's"
                              if art.origin == "ninfer" else
                              f"re-written from upstream ninfer v{art.version}: objects as bound (specs/container.md §6), "
                              "every decoded weight the source's"])
