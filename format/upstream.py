"""Recognising upstream ninfer artifacts (`.ninfer` v2 and v3 as published with the Qwen3.6 / Qwen3.8 models).

Their framing is ours (`NINFER\\0` + version), but their directory is not (../shared/research/interop.md):
v2 names upstream model ids (`qwen3.8-27b`) and weight profiles (`groupwise-int`, `nvfp4`), carries companions
(`mtp/*`, `text/draft_head*`, `dflash2/*`) and `frontend/*` resources instead of `resource/config.json`; v3
has opaque object ids bound to names (`bindings`, `uses`, `files`) and no `identity`. This build cannot bind
their layouts yet (split attention / GDN projections, tap-major convolutions, NVFP4 and FP8 weights), so
instead of failing on the first directory member our spec does not allow, the reader recognises such a file
and says what it is, what it holds and why it cannot run (UpstreamArtifactError), and `inspect` shows that
description in full.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass, field

from .errors import ArtifactError

UPSTREAM_MODEL_IDS = ("qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3.8-27b")
UPSTREAM_PROFILES = ("groupwise-int", "nvfp4")
_V3_MEMBERS = ("bindings", "uses", "files")
_MAX_JSON = 64 << 20
WHY_NOT = ("this build does not bind upstream layouts yet (split attention and GDN projections, tap-major "
           "convolutions, frontend/* resources in place of resource/config.json; issue 25)")


class UpstreamArtifactError(ArtifactError):
    """The file is an upstream ninfer artifact, which this build recognises but cannot run."""

    def __init__(self, info: "UpstreamInfo"):
        self.info = info
        super().__init__(info.one_line())


@dataclass
class UpstreamInfo:
    path: str
    version: int
    model_id: str | None
    profile: str | None
    objects: int
    components: list[str] = field(default_factory=list)
    formats: list[str] = field(default_factory=list)
    resources: list[str] = field(default_factory=list)

    def cannot_run(self) -> list[str]:
        """Why each part cannot run in this build."""
        out = [WHY_NOT]
        odd = [f for f in self.formats if f.lower().replace("_", "") in ("nvfp4", "fp8e4m3fnrowbf16s", "fp8e4m3fnrowbf16")]
        if odd:
            out.append(f"weight formats {', '.join(odd)} are not implemented here")
        if self.model_id not in UPSTREAM_MODEL_IDS:
            out.append(f"model id {self.model_id!r} is not one of {', '.join(UPSTREAM_MODEL_IDS)}")
        return out

    def one_line(self) -> str:
        comps = ", ".join(self.components) or "none named"
        return (f"{self.path} is an upstream ninfer v{self.version} artifact (model {self.model_id or 'unknown'}, "
                f"weights {self.profile or 'unknown'}, components {comps}): this build cannot run it yet; "
                "`ninfer inspect` lists what it holds; convert the model's Hugging Face checkpoint with `ninfer convert`")

    def as_dict(self) -> dict:
        return {"path": self.path, "origin": "upstream ninfer", "version": self.version, "model_id": self.model_id,
                "weights_profile": self.profile, "objects": self.objects, "components": self.components,
                "formats": self.formats, "resources": self.resources, "runnable": False,
                "features": {}, "problems": self.cannot_run()}


def _component(name: str) -> str:
    head = name.split("/", 1)[0]
    if name.startswith("text/draft_head"):
        return "draft_head"
    return "frontend" if head in ("frontend", "resource") else head


def recognise(path, mm: mmap.mmap, version: int) -> UpstreamInfo | None:
    """An UpstreamInfo when the file's directory is upstream's (else None: our own reader judges it).
    Reads only the directory; anything unexpected makes it not upstream."""
    header = {2: 16, 3: 32}.get(version)
    if header is None or len(mm) < header:
        return None
    (json_bytes,) = struct.unpack_from("<Q", mm, 8)
    if not 0 < json_bytes <= _MAX_JSON or header + json_bytes > len(mm):
        return None
    try:
        root = json.loads(bytes(mm[header : header + json_bytes]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(root, dict) or not isinstance(root.get("objects"), list):
        return None
    identity = root.get("identity") if isinstance(root.get("identity"), dict) else {}
    model_id, profile = identity.get("model_id"), identity.get("weights_id")
    if version == 2:
        if model_id not in UPSTREAM_MODEL_IDS and profile not in UPSTREAM_PROFILES:
            return None
    elif not all(k in root for k in _V3_MEMBERS):
        return None
    else:  # v3: names live in bindings; the model id, where given, in the text component's config or metadata
        text = (root.get("components") or {}).get("text") if isinstance(root.get("components"), dict) else None
        config = text.get("config") if isinstance(text, dict) and isinstance(text.get("config"), dict) else {}
        meta = root.get("metadata") if isinstance(root.get("metadata"), dict) else {}
        model_id = next((v for v in (config.get("model_id"), meta.get("model_id"), identity.get("model_id"))
                         if isinstance(v, str)), None)
        profile = next((v for v in (config.get("weights_id"), meta.get("weights_id"), meta.get("profile"),
                                    identity.get("weights_id")) if isinstance(v, str)), None)
    objs = [o for o in root["objects"] if isinstance(o, dict)]
    names = [o["name"] for o in objs if isinstance(o.get("name"), str)]
    if version == 3:
        bindings = root.get("bindings")
        entries = bindings.values() if isinstance(bindings, dict) else bindings if isinstance(bindings, list) else []
        names += [b["name"] for b in entries if isinstance(b, dict) and isinstance(b.get("name"), str)]
        if isinstance(bindings, dict):
            names += [k for k in bindings if isinstance(k, str)]
    formats = sorted({o["format"] for o in objs if isinstance(o.get("format"), str)})
    resources = sorted(n for n in names if _component(n) == "frontend")
    components = sorted({_component(n) for n in names} - {"frontend"})
    if version == 3 and isinstance(root.get("components"), dict):
        components = sorted(set(components) | {c for c in root["components"] if isinstance(c, str)})
    return UpstreamInfo(str(path), version, model_id if isinstance(model_id, str) else None,
                        profile if isinstance(profile, str) else None, len(objs), components, formats, resources)
