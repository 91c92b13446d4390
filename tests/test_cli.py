"""The CLI as a user drives it: exit codes, one-line errors, --json, no heavy imports for --help."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ninfer_cli.main import app

runner = CliRunner()


def test_help_does_not_import_torch():
    code = "import sys; from ninfer_cli.main import app; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_convert_inspect_generate(tiny_with_mtp, tmp_path):
    art = tmp_path / "m.nfer"
    r = runner.invoke(app, ["convert", str(tiny_with_mtp), str(art), "--recipe", "q5", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["version"] == 3 and report["components"] == ["mtp", "text"]
    r = runner.invoke(app, ["inspect", str(art), "--json", "--verify"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert s["runnable"] and s["verify_failures"] == [] and s["identity"]["weights_id"] == "q5"
    r = runner.invoke(app, ["inspect", str(art)])
    assert "verdict: runnable" in r.stdout and "MTP speculative decoding" in r.stdout
    r = runner.invoke(app, ["generate", str(art), "--prompt", "hello", "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0, r.output
    assert 1 <= len(json.loads(r.stdout)["tokens"]) <= 4


def test_inspect_explains_why_not(tiny_with_mtp, tmp_path):
    bad = tmp_path / "bad.nfer"
    bad.write_bytes(b"NINFER\x00\x07" + bytes(64))
    r = runner.invoke(app, ["inspect", str(bad)])
    assert r.exit_code == 1 and "cannot run" in r.stdout and "unsupported .nfer version 7" in r.stdout
    r = runner.invoke(app, ["inspect", str(tmp_path / "missing.nfer"), "--json"])
    assert r.exit_code == 1 and "no such file" in json.loads(r.stdout)["problems"][0]


def test_inspect_reports_missing_tensor(tiny_with_mtp, tmp_path):
    """An artifact whose directory is valid but lacks a tensor the config needs."""
    from format.container import Artifact, ArtifactPlan, ArtifactWriter

    src = tmp_path / "src.nfer"
    assert runner.invoke(app, ["convert", str(tiny_with_mtp), str(src), "--recipe", "bf16", "--no-mtp"]).exit_code == 0
    dropped = "text/layers/2/gdn/norm"
    with Artifact(src) as a:
        plan = ArtifactPlan(3, "qwen3_5", "bf16")
        for e in a.objects.values():
            if e.name == dropped:
                continue
            if e.kind == "tensor":
                plan.add_tensor(e.name, e.shape, e.format)
            else:
                plan.add_resource(e.name, e.nbytes)
        out = tmp_path / "holey.nfer"
        with ArtifactWriter(out, plan) as w:
            for e in a.objects.values():
                if e.name == dropped:
                    continue
                if e.kind == "tensor":
                    w.write_direct(e.name, a.read_direct(e.name))
                else:
                    w.write_resource(e.name, a.resource_bytes(e.name))
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 1
    assert f"required artifact object is missing: {dropped}" in r.stdout
    r = runner.invoke(app, ["generate", str(out)])
    assert r.exit_code == 1 and "missing" in r.output and "Traceback" not in r.output


def test_convert_errors_are_one_line(tmp_path):
    r = runner.invoke(app, ["convert", str(tmp_path), str(tmp_path / "x.nfer")])
    assert r.exit_code == 1
    assert "has no config.json" in r.output and "Traceback" not in r.output


def test_demo_runs(tmp_path):
    r = runner.invoke(app, ["demo", "--workdir", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "tiny-q4.nfer").exists()


def test_generate_on_the_triton_runtime(tiny_with_mtp, tmp_path):
    import pytest

    pytest.importorskip("triton")
    art = tmp_path / "m.nfer"
    assert runner.invoke(app, ["convert", str(tiny_with_mtp), str(art), "--recipe", "q4"]).exit_code == 0
    ref = runner.invoke(app, ["generate", str(art), "--raw", "--prompt", "hello world", "--max-new-tokens", "3", "--json"])
    fast = runner.invoke(app, ["generate", str(art), "--raw", "--prompt", "hello world", "--max-new-tokens", "3",
                               "--runtime", "triton", "--kv-dtype", "int8", "--max-context", "128", "--prefill-chunk", "128",
                               "--json"])
    assert ref.exit_code == 0 and fast.exit_code == 0, fast.output
    assert json.loads(fast.stdout)["tokens"] == json.loads(ref.stdout)["tokens"]
    sampled = runner.invoke(app, ["generate", str(art), "--raw", "--max-new-tokens", "3", "--runtime", "triton",
                                  "--max-context", "128", "--prefill-chunk", "128", "--temperature", "0.8", "--seed", "1",
                                  "--json"])
    assert sampled.exit_code == 0, sampled.output
    bad = runner.invoke(app, ["generate", str(art), "--temperature", "0.5"])
    assert bad.exit_code == 1 and "needs --runtime triton" in bad.output


def test_bench_table_says_when_acceptance_is_forced(capsys):
    """Random-weight MTP benches force acceptance; the table must say so instead of implying a rate."""
    from ninfer_cli import main

    row = {"kv_dtype": "rk4v4-e8", "depth": 8192, "context": "prefilled", "prefill_tok_s": 8000.0,
           "decode_tok_s": 230.0, "roofline_tok_s": 276.4, "of_roofline": 0.83, "peak_allocated_bytes": 2 ** 30,
           "spec_stats": {"tokens_per_round": 4.0}}
    results = {"artifact": "a.nfer", "device": "GPU", "copy_bandwidth_bytes_per_s": 4.2e12, "rows": [row],
               "options": {"accepted_drafts": 3}}
    main._print_bench(results)
    assert "drafts forced: 3 accepted per round" in " ".join(capsys.readouterr().out.split())
    results["options"]["accepted_drafts"] = None
    main._print_bench(results)
    assert "forced" not in capsys.readouterr().out


def test_generated_text_is_printed_safely():
    from ninfer_cli._common import printable

    assert printable("ok\x07\x1b[31mred\ufffd\nnext\ttab é") == "ok\\x07\\x1b[31mred\\ufffd\nnext\ttab é"


def test_inspect_prints_artifact_text_as_itself():
    """Artifact data never reaches rich as markup: "[/x]" is not a MarkupError, brackets do not vanish."""
    import io

    from rich.console import Console

    import ninfer_cli.main as cli

    buf = io.StringIO()
    summary = {"origin": "ninfer", "path": "/m/[bold]a.nfer", "magic": "NINFER", "version": 3, "file_bytes": 10,
               "identity": {"model_id": "[/x]", "weights_id": "q4"}, "artifact_id": None, "model": None,
               "components": ["text"], "objects": 1, "checksums": 1, "by_format": {"Q4[x]": {"objects": 1, "bytes": 5}},
               "runnable": False, "problems": ["expected a [channels, 1, width] kernel"], "features": [], "companions": {}}
    saved, cli.out = cli.out, Console(file=buf, highlight=False, soft_wrap=True, width=200)
    try:
        cli._print_inspect(summary)
    finally:
        cli.out = saved
    text = buf.getvalue()
    for piece in ("/m/[bold]a.nfer", "model_id=[/x]", "Q4[x]", "expected a [channels, 1, width] kernel"):
        assert piece in text, piece


def test_output_off_a_terminal_is_whole_lines(tiny_with_mtp, tmp_path):
    """In a pipe or a log: no blank line left by a progress bar, and a long line is not wrapped or cut."""
    out = tmp_path / "p.nfer"
    r = subprocess.run([sys.executable, "-m", "ninfer_cli.main", "convert", str(tiny_with_mtp), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr and not r.stderr.startswith("\n")
    assert r.stdout.startswith("wrote ") and str(out) in r.stdout.splitlines()[0]


def test_kernel_bench_lists_each_product_geometry_once(tmp_path, capsys):
    """`bench --kernels` times each distinct (format, rows, columns) of the text model once and knows how
    many matrices per step share it (the 27B shape: its four GDN-layer and one attention-layer geometries per
    layer kind, the output head); its table prints every row count; on a CPU it refuses in one line."""
    from format.shapes import write_shape_artifact
    from ninfer_cli import main
    from runtime.bench import distinct_products

    products = distinct_products(write_shape_artifact("qwen3.6-27b", tmp_path / "s.nfer", "q4", mtp=False))
    assert sum(len(v) for v in products.values()) >= 64 * 3  # every layer's products, counted
    head = [k for k, v in products.items() if any(n.endswith("output_head") for n in v)]
    assert head and head[0][1] == 248320 and len(products[head[0]]) == 1
    assert not any(n.endswith("token_embedding") for v in products.values() for n in v)  # a lookup, not a product
    assert len({k for k in products}) == len(products) and all(len(k) == 3 for k in products)
    row = {"matrix": "mlp/gate_up", "format": "Q4G64_F16S", "N": 34816, "K": 5120, "per_step": 64, "t1_us": 29.4,
           "t1_of_copy": 0.75, "t2_us": 61.0, "t2_of_copy": 0.36, "t2_vs_t1": 2.07}
    main._print_kernels({"artifact": "a.nfer", "device": "GPU", "copy_bandwidth_bytes_per_s": 4.2e12,
                         "row_counts": [1, 2], "rows": [row]})
    out = " ".join(capsys.readouterr().out.split())
    assert "mlp/gate_up" in out and "29.4 (0.75)" in out and "61.0 (0.36; x2.07)" in out
    import torch

    if not torch.cuda.is_available():
        r = runner.invoke(app, ["bench", "--random-weights", "qwen3.6-27b", "--kernels", "1,2"])
        assert r.exit_code == 1 and "needs a CUDA GPU" in r.output


def test_bench_results_record_the_kernel_switches_in_effect(monkeypatch):
    """Every bench JSON says which kernel paths produced it (the NINFER_* side-by-side switches as the runtime read
    them), so numbers from two runs can be told apart."""
    from runtime import bench
    from runtime.kernels import qgemm_fragment_layout as fl
    from runtime.kernels import qlinear as ql
    from runtime.kernels.paged_attention_frag import FRAG_ATTENTION

    monkeypatch.setattr(ql, "SWIGLU_EPILOGUE", True)
    monkeypatch.setattr(fl, "FRAGMENT_INT8", "off")
    monkeypatch.setitem(FRAG_ATTENTION, "mode", "auto")
    monkeypatch.setattr(fl, "Q5_FIELDS", "on")
    default = bench.kernel_switches()
    monkeypatch.setattr(ql, "SWIGLU_EPILOGUE", False)
    monkeypatch.setattr(fl, "FRAGMENT_INT8", "q5")
    monkeypatch.setitem(FRAG_ATTENTION, "mode", "off")
    monkeypatch.setattr(fl, "Q5_FIELDS", "off")
    changed = bench.kernel_switches()
    assert {k for k in default if default[k] != changed[k]} == {"swiglu_epilogue", "fragment_int8", "attention_frag",
                                                                "q5_fields"}
    monkeypatch.setenv("NINFER_PIECE_GRAPHS", "off")
    monkeypatch.setenv("NINFER_API_KEY", "sk-secret")  # never written into a result
    monkeypatch.setenv("NINFER_NOT_A_SWITCH", "1")
    environment = bench.kernel_switches()["environment"]
    assert environment["NINFER_PIECE_GRAPHS"] == "off"
    assert "NINFER_API_KEY" not in environment and "NINFER_NOT_A_SWITCH" not in environment


def test_lanes_bench_runs_batched_speculative_rounds(tiny_with_mtp, tmp_path, capsys):
    """`bench --lanes N --spec mtp`: each lane count also runs batched rounds (every lane drafts, one verify
    forward); with acceptance forced each lane gains K + 1 tokens a round, and the table prints the ratio to the
    plain step at that lane count and against one lane's."""
    from format.convert import ConvertOptions, convert_checkpoint
    from ninfer_cli import main
    from runtime.bench import run_lanes_bench

    art = convert_checkpoint(tiny_with_mtp, tmp_path / "t.nfer", ConvertOptions(recipe="q4")).output
    r = run_lanes_bench(art, [1, 2], 40, ["bf16"], steps=2, device="cpu", spec="mtp", draft_tokens=2,
                        accepted_drafts=2, log=lambda m: None)
    assert [row["lanes"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["spec_tokens_per_lane_round"] == 3 and row["spec_stats"]["rounds"] == 2 * row["lanes"]
        assert row["spec_per_lane_tok_s"] > 0 and row["spec_aggregate_tok_s"] == pytest.approx(
            row["lanes"] * row["spec_per_lane_tok_s"])
    assert r["rows"][0]["spec_vs_plain_of_one_lane"] == 1.0
    assert r["rows"][0]["spec_verify_ms"] == 0.0  # drafting and verify are timed apart by CUDA events only
    r["copy_bandwidth_bytes_per_s"] = 0.0
    main._print_lanes(r)
    out = " ".join(capsys.readouterr().out.split())
    assert "batched mtp rounds, 2 drafts per lane, 2 accepted (forced)" in out and "of one lane's x" in out
    assert "verify x step" in out
    none = run_lanes_bench(art, [1], 40, ["bf16"], steps=2, device="cpu", log=lambda m: None)
    assert "spec_round_ms" not in none["rows"][0]
    vocab = run_lanes_bench(art, [1], 40, ["bf16"], steps=2, device="cpu", spec="mtp", draft_tokens=2,
                            accepted_drafts=2, draft_vocab=256, log=lambda m: None)  # the lanes bench passes it on
    assert vocab["draft_vocab"] == 256 and vocab["rows"][0]["spec_tokens_per_lane_round"] == 3


def test_lanes_bench_with_distinct_tokens_counts_the_experts_they_cover(hf_moe, tmp_path):
    """--distinct-lane-tokens: every lane feeds its own token (a MoE routes them apart) and the ideal counts the
    routed experts n independent top-k picks are expected to cover (the same token: every lane the same k)."""
    from format.convert import ConvertOptions, convert_checkpoint
    from runtime.bench import lane_tokens, run_lanes_bench

    assert lane_tokens(3, False, 100) == [1, 1, 1] and len(set(lane_tokens(8, True, 400))) == 8
    art = convert_checkpoint(hf_moe, tmp_path / "m.nfer", ConvertOptions(recipe="q4")).output
    same, apart = (run_lanes_bench(art, [1, 2, 4], 40, ["bf16"], steps=2, device="cpu", distinct_tokens=d,
                                   log=lambda m: None) for d in (False, True))
    assert same["lane_tokens"] == "same" and apart["lane_tokens"] == "distinct"
    bytes_same, bytes_apart = ([row["bytes_per_step"] for row in r["rows"]] for r in (same, apart))
    assert bytes_apart[0] == pytest.approx(bytes_same[0])  # one lane: its own k experts either way
    assert bytes_apart[1] > bytes_same[1] and bytes_apart[2] - bytes_same[2] > bytes_apart[1] - bytes_same[1]


def test_speculative_round_phases_average_their_events():
    """phase_ms: a round's drafting is start -> drafts done, its verify forward drafts done -> verify done."""
    from runtime.speculate import phase_ms

    class Mark:
        def __init__(self, at):
            self.at = at

        def elapsed_time(self, later):
            return later.at - self.at

    assert phase_ms([]) == (0.0, 0.0)
    assert phase_ms([(Mark(0), Mark(2), Mark(7)), (Mark(10), Mark(14), Mark(17))]) == (3.0, 4.0)


def test_serve_takes_its_api_key_from_the_environment(monkeypatch, tmp_path):
    """NINFER_API_KEY stands for --api-key (the README's Codex set-up reads the same variable); the flag wins."""
    import runtime.serve.launch as launch

    seen = []

    class Stop(Exception):
        pass

    def fake_build_server(*args, api_key=None, **kwargs):
        seen.append(api_key)
        raise Stop

    monkeypatch.setattr(launch, "build_server", fake_build_server)
    monkeypatch.delenv("NINFER_API_KEY", raising=False)
    art = tmp_path / "model.nfer"
    art.write_bytes(b"")
    for extra, env in (([], {"NINFER_API_KEY": "sk-env"}), (["--api-key", "sk-flag"], {"NINFER_API_KEY": "sk-env"}),
                       ([], {})):
        result = runner.invoke(app, ["serve", str(art), "--device", "cpu", "--port", "0", *extra], env=env)
        assert isinstance(result.exception, Stop), result.output
    assert seen == ["sk-env", "sk-flag", None]
