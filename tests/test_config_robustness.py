"""The config an artifact or checkpoint carries, read as hostile input: every value typed and bounded,
cross-checked, parsed with limits. One regression case per crash signature of the 2026-12-04 fuzz run,
and a seeded fuzz (a few hundred mutants, a few seconds) whose every outcome is a clean accept or one
ConvertError line."""

from __future__ import annotations

import copy
import json
import random
import time

import pytest

from format.binding import mtp_layer_count
from format.errors import BindingError, ConvertError
from format.model_config import ModelConfig
from format.tiny import tiny_text_config


def _config(moe: bool = False, **changes) -> dict:
    text = tiny_text_config(moe)
    for key, value in changes.items():
        if value is KeyError:
            text.pop(key, None)
        else:
            text[key] = value
    return {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text}


def test_the_tiny_configs_are_accepted():
    dense, moe = ModelConfig.from_hf_dict(_config()), ModelConfig.from_hf_dict(_config(moe=True))
    assert dense.num_layers == 4 and moe.experts_per_token == 2


@pytest.mark.parametrize("changes,names", [
    ({"num_hidden_layers": "four"}, "num_hidden_layers"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_hidden_layers": 10 ** 8, "layer_types": KeyError}, "num_hidden_layers"),  # hung, 2.5 GB and rising
    ({"num_hidden_layers": 0, "layer_types": []}, "num_hidden_layers"),  # a 0-layer model "ran"
    ({"full_attention_interval": 0, "layer_types": KeyError}, "full_attention_interval"),
    ({"layer_types": 5}, "layer_types"),
    ({"rope_parameters": [1, 2]}, "rope_parameters"),
    ({"rms_norm_eps": "tiny"}, "rms_norm_eps"),
    ({"rope_parameters": {"rope_theta": "big", "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1]}}, "rope_theta"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": 3}}, "mrope_section"),
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.25, "mrope_section": ["a"]}}, "mrope_section"),
    ({"intermediate_size": "x"}, "intermediate_size"),
    ({"num_attention_heads": 3}, "num_key_value_heads"),
    ({"mtp_num_hidden_layers": 10 ** 6}, "mtp_num_hidden_layers"),  # took 104 s and 6.3 GB before refusing
    ({"vocab_size": True}, "vocab_size"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
])
def test_bad_config_values_are_one_line_naming_the_field(changes, names):
    with pytest.raises(ConvertError) as err:
        ModelConfig.from_hf_dict(_config(**changes))
    message = str(err.value)
    assert names in message and "\n" not in message


def test_moe_experts_per_token_cannot_exceed_the_experts():  # crashed in generation
    with pytest.raises(ConvertError, match="num_experts_per_tok 100 exceeds num_experts 8"):
        ModelConfig.from_hf_dict(_config(moe=True, num_experts_per_tok=100))


@pytest.mark.parametrize("data,words", [
    (b'{"a": ' + b"1" * 4301 + b"}", "characters"),  # ValueError from json.loads
    (b"[" * 100_000, "too deeply"),  # RecursionError
    (b"\xff\xfe{}", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
])
def test_config_json_is_parsed_with_limits(data, words):
    with pytest.raises(ConvertError, match=words):
        ModelConfig.from_json_bytes(data)


def test_generation_config_of_the_wrong_type_is_refused():
    with pytest.raises(ConvertError, match="generation_config"):
        ModelConfig.from_json_bytes(json.dumps(_config()).encode(), b"[3]")


@pytest.mark.parametrize("name", ["mtp/layers/abc/x", "mtp/layers/100000000/x", "mtp/layers//x"])
def test_mtp_layer_names_are_checked(name):  # int('abc'); an unbounded loop for the huge index
    with pytest.raises(BindingError, match="MTP layer objects are named"):
        mtp_layer_count(["text/token_embedding", name])
    assert mtp_layer_count(["mtp/layers/0/a", "mtp/layers/1/b", "text/x"]) == 2


POOL = [None, "x", "", -1, 0, 1, 3, 2 ** 40, 10 ** 8, 1.5, float("inf"), float("nan"), True, [], [1], {}, {"a": 1},
        ["full_attention"], [2, 1, 1], 1e-6]


def test_seeded_config_fuzz_is_accept_or_one_line():
    """Random keys of the text config (and of rope_parameters) replaced by hostile values."""
    rng = random.Random(20261204)
    base = [_config(), _config(moe=True)]
    started, outcomes = time.monotonic(), {"accepted": 0, "refused": 0}
    for _ in range(400):
        cfg = copy.deepcopy(rng.choice(base))
        for _ in range(rng.randint(1, 3)):
            target = cfg["text_config"]["rope_parameters"] if rng.random() < 0.25 else cfg["text_config"]
            if not isinstance(target, dict):
                target = cfg["text_config"]
            target[rng.choice(sorted(target))] = copy.deepcopy(rng.choice(POOL))
        try:
            ModelConfig.from_hf_dict(cfg)
            outcomes["accepted"] += 1
        except ConvertError as exc:
            assert "\n" not in str(exc) and str(exc)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 200 and time.monotonic() - started < 60


def _converted_with(hf_dense, tmp_path, name: str, edit) -> str:
    """The tiny checkpoint converted after `edit(checkpoint_dir)` changed one of its files."""
    import shutil

    from format.convert import ConvertOptions, convert_checkpoint

    src = tmp_path / f"{name}-src"
    shutil.copytree(hf_dense, src)
    edit(src)
    return str(convert_checkpoint(src, tmp_path / f"{name}.nfer", ConvertOptions(recipe="q4")).output)


def _cli(*args):
    from typer.testing import CliRunner

    from ninfer_cli.main import app

    return CliRunner().invoke(app, list(args))


def test_hostile_chat_template_is_one_line_in_generate(hf_dense, tmp_path):
    """A template that loops 10^9 times (or recurses) fails the render within its budget, not a hang."""
    looping = "{% for i in range(10**9) %}{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    art = _converted_with(hf_dense, tmp_path, "loop", lambda d: (d / "chat_template.jinja").write_text(looping))
    started = time.monotonic()
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.exit_code != 0 and "loops more than" in r.output and "Traceback" not in r.output
    assert time.monotonic() - started < 60


def test_resources_that_would_stop_generate_make_inspect_say_not_runnable(hf_dense, tmp_path):
    """An empty template and a tokenizer config of the wrong JSON type: inspect (no --verify) names them."""
    def edit(d):
        (d / "chat_template.jinja").write_text("   ")
        (d / "generation_config.json").write_text("[1]")

    from format.errors import ConvertError

    with pytest.raises(ConvertError, match="generation_config.json must be a JSON object"):
        _converted_with(hf_dense, tmp_path, "gen", edit)  # convert refuses it first
    art = _converted_with(hf_dense, tmp_path, "empty", lambda d: (d / "chat_template.jinja").write_text("   "))
    r = _cli("inspect", art, "--json")
    report = json.loads(r.stdout)
    assert not report["runnable"] and any("chat_template.jinja is empty" in p for p in report["problems"])
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.exit_code != 0 and "Traceback" not in r.output


def test_convert_refuses_a_tokenizer_that_does_not_load(hf_dense, tmp_path):
    from format.errors import ConvertError

    with pytest.raises(ConvertError, match="tokenizer"):
        _converted_with(hf_dense, tmp_path, "tok", lambda d: (d / "tokenizer.json").write_text('{"model": {"type": "Nope"}}'))


def test_v3_resource_checksums_are_checked_at_load(hf_dense, tmp_path):
    """A flipped byte in a v3 resource (here the config) is found without --verify: inspect says why and
    generate refuses, both in one line."""
    from format.container import Artifact

    art = _converted_with(hf_dense, tmp_path, "sum", lambda d: None)
    with Artifact(art) as a:
        entry = a.entry("resource/config.json")
        at = a.payload_offset + entry.offset + entry.nbytes // 2
    data = bytearray(open(art, "rb").read())
    data[at] ^= 0x01
    open(art, "wb").write(bytes(data))
    r = _cli("inspect", art, "--json")
    report = json.loads(r.stdout)
    assert not report["runnable"] and "do not match its sha256" in " ".join(report["problems"])
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.exit_code != 0 and "sha256" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("header", [
    [1, 2],  # a list, not an object
    {"w": {"shape": [2], "data_offsets": [0, 4]}},  # no dtype
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}},  # string offsets
    {"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}},  # reversed
    {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},  # negative dimension
    {"w": "F32"},
])
def test_convert_refuses_malformed_safetensors_headers_in_one_line(tmp_path, header):
    import struct

    from format.checkpoint import Checkpoint
    from format.errors import ConvertError

    raw = json.dumps(header).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    with pytest.raises(ConvertError) as err:
        Checkpoint(tmp_path)
    assert "model.safetensors" in str(err.value) and "\n" not in str(err.value)


def test_convert_removes_stale_temps_and_reports_a_full_disk(hf_dense, tmp_path, monkeypatch):
    """A dead writer's temp file (kill -9) is removed by the next conversion of the same target; a write
    that fails (ENOSPC) is one line and leaves nothing behind."""
    import errno
    import os

    from format import container
    from format.convert import ConvertOptions, convert_checkpoint
    from format.errors import ConvertError

    out = tmp_path / "m.nfer"
    dead = tmp_path / "m.nfer.tmp-999999999"  # no such process
    dead.write_bytes(b"x" * 100)
    convert_checkpoint(hf_dense, out, ConvertOptions(recipe="q4"))
    assert out.exists() and not dead.exists()

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(container.os, "ftruncate", full)
    with pytest.raises(ConvertError, match="No space left on device") as err:
        convert_checkpoint(hf_dense, tmp_path / "n.nfer", ConvertOptions(recipe="q4"))
    assert "\n" not in str(err.value)
    assert not list(tmp_path.glob("n.nfer*"))


def test_convert_names_checkpoint_tensors_it_does_not_use(hf_dense, tmp_path):
    import shutil

    import torch
    from safetensors.torch import save_file

    from format.convert import ConvertOptions, convert_checkpoint

    src = tmp_path / "extra"
    shutil.copytree(hf_dense, src)
    save_file({"model.language_model.layers.0.mystery.weight": torch.zeros(2, 2)}, str(src / "extra.safetensors"))
    report = convert_checkpoint(src, tmp_path / "m.nfer", ConvertOptions(recipe="q4"))
    assert any("mystery.weight" in note and "not used" in note for note in report.notes)
    clean = convert_checkpoint(hf_dense, tmp_path / "c.nfer", ConvertOptions(recipe="q4"))
    assert not any("not used" in note for note in clean.notes)


def test_seeded_artifact_fuzz_is_a_clean_error_or_a_clean_accept(hf_dense, tmp_path):
    """Byte mutants of a small v3 artifact -- header, directory JSON (digits, brackets, names), payload,
    truncation, appended bytes -- opened and judged as `inspect` does (`--verify` on a sample). Every
    outcome is a project error (one line) or an accept; nothing else escapes, nothing hangs."""
    from format.container import Artifact
    from format.errors import ArtifactError, BindingError
    from format.inspect import summarize, verify

    art = _converted_with(hf_dense, tmp_path, "fuzz", lambda d: None)
    original = open(art, "rb").read()
    with Artifact(art) as a:
        directory_end = a.payload_offset
    rng = random.Random(4)
    target = tmp_path / "mutant.nfer"
    started, outcomes = time.monotonic(), {"accepted": 0, "refused": 0}
    for i in range(300):
        data = bytearray(original)
        kind = i % 5
        if kind == 0:  # one byte of the header or directory
            at = rng.randrange(directory_end)
            data[at] = rng.randrange(256)
        elif kind == 1:  # a digit of the directory JSON becomes another (offsets, sizes, shapes)
            digits = [j for j in range(directory_end) if 48 <= data[j] <= 57]
            data[rng.choice(digits)] = rng.choice(b"0123456789")
        elif kind == 2:  # a structural JSON character replaced
            marks = [j for j in range(directory_end) if data[j] in b'{}[]":,']
            data[rng.choice(marks)] = rng.choice(b'{}[]":,x0 ')
        elif kind == 3:  # truncated, or bytes appended
            data = data[: rng.randrange(len(data))] if rng.random() < 0.5 else data + bytes(rng.randrange(1, 64))
        else:  # a payload byte (resources are checksummed; tensors are --verify's business)
            at = rng.randrange(directory_end, len(data))
            data[at] ^= 1 << rng.randrange(8)
        target.write_bytes(bytes(data))
        try:
            with Artifact(target) as a:
                summary = summarize(a)
                if i % 25 == 0 and summary["runnable"]:
                    verify(a)
            outcomes["accepted"] += 1
        except (ArtifactError, BindingError, ConvertError) as exc:
            assert "\n" not in str(exc) and str(exc), exc
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100 and time.monotonic() - started < 60, outcomes


def test_inspect_verify_says_plainly_what_a_v2_file_cannot_prove(hf_dense, tmp_path):
    from format.convert import ConvertOptions, convert_checkpoint

    v2 = str(convert_checkpoint(hf_dense, tmp_path / "v2.nfer", ConvertOptions(recipe="q4", version=2)).output)
    r = _cli("inspect", v2, "--verify")
    assert r.exit_code == 0 and "carries no checksums" in r.output and "every tensor decodes cleanly" in r.output
    report = json.loads(_cli("inspect", v2, "--verify", "--json").stdout)
    assert "version 2 has none" in report["verify_note"]


def test_verify_weights_before_generate(hf_dense, tmp_path):
    """--verify-weights recomputes the tensors' checksums first: a flipped code byte (which decoding alone
    would run with) stops generate in one line; a clean file generates."""
    from format.container import Artifact

    art = _converted_with(hf_dense, tmp_path, "vw", lambda d: None)
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "1", "--verify-weights")
    assert r.exit_code == 0 and "weights verified" in r.output
    with Artifact(art) as a:
        entry = a.entry("text/layers/0/mlp/gate_up")
        at = a.payload_offset + entry.offset + 7
    data = bytearray(open(art, "rb").read())
    data[at] ^= 0x10
    open(art, "wb").write(bytes(data))
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "1", "--verify-weights")
    assert r.exit_code != 0 and "text/layers/0/mlp/gate_up" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("directory,words", [
    (b'{"identity": {"model_id": "qwen3_5", "weights_id": "q4"}, "objects": [{"offset": ' + b"9" * 4301 + b"}]}",
     "digits"),  # a ValueError from json.loads
    (b"[" * 100_000, "nested too deeply"),  # a RecursionError
])
def test_directory_json_is_parsed_with_limits(tmp_path, directory, words):
    import struct

    from format.container import Artifact
    from format.errors import ArtifactError

    path = tmp_path / "x.nfer"
    start = -(-(16 + len(directory)) // 4096) * 4096
    path.write_bytes(b"NINFER\x00\x02" + struct.pack("<Q", len(directory)) + directory + bytes(start - 16 - len(directory)))
    with pytest.raises(ArtifactError, match=words):
        Artifact(path)


@pytest.mark.parametrize("edit,words", [
    ("padding", "padding"),
    (b'"weights_id":"q4"', "weights_id"),
    (b'"model_id":"qwen3_5"', "model_id"),
])
def test_padding_and_identity_follow_the_spec(hf_dense, tmp_path, edit, words):
    from format.container import Artifact
    from format.errors import ArtifactError

    art = _converted_with(hf_dense, tmp_path, "spec", lambda d: None)
    data = bytearray(open(art, "rb").read())
    if edit == "padding":
        with Artifact(art) as a:
            data[a.payload_offset - 1] = 7
    else:
        at = data.index(edit)
        data[at + len(edit) - 2] = ord("z")  # q4 -> qz, qwen3_5 -> qwen3_z: same length, not in the spec's sets
    open(art, "wb").write(bytes(data))
    with pytest.raises(ArtifactError, match=words):
        Artifact(art)


def test_inspect_finds_a_template_that_does_not_parse(hf_dense, tmp_path):
    art = _converted_with(hf_dense, tmp_path, "syntax", lambda d: (d / "chat_template.jinja").write_text("{% for x in %}"))
    report = json.loads(_cli("inspect", art, "--json").stdout)
    assert not report["runnable"] and any("does not parse as Jinja" in p for p in report["problems"])
    r = _cli("generate", art, "--prompt", "hi", "--max-new-tokens", "1")
    assert r.exit_code != 0 and "does not parse" in r.output and "Traceback" not in r.output
