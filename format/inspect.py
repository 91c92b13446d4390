"""Summary, verdict and deep verification of an artifact (used by `ninfer inspect`)."""

from __future__ import annotations

import hashlib

import numpy as np

from .binding import check_inventory, load_dflash2_config
from .container import Artifact
from .errors import ArtifactError
from .numeric import DirectFormat, GroupedFormat, get_format
from .layouts import unpack_row_split

# What this build can execute, per component.
SUPPORTED_FEATURES = {
    "text": "text generation (reference and Triton runtimes), serve, fit, bench",
    "mtp": "MTP speculative decoding (--spec mtp, Triton runtime)",
    "lm_head_draft": "reduced lm-head drafting (--spec mtp|dflash2 --lm-head-draft)",
    "dflash2": "DFlash2 block-diffusion speculative decoding (--spec dflash2, Triton runtime)",
    "vision": "image input (--vision: generate --image, serve image parts)",
}
NOT_YET: dict[str, str] = {}  # components this build carries but cannot run


def summarize(art: Artifact) -> dict:
    by_format: dict[str, dict[str, int]] = {}
    by_component: dict[str, int] = {}
    for e in art.objects.values():
        key = e.format if e.kind == "tensor" else "resource"
        slot = by_format.setdefault(key, {"objects": 0, "bytes": 0})
        slot["objects"] += 1
        slot["bytes"] += e.nbytes
        by_component[e.component] = by_component.get(e.component, 0) + e.nbytes
    report = check_inventory(art)
    cfg = report.config
    features, unused = [], {}
    if report.ok:
        features.append(SUPPORTED_FEATURES["text"])
    for comp, status in report.companions.items():
        if status != "complete":
            unused[comp] = f"malformed: {status}"
        elif comp in NOT_YET:
            unused[comp] = NOT_YET[comp]
        elif report.ok:
            features.append(SUPPORTED_FEATURES[comp])
    drafter = None
    if report.companions.get("dflash2") == "complete":
        d = load_dflash2_config(art)
        drafter = {"layers": d.num_layers, "hidden": d.hidden_size, "target_layer_ids": list(d.target_layer_ids),
                   "sliding_window": d.sliding_window, "block_size": d.block_size,
                   "selector_top_k": d.selector_top_k, "selector_rank": d.selector_rank}
    model = None
    if cfg is not None:
        model = {"model_type": cfg.model_type, "layers": cfg.num_layers,
                 "full_attention_layers": sum(cfg.is_full_attention(i) for i in range(cfg.num_layers)),
                 "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
                 "experts": cfg.num_experts, "mtp_layers": report.mtp_layers, "dflash2": drafter}
    origin = {"origin": art.origin}
    if art.origin != "ninfer":  # an upstream ninfer artifact, bound to our names (format/upstream_bind.py)
        up = art.describe()
        origin = {"origin": up["origin"], "upstream_model_id": up["model_id"], "weights_profile": up["weights_profile"],
                  "upstream_components": up["components"], "bound_components": up["bound_components"],
                  "binding_notes": up["notes"]}
        for comp, why in up["unbound"].items():
            unused[comp] = f"not run by this build: {why}"
    return {
        **origin,
        "path": str(art.path), "magic": "NINFER\\0" + f"\\x{art.version:02x}", "version": art.version,
        "file_bytes": art.file_bytes, "payload_offset": art.payload_offset,
        "artifact_id": str(art.artifact_id) if art.artifact_id else None,
        "identity": art.identity, "components": list(art.components), "model": model,
        "objects": len(art.objects), "by_format": by_format, "bytes_by_component": by_component,
        "runnable": report.ok, "problems": report.problems, "features": features, "companions": unused,
        "checksums": sum(1 for e in art.objects.values() if e.sha256),
    }


def _sha256(art: Artifact, name: str, counted=None, step: int = 64 << 20) -> str:
    """The object's sha256, read in `step`-byte pieces (`counted(n)` after each)."""
    h = hashlib.sha256()
    raw = art.raw(name)
    for pos in range(0, len(raw), step):
        piece = raw[pos : pos + step]
        h.update(piece)
        if counted:
            counted(len(piece))
    return h.hexdigest()


def verify_checksums(art: Artifact, progress=None) -> None:
    """Recompute every object's sha256 (the weights a run is about to load); `progress(done, total)`
    in bytes. A mismatch, or an artifact without checksums, is an ArtifactError naming it."""
    summed = [(name, e) for name, e in art.objects.items() if e.sha256]
    if not summed:
        raise ArtifactError("--verify-weights: this artifact carries no checksums (version 2 has none); "
                            "run without it, or use `ninfer inspect --verify` to decode every tensor")
    total, done = sum(e.nbytes for _, e in summed), 0

    def counted(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    for name, e in summed:
        if _sha256(art, name, counted) != e.sha256:
            raise ArtifactError(f"object {name}: its bytes do not match its sha256 (the file is corrupt); "
                                "download or convert it again")


def verify(art: Artifact) -> list[str]:
    """Recompute checksums and re-decode every tensor; returns the list of failures (empty = good)."""
    failures: list[str] = []
    for name, e in art.objects.items():
        if e.sha256 and _sha256(art, name) != e.sha256:
            failures.append(f"object {name}: sha256 mismatch (payload corrupted)")
            continue
        if e.kind != "tensor":
            continue
        fmt = get_format(e.format)
        if isinstance(fmt, GroupedFormat):
            failures += _verify_grouped(art, name, fmt)
        elif e.format in ("BF16", "FP32") or not isinstance(fmt, DirectFormat):
            if not np.isfinite(art.read_float(name)).all():  # float codes: a NaN code, scale or divisor
                failures.append(f"tensor {name}: holds NaN or infinity")
    return failures


def _verify_grouped(art: Artifact, name: str, fmt: GroupedFormat) -> list[str]:
    base, high, scale, geo = art.planes(name)
    step = max(1, (16 << 20) // max(1, geo.k_pad))
    out = []
    for r in range(0, geo.rows, step):
        n = min(step, geo.rows - r)
        spans = geo.row_spans(r, r + n)
        raw = art.raw(name)
        planes = [raw[o : o + l] for o, l in spans]
        b, s = planes[0], planes[-1]
        h = planes[1] if len(planes) == 3 else None
        codes, bits = unpack_row_split(b, h, s, n, fmt, geo.k_pad)
        halves = bits.view(np.float16)
        if not np.isfinite(halves).all() or (bits & 0x8000).any():
            out.append(f"tensor {name}: a scale is negative, -0, infinite or NaN (rows {r}..{r + n})")
            break
        if fmt.bits == 8 and (codes == -128).any():
            out.append(f"tensor {name}: W8 code -128 is illegal (rows {r}..{r + n})")
            break
        zero_groups = bits == 0
        if zero_groups.any() and (codes.reshape(n, -1, fmt.group_size)[zero_groups] != 0).any():
            out.append(f"tensor {name}: a group with scale +0 has nonzero codes (rows {r}..{r + n})")
            break
        pad = codes[:, geo.cols:]
        if pad.size and (pad != 0).any():
            out.append(f"tensor {name}: padding columns beyond K={geo.cols} hold nonzero codes")
            break
    return out
