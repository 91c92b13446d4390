"""The memory plan: solver optimality, allocator == plan, fail-fast numbers, CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

from format.container import Artifact
from format.convert import ConvertOptions, convert_checkpoint
from ninfer_cli.main import app
from runtime.allocator import DeviceMemory
from runtime.kv.codecs import CODECS
from runtime.memory_plan import (
    MemoryPlanError,
    PlanOptions,
    build_plan,
    fit,
    PREFILL_CHUNK_CHOICES,
    _workspace,
    parse_bytes,
    parse_prefill_chunk,
    require_fit,
    resolve_prefill_chunk,
)


@pytest.fixture(scope="module")
def artifact(tiny_with_mtp, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "m.nfer"
    convert_checkpoint(tiny_with_mtp, out, ConvertOptions(version=3, recipe="q4", lm_head_draft=64))
    with Artifact(out) as art:
        yield art


def test_parse_bytes():
    assert parse_bytes("24G") == 24 << 30 and parse_bytes("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("4096") == 4096
    with pytest.raises(MemoryPlanError, match="cannot read a byte size"):
        parse_bytes("lots")


@pytest.mark.parametrize("kv", list(CODECS))
@pytest.mark.parametrize("lanes,spec", [(1, "none"), (3, "mtp")])
def test_solver_is_exact_and_optimal(artifact, kv, lanes, spec):
    opts = PlanOptions(max_context=64, max_concurrency=lanes, kv_dtype=kv, spec=spec,
                       lm_head_draft=spec != "none", prefill_chunk=256)
    small = build_plan(artifact, opts).total_bytes
    budget = small + 3_000_000
    r = fit(artifact, opts, budget, 0)
    assert r.max_context % 64 == 0 and r.max_context > 64
    assert r.plan.total_bytes <= budget
    from dataclasses import replace

    assert build_plan(artifact, replace(opts, max_context=r.max_context + 64)).total_bytes > budget


def test_kv_bytes_per_token_follow_the_codec(artifact):
    p = build_plan(artifact, PlanOptions(max_context=4096, kv_dtype="rk4v4-e8"))
    # tiny model: 1 full-attention layer, 2 kv heads, head_dim 64
    assert p.kv_bytes_per_token == CODECS["rk4v4-e8"].bytes_per_token_head(64) * 2 * 1
    mtp = build_plan(artifact, PlanOptions(max_context=4096, kv_dtype="rk4v4-e8", spec="mtp"))
    assert mtp.kv_bytes_per_token == 2 * p.kv_bytes_per_token


def test_allocator_matches_plan_and_loads_weights(artifact):
    plan = build_plan(artifact, PlanOptions(max_context=1000, max_concurrency=2, kv_dtype="int8"))
    mem = DeviceMemory(plan, "cpu")
    assert set(mem.buffers) == set(plan.resident_arenas) == set(plan.arenas) - {"workspace"}
    for name, arena in plan.resident_arenas.items():
        assert mem.buffers[name].numel() == arena.allocated_bytes >= arena.nbytes
    assert plan.arenas["workspace"].allocated_bytes > 0  # planned (and in total_bytes) as headroom
    assert plan.total_bytes == sum(a.allocated_bytes for a in plan.arenas.values()) + plan.graph_pool_bytes
    mem.load_weights(artifact)
    name = "text/layers/3/attention/query_gate_key_value"
    assert bytes(mem.raw("weights", name).numpy()) == bytes(artifact.raw(name))
    k = mem.view("kv_pool", "layer3/k_codes", torch.int8, (plan.pages, 64, 2, 64))
    assert k.shape[0] == 2 * 16


def test_features_change_resident_weights(artifact):
    base = build_plan(artifact, PlanOptions(max_context=128)).arenas["weights"].nbytes
    spec = build_plan(artifact, PlanOptions(max_context=128, spec="mtp")).arenas["weights"].nbytes
    draft = build_plan(artifact, PlanOptions(max_context=128, spec="mtp", lm_head_draft=True)).arenas["weights"].nbytes
    mtp_bytes = sum(e.nbytes for e in artifact.objects.values() if e.component == "mtp")
    assert spec - base >= mtp_bytes and draft > spec


@pytest.mark.parametrize("opts,message", [
    (dict(max_concurrency=9), "1..8"), (dict(prefill_chunk=100), "multiple of 128"),
    (dict(spec="dflash2"), "dflash2 component"), (dict(lm_head_draft=True), "needs --spec"),
    (dict(vision=True), "vision tower"), (dict(kv_dtype="int3"), "unknown --kv-dtype"),
    (dict(max_context=300_000), "native context"), (dict(weight_cache="all"), "--weight-cache"),
])
def test_bad_options(artifact, opts, message):
    with pytest.raises((MemoryPlanError, ValueError), match=message):
        build_plan(artifact, PlanOptions(**{"max_context": 128, **opts}))


def test_require_fit_names_the_numbers(artifact):
    opts = PlanOptions(max_context=8192, kv_dtype="bf16")
    need = build_plan(artifact, opts).total_bytes
    with pytest.raises(MemoryPlanError) as e:
        require_fit(artifact, opts, need - 1)
    msg = str(e.value)
    assert f"needs {need} bytes" in msg and f"only {need - 1} are available (1 short)" in msg
    assert "largest context that fits is 8128" in msg


def test_fit_cli(artifact):
    runner = CliRunner()
    r = runner.invoke(app, ["fit", str(artifact.path), "--vram", "160M", "--vram-reserve", "0", "--kv-dtype", "rk2v4-e8", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert res["fits"] and res["max_context"] > 0 and res["total_bytes"] <= res["budget_bytes"]
    assert sum(res["breakdown"].values()) == res["total_bytes"]
    r = runner.invoke(app, ["fit", str(artifact.path), "--vram", "20M", "--vram-reserve", "0", "--max-context", "200000"])
    assert r.exit_code == 1 and "does NOT fit" in r.stdout
    r = runner.invoke(app, ["fit", str(artifact.path), "--gpu", "voodoo2"])
    assert r.exit_code == 1 and "unknown --gpu" in r.output
    r = runner.invoke(app, ["fit", str(artifact.path), "--vram", "24G"])  # the model's limit, not memory, decides
    assert r.exit_code == 0 and "262,144 tokens = the model's maximum" in r.stdout and "GiB to spare" in r.stdout
    assert not json.loads(runner.invoke(app, ["fit", str(artifact.path), "--vram", "160M", "--vram-reserve", "0",
                                              "--json"]).stdout)["capped_by_model"]
    r = runner.invoke(app, ["fit", str(artifact.path), "--vram", "0"])
    assert r.exit_code == 1 and "leaves nothing of a 0.00 GiB card" in r.output and "1395864371" not in r.output



def test_fit_tells_what_the_weight_cache_keeps():
    """fit --max-context shorter than the card allows: the layer products the engine keeps as dense copies in the
    spare memory (all of the 27B's on an H200 at 32K, some on a 24 GB card, none when solving for the largest)."""
    runner = CliRunner()
    res = lambda *a: json.loads(runner.invoke(app, ["fit", "--shape", "qwen3.6-27b", *a, "--json"]).stdout)["weight_cache"]  # noqa: E731
    roomy = res("--gpu", "h200", "--max-context", "32768")
    assert roomy["products"] == roomy["of_products"] == 256 and roomy["bytes"] > 40 << 30
    tight = res("--vram", "24G", "--max-context", "32768")
    assert 0 < tight["products"] < 256 and tight["bytes"] < 4 << 30
    assert res("--vram", "24G")["products"] == 0  # the longest context takes the memory
    r = runner.invoke(app, ["fit", "--shape", "qwen3.6-27b", "--gpu", "h200", "--max-context", "32768"])
    assert "dense copies of 256 of 256 layer products" in r.stdout


def test_prefill_chunk_auto_follows_the_card(artifact):
    from dataclasses import replace

    from format.binding import load_config

    assert parse_prefill_chunk("auto") == parse_prefill_chunk("AUTO") == 0
    assert parse_prefill_chunk("2048") == 2048
    for bad in ("3000", "0", "-128", "big"):
        with pytest.raises(MemoryPlanError, match="multiple of 128 tokens"):
            parse_prefill_chunk(bad)
    auto = PlanOptions(max_context=256, prefill_chunk=0)
    assert resolve_prefill_chunk(artifact, PlanOptions(max_context=256, prefill_chunk=384), 1 << 20).prefill_chunk == 384
    assert resolve_prefill_chunk(artifact, auto, None).prefill_chunk == 1024  # CPU: no card
    cfg = load_config(artifact)

    def share(chunk):  # the card size at which `chunk`'s workspace is exactly 1/32 of it
        return 32 * _workspace(cfg, replace(auto, prefill_chunk=chunk, max_context=262_144)).allocated_bytes

    for chunk in PREFILL_CHUNK_CHOICES:  # largest chunk within 1/32 of the card; 1 byte less -> the next one down
        assert resolve_prefill_chunk(artifact, auto, share(chunk)).prefill_chunk == chunk
        if chunk != PREFILL_CHUNK_CHOICES[-1]:
            assert resolve_prefill_chunk(artifact, auto, share(chunk) - 1).prefill_chunk < chunk
    assert resolve_prefill_chunk(artifact, auto, 1).prefill_chunk == 1024  # tiny card: the smallest choice
    with pytest.raises(MemoryPlanError, match="positive multiple of 128"):
        build_plan(artifact, auto)  # auto must be resolved before planning
    # fit reports the chunk it planned with, and auto there equals the engine's choice for the same card
    r = CliRunner().invoke(app, ["fit", str(artifact.path), "--vram", str(share(4096)), "--vram-reserve", "0", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["prefill_chunk"] == 4096
    r = CliRunner().invoke(app, ["fit", str(artifact.path), "--vram", "64M", "--prefill-chunk", "100"])
    assert r.exit_code == 1 and "--prefill-chunk '100' is not valid" in r.output


def test_the_ride_graphs_pool_is_planned(artifact):
    """Without speculation: the prompt-piece and prefill-with-riders graphs' shared pool (a shared chunk's
    activations, the dequantization scratch, every graph's logits) is counted in the plan, one lane's too, grows with
    the lanes (riding rows, more graphs) and shrinks with the shared chunk."""
    from format.binding import load_config
    from runtime.memory_plan import GRAPH_POOL_BYTES_PER_BATCH, PIECE_BUCKETS, RIDE_DEQUANT_SCRATCH, ride_pool_bytes

    cfg = load_config(artifact)
    one = build_plan(artifact, PlanOptions(max_context=1024, max_concurrency=1))
    two = build_plan(artifact, PlanOptions(max_context=1024, max_concurrency=2))
    small = build_plan(artifact, PlanOptions(max_context=1024, max_concurrency=2, shared_prefill_chunk=64))
    assert one.graph_pool_bytes == GRAPH_POOL_BYTES_PER_BATCH + ride_pool_bytes(cfg, one.options)
    assert two.graph_pool_bytes == 2 * GRAPH_POOL_BYTES_PER_BATCH + ride_pool_bytes(cfg, two.options)
    # the second lane adds one riding row to the pool's activations and its graphs' logits: 2 per bucket and a whole
    # shared chunk, two rows each
    logits_row = cfg.vocab_size * 4
    assert ride_pool_bytes(cfg, two.options) - ride_pool_bytes(cfg, one.options) > \
        (2 * len(PIECE_BUCKETS) + 1) * 2 * logits_row
    assert RIDE_DEQUANT_SCRATCH < small.graph_pool_bytes - 2 * GRAPH_POOL_BYTES_PER_BATCH < \
        two.graph_pool_bytes - 2 * GRAPH_POOL_BYTES_PER_BATCH
    eager = build_plan(artifact, PlanOptions(max_context=1024, max_concurrency=2, cuda_graphs=False))
    assert eager.graph_pool_bytes == 0
    # speculating: a pool per batch size for decode, draft and verify; no prompt-piece graphs (prefill is eager)
    spec = build_plan(artifact, PlanOptions(max_context=1024, max_concurrency=2, spec="mtp"))
    assert spec.graph_pool_bytes == 3 * 2 * GRAPH_POOL_BYTES_PER_BATCH


def test_moe_router_and_shared_gate_lie_side_by_side(tmp_path):
    """The 35B-A3B's plan puts every MoE layer's shared-expert gate right after its router, so the engine multiplies
    both as one [experts + 1, hidden] product (Engine.router_and_gate)."""
    from format.shapes import write_shape_artifact

    plan = build_plan(Artifact(write_shape_artifact("qwen3.6-35b-a3b", tmp_path / "m.nfer", "q4", mtp=False)),
                      PlanOptions(max_context=4096))
    plan.arenas["weights"].layout()
    regions = {r.name: r for r in plan.arenas["weights"].regions}
    routers = [n for n in regions if n.endswith("moe/router")]
    assert len(routers) == 40
    for name in routers:
        router, gate = regions[name], regions[name[: -len("router")] + "shared_gate"]
        assert gate.offset == router.offset + router.nbytes and gate.nbytes == 2 * 2048


def test_shared_prefill_chunk_auto_is_shorter_with_every_product_cached():
    """--prefill-chunk-shared auto: 1,024 tokens (what the plan sizes for), 512 where the weight cache holds every
    layer product; an explicit size (0: the full chunk) is kept as given; never more than the full chunk."""
    from runtime.memory_plan import SHARED_CHUNK, SHARED_CHUNK_WEIGHTS_CACHED, shared_chunk_for

    auto = PlanOptions(max_context=8192, max_concurrency=2, prefill_chunk=4096)
    assert auto.shared_chunk == shared_chunk_for(auto, False) == SHARED_CHUNK == 1024
    assert shared_chunk_for(auto, True) == SHARED_CHUNK_WEIGHTS_CACHED == 512
    given = PlanOptions(max_context=8192, max_concurrency=2, prefill_chunk=4096, shared_prefill_chunk=256)
    assert shared_chunk_for(given, True) == shared_chunk_for(given, False) == given.shared_chunk == 256
    whole = PlanOptions(max_context=8192, max_concurrency=2, prefill_chunk=4096, shared_prefill_chunk=0)
    assert shared_chunk_for(whole, True) == 4096
    short = PlanOptions(max_context=8192, max_concurrency=2, prefill_chunk=384)
    assert shared_chunk_for(short, False) == shared_chunk_for(short, True) == 384
