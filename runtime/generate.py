"""Tokenize, apply the chat template, generate greedily, detokenize."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from format.binding import load_config
from format.model_config import load_json
from format.container import Artifact, open_artifact
from format.errors import BindingError
from format.inventory import RESOURCE_NAMES


def stop_token_ids(art: Artifact, tokenizer) -> set[int]:
    """The config's EOS ids plus the tokenizer config's eos_token (Qwen3.5 stops on either)."""
    stop = set(load_config(art).eos_token_ids)
    if art.has(RESOURCE_NAMES["tokenizer_config"]):
        tok_cfg = load_json(art.resource_bytes(RESOURCE_NAMES["tokenizer_config"]), "tokenizer_config resource")
        eos = tok_cfg.get("eos_token") if isinstance(tok_cfg, dict) else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            stop.add(tokenizer.token_to_id(eos))
    return stop


def load_tokenizer(art: Artifact):
    """The artifact's tokenizer, or one line saying why it cannot be used."""
    from tokenizers import Tokenizer

    if not art.has(RESOURCE_NAMES["tokenizer"]):
        raise BindingError(f"required artifact object is missing: {RESOURCE_NAMES['tokenizer']}")
    try:
        return Tokenizer.from_str(art.resource_bytes(RESOURCE_NAMES["tokenizer"]).decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises its own exception types
        reason = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise BindingError(f"the artifact's tokenizer resource cannot be loaded ({reason}); re-convert it") from None


def load_chat_template(art: Artifact):
    """The artifact's chat template, parsed (None without one), or one line saying why it cannot be used."""
    from .serve.chat_template import ChatTemplate, RequestError

    if not art.has(RESOURCE_NAMES["chat_template"]):
        return None
    try:
        return ChatTemplate(art.resource_bytes(RESOURCE_NAMES["chat_template"]).decode("utf-8"))
    except UnicodeDecodeError:
        raise BindingError("the artifact's chat template is not UTF-8 text; re-convert it") from None
    except RequestError as exc:
        raise BindingError(str(exc)) from None


@dataclass
class TextSession:
    model: object
    tokenizer: object
    chat_template: object | None  # serve.chat_template.ChatTemplate
    stop_ids: tuple[int, ...]
    vision: object = None  # runtime.vision.VisionTower when the session was loaded with vision

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", engine_options=None, vision: bool = False) -> "TextSession":
        """The reference model, or the Triton engine when `engine_options` (a PlanOptions) is given."""
        import torch

        from .model import ReferenceModel

        if device.startswith("cuda") and not torch.cuda.is_available():
            raise BindingError("--device cuda was requested but no CUDA GPU is visible; use --device cpu")
        art = open_artifact(path)
        if engine_options is not None:
            from .engine import Engine

            model = Engine(path, engine_options, device=device)
            tower = model.vision
        else:
            model = ReferenceModel(art, device)
            tower = None
            if vision:
                from .vision import VisionTower

                tower = VisionTower.from_artifact(art, model.device, model.dtype)
        tok = load_tokenizer(art)
        template = load_chat_template(art)
        stop = stop_token_ids(art, tok)
        art.close()
        return cls(model, tok, template, tuple(sorted(stop)), tower)

    def render(self, prompt: str, images: int = 0) -> str:
        if self.chat_template is None:
            raise BindingError("the artifact carries no chat template; use --raw")
        from .serve.chat_template import IMAGE_PLACEHOLDER, RequestError

        try:
            return self.chat_template.render([{"role": "user", "content": IMAGE_PLACEHOLDER * images + prompt}],
                                                           enable_thinking=False)
        except RequestError as exc:
            raise BindingError(str(exc)) from None

    def complete(self, prompt: str, max_new_tokens: int, chat: bool = True, params=None, seed: int | None = None,
                 image_files: tuple = ()) -> dict:
        images = self._images(image_files)
        if images and not chat:
            raise BindingError("--image needs the chat template (drop --raw)")
        text = self.render(prompt, len(images)) if chat else prompt
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        extra = {}
        if images:
            from .vision import expand_image_tokens

            ids = expand_image_tokens(ids, images, self.vision.ids.image)
            extra = {"images": images} if hasattr(self.model, "opts") else {"images": images, "vision": self.vision}
        if params is None:
            new = self.model.generate(ids, max_new_tokens, self.stop_ids, **extra)
        else:
            import torch

            gen = torch.Generator(getattr(self.model, "device", "cpu"))
            gen.manual_seed(seed if seed is not None else torch.seed())
            new = self.model.generate(ids, max_new_tokens, self.stop_ids, params=params, generator=gen, **extra)
        shown = [t for t in new if t not in self.stop_ids]
        return {"text": self.tokenizer.decode(shown), "tokens": new, "prompt_tokens": len(ids)}


    def _images(self, files) -> list:
        if not files:
            return []
        if self.vision is None:
            raise BindingError("--image needs --vision (and an artifact that carries the vision tower)")
        from .vision import preprocess

        out = []
        for f in files:
            try:
                data = Path(f).read_bytes()
            except OSError as exc:
                raise BindingError(f"cannot read image {f}: {exc.strerror}") from None
            try:
                out.append(preprocess(data, self.vision.cfg))
            except ValueError as exc:
                raise BindingError(f"image {f}: {exc}") from None
        return out
