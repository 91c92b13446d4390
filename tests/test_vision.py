"""Vision: our tower + MRoPE against transformers' qwen3_5 on a tiny random config, preprocessing,
placeholder expansion, the Triton engine on an image prompt, and images through the server."""

import json
import base64
import io

import pytest
import torch

from format.container import Artifact
from format.convert import ConvertOptions, convert_checkpoint
from runtime.model import ReferenceModel
from runtime.vision import (ImageInput, VisionConfig, VisionTower, expand_image_tokens, mrope_positions, patchify,
                            preprocess)

IMAGE_TOKEN, VS, VE = 9, 7, 8


@pytest.fixture(scope="module")
def vision_artifact(hf_dense, tmp_path_factory):
    out = tmp_path_factory.mktemp("vision") / "v.nfer"
    return convert_checkpoint(hf_dense, out, ConvertOptions(recipe="bf16")).output


def _image(cfg: VisionConfig, h_patches=8, w_patches=12, seed=0) -> ImageInput:
    g = torch.Generator().manual_seed(seed)
    return patchify(torch.randn(3, h_patches * cfg.patch_size, w_patches * cfg.patch_size, generator=g), cfg)


def _prompt(images):
    ids = [1, 20, 30]
    for _ in images:
        ids += [VS, IMAGE_TOKEN, VE, 40]
    return expand_image_tokens(ids + [50, 60], images, IMAGE_TOKEN)


def _fla_on_a_gpu_machine() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("fla") is not None


@pytest.mark.skipif(_fla_on_a_gpu_machine(), reason="transformers dispatches its CPU oracle to flash-linear-attention's "
                    "Triton kernels when fla is installed, which need CUDA tensors; the CPU CI runs this oracle")
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_reference_logits_match_transformers_on_an_image_prompt(hf_dense, hf_moe, vision_artifact, moe, tmp_path):
    import transformers

    src = hf_moe if moe else hf_dense
    path = convert_checkpoint(src, tmp_path / "m.nfer", ConvertOptions(recipe="bf16")).output if moe else vision_artifact
    art = Artifact(path)
    cfg = VisionConfig.from_artifact(art)
    images = [_image(cfg), _image(cfg, 4, 4, seed=1)]
    ids = _prompt(images)
    cls = transformers.Qwen3_5MoeForConditionalGeneration if moe else transformers.Qwen3_5ForConditionalGeneration
    hf = cls.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        types = torch.tensor([[1 if t == IMAGE_TOKEN else 0 for t in ids]])
        want = hf(input_ids=torch.tensor([ids]), mm_token_type_ids=types, pixel_values=torch.cat([i.pixel_values for i in images]),
                  image_grid_thw=torch.tensor([list(i.grid_thw) for i in images])).logits[0]
    ref = ReferenceModel(art)
    tower = VisionTower.from_artifact(art, "cpu", torch.float32)
    embeds = torch.cat([tower.encode(i) for i in images])
    rope, delta = mrope_positions(ids, images, IMAGE_TOKEN)
    got = ref.forward(torch.tensor(ids), ref.new_state(), 0, image_embeds=embeds, image_token=IMAGE_TOKEN,
                      rope_positions=rope)
    assert delta == int(rope.max()) + 1 - len(ids) and delta < 0
    err = (got - want).abs().max().item()
    assert err < 2e-3 * want.abs().max().item(), f"max abs logit diff {err}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_tower_keeps_every_tensor_on_the_engine_device(vision_artifact):
    """The tower on torch's "meta" device (shapes only): any tensor built on the CPU and mixed into
    the computation raises the same device-mismatch error a GPU would (no GPU needed)."""
    art = Artifact(vision_artifact)
    cpu = VisionTower.from_artifact(art, "cpu", torch.float32)
    meta = VisionTower(cpu.cfg, cpu.ids, {k: v.to("meta") for k, v in cpu.w.items()}, "meta", torch.float32)
    image = _image(cpu.cfg)
    out = meta.encode(image)
    assert out.device.type == "meta" and out.shape == cpu.encode(image).shape


def test_preprocess_resizes_to_the_merge_grid_and_rejects_garbage(vision_artifact):
    from PIL import Image

    cfg = VisionConfig.from_artifact(Artifact(vision_artifact))
    buf = io.BytesIO()
    Image.new("RGB", (50, 30), (255, 0, 0)).save(buf, format="PNG")
    img = preprocess(buf.getvalue(), cfg)
    t, h, w = img.grid_thw
    factor = cfg.spatial_merge_size
    assert t == 1 and h % factor == 0 and w % factor == 0 and w > h
    assert img.pixel_values.shape == (h * w, 3 * cfg.temporal_patch_size * cfg.patch_size ** 2)
    # pure red after normalization: channel 0 is +1, channels 1 and 2 are -1
    per_channel = img.pixel_values.view(h * w, 3, -1)
    assert torch.allclose(per_channel[:, 0], torch.ones(1)) and torch.allclose(per_channel[:, 1:], -torch.ones(1))
    with pytest.raises(ValueError, match="cannot decode"):
        preprocess(b"not an image", cfg)


def test_placeholder_counts_must_match():
    cfg = VisionConfig(1, 8, 2, 2, 2, 2, 16, 8)
    img = patchify(torch.zeros(3, 8, 8), cfg)
    with pytest.raises(ValueError, match="more image placeholders"):
        expand_image_tokens([IMAGE_TOKEN, IMAGE_TOKEN], [img], IMAGE_TOKEN)
    with pytest.raises(ValueError, match="fewer image placeholders"):
        expand_image_tokens([1], [img], IMAGE_TOKEN)


def png_data_url(size=(40, 24), color=(10, 200, 30)) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _reference_greedy(art, ids, images, n):
    ref = ReferenceModel(art)
    tower = VisionTower.from_artifact(art, "cpu", torch.float32)
    embeds = torch.cat([tower.encode(i) for i in images])
    rope, delta = mrope_positions(ids, images, IMAGE_TOKEN)
    state = ref.new_state()
    logits = ref.forward(torch.tensor(ids), state, 0, image_embeds=embeds, image_token=IMAGE_TOKEN, rope_positions=rope)
    out = [int(logits[-1].argmax())]
    for i in range(n - 1):
        pos = len(ids) + i
        logits = ref.forward(torch.tensor([out[-1]]), state, pos, rope_positions=torch.tensor([pos + delta]))
        out.append(int(logits[-1].argmax()))
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="exact token equality is asserted in float32 on CPU")
def test_engine_image_prompt_equals_reference(vision_artifact):
    pytest.importorskip("triton")
    from runtime.engine import Engine
    from runtime.memory_plan import MemoryPlanError, PlanOptions

    art = Artifact(vision_artifact)
    cfg = VisionConfig.from_artifact(art)
    images = [_image(cfg), _image(cfg, 4, 4, seed=1)]
    ids = _prompt(images)
    want = _reference_greedy(art, ids, images, 5)
    engine = Engine(vision_artifact, PlanOptions(max_context=256, prefill_chunk=128, vision=True), device="cpu")
    assert engine.generate(ids, 5, images=images) == want
    assert engine.reusable_prefix(0, ids + want + [5]) == 0  # image lanes never reuse by token ids
    plain = Engine(vision_artifact, PlanOptions(max_context=256, prefill_chunk=128), device="cpu")
    with pytest.raises(MemoryPlanError, match="without --vision"):
        plain.generate(ids, 2, images=images)


@pytest.fixture(scope="module")
def vision_server(vision_artifact):
    pytest.importorskip("triton")
    import socket
    import threading
    import time

    import uvicorn

    from runtime.memory_plan import PlanOptions
    from runtime.serve.launch import build_server

    servers = {}
    for name, vision in (("on", True), ("off", False)):
        app, _ = build_server(vision_artifact, PlanOptions(max_context=512, prefill_chunk=128, vision=vision), device="cpu",
                              model_id="tiny")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        threading.Thread(target=srv.run, daemon=True).start()
        deadline = time.time() + 30
        while not srv.started and time.time() < deadline:
            time.sleep(0.05)
        servers[name] = (srv, f"http://127.0.0.1:{port}")
    yield {k: v[1] for k, v in servers.items()}
    for srv, _ in servers.values():
        srv.should_exit = True


def test_server_answers_image_requests_on_all_three_apis(vision_server):
    anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is a test dependency (.ci/run installs it)")
    import openai

    url = vision_server["on"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    no_think = {"chat_template_kwargs": {"enable_thinking": False}}
    text_only = client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, extra_body=no_think,
                                               messages=[{"role": "user", "content": "what is this?"}])
    r = client.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0, extra_body=no_think,
        messages=[{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                               {"type": "image_url", "image_url": {"url": png_data_url()}}]}])
    # 40x24 px -> a 40x24 grid rounded to multiples of 8 -> 5x3 merged tokens at patch 4 (x2 merge)
    extra = r.usage.prompt_tokens - text_only.usage.prompt_tokens
    assert extra > 3 and r.choices[0].finish_reason in ("length", "stop")
    resp = client.responses.create(model="tiny", max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"}, {"type": "input_image", "image_url": png_data_url()}]}])
    assert resp.usage.input_tokens > 3
    ac = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    m = ac.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": png_data_url().split(",", 1)[1]}},
        {"type": "text", "text": "what is this?"}]}])
    assert m.usage.input_tokens > 3


def test_image_errors_are_clear_400s(vision_server):
    import httpx

    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url()}}]}]}
    off = httpx.post(vision_server["off"] + "/v1/chat/completions", json=body, timeout=60)
    assert off.status_code == 400 and off.json()["error"]["code"] == "vision_disabled"
    bad = dict(body, messages=[{"role": "user", "content": [{"type": "image_url",
                                                             "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    r = httpx.post(vision_server["on"] + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and "cannot decode" in r.json()["error"]["message"]
    remote = dict(body, messages=[{"role": "user", "content": [{"type": "image_url",
                                                                "image_url": {"url": "https://example.com/x.png"}}]}])
    r = httpx.post(vision_server["on"] + "/v1/chat/completions", json=remote, timeout=60)
    assert r.status_code == 400 and "remote image URLs are off" in r.json()["error"]["message"]
    assert httpx.get(vision_server["on"] + "/health").json()["status"] == "ok"


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the triton runtime on the CPU, which needs TRITON_INTERPRET "
                    "set before triton is first imported; the CPU CI runs it, the GPU path is bench/serve_smoke.py")
def test_cli_generate_with_an_image_on_both_runtimes(vision_artifact, tmp_path):
    import json

    from PIL import Image
    from typer.testing import CliRunner

    from ninfer_cli.main import app

    img = tmp_path / "green.png"
    Image.new("RGB", (40, 24), (10, 200, 30)).save(img)
    runner = CliRunner()
    base = ["generate", str(vision_artifact), "--prompt", "what is this", "--max-new-tokens", "3", "--json",
            "--vision", "--image", str(img)]
    ref = runner.invoke(app, base)
    fast = runner.invoke(app, base + ["--runtime", "triton"])
    assert ref.exit_code == 0 and fast.exit_code == 0, ref.output + fast.output
    assert json.loads(fast.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    text_only = runner.invoke(app, base[:-3])
    assert json.loads(ref.stdout)["prompt_tokens"] > json.loads(text_only.stdout)["prompt_tokens"] + 3
    missing = runner.invoke(app, base[:-3] + ["--image", str(img)])
    assert missing.exit_code == 1 and "--image needs --vision" in missing.output


def test_image_sink_sources_and_limits(tmp_path):
    from runtime.serve.chat_template import IMAGE_PLACEHOLDER, ImageSink, RequestError, normalize_openai_messages

    png = base64.b64decode(png_data_url().split(",", 1)[1])
    f = tmp_path / "a.png"
    f.write_bytes(png)
    sink = ImageSink(allow_files=str(tmp_path))
    msgs = normalize_openai_messages([{"role": "user", "content": [
        {"type": "text", "text": "compare "}, {"type": "image_url", "image_url": {"url": png_data_url()}},
        {"type": "image_url", "image_url": {"url": f"file://{f}"}}]}], sink)
    assert msgs[0]["content"] == "compare " + IMAGE_PLACEHOLDER * 2 and sink.images == [png, png]
    with pytest.raises(RequestError, match="local image files are off"):
        normalize_openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(f)}}]}],
                                  ImageSink(allow_files=None))
    outside = tmp_path.parent / f"{tmp_path.name}-outside.png"
    outside.write_bytes(png)
    for url in (str(outside), f"file://{tmp_path}/../{outside.name}", str(tmp_path / "missing.png"), "/etc/passwd"):
        with pytest.raises(RequestError, match="not readable under the server's allowed image directory"):
            normalize_openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}],
                                      ImageSink(allow_files=str(tmp_path)))
    with pytest.raises(RequestError, match="exceeds the 10-byte limit"):
        normalize_openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}}]}],
                                  ImageSink(max_bytes=10))
    with pytest.raises(RequestError, match="vision_disabled"):
        normalize_openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_data_url()}}]}],
                                  False)


@pytest.mark.parametrize("h,w,min_pixels,max_pixels", [(30, 50, 64, 64 * 64), (300, 200, 64, 64 * 64),
                                                        (17, 90, 3136, 100_000)])
def test_preprocess_equals_transformers_image_processor(h, w, min_pixels, max_pixels):
    """Resize (round / shrink / grow to the merge grid), normalization and patch order bit-identical to
    transformers' PIL image processor for Qwen2-VL-family models."""
    import numpy as np
    import transformers
    from PIL import Image

    proc_cls = getattr(transformers, "Qwen2VLImageProcessorPil", None)
    if proc_cls is None:
        pytest.skip("this transformers has no Qwen2VLImageProcessorPil")
    proc = proc_cls(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels, max_pixels=max_pixels,
                    image_mean=[0.5] * 3, image_std=[0.5] * 3)
    img = Image.fromarray((np.random.RandomState(h + w).rand(h, w, 3) * 255).astype("uint8"))
    want = proc(images=[img], return_tensors="pt")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    cfg = VisionConfig(1, 8, 2, 4, 2, 2, 16, 8, min_pixels=min_pixels, max_pixels=max_pixels)
    got = preprocess(buf.getvalue(), cfg)
    assert [list(got.grid_thw)] == want["image_grid_thw"].tolist()
    assert torch.equal(got.pixel_values, want["pixel_values"].float())


def test_shape_artifacts_carry_the_vision_tower_the_converter_keeps(vision_artifact, hf_dense, tmp_path):
    """The zero-payload shape artifacts' vision inventory is, name for name and shape for shape, what the
    converter keeps from a transformers checkpoint (the tiny one here), and the full-size tower has the
    family's 460.7M parameters; `ninfer fit --shape ... --vision` counts it without a file or a GPU."""
    import math
    import subprocess
    import sys

    from format.container import Artifact
    from format.shapes import vision_inventory, write_shape_artifact

    config = json.loads((hf_dense / "config.json").read_text())
    with Artifact(vision_artifact) as art:
        converted = {n: tuple(e.shape) for n, e in art.objects.items() if n.startswith("vision/")}
    assert dict(vision_inventory(config["vision_config"])) == converted
    full = write_shape_artifact("qwen3.8-27b", tmp_path / "v.nfer", vision=True)
    with Artifact(full) as art:
        params = sum(math.prod(e.shape) for n, e in art.objects.items() if n.startswith("vision/"))
    assert params == 460_730_096

    def fit(*extra):
        out = subprocess.run([sys.executable, "-m", "ninfer_cli.main", "fit", "--shape", "qwen3.6-27b", "--gpu", "rtx5090",
                              "--json", *extra], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    plain, seeing = fit(), fit("--vision")
    assert abs(seeing["breakdown"]["weights"] - plain["breakdown"]["weights"] - 2 * params) < 2 << 20  # arena rounding
    assert 0 < seeing["max_context"] < plain["max_context"]
    w8 = fit("--vision", "--vision-recipe", "w8")  # the tower's products in W8: about half the BF16 bytes
    assert seeing["max_context"] < w8["max_context"]
    assert 0.45 < (w8["breakdown"]["weights"] - plain["breakdown"]["weights"]) / (2 * params) < 0.6


@pytest.mark.parametrize("recipe,fmt,tol", [("w8", "W8G32_F16S", 2e-2), ("q6", "Q6G64_F16S", 6e-2)])
def test_quantized_vision_tower_stays_quantized_and_close(hf_dense, vision_artifact, tmp_path, recipe, fmt, tol):
    """convert --vision-recipe w8|q6 stores the tower's products quantized (patch embedding, position table,
    norms and biases stay BF16); the engine multiplies them as stored (the plan counts the quantized bytes, so
    `fit --vision` sees the saving) and an image's embeddings stay within the format's rounding of the BF16 tower."""
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions, build_plan

    out = convert_checkpoint(hf_dense, tmp_path / f"v-{recipe}.nfer", ConvertOptions(recipe="bf16", vision_recipe=recipe)).output
    with Artifact(out) as art, Artifact(vision_artifact) as ref_art:
        formats = {n: e.format for n, e in art.objects.items() if n.startswith("vision/")}
        assert formats["vision/blocks.0.attn.qkv.weight"] == fmt and formats["vision/merger.linear_fc2.weight"] == fmt
        assert formats["vision/patch_embed.proj.weight"] == "BF16" and formats["vision/blocks.0.attn.qkv.bias"] == "BF16"
        opts = PlanOptions(max_context=256, prefill_chunk=128, vision=True)
        tower = lambda a: sum(r.nbytes for r in build_plan(a, opts).arenas["weights"].regions  # noqa: E731
                              if r.name.startswith("vision/"))
        assert tower(art) < tower(ref_art)  # (tiny matrices: K = 32 pads to 128, so less than the full-size saving)
        image = _image(VisionConfig.from_artifact(art))
    engine = Engine(out, PlanOptions(max_context=256, prefill_chunk=128, vision=True), device="cpu")
    assert engine.vision.packed and all(k.endswith(".weight") for k in engine.vision.packed)
    bf16 = Engine(vision_artifact, PlanOptions(max_context=256, prefill_chunk=128, vision=True), device="cpu")
    got, want = engine.vision.encode(image).float(), bf16.vision.encode(image).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err < tol, err
    with Artifact(out) as art:  # the reference runtime's tower (generate) loads the same quantized planes
        assert torch.equal(VisionTower.from_artifact(art, "cpu", torch.float32).encode(image), got)


def test_warm_up_covers_image_lanes(vision_artifact, monkeypatch):
    """With --vision, Engine.warm_up also runs the tower once and captures the decode graphs at shifted rotary
    positions: a lane decoding after an image prompt captures nothing later."""
    pytest.importorskip("triton")
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    from .test_engine import _graphs_on_the_cpu

    engine = Engine(vision_artifact, PlanOptions(max_context=256, prefill_chunk=128, vision=True), device="cpu")
    _graphs_on_the_cpu(engine, monkeypatch)
    encoded = []
    real = engine.vision.encode
    monkeypatch.setattr(engine.vision, "encode", lambda image: encoded.append(image.grid_thw) or real(image))
    engine.warm_up()
    assert ("decode-shifted", 1, True) in engine._graphs and len(encoded) == 1
    cfg = engine.vision.cfg
    images = [_image(cfg)]
    ids = _prompt(images)
    logits = list(engine.prefill_chunks(0, ids, images=images))[-1]
    engine.decode_step([0], [int(logits.argmax())])
    assert engine.rope_delta[0] and engine.stats.graphs_captured_serving == 0
