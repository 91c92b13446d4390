"""HF checkpoint -> .nfer: every tensor round-trips, companions, v2 refusals, atomic failure."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from format.container import Artifact
from format.convert import ConvertOptions, convert_checkpoint
from format.errors import ConvertError, QuantizationError
from format.numeric import FORMATS, GroupedFormat
from format.quantize import dequantize, quantize_reference
from format.layouts import pack_row_split

PREFIX = "model.language_model."


def _source(ckpt):
    out = {}
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for k in f.keys():
            out[k] = f.get_tensor(k).float()
    return out


def _expected(src: dict, name: str, cfg_moe: bool, experts: int):
    """Rebuild an artifact object from the source tensors, independently of the converter."""
    if name.startswith("vision/"):
        return src["model.visual." + name[len("vision/"):]]
    parts = name.split("/")
    if name == "text/token_embedding":
        return src[PREFIX + "embed_tokens.weight"]
    if name == "text/output_head":
        return src["lm_head.weight"]
    if name == "text/final_norm":
        return src[PREFIX + "norm.weight"]
    i, rest = parts[2], "/".join(parts[3:])
    p = f"{PREFIX}layers.{i}."
    simple = {"input_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
              "attention/query_norm": "self_attn.q_norm.weight", "attention/key_norm": "self_attn.k_norm.weight",
              "attention/output": "self_attn.o_proj.weight", "gdn/beta_projection": "linear_attn.in_proj_b.weight",
              "gdn/alpha_projection": "linear_attn.in_proj_a.weight", "gdn/a_log": "linear_attn.A_log",
              "gdn/dt_bias": "linear_attn.dt_bias", "gdn/norm": "linear_attn.norm.weight",
              "gdn/output": "linear_attn.out_proj.weight", "mlp/down": "mlp.down_proj.weight",
              "moe/router": "mlp.gate.weight", "moe/shared_gate": "mlp.shared_expert_gate.weight",
              "moe/shared_down": "mlp.shared_expert.down_proj.weight"}
    if rest in simple:
        return src[p + simple[rest]]
    cat = lambda *keys: torch.cat([src[p + k] for k in keys])
    if rest == "attention/query_gate_key_value":
        return cat("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
    if rest == "gdn/query_key_value_z":
        return cat("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight")
    if rest == "gdn/convolution":
        return src[p + "linear_attn.conv1d.weight"][:, 0, :]
    if rest == "mlp/gate_up":
        return cat("mlp.gate_proj.weight", "mlp.up_proj.weight")
    if rest == "moe/shared_gate_up":
        return cat("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")
    if rest == "moe/experts_gate_up":
        return torch.cat([cat(f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight") for e in range(experts)])
    if rest == "moe/experts_down":
        return torch.cat([src[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)])
    raise AssertionError(f"test does not know object {name}")


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize("recipe", ["bf16", "q4", "q6", "w8"])
def test_every_tensor_round_trips(hf_checkpoints, tmp_path, kind, version, recipe):
    ckpt = hf_checkpoints[kind]
    out = tmp_path / f"{kind}.nfer"
    report = convert_checkpoint(ckpt, out, ConvertOptions(version=version, recipe=recipe))
    assert report.peak_rss_bytes > 0 and report.objects > 0
    src = _source(ckpt)
    experts = json.loads((ckpt / "config.json").read_text())["text_config"].get("num_experts", 0)
    with Artifact(out) as art:
        assert art.version == version and art.identity == {"model_id": f"qwen3_5{'_moe' if kind == 'moe' else ''}",
                                                          "weights_id": recipe}
        assert "vision" in art.components
        tensors = [e for e in art.objects.values() if e.kind == "tensor"]
        assert len(tensors) > 20
        for e in tensors:
            want = _expected(src, e.name, kind == "moe", experts).numpy().astype(np.float32)
            got = art.read_float(e.name)
            assert got.shape == want.shape, e.name
            fmt = FORMATS[e.format]
            if isinstance(fmt, GroupedFormat):
                codes, bits = quantize_reference(want, fmt)  # the canonical encoder on the source
                assert np.array_equal(got, dequantize(*pack_row_split(codes, bits, fmt), *want.shape, fmt)), e.name
                scale = np.repeat(bits.view(np.float16).astype(np.float32), fmt.group_size, 1)[:, : want.shape[1]]
                assert (np.abs(got - want) <= scale * 0.5 + 1e-6 + np.abs(want) * 1e-3).all(), e.name
            else:
                assert np.array_equal(got, want), e.name  # bf16 source: exact


def test_fused_expert_checkpoint_gives_identical_artifact(hf_moe, tmp_path):
    """Experts stored as 3-D gate_up_proj/down_proj convert to the same bytes as per-expert keys."""
    import shutil

    fused_dir = tmp_path / "fused"
    shutil.copytree(hf_moe, fused_dir)
    src = _source(hf_moe)
    n = json.loads((hf_moe / "config.json").read_text())["text_config"]["num_experts"]
    out = {}
    for k, t in src.items():
        if ".mlp.experts." in k:
            continue
        out[k] = t
    for i in range(4):
        p = f"{PREFIX}layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = torch.stack([torch.cat([src[f"{p}{e}.gate_proj.weight"], src[f"{p}{e}.up_proj.weight"]]) for e in range(n)])
        out[p + "down_proj"] = torch.stack([src[f"{p}{e}.down_proj.weight"] for e in range(n)])
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}, str(fused_dir / "model.safetensors"))
    a = convert_checkpoint(hf_moe, tmp_path / "a.nfer", ConvertOptions(recipe="q4", checksums=False))
    b = convert_checkpoint(fused_dir, tmp_path / "b.nfer", ConvertOptions(recipe="q4", checksums=False))
    with Artifact(a.output) as x, Artifact(b.output) as y:
        for name in x.objects:
            if "experts" in name:
                assert bytes(x.raw(name)) == bytes(y.raw(name)), name


def test_v3_carries_companions_and_v2_refuses_them(tiny_with_mtp, tmp_path):
    from format.tiny import write_tiny_dflash2

    drafter = write_tiny_dflash2(tmp_path / "dflash2", tiny_with_mtp, seed=1)
    out = tmp_path / "full.nfer"
    convert_checkpoint(tiny_with_mtp, out, ConvertOptions(version=3, recipe="q4", lm_head_draft=96, dflash2=drafter))
    with Artifact(out) as art:
        assert set(art.components) == {"text", "mtp", "lm_head_draft", "dflash2"}
        ids = art.read_direct("lm_head_draft/token_ids")
        assert ids.shape == (96,) and (np.diff(ids) > 0).all()
        specials = {int(k) for k in json.loads((tiny_with_mtp / "tokenizer_config.json").read_text())["added_tokens_decoder"]}
        assert specials <= set(ids.tolist())
        with safe_open(str(tiny_with_mtp / "model.safetensors"), "pt") as f:
            head = f.get_tensor("lm_head.weight").float().numpy()
        codes, bits = quantize_reference(head[ids], "Q4G64_F16S")
        assert np.array_equal(art.read_float("lm_head_draft/head"), dequantize(*pack_row_split(codes, bits, FORMATS["Q4G64_F16S"]), 96, 64, "Q4G64_F16S"))
        assert art.entry("dflash2/feature_projection").format == "W8G32_F16S"
        assert art.entry("dflash2/feature_projection").shape == (64, 128)  # two taps of hidden 64
        assert art.entry("dflash2/layers/0/attention/query_key_value").format == "W8G32_F16S"
        assert art.entry("dflash2/layers/0/input_norm").format == "BF16"
        assert art.entry("dflash2/candidate_selector/successor_codebook").format == "BF16"
        assert len([n for n in art.objects if n.startswith("dflash2/") and n != "dflash2/config.json"]) == 6 + 2 * 12
        assert art.entry("mtp/input_projection").shape == (64, 128)
        assert art.resource_bytes("dflash2/config.json").startswith(b"{")
        from format.inspect import summarize

        s = summarize(art)
        assert s["runnable"] and not s["companions"]
        assert all(any(word in f for f in s["features"]) for word in ("MTP", "lm-head", "DFlash2"))

    for opts, word in [(dict(mtp=True), "MTP head"), (dict(lm_head_draft=8), "lm-head draft"),
                       (dict(dflash2=drafter), "DFlash2")]:
        with pytest.raises(ConvertError, match=f"version 2 cannot carry companion weights \\({word}"):
            convert_checkpoint(tiny_with_mtp, tmp_path / "v2.nfer", ConvertOptions(version=2, **opts))
    rep = convert_checkpoint(tiny_with_mtp, tmp_path / "v2.nfer", ConvertOptions(version=2))
    assert any("MTP" in n for n in rep.notes)
    with Artifact(rep.output) as art:
        assert art.components == ("text",)


def test_failed_conversion_leaves_no_file_and_keeps_old_output(tiny_with_mtp, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_with_mtp, bad)
    with safe_open(str(bad / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.language_model.layers.2.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    target = tmp_path / "out.nfer"
    target.write_bytes(b"old")
    with pytest.raises(QuantizationError, match="NaN or infinity"):
        convert_checkpoint(bad, target, ConvertOptions(recipe="q4"))
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out.nfer"]


@pytest.mark.parametrize("breakage,message", [
    (lambda d: (d / "config.json").unlink(), "has no config.json"),
    (lambda d: (d / "config.json").write_text('{"model_type": "llama"}'), "not a Qwen3.5-family checkpoint"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
    (lambda d: (d / "model.safetensors").write_bytes(b"\x01\x00"), "truncated safetensors"),
    (lambda d: (d / "model.safetensors").unlink(), "no \\*.safetensors"),
])
def test_bad_checkpoints_get_one_line_errors(tiny_with_mtp, tmp_path, breakage, message):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(tiny_with_mtp, d)
    breakage(d)
    with pytest.raises(ConvertError, match=message):
        convert_checkpoint(d, tmp_path / "o.nfer", ConvertOptions())
    assert not (tmp_path / "o.nfer").exists()


def test_missing_tensor_named(tiny_with_mtp, tmp_path):
    import shutil

    d = tmp_path / "ck"
    shutil.copytree(tiny_with_mtp, d)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if "layers.1.linear_attn.in_proj_z" not in k}
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(ConvertError, match="lacks tensor model.language_model.layers.1.linear_attn.in_proj_z.weight"):
        convert_checkpoint(d, tmp_path / "o.nfer", ConvertOptions())


def test_from_artifact_rewrites_any_readable_artifact_as_v3(tiny_with_mtp, tmp_path):
    """`convert --from-artifact OLD NEW`: our v2 becomes v3 with every object's bytes unchanged, checksums
    added and the same generation; the source itself is never the output."""
    import json as _json

    from typer.testing import CliRunner

    from format.container import Artifact
    from ninfer_cli.main import app

    runner = CliRunner()
    v2, v3 = tmp_path / "old.nfer", tmp_path / "new.nfer"
    assert runner.invoke(app, ["convert", str(tiny_with_mtp), str(v2), "--version", "2"]).exit_code == 0
    r = runner.invoke(app, ["convert", "--from-artifact", str(v2), str(v3), "--json"])
    assert r.exit_code == 0, r.output
    report = _json.loads(r.stdout)
    assert report["version"] == 3 and report["objects"] > 0
    with Artifact(v2) as a, Artifact(v3) as b:
        assert b.version == 3 and a.objects.keys() == b.objects.keys()
        assert all(bytes(a.raw(n)) == bytes(b.raw(n)) for n in a.objects)
        assert all(e.sha256 and e.sha256 != "0" * 64 for e in b.objects.values())
        assert b.metadata["rewritten_from"].startswith("v2")
    gen = lambda p: _json.loads(runner.invoke(app, ["generate", str(p), "--raw", "--prompt", "hello", "--max-new-tokens",  # noqa: E731
                                                    "4", "--json"]).stdout)["tokens"]
    assert gen(v2) == gen(v3)
    same = runner.invoke(app, ["convert", "--from-artifact", str(v3), str(v3)])
    assert same.exit_code == 1 and "replace the artifact being read" in same.output
    both = runner.invoke(app, ["convert", "--from-artifact", str(v3), str(tmp_path / "a.nfer"), str(tmp_path / "b.nfer")])
    assert both.exit_code == 1 and "one path" in both.output
