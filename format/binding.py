"""Checks an artifact's inventory against what its own config requires (the binder)."""

from __future__ import annotations

import re

from dataclasses import dataclass, field

from .container import Artifact
from .errors import ArtifactError, BindingError, ConvertError
from .inventory import (
    DFLASH2_CONFIG,
    DRAFT_HEAD,
    DRAFT_TOKEN_IDS,
    FIXED_ROLE_FORMATS,
    RESOURCE_NAMES,
    dflash2_inventory,
    required_mtp_names,
    required_text_names,
)
from .model_config import DFlash2Config, ModelConfig, load_json
from .numeric import FORMATS

MATRIX_FORMATS = tuple(f for f in FORMATS if f not in ("FP32", "I32"))


@dataclass
class InventoryReport:
    config: ModelConfig | None
    problems: list[str] = field(default_factory=list)  # each one makes the text model unrunnable
    companions: dict[str, str] = field(default_factory=dict)  # component -> "complete" | problem text
    mtp_layers: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def _check_object(art: Artifact, spec, problems: list[str]) -> None:
    e = art.objects.get(spec.name)
    if e is None:
        problems.append(f"required artifact object is missing: {spec.name}")
        return
    if e.kind != "tensor" or tuple(e.shape) != tuple(spec.shape):
        problems.append(f"tensor {spec.name} has shape {list(e.shape)}; the config requires {list(spec.shape)}")
        return
    allowed = (FIXED_ROLE_FORMATS[spec.role],) if spec.role in FIXED_ROLE_FORMATS else MATRIX_FORMATS
    if e.format not in allowed:
        problems.append(f"tensor {spec.name} is {e.format}; its role allows {', '.join(allowed)}")


def load_config(art: Artifact) -> ModelConfig:
    if not art.has(RESOURCE_NAMES["config"]):
        raise BindingError(f"required artifact object is missing: {RESOURCE_NAMES['config']}")
    gen = art.resource_bytes(RESOURCE_NAMES["generation_config"]) if art.has(RESOURCE_NAMES["generation_config"]) else None
    try:
        return ModelConfig.from_json_bytes(art.resource_bytes(RESOURCE_NAMES["config"]), gen)
    except ConvertError as exc:
        raise BindingError(str(exc)) from None


MAX_MTP_LAYERS = 16
_MTP_LAYER = re.compile(r"mtp/layers/(\d{1,3})/")


def mtp_layer_count(names) -> int:
    """How many MTP layers the objects `mtp/layers/<j>/...` describe (0 without any); a malformed or
    absurd layer index is a BindingError naming the object."""
    layers = 0
    for name in names:
        if not name.startswith("mtp/layers/"):
            continue
        m = _MTP_LAYER.match(name)
        if m is None or int(m.group(1)) >= MAX_MTP_LAYERS:
            raise BindingError(f"object {name[:80]!r}: MTP layer objects are named mtp/layers/<0..{MAX_MTP_LAYERS - 1}>/...")
        layers = max(layers, int(m.group(1)) + 1)
    return layers


def load_dflash2_config(art: Artifact) -> DFlash2Config:
    if not art.has(DFLASH2_CONFIG):
        raise BindingError(f"required artifact object is missing: {DFLASH2_CONFIG}")
    try:
        return DFlash2Config.from_json_bytes(art.resource_bytes(DFLASH2_CONFIG))
    except ConvertError as exc:
        raise BindingError(str(exc)) from None


def resource_problems(art: Artifact) -> list[str]:
    """What would stop generate or serve in the small resources, found without loading a model: JSON
    that does not parse or is not an object, a tokenizer without a model, a chat template that is empty
    or not UTF-8. (The template's Jinja and the tokenizer itself are loaded by the runtime, which
    refuses them the same way.)"""
    problems = []
    for key in ("tokenizer", "tokenizer_config", "generation_config", "preprocessor_config"):
        name = RESOURCE_NAMES[key]
        if not art.has(name):
            continue
        try:
            value = load_json(art.resource_bytes(name), name)
        except (ConvertError, ArtifactError) as exc:
            problems.append(str(exc))
            continue
        if not isinstance(value, dict):
            problems.append(f"{name} must be a JSON object")
        elif key == "tokenizer" and not isinstance(value.get("model"), dict):
            problems.append(f"{name} has no tokenizer model")
    name = RESOURCE_NAMES["chat_template"]
    if art.has(name):
        try:
            text = art.resource_bytes(name).decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"{name} is not UTF-8 text")
        except ArtifactError as exc:
            problems.append(str(exc))
        else:
            if not text.strip():
                problems.append(f"{name} is empty")
            else:
                problems += _template_syntax(name, text)
    return problems


def _template_syntax(name: str, text: str) -> list[str]:
    """The template's Jinja syntax (parsed, never rendered here: rendering is the runtime's sandbox)."""
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return [f"{name} does not parse as Jinja (line {exc.lineno}: {str(exc.message or exc)[:160]})"]
    except RecursionError:
        return [f"{name} nests too deeply to parse"]
    return []


def check_inventory(art: Artifact) -> InventoryReport:
    try:
        cfg = load_config(art)
    except (BindingError, ArtifactError) as exc:
        return InventoryReport(None, [str(exc)])
    report = InventoryReport(cfg)
    text = required_text_names(cfg)
    for spec in text.values():
        _check_object(art, spec, report.problems)
    if not art.has(RESOURCE_NAMES["tokenizer"]):
        report.problems.append(f"required artifact object is missing: {RESOURCE_NAMES['tokenizer']}")
    report.problems += resource_problems(art)
    consumed = set(text) | set(RESOURCE_NAMES.values())

    if "mtp" in art.components:
        try:
            layers = mtp_layer_count(art.objects)
        except BindingError as exc:
            return InventoryReport(cfg, report.problems + [str(exc)])
        report.mtp_layers = layers
        required = required_mtp_names(cfg, layers)
        problems: list[str] = []
        for spec in required.values():
            _check_object(art, spec, problems)
        report.companions["mtp"] = problems[0] if problems else "complete"
        consumed |= set(required)
    if "lm_head_draft" in art.components:
        problems = []
        head, ids = art.objects.get(DRAFT_HEAD), art.objects.get(DRAFT_TOKEN_IDS)
        if head is None or ids is None:
            problems.append(f"required artifact object is missing: {DRAFT_HEAD if head is None else DRAFT_TOKEN_IDS}")
        elif len(head.shape) != 2 or head.shape[1] != cfg.hidden_size or ids.shape != (head.shape[0],) or ids.format != "I32":
            problems.append(f"lm-head draft shapes {list(head.shape)} / {list(ids.shape)} do not match hidden {cfg.hidden_size}")
        else:
            token_ids = art.read_direct(DRAFT_TOKEN_IDS)
            if token_ids.size == 0:
                problems.append("the lm-head draft holds no rows")
            elif token_ids.min() < 0 or token_ids.max() >= cfg.vocab_size:
                problems.append("lm-head draft token ids fall outside the vocabulary")
        report.companions["lm_head_draft"] = problems[0] if problems else "complete"
        consumed |= {DRAFT_HEAD, DRAFT_TOKEN_IDS}
    if "dflash2" in art.components:
        names = {n for n in art.objects if n.startswith("dflash2/")}
        problems = []
        try:
            dcfg = load_dflash2_config(art)
            dcfg.check_target(cfg)
        except (BindingError, ConvertError) as exc:
            problems.append(str(exc))
        else:
            required = {s.name: s for s in dflash2_inventory(dcfg)}
            for spec in required.values():
                _check_object(art, spec, problems)
            problems += [f"artifact object was not consumed by the DFlash2 drafter: {n}"
                         for n in sorted(names - set(required) - {DFLASH2_CONFIG})]
        report.companions["dflash2"] = problems[0] if problems else "complete"
        consumed |= names
    if "vision" in art.components:
        names = {n for n in art.objects if n.startswith("vision/")}
        report.companions["vision"] = "complete" if names else "no objects"
        consumed |= names
    for name, e in art.objects.items():
        if name not in consumed:
            report.problems.append(f"artifact object was not consumed by the selected target: {name}")
            break
        expected_comp = "text" if name.startswith(("text/", "resource/")) else name.split("/", 1)[0]
        if e.component != expected_comp:
            report.problems.append(f"object {name} is filed under component {e.component}, expected {expected_comp}")
            break
    return report


def token_limit(art: Artifact, vocab_size: int) -> int:
    """How many of the output head's rows are tokens: one past the tokenizer's largest id, at most
    vocab_size. Checkpoints pad the head (Qwen3.5: 248,320 rows for 248,077 tokens); the runtimes never
    produce a padded id, as upstream masks them at sampling."""
    from tokenizers import Tokenizer

    if not art.has(RESOURCE_NAMES["tokenizer"]):
        return vocab_size
    try:
        vocab = Tokenizer.from_str(art.resource_bytes(RESOURCE_NAMES["tokenizer"]).decode("utf-8")).get_vocab(True)
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is reported where it is loaded
        return vocab_size
    return min(vocab_size, max(vocab.values(), default=vocab_size - 1) + 1)


def require_runnable(art: Artifact) -> InventoryReport:
    report = check_inventory(art)
    if report.problems:
        raise BindingError(report.problems[0])
    return report


__all__ = ["InventoryReport", "check_inventory", "require_runnable", "load_config", "token_limit", "load_dflash2_config", "ArtifactError"]
