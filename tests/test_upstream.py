"""Official upstream ninfer artifacts run as they are: small synthetic files in upstream's v2 and v3 layouts
(tests/upstream_files.py, written from interop.md's facts) bind to exactly the weights of the artifact they
were made from, and generate the same greedy tokens on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

import format.shapes
from format.container import Artifact, open_artifact
from format.convert import ConvertOptions, convert_checkpoint, rewrite_artifact
from format.errors import ArtifactError
from format.tiny import write_tiny_checkpoint
from format.upstream import UpstreamArtifactError
from .upstream_files import Rows, write_v2, write_v3


@pytest.fixture(scope="module")
def ours_dense(tmp_path_factory, tiny_with_mtp):
    out = tmp_path_factory.mktemp("up_dense") / "dense.nfer"
    convert_checkpoint(tiny_with_mtp, out, ConvertOptions(recipe="q4", lm_head_draft=96))
    return out


@pytest.fixture(scope="module")
def ours_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("up_moe")
    src = write_tiny_checkpoint(d / "hf", moe=True, seed=5)
    out = d / "moe.nfer"
    convert_checkpoint(src, out, ConvertOptions(recipe="q4"))
    return out


def _text_config(path) -> dict:
    with Artifact(path) as art:
        cfg = json.loads(art.resource_bytes("resource/config.json"))
    return cfg.get("text_config", cfg)


@pytest.fixture
def as_27b(monkeypatch, ours_dense):
    """v2 carries no config: its model id names the shape. The tiny model stands in for the 27B here."""
    monkeypatch.setitem(format.shapes.NAMED_SHAPES, "qwen3.6-27b", _text_config(ours_dense))


def _same_weights(ours_path, bound) -> list[str]:
    """Every object of ours decodes to the same values from the bound upstream file; returns the names
    whose format differs (re-packed wider)."""
    widened = []
    with Artifact(ours_path) as ours:
        assert set(bound.objects) == set(ours.objects)
        for name, e in ours.objects.items():
            b = bound.objects[name]
            assert b.shape == e.shape and b.component == e.component, name
            if e.kind == "resource":
                continue
            if b.format != e.format:
                widened.append(name)
            assert np.array_equal(bound.read_float(name), ours.read_float(name)), name
    return widened


def _greedy(path) -> list[int]:
    from runtime.generate import TextSession

    session = TextSession.load(str(path))
    return session.complete("the quick brown fox", 10, chat=False)["tokens"]


def test_v2_with_split_attention_binds_to_the_same_weights_and_tokens(tmp_path, ours_dense, as_27b):
    """The 27B profile: Q4 query/key + Q5 gate/value parents, split GDN projections, tap-major
    convolutions, `mtp/layer/`, a draft head in count order, special tokens only in tokenizer_config."""
    up = write_v2(ours_dense, tmp_path / "qwen.ninfer", "qwen3.6-27b", fused_attention=False, widen_gate_value=True)
    with pytest.raises(ArtifactError):
        Artifact(up)  # our own reader does not take it; open_artifact binds it
    with open_artifact(up) as bound:
        assert bound.version == 2 and bound.upstream.model_id == "qwen3.6-27b"
        widened = _same_weights(ours_dense, bound)
        assert widened and all(n.endswith("attention/query_gate_key_value") for n in widened)
        assert bound.objects[widened[0]].format == "Q5G64_F16S"
        assert any("stacked as Q5G64_F16S" in n for n in bound.notes)
        assert set(bound.components) == {"text", "mtp", "lm_head_draft"}
        tok = json.loads(bound.resource_bytes("resource/tokenizer.json"))
        assert any(t["content"] == "<|im_end|>" for t in tok["added_tokens"])  # merged back from tokenizer_config
    assert _greedy(up) == _greedy(ours_dense)


def test_v3_moe_with_fused_parents_and_continuation_parts(tmp_path, ours_moe):
    """The 35B profile in v3: opaque ids, logical bindings as element ranges of fused parents
    ([q, k, gate, v], router + shared score, 8 experts' gate/up), the payload over an entry file and parts."""
    up = write_v3(ours_moe, tmp_path / "moe.ninfer", fused_attention=True, part_bytes=64 * 4096)
    parts = sorted(p.name for p in tmp_path.iterdir() if ".part-" in p.name)
    assert len(parts) >= 2
    with open_artifact(up) as bound:
        assert bound.version == 3 and _same_weights(ours_moe, bound) == []
        described = bound.describe()
        assert described["origin"] == "upstream ninfer" and described["runnable"] and described["model"] == "qwen3_5_moe"
    assert _greedy(up) == _greedy(ours_moe)
    # a missing or foreign continuation part is one line naming it
    (tmp_path / parts[-1]).rename(tmp_path / "elsewhere")
    with pytest.raises(ArtifactError, match=f"continuation part {parts[-1]} is missing"):
        open_artifact(up)
    other = write_v3(ours_moe, tmp_path / "other.ninfer", part_bytes=64 * 4096)
    (tmp_path / f"other.ninfer.part-{len(parts):04d}").rename(tmp_path / parts[-1])
    with pytest.raises(ArtifactError, match="not part .* of this artifact"):
        open_artifact(up)
    assert other.exists()


def test_v3_dense_runs_through_the_cli_and_rewrites_as_ours(tmp_path, ours_dense):
    from ninfer_cli.main import app

    up = write_v3(ours_dense, tmp_path / "dense.ninfer", fused_attention=False, widen_gate_value=True, name="qwen3.8-27b")
    runner = CliRunner()
    shown = runner.invoke(app, ["inspect", str(up), "--json"])
    assert shown.exit_code == 0, shown.output
    d = json.loads(shown.stdout)
    assert d["origin"] == "upstream ninfer" and d["version"] == 3 and d["upstream_model_id"] == "qwen3.8-27b"
    assert d["runnable"] and "mtp" in d["bound_components"]
    gen = runner.invoke(app, ["generate", str(up), "--raw", "--max-new-tokens", "6", "--prompt", "the quick brown fox",
                              "--temperature", "0"])
    assert gen.exit_code == 0, gen.output
    ours = runner.invoke(app, ["generate", str(ours_dense), "--raw", "--max-new-tokens", "6", "--prompt",
                               "the quick brown fox", "--temperature", "0"])
    assert gen.stdout == ours.stdout
    engine = runner.invoke(app, ["generate", str(up), "--runtime", "triton", "--raw", "--max-new-tokens", "6",
                                 "--prompt", "the quick brown fox", "--temperature", "0", "--max-context", "256"])
    assert engine.exit_code == 0, engine.output
    assert engine.stdout == ours.stdout  # the engine's weights come through the binder too
    fits = [runner.invoke(app, ["fit", str(p), "--vram", "24G", "--json"]) for p in (up, ours_dense)]
    assert all(f.exit_code == 0 for f in fits), fits[0].output
    plans = [json.loads(f.stdout) for f in fits]
    assert plans[0].keys() == plans[1].keys()
    rewritten = rewrite_artifact(up, tmp_path / "ours.nfer")
    with Artifact(rewritten.output) as art:
        _same_weights(ours_dense, art)


def test_stray_parameters_profiles_and_broken_files(tmp_path, ours_dense, as_27b):
    from ninfer_cli.main import app

    # a text parameter our model does not use: recognised, described, refused naming it
    extra = ({"shape": [128, 64], "format": "NVFP4", "layout": "blockscale-k16-m128x4-v1"},
             bytes(128 * 64 // 2 + 128 * 64 // 16 + 4))
    up = write_v2(ours_dense, tmp_path / "good.ninfer", "qwen3.6-27b")
    fake = write_v2(ours_dense, tmp_path / "extra.ninfer", "qwen3.6-27b", extra_objects=[("text/layers/0/gdn/extra", extra)])
    with pytest.raises(UpstreamArtifactError) as err:
        open_artifact(fake)
    assert "\n" not in str(err.value) and "upstream ninfer v2 artifact (model qwen3.6-27b" in str(err.value)
    assert "text/layers/0/gdn/extra is not one the qwen3_5 model of this build uses" in str(err.value)
    r = CliRunner().invoke(app, ["inspect", str(fake), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["origin"] == "upstream ninfer"
    # an nvfp4-profile file re-writes as our v3 (its profile kept in the metadata, not as one of our recipes)
    profiled = write_v2(ours_dense, tmp_path / "p.ninfer", "qwen3.6-27b", profile="nvfp4")
    with Artifact(rewrite_artifact(profiled, tmp_path / "p.nfer").output) as art:
        assert art.metadata["upstream_profile"] == "nvfp4" and art.identity["weights_id"] == "q4"
    # truncated payload
    cut = tmp_path / "cut.ninfer"
    cut.write_bytes(up.read_bytes()[:-5000])
    with pytest.raises(ArtifactError) as err:
        open_artifact(cut)
    assert "\n" not in str(err.value)
    r = CliRunner().invoke(app, ["generate", str(cut), "--raw", "--prompt", "x"])
    assert r.exit_code == 1 and "Traceback" not in r.output


def test_widened_codes_decode_to_the_same_values():
    """Q4 -> Q5 / Q6 / W8 re-packing keeps every decoded value (the stacking rule for mixed parents)."""
    from format.layouts import RowSplitGeometry
    from format.numeric import FORMATS
    from format.quantize import dequantize, encode_rows
    from format.upstream_bind import _widen

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 200)).astype(np.float32)
    base, high, scale = encode_rows(x, "Q4G64_F16S")
    src = FORMATS["Q4G64_F16S"]
    planes = (np.frombuffer(base, np.uint8).reshape(6, -1), None, np.frombuffer(scale, np.uint8).reshape(6, -1))
    want = dequantize(base, None, scale, 6, 200, src)
    for dst in ("Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S"):
        b, h, s = _widen(planes, src, FORMATS[dst], 200)
        got = dequantize(b.tobytes(), None if h is None else h.tobytes(), s.tobytes(), 6, 200, FORMATS[dst])
        assert np.array_equal(got, want), dst
        assert RowSplitGeometry(6, 200, FORMATS[dst]).base_bytes == b.size
    assert Rows  # the test writer's row model is what the binder is checked against


def test_padded_vocabulary_rows_are_never_produced(tmp_path):
    """A head padded past the tokenizer (Qwen3.5: 248,320 rows, 248,077 tokens; here 512 rows, 478 tokens)
    never yields a padded id, whichever runtime: those logits are -inf (upstream masks them at sampling)."""
    import torch

    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from runtime.model import ReferenceModel

    src = write_tiny_checkpoint(tmp_path / "hf", vocab_size=512, seed=2)
    out = tmp_path / "padded.nfer"
    convert_checkpoint(src, out, ConvertOptions(recipe="q4"))
    prompt = [5, 17, 99, 300, 12]
    with Artifact(out) as art:
        ref = ReferenceModel(art)
        assert ref.token_limit == 478
        logits = ref.forward(torch.tensor(prompt), ref.new_state(), 0)
    assert torch.isinf(logits[..., 478:]).all() and torch.isfinite(logits[..., :478]).all()
    engine = Engine(out, PlanOptions(max_context=128, prefill_chunk=128), device="cpu")
    first = engine.prefill(0, prompt)
    step = engine.decode_step([0], [int(first.argmax())])
    for got in (first, step):
        assert torch.isinf(got[..., 478:]).all() and torch.isfinite(got[..., :478]).all()


def _twin(src, out, values: dict):
    """Our artifact with the objects in `values` stored as BF16 holding exactly those values."""
    from format.container import ArtifactPlan, ArtifactWriter
    from format.numeric import GroupedFormat, get_format

    with Artifact(src) as art:
        plan = ArtifactPlan(3, art.identity["model_id"], art.identity["weights_id"])
        for name, e in art.objects.items():
            if e.kind == "tensor":
                plan.add_tensor(name, e.shape, "BF16" if name in values else e.format, e.component)
            else:
                plan.add_resource(name, e.nbytes, e.component)
        with ArtifactWriter(out, plan) as w:
            for name, e in art.objects.items():
                if e.kind == "resource":
                    w.write_resource(name, art.resource_bytes(name))
                elif name in values:
                    bits = np.ascontiguousarray(values[name], np.float32).view(np.uint32)
                    assert not (bits & 0xFFFF).any()  # exactly representable: the twin is exact
                    w.write_direct(name, (bits >> 16).astype(np.uint16))
                elif isinstance(get_format(e.format), GroupedFormat):
                    base, high, scale, _ = art.planes(name)
                    w.write_rows(name, 0, (base, high if high is not None else b"", scale))
                else:
                    w.write_direct(name, art.read_direct(name))
    return out


def test_nvfp4_and_fp8_weights_bind_and_run_as_their_values(tmp_path, ours_dense):
    """The nvfp4 profile's formats: NVFP4 (swizzled E4M3FN block scales, two stacked sources with their own
    divisors) for the embedding, head, attention and MLP gate/up; FP8 rows for down / GDN output. Bound,
    they decode to exactly the values written, and both runtimes generate what a BF16 twin of those values does."""
    from ninfer_cli.main import app
    from .upstream_files import FloatRows

    with Artifact(ours_dense) as art:
        w = {n: art.read_float(n) for n in ("text/token_embedding", "text/output_head", "text/layers/0/mlp/gate_up",
                                              "text/layers/3/attention/query_gate_key_value", "text/layers/0/mlp/down",
                                              "text/layers/1/gdn/output")}
    half = w["text/layers/0/mlp/gate_up"].shape[0] // 2
    floats = {
        "text/token_embedding": FloatRows.encode_nvfp4(w["text/token_embedding"], np.full(384, 2.0)),
        "text/output_head": FloatRows.encode_nvfp4(w["text/output_head"], np.full(384, 0.5)),
        "text/layers/3/attention/query_gate_key_value":
            FloatRows.encode_nvfp4(w["text/layers/3/attention/query_gate_key_value"], np.full(768, 4.0)),
        "text/layers/0/mlp/gate_up": FloatRows.encode_nvfp4(w["text/layers/0/mlp/gate_up"],
                                                            np.repeat([2.0, 8.0], half)),  # two sources, two divisors
        "text/layers/0/mlp/down": FloatRows.encode_fp8(w["text/layers/0/mlp/down"]),
        "text/layers/1/gdn/output": FloatRows.encode_fp8(w["text/layers/1/gdn/output"]),
    }
    values = {n: f.decoded() for n, f in floats.items()}
    for n in values:  # the encodings are close to the weights they replace (a sane profile, not noise)
        assert np.abs(values[n] - w[n]).max() <= 0.3 * np.abs(w[n]).max() + 1e-6, n
    up = write_v3(ours_dense, tmp_path / "fp4.ninfer", fused_attention=False, name="qwen3.6-27b", floats=floats)
    twin = _twin(ours_dense, tmp_path / "twin.nfer", values)
    with open_artifact(up) as bound:
        for n, f in floats.items():
            assert bound.objects[n].format == f.fmt
            assert np.array_equal(bound.read_float(n), values[n]), n
        root_formats = bound.upstream.formats
    assert "NVFP4" in root_formats and "FP8_E4M3FN_ROW_BF16S" in root_formats
    assert _greedy(up) == _greedy(twin)
    runner = CliRunner()
    args = ["--runtime", "triton", "--raw", "--max-new-tokens", "6", "--prompt", "the quick brown fox", "--temperature",
            "0", "--max-context", "256"]
    got, want = runner.invoke(app, ["generate", str(up), *args]), runner.invoke(app, ["generate", str(twin), *args])
    assert got.exit_code == 0, got.output
    assert got.stdout == want.stdout
    rewritten = rewrite_artifact(up, tmp_path / "ours.nfer")  # our own v3 carries the float formats too
    with Artifact(rewritten.output) as art:
        assert art.objects["text/output_head"].format == "NVFP4"
        assert np.array_equal(art.read_float("text/output_head"), values["text/output_head"])


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU: the Triton engine on the device")
def test_bound_upstream_files_run_on_the_gpu_engine(tmp_path, ours_dense, as_27b):
    """On the GPU the bound files go through the real kernels (widened Q5 rows, NVFP4 / FP8 in-kernel
    decoding): their logits match those of the artifacts they stand for."""
    import torch

    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from .upstream_files import FloatRows

    with Artifact(ours_dense) as art:
        head, gate_up = art.read_float("text/output_head"), art.read_float("text/layers/0/mlp/gate_up")
        down = art.read_float("text/layers/0/mlp/down")
    floats = {"text/output_head": FloatRows.encode_nvfp4(head, np.full(head.shape[0], 0.5)),
              "text/layers/0/mlp/gate_up": FloatRows.encode_nvfp4(gate_up, np.full(gate_up.shape[0], 2.0)),
              "text/layers/0/mlp/down": FloatRows.encode_fp8(down)}
    pairs = [(write_v2(ours_dense, tmp_path / "q.ninfer", "qwen3.6-27b"), ours_dense),
             (write_v3(ours_dense, tmp_path / "f.ninfer", fused_attention=False, name="qwen3.6-27b", floats=floats),
              _twin(ours_dense, tmp_path / "twin.nfer", {n: f.decoded() for n, f in floats.items()}))]
    prompt = [5, 17, 99, 300, 12, 7, 7, 41]
    for up, ref in pairs:
        got, want = [], []
        for path, sink in ((up, got), (ref, want)):
            engine = Engine(path, PlanOptions(max_context=256, prefill_chunk=128), device="cuda")
            first = engine.prefill(0, prompt)
            sink += [first.float().cpu(), engine.decode_step([0], [int(first.argmax())]).float().cpu()]
            del engine
        for g, w in zip(got, want):
            finite = torch.isfinite(w)
            assert torch.equal(finite, torch.isfinite(g))
            assert (g[finite] - w[finite]).abs().max() <= 0.05 * w[finite].abs().max(), up.name


def test_v3_with_a_dflash2_companion_drafts_as_ours(tmp_path, tiny_with_mtp):
    """A DFlash2 drafter in upstream's v3 (its config in components.dflash2, q/k/v and gate/up as logical
    parameters, context K/V bound to the same rows): bound, it drafts exactly as our artifact's."""
    from format.tiny import write_tiny_dflash2
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    drafter = write_tiny_dflash2(tmp_path / "drafter", tiny_with_mtp, seed=7)
    ours = convert_checkpoint(tiny_with_mtp, tmp_path / "d.nfer", ConvertOptions(recipe="q4", dflash2=drafter)).output
    up = write_v3(ours, tmp_path / "d.ninfer", fused_attention=True, name="qwen3.8-27b")
    with open_artifact(up) as bound:
        assert "dflash2" in bound.components and not bound.unbound
        _same_weights(ours, bound)
    prompt = [5, 17, 99, 300, 12, 7, 7, 41]
    runs = []
    for path in (ours, up):
        engine = Engine(path, PlanOptions(max_context=256, prefill_chunk=128, spec="dflash2", draft_tokens=3), device="cpu")
        runs.append(engine.generate(prompt, 12))
    assert runs[0] == runs[1] and len(runs[0]) == 12


@pytest.mark.parametrize("version", [2, 3])
def test_the_vision_tower_binds_to_the_checkpoint_names(tmp_path, hf_dense, monkeypatch, version):
    """Upstream's vision objects (fused qkv and its bias split by thirds, the [hidden, C*T*P*P] patch matrix,
    norm1/weight, merger/...) bind to our checkpoint-named tower with the same weights and config, and the
    tower encodes an image exactly as ours does."""
    import torch

    from runtime.vision import ImageInput, VisionTower

    ours = convert_checkpoint(hf_dense, tmp_path / "v.nfer", ConvertOptions(recipe="q4", vision_recipe="w8")).output
    if version == 2:  # v2: the model id names the shape, and every family member has the same tower
        text = _text_config(ours)
        with Artifact(ours) as art:
            vision = json.loads(art.resource_bytes("resource/config.json"))["vision_config"]
        monkeypatch.setitem(format.shapes.NAMED_SHAPES, "qwen3.6-27b", text)
        monkeypatch.setattr(format.shapes, "_VISION", {k: v for k, v in vision.items() if k != "out_hidden_size"})
        up = write_v2(ours, tmp_path / "v.ninfer", "qwen3.6-27b")
    else:
        up = write_v3(ours, tmp_path / "v.ninfer", fused_attention=False, name="qwen3.6-27b")
    with open_artifact(up) as bound, Artifact(ours) as art:
        assert "vision" in bound.components and not bound.unbound
        _same_weights(ours, bound)
        for key in ("depth", "hidden_size", "out_hidden_size", "patch_size"):
            got = json.loads(bound.resource_bytes("resource/config.json"))["vision_config"][key]
            assert got == json.loads(art.resource_bytes("resource/config.json"))["vision_config"][key]
        towers = [VisionTower.from_artifact(a, "cpu", torch.float32) for a in (bound, art)]
        patch_values = 3 * 2 * towers[1].cfg.patch_size ** 2
        image = ImageInput(torch.randn(16, patch_values, generator=torch.Generator().manual_seed(0)), (1, 4, 4))
        a, b = (t.encode(image) for t in towers)
        assert torch.equal(a, b)


def test_fit_takes_the_upstream_profiles_of_a_full_size_shape():
    """`fit --shape --recipe groupwise-int | nvfp4`: the memory of an official file as it binds, on a CPU."""
    from ninfer_cli.main import app

    weights = {}
    for recipe in ("q4", "groupwise-int", "nvfp4"):
        r = CliRunner().invoke(app, ["fit", "--shape", "qwen3.6-27b", "--recipe", recipe, "--gpu", "rtx5090", "--json"])
        assert r.exit_code == 0, r.output
        weights[recipe] = json.loads(r.stdout)["breakdown"]["weights"]
    # the widened attention input costs 1 bit per weight of 16 layers' [14336, 5120]; NVFP4 4.5 bits against 4.25-6.25
    assert weights["groupwise-int"] - weights["q4"] == 16 * 14336 * 5120 // 8
    assert weights["nvfp4"] < weights["q4"]
    bad = CliRunner().invoke(app, ["fit", "--shape", "qwen3.6-27b", "--recipe", "fp3", "--gpu", "rtx5090"])
    assert bad.exit_code == 1 and "upstream profile (groupwise-int, nvfp4)" in bad.output


@pytest.mark.parametrize("version", [2, 3])
def test_serve_answers_from_an_upstream_file_as_from_ours(tmp_path, ours_dense, as_27b, version):
    """`ninfer serve` on an official-layout file: the same chat answer (greedy, with its chat template and
    stop tokens from frontend/*) as our layout of the same weights, through the OpenAI SDK."""
    import openai
    import torch

    from runtime.memory_plan import PlanOptions
    from runtime.serve.launch import build_server
    from .serving import Loopback

    up = write_v2(ours_dense, tmp_path / "s.ninfer", "qwen3.6-27b", fused_attention=True) if version == 2 else \
        write_v3(ours_dense, tmp_path / "s.ninfer", fused_attention=True, name="qwen3.6-27b")
    answers = []
    for path in (up, ours_dense):
        app, summary = build_server(path, PlanOptions(max_context=256, prefill_chunk=128),
                                    device="cuda" if torch.cuda.is_available() else "cpu", model_id="tiny")
        loop = Loopback(app)
        try:
            client = openai.OpenAI(base_url=loop.url + "/v1", api_key="x")
            r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                               max_tokens=12, temperature=0)
            answers.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
        finally:
            loop.stop()
    assert answers[0] == answers[1] and answers[0][2] > 0


def _edit_v3(path, edit) -> None:
    """Re-write a v3 file's JSON directory in place through `edit(root)` (the payload start kept)."""
    import struct

    data = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", data, 8)
    root = json.loads(bytes(data[32 : 32 + n]))
    edit(root)
    text = json.dumps(root).encode()
    start = -(-(32 + n) // 4096) * 4096
    assert 32 + len(text) <= start, "the edited directory must fit the same pages"
    data[8:16] = struct.pack("<Q", start - 32)
    data[32:start] = text + b" " * (start - 32 - len(text))  # JSON whitespace up to the payload
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["objects"].append(dict(r["objects"][0])), "duplicate object"),
    (lambda r: r["objects"][1].update(offset=r["objects"][0]["offset"]), "overlaps"),
    (lambda r: r["bindings"].update({"text/final_norm": {"parts": [{"object": r["objects"][0]["id"], "range": [0, 10 ** 12]}]}}),
     "beyond the"),
    (lambda r: r["bindings"].update({"text/final_norm": {"object": "nope"}}), "names no tensor object"),
    (lambda r: r["uses"].append({"parameter": "text/ghost", "input": "x"}), "has no binding"),
    (lambda r: r["uses"].append({"parameter": "text/final_norm", "input": "x", "auxiliaries": {
        "hadamard_signs": {"object": r["objects"][0]["id"]}}}), "hadamard_signs, which this build does not apply"),
    (lambda r: r["objects"][0].update(bytes=r["objects"][0]["bytes"] + 1), "encodes to"),
    (lambda r: r["objects"][0].update(format="q3_g64_fp16"), "not one this build reads"),
    (lambda r: r["files"][0].update(payload_bytes=r["files"][0]["payload_bytes"] + 4096), "truncated or padded"),
    (lambda r: r["components"].pop("text"), "components must be an object holding text"),
    (lambda r: r["bindings"].update({"text/layers/0/input_norm": {"parts": [{"object": r["objects"][1]["id"], "range": [1, 3]}]}}),
     "not whole rows|needs"),
])
def test_malformed_v3_directories_are_one_line(tmp_path, ours_moe, edit, message):
    up = write_v3(ours_moe, tmp_path / "m.ninfer")
    _edit_v3(up, edit)
    with pytest.raises(ArtifactError) as err:
        open_artifact(up)
    assert "\n" not in str(err.value)
    assert __import__("re").search(message, str(err.value)), str(err.value)
